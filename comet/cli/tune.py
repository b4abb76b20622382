"""``comet tune``: measure the best block split per shape and write a tuned table.

For a model config and a list of tokens-per-rank buckets, time the fused layer at
candidate numbers of comm blocks (the same count for both layers in one call; each layer
is a separate kernel, so one call times a candidate for both) and keep, per bucket and
layer, the fastest. By default the candidates timed are those a hill climb from the
analytic model's pick and from 0 needs (comet.scheduler.search); ``--search exhaustive``
times all of them. With ``--routings uniform skewed`` each candidate is timed on both
of the benchmark's routings and judged by their mean: a call's routing lives on the
device, so one split must serve the mix (default: uniform only; the mix has not yet been
measured to pick better, see docs/tuning.md). Where the layer has a decode tile (narrower
layer1 column blocks), layer1 is also timed on the tile its rule does not pick, and the
faster tile is kept. Then, at the chosen split and layer1 tile, the per-call tile fields
(:data:`comet.config.TUNABLE_TILE_FIELDS`: layer0's group of m-tiles, the local head of
the tile table) are timed at the values of ``TILE_CANDIDATES``; one is kept (``tile`` in
the bucket) only if the call is ``TILE_MARGIN`` faster with it than with the layer's own.
The table goes to ``<output-dir>/E=..,H=..,F=..,topk=..,ep=..,device_name=..,
dtype=...json`` (see comet.scheduler.tuned), written after every bucket: an interrupted
sweep resumes where it stopped, and an existing file is merged into.

``--check`` re-times the choices of the table a layer would load (``--output-dir``, then
``$COMET_TUNED_CONFIG_FOLDER``, then the shipped tables), at any token counts -- tuned
buckets or not -- against every candidate on both layer1 tiles (the exhaustive best; the
table's own tile fields are timed at its split and count among the candidates), a fixed
split of ``FIXED_SPLIT`` comm blocks and the analytic model (both on the rule's tile and
the layer's own tile fields), and prints the comparison.

Examples::

    comet tune --config mixtral                        # every GPU, default buckets
    comet tune --config-json path/to/config.json --tokens 512 2048
    comet tune --experts 64 --topk 8 --hidden 4096 --ffn 1024 --output-dir my_tables/
    comet tune --config mixtral --check --tokens 128 3000 8192
    comet tune --config qwen2-moe --tp 2 --convention replicated   # a TP layout's table
    comet tune --config mixtral --dtype fp8            # the FP8 layer's table (dtype=fp8)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from comet import __version__
from comet.bench.inputs import (ROUTINGS, make_expert_weights, make_input_sets,
                                quantize_expert_weights)
from comet.bench.provenance import provenance, write_result
from comet.bench.timing import median, reduce_over_ranks, time_calls
from comet.cli.launch import init_ranks, maybe_relaunch
from comet.config import PRESETS, MoEConfig, TileConfig
from comet.mesh import CONVENTIONS, MeshLayout
from comet.quant import Fp8
from comet.scheduler import search, tuned

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: ``--dtype`` of the FP8 layer, whose table no bf16 layer loads (tuned.dtype_name).
FP8 = "fp8"
#: Token buckets from decode to long prefill chunks; a call uses the nearest (log scale).
DEFAULT_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_CANDIDATES = (0, 2, 4, 8, 12, 16, 24, 32, 48, 64)
#: The single split ``--check`` compares against (the split before tuning existed).
FIXED_SPLIT = 16
#: Per-call tile fields timed per bucket at the chosen split, beside the layer's own.
#: A group of 16 m-tiles reads an expert's W13 half as often in large calls, no local
#: head paid in some mid-sized fused calls: each where the other does not
#: (docs/tuning.md).
TILE_CANDIDATES = ({"group_m": 16}, {"local_head_tiles": 0},
                   {"group_m": 16, "local_head_tiles": 0})
#: How much faster (fraction of the call) a tile candidate must be to be kept: below
#: that, timing noise would pick among equals.
TILE_MARGIN = 0.01


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="comet tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(PRESETS), help="a named model shape")
    p.add_argument("--config-json", help="a transformers config.json of an MoE model")
    for name in ("experts", "topk", "hidden", "ffn"):
        p.add_argument(f"--{name}", type=int, help="explicit sizes (all four together)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                   help="tokens-per-rank buckets (default: %(default)s)")
    p.add_argument("--candidates", type=int, nargs="+", default=list(DEFAULT_CANDIDATES),
                   help="comm-block counts to try (0: comm then compute)")
    p.add_argument("--search", choices=("local", "exhaustive"), default="local",
                   help="local: hill-climb from the analytic pick and from 0 (a few calls "
                        "per bucket); exhaustive: every candidate")
    p.add_argument("--routings", nargs="+", choices=ROUTINGS, default=["uniform"],
                   help="routings a split is timed on; it is chosen for their mean time "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=[*sorted(DTYPES), FP8], default="bf16",
                   help="fp8: the FP8 layer (MoEConfig.fp8: bf16 rows, FP8 experts), "
                        "into its own table (dtype=fp8) (default: bf16)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-dir", default=os.environ.get(tuned.ENV_FOLDER, "comet_tuned"),
                   help=f"where tables go (default: ${tuned.ENV_FOLDER} or ./comet_tuned)")
    p.add_argument("--overwrite", action="store_true",
                   help="re-measure buckets already in the file")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1,
                   help="tune a (tp, ranks/tp) layout (comet.mesh); its table is keyed by the "
                        "kernels' shard-expert shape, which the layer looks up (default: 1)")
    p.add_argument("--convention", choices=CONVENTIONS, default="sequence",
                   help="with --tp: the inputs the layout is tuned on (default: sequence)")
    p.add_argument("--check", action="store_true",
                   help="re-time the table's choices against the exhaustive best, a fixed "
                        f"split of {FIXED_SPLIT} and the analytic model (writes nothing "
                        "but a check-*.json report in --output-dir)")
    return p


def config_from_json(path: str) -> MoEConfig:
    """The MoE shape of a transformers config.json (Mixtral, Qwen2/3-MoE, OLMoE,
    DeepSeek-V3 names)."""
    with open(path) as f:
        c = json.load(f)
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    ffn = c.get("moe_intermediate_size") or c.get("intermediate_size")
    if not (experts and c.get("num_experts_per_tok") and c.get("hidden_size") and ffn):
        raise ValueError(f"{path}: not an MoE config (needs experts, num_experts_per_tok, "
                         "hidden_size and an expert intermediate size)")
    return MoEConfig(num_experts=int(experts), top_k=int(c["num_experts_per_tok"]),
                     hidden_size=int(c["hidden_size"]), intermediate_size=int(ffn))


def resolve_config(args, parser) -> MoEConfig:
    explicit = [args.experts, args.topk, args.hidden, args.ffn]
    chosen = sum([args.config is not None, args.config_json is not None,
                  any(v is not None for v in explicit)])
    if chosen != 1:
        parser.error("give exactly one of --config, --config-json, or the four sizes")
    try:
        if args.config:
            return PRESETS[args.config]
        if args.config_json:
            return config_from_json(args.config_json)
        if any(v is None for v in explicit):
            parser.error("--experts, --topk, --hidden and --ffn go together")
        return MoEConfig(num_experts=args.experts, top_k=args.topk, hidden_size=args.hidden,
                         intermediate_size=args.ffn)
    except ValueError as err:
        parser.error(str(err))


#: What a table without ``meta["routings"]`` was timed on (tables before the mix).
LEGACY_ROUTINGS = ["uniform"]


def load_existing(path: str, meta: dict, routings: list[str] | None = None) -> dict:
    """The table already at ``path`` (to resume / merge), or a fresh one. A table of
    other kernels (:func:`comet.scheduler.tuned.other_kernels`) or one timed on another
    routing mix is replaced; one of another shape is refused; one of another TileConfig
    variant is replaced too."""
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        try:
            tuned.parse_table(data, meta)
            if (why := tuned.other_kernels(data["meta"], meta)) is not None:
                raise tuned.VariantTableError(why)
        except tuned.VariantTableError as e:
            print(f"{path}: {e}; measuring every bucket again", file=sys.stderr)
            return {"meta": meta, "buckets": {}}
        had = data["meta"].get("routings", LEGACY_ROUTINGS)
        if routings is not None and sorted(had) != sorted(routings):
            print(f"{path}: timed on routings {had}, now {routings}; measuring every "
                  "bucket again", file=sys.stderr)
            return {"meta": meta, "buckets": {}}
        return data
    return {"meta": meta, "buckets": {}}


def write_table(path: str, table: dict, device: str) -> None:
    """Write a tuned table whole or not at all (a reader never sees half a file), its
    ``meta`` stamped with the provenance every results file carries: device, commit,
    kernels (the identity layers compare on load), command."""
    table["meta"].update(comet_version=__version__, **provenance(device=device),
                         date=datetime.date.today().isoformat())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
    os.replace(path + ".tmp", path)


def bucket_timer(layer, cfg: MoEConfig, tokens: int, args, device, rank: int,
                 decode_tile: bool | None = None, tile_overrides: dict | None = None
                 ) -> Callable[[int], search.Times]:
    """``fn(comm blocks) -> (layer0 us, layer1 us)`` at ``tokens`` per rank, on the
    decode tile or the default one (None: the layer's own choice) and with the per-call
    tile fields ``tile_overrides`` (default: the layer's TileConfig, never a table's --
    what is timed must not depend on the tables already installed): per routing of
    ``args.routings`` the slowest rank's median, then their mean -- one split for the
    routing mix, since a call's routing is on the device and selection never waits for
    it. The same on every rank (collective: every rank calls it alike)."""
    from comet.runtime.layer import PhaseTimer
    me = layer.mesh.token_source(rank, layer.convention)
    mix = [make_input_sets(cfg, "tune", tokens, routing, 2, me, args.seed, device)
           for routing in args.routings]

    def timed(n: int) -> search.Times:
        per_routing = []
        for sets in mix:
            def call(i, timer, sets=sets):
                s = sets[i]
                layer(s.x, s.topk_ids, s.topk_weights, comm_blocks=n, timer=timer,
                      decode_tile=decode_tile, tile_overrides=tile_overrides or {})
            series = time_calls(call, n_sets=len(sets), iters=args.iters,
                                warmup=args.warmup, device=device, make_timer=PhaseTimer)
            series = reduce_over_ranks(series)
            per_routing.append((median(series["layer0"]), median(series["layer1"])))
        return (sum(t[0] for t in per_routing) / len(mix),
                sum(t[1] for t in per_routing) / len(mix))
    return timed


def tiles_to_time(layer, tokens: int) -> list[bool | None]:
    """The layer1 tiles a bucket is timed on: the rule's pick first, then the other one
    (None alone for a layer without a decode tile)."""
    if layer.tile.decode_tile() is None:
        return [None]
    rule = layer.selection.decode_by_rule(tokens)
    return [rule, not rule]


def _sweep(times: dict[int, search.Times]) -> dict[str, list[float]]:
    return {str(n): [round(a, 1), round(b, 1)] for n, (a, b) in sorted(times.items())}


def sweep_bucket(layer, cfg: MoEConfig, tokens: int, candidates: list[int], args, device,
                 rank: int) -> dict:
    """Layer times of the candidates the search timed for one bucket; the table entry.

    The split is searched on the layer1 tile the rule picks; where the layer has a decode
    tile, layer1 is then climbed on the other tile from the best split found, and the
    faster of the two is kept (``decode_tile`` in the entry): the rule only counts work
    items, and a narrower tile can lose where items were already plenty."""
    first, *others = tiles_to_time(layer, tokens)
    timer = bucket_timer(layer, cfg, tokens, args, device, rank, first)
    # With the scatter epilogue layer1 has no comm role (its split is ignored): only
    # layer0's split and layer1's tile are searched, and layer1's entry is 0.
    scatter = layer.tile.variant.layer1_scatter
    if args.search == "exhaustive":
        times = {n: timer(n) for n in candidates}
    else:
        a0, a1 = layer.selection.analytic(tokens)
        times = search.climb(timer, candidates, [(a0, 0), () if scatter else (a1, 0)])
    best0, best1 = search.best_splits(times)
    # Scattering, every call timed layer1 alike: the one of layer0's best is kept.
    timed1 = best0 if scatter else best1
    entry = {"layer0": best0, "layer1": 0 if scatter else best1, "layer0_us": times[best0][0],
             "layer1_us": times[timed1][1], "search": args.search, "sweep_us": _sweep(times)}
    if not others:
        return entry
    entry["decode_tile"] = first
    other = bucket_timer(layer, cfg, tokens, args, device, rank, others[0])
    if scatter:
        alt = {timed1: other(timed1)}
    elif args.search == "exhaustive":
        alt = {n: other(n) for n in candidates}
    else:
        alt = search.climb(other, candidates, [(), (best1,)])
    alt1 = search.best_splits(alt)[1]
    if alt[alt1][1] < entry["layer1_us"]:
        entry.update(layer1=0 if scatter else alt1, layer1_us=alt[alt1][1],
                     decode_tile=others[0])
    entry["sweep_us_other_tile"] = _sweep(alt)
    return entry


def tile_label(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "default"


def search_tile(layer, cfg: MoEConfig, tokens: int, entry: dict, args, device,
                rank: int) -> dict:
    """Time ``TILE_CANDIDATES`` at the entry's split and layer1 tile, beside the layer's
    own tile fields timed again there (so drift since the split search cannot favour a
    candidate); keep the fastest (``tile`` in the entry) if it beats the layer's own by
    ``TILE_MARGIN`` of the call. Returns the entry, with ``tile_sweep_us``."""
    decode = entry.get("decode_tile")
    split = (entry["layer0"], entry["layer1"])
    sweep = {}
    for overrides in ({}, *TILE_CANDIDATES):
        timer = bucket_timer(layer, cfg, tokens, args, device, rank, decode, overrides)
        sweep[tile_label(overrides)] = (overrides, timer(split))
    total = {k: sum(t) for k, (_, t) in sweep.items()}
    best = min(total, key=total.get)
    if total[best] < (1 - TILE_MARGIN) * total["default"]:
        overrides, (l0, l1) = sweep[best]
        entry.update(tile=overrides, layer0_us=l0, layer1_us=l1)
    entry["tile_sweep_us"] = {k: [round(a, 1), round(b, 1)] for k, (_, (a, b)) in sweep.items()}
    return entry


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = resolve_config(args, parser)
    try:
        cfg = (cfg.replace(dtype=torch.bfloat16, fp8=Fp8(), max_tokens=max(args.tokens))
               if args.dtype == FP8 else
               cfg.replace(dtype=DTYPES[args.dtype], max_tokens=max(args.tokens)))
    except ValueError as err:
        parser.error(str(err))
    code = maybe_relaunch(argv, args.nproc, "comet.cli.tune")
    if code is not None:
        return code
    device, world, rank = init_ranks()
    if device.type != "cuda":
        print("comet tune measures the fused kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        try:
            layer, table_cfg = tuned_layer(cfg, args, device, world, rank)
        except ValueError as err:
            print(err, file=sys.stderr)
            return 2
        return (_check if args.check else _tune)(layer, table_cfg, cfg, args, device, world,
                                                 rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tuned_layer(cfg: MoEConfig, args, device, world: int, rank: int):
    """``(layer, table_cfg)``: the layer ``comet tune`` times -- expert parallelism over
    the ranks, or with ``--tp`` a (tp, ranks/tp) layout in ``--convention`` -- and the
    config its table is keyed by, the kernels' (a layout's shard experts:
    :meth:`comet.mesh.MeshLayout.kernel_config`), which is what the layer's per-call
    selection looks up. ValueError for a layout that cannot shard ``cfg``."""
    from comet.runtime.layer import FusedMoE
    if args.tp < 1 or world % args.tp:
        raise ValueError(f"--tp ({args.tp}) must divide the number of ranks ({world})")
    mesh = MeshLayout(tp=args.tp, ep=world // args.tp)
    mesh.check(cfg.num_experts, cfg.intermediate_size)
    shard = cfg.replace(intermediate_size=cfg.intermediate_size // mesh.tp)
    w13, w2 = make_expert_weights(shard, cfg.num_experts // mesh.ep, "tune", rank, args.seed,
                                  device)
    if cfg.fp8 is not None:
        w13, w2 = quantize_expert_weights(w13, w2)
    layer = FusedMoE(cfg, w13, w2, mesh=mesh, convention=args.convention)
    return layer, layer.ws.cfg


def _tune(layer, table_cfg: MoEConfig, cfg: MoEConfig, args, device, world: int,
          rank: int) -> int:
    from tqdm import tqdm

    name = tuned.device_name(device)
    layout = layer.selection.layout
    meta = tuned.expected_meta(table_cfg, world, name, layer.tile, layout)
    path = os.path.join(args.output_dir,
                        tuned.file_name(table_cfg, world, name, layout, layer.tile))
    table = load_existing(path, meta, args.routings)
    candidates = sorted({n for n in args.candidates if 0 <= n < layer.programs})
    todo = [t for t in args.tokens if args.overwrite or str(t) not in table["buckets"]]
    ranks = f"ep={world}" if args.tp == 1 else f"tp={args.tp} ep={world // args.tp}"
    bar = tqdm(todo, desc=f"comet tune E={cfg.num_experts} {ranks}", disable=rank != 0)
    for tokens in bar:
        entry = sweep_bucket(layer, cfg, tokens, candidates, args, device, rank)
        entry = search_tile(layer, cfg, tokens, entry, args, device, rank)
        table["buckets"][str(tokens)] = entry
        table["meta"].update(candidates=candidates, iters=args.iters,
                             routings=args.routings)
        if rank == 0:
            write_table(path, table, name)
            decode = " on the decode tile" if entry.get("decode_tile") else ""
            tile = f", tile {tile_label(entry['tile'])}" if entry.get("tile") else ""
            bar.write(f"tokens={tokens}: layer0 {entry['layer0']} comm blocks "
                      f"({entry['layer0_us']:.0f} us), layer1 {entry['layer1']}{decode} "
                      f"({entry['layer1_us']:.0f} us){tile}")
    if rank == 0:
        print(f"wrote {path}")
        if not _searched(args.output_dir):
            print(f"layers load it with CometMoE(..., tuned_config_folder="
                  f"{args.output_dir!r}) or {tuned.ENV_FOLDER}={args.output_dir}")
    return 0


def _searched(folder: str) -> bool:
    """Whether a layer built without ``tuned_config_folder`` looks in ``folder``."""
    target = os.path.realpath(folder)
    return any(os.path.realpath(f) == target for f in tuned.search_folders())


def find_table(cfg: MoEConfig, world: int, device_name: str, folder: str,
               layout: str | None = None, tile: TileConfig | None = None) -> str | None:
    """The table a layer would load (first folder of the lookup that has the file)."""
    for f in tuned.search_folders(folder):
        for name in tuned.file_names(cfg, world, device_name, layout, tile):
            if (f / name).is_file():
                return str(f / name)
    return None


#: A pick: (layer0 comm blocks, layer1 comm blocks, decode tile or None, tile fields as
#: sorted (name, value) pairs).
Pick = tuple[int, int, bool | None, tuple[tuple[str, int], ...]]
#: What ``--check`` timed: (comm blocks, decode tile or None, tile fields) -> layer times.
CheckTimes = dict[tuple[int, bool | None, tuple[tuple[str, int], ...]], search.Times]


def pool_split_free(times: CheckTimes) -> CheckTimes:
    """``times`` with layer1's time of every split replaced by the median over the
    splits of its (decode tile, tile fields): with the scatter epilogue layer1 has no
    comm role, so its split changes nothing, and the fastest of several timings of one
    program is luck, not a better split."""
    pooled: dict[tuple, list[float]] = {}
    for (_, tile, fields), (_, t1) in times.items():
        pooled.setdefault((tile, fields), []).append(t1)
    return {k: (t0, median(pooled[k[1:]])) for k, (t0, _) in times.items()}


def check_rows(times: CheckTimes, picks: dict[str, Pick]) -> list[dict]:
    """Per layer (and both together), each pick's time against the exhaustive best;
    ``times`` is keyed by (comm blocks, decode tile, tile fields) (pooled by
    :func:`pool_split_free` where layer1's split is ignored)."""
    rows = []
    for i, layer_name in enumerate(("layer0", "layer1")):
        best = min(times, key=lambda k: times[k][i])
        row = {"layer": layer_name, "best": best[0], "best_decode_tile": best[1],
               "best_tile": dict(best[2]), "best_us": times[best][i]}
        for label, pick in picks.items():
            t = times[(pick[i], pick[2], pick[3])][i]
            row.update({label: pick[i], f"{label}_decode_tile": pick[2],
                        f"{label}_tile": dict(pick[3]), f"{label}_us": t,
                        f"{label}_over_best": t / times[best][i]})
        rows.append(row)
    both = {"layer": "both", "best_us": rows[0]["best_us"] + rows[1]["best_us"]}
    for label in picks:
        both[f"{label}_us"] = rows[0][f"{label}_us"] + rows[1][f"{label}_us"]
        both[f"{label}_over_best"] = both[f"{label}_us"] / both["best_us"]
    return rows + [both]


def format_check(report: list[dict], labels: list[str]) -> str:
    """The ``--check`` report as a markdown table (``d`` after a split: the decode
    tile; ``*`` after it: the pick sets tile fields, listed in the JSON report)."""
    head = ("| tokens | layer | " + " | ".join(f"{x} (n) us" for x in labels)
            + " | best (n) us | " + " | ".join(f"{x}/best" for x in labels) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(labels))]
    for r in report:
        def cell(label):
            n = r.get(label)
            d = "d" if r.get(f"{label}_decode_tile") else ""
            d += "*" if r.get(f"{label}_tile") else ""
            return f"{r[f'{label}_us']:.0f}" + (f" ({n}{d})" if n is not None else "")
        lines.append(f"| {r['tokens']} | {r['layer']} | "
                     + " | ".join(cell(x) for x in labels) + f" | {cell('best')} | "
                     + " | ".join(f"{r[f'{x}_over_best']:.3f}" for x in labels) + " |")
    return "\n".join(lines)


def _check(layer, table_cfg: MoEConfig, cfg: MoEConfig, args, device, world: int,
           rank: int) -> int:
    from tqdm import tqdm

    name = tuned.device_name(device)
    layout = layer.selection.layout
    path = find_table(table_cfg, world, name, args.output_dir, layout, layer.tile)
    if path is None:
        print(f"no table {tuned.file_name(table_cfg, world, name, layout, layer.tile)} to "
              "check (searched "
              f"{', '.join(map(str, tuned.search_folders(args.output_dir)))})",
              file=sys.stderr)
        return 2
    with open(path) as f:
        data = json.load(f)
    table = tuned.parse_table(data)
    try:
        tuned.parse_table(data, tuned.expected_meta(table_cfg, world, name, layer.tile,
                                                    layout))
    except tuned.TunedTableError as e:
        print(f"note: a layer would not use {path}: {e}", file=sys.stderr)
    report, raw = [], []
    for tokens in tqdm(args.tokens, desc="comet tune --check", disable=rank != 0):
        tiles = tiles_to_time(layer, tokens)
        choice = tuned.nearest_bucket(table, tokens)
        # The table's tile where it has one and the layer can run it; else the rule's.
        tuned_tile = (tiles[0] if None in tiles or choice.decode_tile is None
                      else choice.decode_tile)
        picks = {"tuned": (*choice.splits, tuned_tile, choice.tile),
                 "fixed": (FIXED_SPLIT, FIXED_SPLIT, tiles[0], ()),
                 "analytic": (*layer.selection.analytic(tokens), tiles[0], ())}
        # A pick beyond this GPU's programs runs as the largest split it has (clamped
        # before the sweep, so every pick is among the timed candidates).
        picks = {k: (*(min(n, layer.programs - 1) for n in v[:2]), *v[2:])
                 for k, v in picks.items()}
        wanted = set(args.candidates) | {n for p in picks.values() for n in p[:2]}
        candidates = sorted(n for n in wanted if 0 <= n < layer.programs)
        times: CheckTimes = {}
        for tile in tiles:
            timer = bucket_timer(layer, cfg, tokens, args, device, rank, tile)
            times.update({(n, tile, ()): timer(n) for n in candidates})
        if choice.tile:     # the table's tile fields, at its own split
            pick = picks["tuned"]
            timer = bucket_timer(layer, cfg, tokens, args, device, rank, pick[2],
                                 dict(pick[3]))
            for n in sorted(set(pick[:2])):
                times[(n, pick[2], pick[3])] = timer(n)
        raw += [{"tokens": tokens, "comm_blocks": n, "decode_tile": tile, "tile": dict(fields),
                 "layer0_us": t0, "layer1_us": t1}
                for (n, tile, fields), (t0, t1) in sorted(times.items(), key=str)]
        if layer.tile.variant.layer1_scatter:
            times = pool_split_free(times)
        report += [{"tokens": tokens, **r} for r in check_rows(times, picks)]
    if rank == 0:
        print(f"table: {path}")
        print(format_check(report, ["tuned", "fixed", "analytic"]))
        os.makedirs(args.output_dir, exist_ok=True)
        layout = f"ep{world}" if args.tp == 1 else f"tp{args.tp}-{args.convention}"
        out = os.path.join(args.output_dir, f"check-E{cfg.num_experts}-H{cfg.hidden_size}-"
                           f"F{cfg.intermediate_size}-k{cfg.top_k}-{layout}.json")
        write_result(out, {"table": path, "meta": data.get("meta"), "iters": args.iters,
                           "routings": args.routings,
                           "layer1_split_pooled": layer.tile.variant.layer1_scatter, "rows": report,
                           "times": raw}, device=name)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
