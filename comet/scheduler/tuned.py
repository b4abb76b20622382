"""Tuned tables (block split, tile) written by ``comet tune``; the per-call lookup.

One JSON file per (shape, expert-parallel size, device, dtype, TileConfig variant), named
like vLLM's fused-MoE configs::

    E=8,H=4096,F=14336,topk=2,ep=4,device_name=NVIDIA_H200,dtype=bf16.json

(``dtype=fp8`` for a layer with FP8 experts: :func:`dtype_name`; a variant other than the
default's adds ``variant=<hash>,`` before ``device_name``:
:func:`file_name`; tables named without it load too, their ``meta["tile"]`` matched).

A tensor-parallel layout's table is keyed by the kernels' shard-expert shape and by its
*layout* (:meth:`comet.mesh.MeshLayout.table_layout`: TP size and input convention), in the
name (``...,ep=2,layout=tp2-sequence,device_name=...``) and in ``meta["layout"]``: the
conventions run the same kernel shape on different rows, and an expert-parallel layer of
that shape is a third case.

holding ``{"meta": {...}, "buckets": {"<tokens per rank>": {"layer0": n0, "layer1": n1,
"decode_tile": true|false, "tile": {"group_m": 16}, ...}}}``. Optional per bucket:
``decode_tile`` (whether layer1 runs on the decode tile, see
``comet.runtime.selection.Selector.tile_for``; absent, the layer's rule decides) and
``tile`` (values of the :data:`comet.config.TUNABLE_TILE_FIELDS` that differ from the
layer's TileConfig; absent, none do). Folders
are searched in order: the ``folder`` argument (``CometMoE(...,
tuned_config_folder=)``), ``$COMET_TUNED_CONFIG_FOLDER``, then the tables shipped in
``comet/configs/``. The first file found wins.

Every table records the kernels it was measured on (``meta["kernels"]``:
:func:`comet.constants.kernel_identity`, a hash of comet/kernels; tables written before it
was computed hold ``kernel_revision``) and the TileConfig variant of the layer it was
tuned for (``meta["tile"]``: :meth:`comet.config.TileConfig.table_variant`, the non-tunable
fields that differ from the defaults; absent in tables of the default variant). A table
of other kernels is still used and reported once, naming both identities (the hash moves
with any kernel edit, and splits are usually still good; ``comet tune`` measures it
again); one of another variant does not match and is ignored, so splits tuned for one
variant never serve another.

Selection uses only what the host knows (this rank's token count, from the input's
shape): the bucket nearest to it in log scale (buckets are geometric), clamped at the
ends. Splits are never interpolated: layer time over a split is far from linear (too few
comm blocks for the rows starve the GEMM), and a split between two good ones can be the
worst of all (docs/tuning.md).

A missing or unusable table returns None (the caller falls back to the analytic model and
logs once); a bad file is reported with a warning, never an exception in the middle of a
forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from comet.config import MoEConfig, TileConfig, tile_field_error
from comet.constants import kernel_identity, kernels_of

log = logging.getLogger("comet")

SHIPPED = Path(__file__).resolve().parent.parent / "configs"
ENV_FOLDER = "COMET_TUNED_CONFIG_FOLDER"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(cfg: MoEConfig) -> str:
    """The dtype a table names and records: ``"fp8"`` for a layer with FP8 experts (its
    rows enter and leave in bf16, but its kernels, workspace and best splits are its
    own, so a bf16 table must never serve it, nor its table a bf16 layer), else the
    rows' dtype."""
    return "fp8" if cfg.fp8 is not None else _DTYPE_NAMES[cfg.dtype]


def device_name(device: torch.device | str | None = None) -> str:
    """The device name as used in file names (``NVIDIA H200`` -> ``NVIDIA_H200``)."""
    if device is None or torch.device(device).type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")


def file_name(cfg: MoEConfig, world_size: int, device: str, layout: str | None = None,
              tile: TileConfig | None = None) -> str:
    """The table's file name; ``layout``: a TP layout's key (None: expert parallelism);
    ``tile``: the layer's TileConfig, whose variant (:meth:`TileConfig.table_variant`,
    if not the default's) the name carries as a short hash (``variant=1a2b3c4d``; the
    fields themselves are in ``meta["tile"]``), so tables of two variants of one shape
    can sit side by side."""
    variant = (tile or TileConfig()).table_variant()
    tag = (f"variant={hashlib.sha1(json.dumps(variant, sort_keys=True).encode()).hexdigest()[:8]},"
           if variant else "")
    return (f"E={cfg.num_experts},H={cfg.hidden_size},F={cfg.intermediate_size},"
            f"topk={cfg.top_k},ep={world_size},"
            + (f"layout={layout}," if layout else "") + tag
            + f"device_name={device},dtype={dtype_name(cfg)}.json")


def file_names(cfg: MoEConfig, world_size: int, device: str, layout: str | None = None,
               tile: TileConfig | None = None) -> list[str]:
    """The names a layer's table may have, in lookup order: :func:`file_name`, then the
    name without the variant that tables written before it carried (their ``meta["tile"]``
    still says which variant they serve)."""
    return list(dict.fromkeys([file_name(cfg, world_size, device, layout, tile),
                               file_name(cfg, world_size, device, layout)]))


def expected_meta(cfg: MoEConfig, world_size: int, device: str,
                  tile: TileConfig | None = None, layout: str | None = None) -> dict:
    """What a table's ``meta`` must hold to serve this layer (``tile``: its TileConfig,
    default the default one, whose tables record no ``"tile"``; ``layout``: a TP layout's
    key, absent from expert-parallel tables)."""
    meta = {"E": cfg.num_experts, "H": cfg.hidden_size, "F": cfg.intermediate_size,
            "top_k": cfg.top_k, "world_size": world_size, "device_name": device,
            "dtype": dtype_name(cfg), "kernels": kernel_identity()}
    variant = (tile or TileConfig()).table_variant()
    if variant:
        meta["tile"] = variant
    if layout:
        meta["layout"] = layout
    return meta


@dataclass(frozen=True)
class Choice:
    """One bucket of a table: comm blocks per layer, the layer1 tile if tuned, and the
    tile fields the bucket sets (``(name, value)`` pairs, sorted)."""

    layer0: int
    layer1: int
    decode_tile: bool | None = None
    tile: tuple[tuple[str, int], ...] = ()

    @property
    def splits(self) -> tuple[int, int]:
        return self.layer0, self.layer1


def parse_tile(tokens: str, tile) -> tuple[tuple[str, int], ...]:
    """A bucket's ``tile`` entry as sorted ``(field, value)`` pairs; TunedTableError
    unless it maps :data:`comet.config.TUNABLE_TILE_FIELDS` to values in range."""
    if tile is None:
        return ()
    if not isinstance(tile, dict):
        raise TunedTableError(f"bucket {tokens!r}: 'tile' must be an object, got {tile!r}")
    for name, value in tile.items():
        if (why := tile_field_error(name, value)) is not None:
            raise TunedTableError(f"bucket {tokens!r}: {why}")
    return tuple(sorted(tile.items()))


class TunedTableError(ValueError):
    """A tuning file that cannot be used (malformed, wrong keys, another device)."""


def other_kernels(meta: dict, expect: dict) -> str | None:
    """Why a table's kernels are not these (both identities named), or None when they
    are, or when ``expect`` names none."""
    if "kernels" not in expect or kernels_of(meta) == expect["kernels"]:
        return None
    return f"tuned on kernels {kernels_of(meta)}, these are {expect['kernels']}"


class VariantTableError(TunedTableError):
    """A table tuned for another TileConfig variant of the same shape (a file name holds
    one): not a bad file -- e.g. a layout whose default tile changed since it was tuned."""


def parse_table(data: dict, expect: dict | None = None) -> dict[int, Choice]:
    """Validate a loaded table; returns ``{tokens: Choice}``."""
    if not isinstance(data, dict) or "buckets" not in data or "meta" not in data:
        raise TunedTableError("expected an object with 'meta' and 'buckets'")
    meta = data["meta"]
    if expect is not None:
        for key, value in expect.items():
            if key not in ("tile", "kernels") and meta.get(key) != value:
                raise TunedTableError(f"meta[{key!r}] is {meta.get(key)!r}, expected {value!r}")
        if meta.get("layout") != expect.get("layout"):
            raise TunedTableError(f"tuned for the layout {meta.get('layout') or 'ep'}, this "
                                  f"layer is {expect.get('layout') or 'ep'}")
        if meta.get("tile", {}) != expect.get("tile", {}):
            raise VariantTableError(f"tuned for the TileConfig variant "
                                    f"{meta.get('tile', {})}, this layer is "
                                    f"{expect.get('tile', {})}")
    out = {}
    for tokens, entry in data["buckets"].items():
        try:
            n0, n1 = int(entry["layer0"]), int(entry["layer1"])
            t = int(tokens)
        except (KeyError, TypeError, ValueError) as e:
            raise TunedTableError(f"bucket {tokens!r}: needs integer 'layer0' and 'layer1' "
                                  f"({e})") from None
        if t <= 0 or n0 < 0 or n1 < 0:
            raise TunedTableError(f"bucket {tokens!r}: negative or zero values")
        decode = entry.get("decode_tile")
        if decode is not None and not isinstance(decode, bool):
            raise TunedTableError(f"bucket {tokens!r}: 'decode_tile' must be true or false, "
                                  f"got {decode!r}")
        out[t] = Choice(n0, n1, decode, parse_tile(tokens, entry.get("tile")))
    if not out:
        raise TunedTableError("no buckets")
    return out


@lru_cache(maxsize=256)
def _load(path: str, expect_json: str) -> dict[int, Choice] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        expect = json.loads(expect_json)
        table = parse_table(data, expect)
    except VariantTableError as e:
        log.info("comet: not using tuning file %s: %s; using the analytic model (run "
                 "`comet tune` for this variant)", path, e)
        return None
    except (OSError, json.JSONDecodeError, TunedTableError) as e:
        warnings.warn(f"comet: ignoring tuning file {path}: {e}", stacklevel=3)
        return None
    if (why := other_kernels(data["meta"], expect)) is not None:
        log.warning("comet: tuning file %s was %s; using it (re-run `comet tune` to "
                    "measure it on these kernels)", path, why)
    return table


def search_folders(folder: str | os.PathLike | None = None) -> list[Path]:
    folders = []
    if folder:
        folders.append(Path(folder))
    if os.environ.get(ENV_FOLDER):
        folders.append(Path(os.environ[ENV_FOLDER]))
    folders.append(SHIPPED)
    return folders


def nearest_bucket(table: dict[int, Choice], tokens: int) -> Choice:
    """The bucket nearest to ``tokens`` in log scale (ties: the larger bucket, whose rows
    are the closer worst case); clamped at the ends."""
    keys = sorted(table)
    t = max(tokens, 1)
    return table[min(keys, key=lambda k: (abs(math.log(k / t)), -k))]


_untuned_logged: set = set()


def load_table(cfg: MoEConfig, world_size: int, device=None,
               folder: str | os.PathLike | None = None,
               tile: TileConfig | None = None, layout: str | None = None
               ) -> dict[int, Choice] | None:
    """The table a layer of this shape, TileConfig (default: the default one) and layout
    (a TP layout's key, None for expert parallelism) uses (``{tokens: Choice}``), or None
    when untuned (logged once per shape)."""
    dev = device_name(device)
    names = file_names(cfg, world_size, dev, layout, tile)
    name = names[0]
    expect = json.dumps(expected_meta(cfg, world_size, dev, tile, layout), sort_keys=True)
    for f in search_folders(folder):
        for path in (f / n for n in names):
            if path.is_file():
                table = _load(str(path), expect)
                if table is not None:
                    return table
    if name not in _untuned_logged:
        _untuned_logged.add(name)
        log.info("comet: no tuned block split for %s; using the analytic model "
                 "(run `comet tune` for this shape)", name)
    return None


def lookup(cfg: MoEConfig, world_size: int, tokens: int, device=None,
           folder: str | os.PathLike | None = None,
           tile: TileConfig | None = None, layout: str | None = None) -> Choice | None:
    """The tuned choice for ``tokens`` on this rank, or None when untuned."""
    table = load_table(cfg, world_size, device, folder, tile, layout)
    return None if table is None else nearest_bucket(table, tokens)
