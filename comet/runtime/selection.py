"""What a call runs on: the block split and the tile configuration, chosen per call.

The block split (comm blocks of each layer) comes from an explicit override, else the
tuned table of this shape, device and tile variant (comet.scheduler.tuned), else the
analytic model (comet.scheduler.split). The tile is the layer's TileConfig with the tunable
fields a tuned bucket sets, on the decode tile (narrower layer1 column blocks) when the
table or a rule says a call is too small to fill the GPU, an FP8 call of a few rows per
expert on m-tiles of ``small_block_m`` rows, and with layer0's small-call
variants compiled in only for calls small enough: stream-K where the device may take
it, the K splits of layer0's last round where that round is nearly empty, and a
gathered GEMM's loads of live rows only where its tiles are mostly others' rows; the
plan in two launches for calls of a few token blocks. All are rank-local choices --
nothing a peer reads depends on them except the split, which every rank of a group
derives from the same table -- and all are remembered per token count,
so the forward path does not search folders or run the model's loop on every call.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from comet.config import TUNABLE_TILE_FIELDS, MoEConfig, TileConfig
from comet.kernels.fp8_roles import packed_row_bytes
from comet.kernels.layer0 import STREAM_K_ROUNDS, TAIL_ROWS, cut_item_columns, item_columns
from comet.kernels.plan import open_step_blocks, plan_block_tokens
from comet.scheduler import tuned
from comet.scheduler.split import analytic_split, layer_work


#: A gathered layer0 loads only its tiles' own A rows while each expert's expected rows
#: fill at most this fraction of an m-tile (:meth:`Selector.live_rows_by_rule`).
LIVE_ROWS_MAX_FILL = 1 / 8
#: Most steps of a small call's opening (comet.kernels.plan.open_kernel) for which the
#: two-launch plan pays (:meth:`Selector.small_plan_by_rule`): each step is a serial
#: pass, and from four steps on the seven launches were faster (docs/notebook.md, "Small
#: calls").
SMALL_PLAN_STEPS = 2


class Selector:
    """Per-call choices of one layer.

    Args:
        cfg, world: the layer's shape and expert-parallel size.
        tile: the layer's TileConfig (its variant keys the tuned tables).
        programs: programs of the fused kernels (SMs of the device).
        device: where the layer runs (its name keys the tuned tables).
        folder: an extra folder of ``comet tune`` tables.
        layout: a TP layout's table key (:meth:`comet.mesh.MeshLayout.table_layout`;
            None: expert parallelism).
    """

    def __init__(self, cfg: MoEConfig, world: int, tile: TileConfig, programs: int,
                 device: torch.device, folder: str | None = None, layout: str | None = None):
        self.cfg, self.world, self.tile = cfg, world, tile
        self.programs, self.device, self.folder = programs, device, folder
        self.layout = layout
        self._variants: dict[tuple, tuple[TileConfig, TileConfig | None]] = {}
        self._small: dict[int, bool] = {}
        self._stream_k: dict[int, bool] = {}
        self._too_large: dict[int, tuple[str, ...]] = {}
        #: layer0's items can be cut in K (FP8, or one dot each; block_n0 is no per-call
        #: field): only then has the workspace stream-K's scratch, and the variant a
        #: kernel of its own
        cut = cut_item_columns(tile.gemm.block_n0, cfg.intermediate_size, cfg.fp8 is not None)
        self.may_stream_k = tile.variant.layer0_stream_k and cut > 0
        self.may_tail_split = tile.variant.layer0_tail_split > 1 and cut > 0
        self.may_live_rows = tile.variant.layer0_gather and tile.variant.layer0_live_rows
        self.may_small_plan = tile.variant.small_plan_blocks > 0
        self.may_ws_gemm = cfg.fp8 is not None and tile.variant.fp8_ws_min_rows > 0
        self.may_ws_paired = self.may_ws_gemm and tile.variant.fp8_ws_paired_rows > 0
        self.may_small_rows = cfg.fp8 is not None and tile.small_rows_tile() is not None
        self._small_rows: dict[int, bool] = {}
        self._on_small_rows: dict[TileConfig, TileConfig] = {}
        self._without: dict[tuple[TileConfig, tuple[str, ...]], TileConfig] = {}
        self._selected: dict[tuple, tuned.Choice] = {}
        self._per_call: dict[tuple, tuple[tuple[int, int], TileConfig]] = {}

    def for_call(self, num_tokens: int) -> tuple[tuple[int, int], TileConfig]:
        """``(comm_blocks(num_tokens), tile_for(num_tokens))`` of a call without
        overrides, decided once per token count (programs and tuned-table folder): the
        per-call path of a layer, where each us of host time counts."""
        key = (num_tokens, self.programs, os.environ.get(tuned.ENV_FOLDER))
        found = self._per_call.get(key)
        if found is None:
            found = self._per_call[key] = (self.comm_blocks(num_tokens),
                                           self.tile_for(num_tokens))
        return found

    # ------------------------------------------------------------------ split
    def comm_blocks(self, num_tokens: int, override=None) -> tuple[int, int]:
        """(layer0, layer1) comm blocks for a call with ``num_tokens`` on this rank: the
        ``override`` (an int for both layers, or a pair), else the tuned table, else the
        analytic model."""
        if override is not None:
            n0, n1 = (override, override) if isinstance(override, int) else override
        else:
            n0, n1 = self._choice(num_tokens).splits
        for n in (n0, n1):
            if not 0 <= n < self.programs:
                raise ValueError(f"comm_blocks must be in [0, {self.programs}), got {n}")
        return int(n0), int(n1)

    def analytic(self, num_tokens: int) -> tuple[int, int]:
        """(layer0, layer1) comm blocks of the analytic model for ``num_tokens`` (layer1:
        0 with the scatter epilogue, which has no comm role)."""
        c = self.cfg
        fp8_row = packed_row_bytes(c.hidden_size) if c.fp8 is not None else None
        w0, w1 = layer_work(num_tokens, self.world, c.top_k, c.hidden_size,
                            c.intermediate_size, c.dtype.itemsize,
                            self.tile.n_splits(c.hidden_size), fp8_row)
        n1 = 0 if self.tile.variant.layer1_scatter else analytic_split(w1, self.programs)
        return analytic_split(w0, self.programs), n1

    def _choice(self, num_tokens: int) -> tuned.Choice:
        """The tuned table's bucket (comm blocks, decode-tile flag or None, tile fields),
        else the analytic model's split and nothing else."""
        key = (num_tokens, os.environ.get(tuned.ENV_FOLDER))
        if key not in self._selected:
            picked = tuned.lookup(self.cfg, self.world, num_tokens, self.device, self.folder,
                                  tile=self.tile, layout=self.layout)
            if picked is not None and not all(0 <= n < self.programs for n in picked.splits):
                warnings.warn(f"comet: the tuned table's split {picked.splits} at "
                              f"{num_tokens} tokens does not fit this GPU's {self.programs} "
                              "programs; using the analytic model", stacklevel=4)
                picked = None
            self._selected[key] = (picked if picked is not None
                                   else tuned.Choice(*self.analytic(num_tokens)))
        return self._selected[key]

    # ------------------------------------------------------------------ tile
    def tile_for(self, num_tokens: int, decode_tile: bool | None = None,
                 overrides: dict[str, int] | None = None) -> TileConfig:
        """The tile configuration of a call with ``num_tokens`` on this rank: the layer's
        with the tunable fields the tuned bucket sets (``overrides`` replaces those), on
        the decode tile or not -- ``decode_tile`` forces that choice; else the bucket's,
        else :meth:`decode_by_rule`."""
        picked = self._choice(num_tokens)
        base, decode = self._variant(picked.tile if overrides is None
                                     else tuple(sorted(overrides.items())))
        if decode is None:
            if decode_tile:
                raise ValueError("decode_tile=True, but this layer's TileConfig has no "
                                 "decode tile (decode_block_n1 is 0 or block_n1)")
            tile = base
        else:
            if decode_tile is None:
                decode_tile = picked.decode_tile
            if decode_tile is None:
                decode_tile = self.decode_by_rule(num_tokens)
            tile = decode if decode_tile else base
        return self.shaped(tile, self.too_large_for(num_tokens),
                           self.small_rows_by_rule(num_tokens))

    def shaped(self, tile: TileConfig, off: tuple[str, ...], small_rows: bool
               ) -> TileConfig:
        """``tile`` as a call runs it: without the variants ``off``
        (:meth:`too_large_for`), on :meth:`TileConfig.small_rows_tile` where
        ``small_rows`` (:meth:`small_rows_by_rule`); built once per combination."""
        tile = self.without(tile, off)
        if small_rows:
            if tile not in self._on_small_rows:
                self._on_small_rows[tile] = tile.small_rows_tile() or tile
            tile = self._on_small_rows[tile]
        return tile

    def too_large_for(self, num_tokens: int) -> tuple[str, ...]:
        """The variants the layer may run that a call with ``num_tokens`` runs without:
        the small-call ones -- layer0's stream-K past :meth:`stream_k_by_rule`, its last
        round's K splits where :meth:`tail_split_by_rule` says no, the gathered GEMM's
        live-row loads past :meth:`live_rows_by_rule` (a call that stream-K may cut
        keeps them: it is a small one), the two-launch plan past
        :meth:`small_plan_by_rule` -- and the one of large calls, the warp-specialized
        FP8 GEMM below :meth:`ws_gemm_by_rule` and its paired m-tiles below
        :meth:`ws_paired_by_rule`. Decided once per token count."""
        if num_tokens not in self._too_large:
            stream_k = self.may_stream_k and self.stream_k_by_rule(num_tokens)
            off = []
            if self.may_stream_k and not stream_k:
                off.append("layer0_stream_k")
            if self.may_tail_split and not self.tail_split_by_rule(num_tokens):
                off.append("layer0_tail_split")
            if self.may_live_rows and not (stream_k or self.live_rows_by_rule(num_tokens)):
                off.append("layer0_live_rows")
            if self.may_small_plan and not self.small_plan_by_rule(num_tokens):
                off.append("small_plan_blocks")
            if self.may_ws_gemm and not self.ws_gemm_by_rule(num_tokens):
                off.append("fp8_ws_min_rows")
            if self.may_ws_paired and not self.ws_paired_by_rule(num_tokens):
                off.append("fp8_ws_paired_rows")
            self._too_large[num_tokens] = tuple(off)
        return self._too_large[num_tokens]

    def without(self, tile: TileConfig, variants: tuple[str, ...]) -> TileConfig:
        """``tile`` with the fields ``variants`` off (False, or 0; built once per pair):
        what a call too large for them runs -- the same as a layer that never enables
        them (compiled in, stream-K cost 8-128-token calls 2-6% that it never cut, and
        the live-row masks 1-5% of a large call's layer0: docs/benchmarks.md)."""
        if not variants:
            return tile
        if (tile, variants) not in self._without:
            self._without[tile, variants] = dataclasses.replace(
                tile, variant=tile.variant.without(variants))
        return self._without[tile, variants]

    def _variant(self, overrides: tuple[tuple[str, int], ...]
                 ) -> tuple[TileConfig, TileConfig | None]:
        """(the layer's TileConfig with ``overrides``, its decode tile or None), built
        once per set of overrides (a ValueError names a field that is not tunable)."""
        if overrides not in self._variants:
            base = self.tile.with_overrides(dict(overrides))
            self._variants[overrides] = (base, base.decode_tile())
        return self._variants[overrides]

    def tile_variants(self) -> list[TileConfig]:
        """Every tile configuration a call may select: the layer's, the tuned table's
        per-bucket ones, the decode tile of each, and each without the small-call
        variants that :meth:`too_large_for` may turn off."""
        table = tuned.load_table(self.cfg, self.world, self.device, self.folder,
                                 tile=self.tile, layout=self.layout)
        picks = {()} | {c.tile for c in (table or {}).values()}
        tiles = [t for o in sorted(picks) for t in self._variant(o) if t is not None]
        return [self.shaped(t, *shape) for t in tiles for shape in self._reachable_shapes()]

    def _reachable_shapes(self) -> list[tuple[tuple[str, ...], bool]]:
        """Every answer of (:meth:`too_large_for`, :meth:`small_rows_by_rule`) some
        token count in ``[0, max_tokens]`` gets. Each size rule holds from 1 token up to
        a last count and not after (more tokens, more rows and items), so its answers
        change only there: the counts tried are 0, 1, ``max_tokens`` and each size rule's
        last and next. The tail rule's answer turns with the last round's fill, so every
        count up to its last (small m-tiles) is tried."""
        counts = {0, 1, self.cfg.max_tokens}
        for rule in (self.stream_k_by_rule, self.live_rows_by_rule, self.small_plan_by_rule,
                     lambda n: not self.ws_gemm_by_rule(n), self._less_than_a_round):
            lo = self._last_true(rule)
            counts |= {lo, lo + 1}
        if self.may_tail_split:
            counts |= set(range(self._last_true(self._tail_rows_fit) + 2))
        return sorted({(self.too_large_for(n), self.small_rows_by_rule(n)) for n in counts
                       if n <= self.cfg.max_tokens})

    def _last_true(self, rule) -> int:
        """The last token count in ``[0, max_tokens]`` where ``rule`` (true from 1 token
        up to some count, false after) holds; 0 if none."""
        lo, hi = 0, self.cfg.max_tokens            # rule(lo) (or lo = 0), not rule(hi + 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if rule(mid) else (lo, mid - 1)
        return lo

    def decode_by_rule(self, num_tokens: int) -> bool:
        """Whether the untuned choice of :meth:`tile_for` is the decode tile:
        :meth:`TileConfig.decode_pays` with this rank's rows (every rank sending as many
        tokens as this one, spread evenly: :meth:`_expected_rows`); counting all of a
        rank's experts made the rule see 128 items of a 1-token Mixtral call where there
        are 32, and keep the wide tile."""
        if num_tokens not in self._small:
            per_expert, busy = self._expected_rows(num_tokens)
            self._small[num_tokens] = busy > 0 and self.tile.decode_pays(
                per_expert, busy, self.cfg.hidden_size, self.programs)
        return self._small[num_tokens]

    def stream_k_by_rule(self, num_tokens: int) -> bool:
        """Whether a call with ``num_tokens`` on this rank may run layer0 as stream-K:
        layer0's expected work items (:meth:`_expected_items`) make fewer than
        ``STREAM_K_ROUNDS`` rounds of the programs -- the bound of the device's own test
        (comet.kernels.layer0.stream_k_pays), which decides from the plan's real tiles.
        Where this says no, the call runs the kernel without the variant."""
        if num_tokens not in self._stream_k:
            items = self._expected_items(num_tokens)
            self._stream_k[num_tokens] = 0 < items < STREAM_K_ROUNDS.value * self.programs
        return self._stream_k[num_tokens]

    def tail_split_by_rule(self, num_tokens: int) -> bool:
        """Whether a call with ``num_tokens`` on this rank may run layer0's last partial
        round as K splits: its items, expected as :meth:`stream_k_by_rule` expects them,
        make at least one whole round and a last round that fills at most half the
        programs, on m-tiles of at most ``TAIL_ROWS`` rows -- the device's own test
        (comet.kernels.layer0.tail_split) on expected tiles. Elsewhere the call runs the
        kernel without it, as stream-K's gate does: compiled in and never cutting, it
        slowed larger calls (docs/notebook.md, "Small calls")."""
        if not self._tail_rows_fit(num_tokens):
            return False
        items = self._expected_items(num_tokens)
        tail = items % self.programs
        return items > self.programs and 0 < tail and self.programs // tail >= 2

    def _expected_items(self, num_tokens: int) -> int:
        """layer0's work items of a call with ``num_tokens``, rows expected as
        :meth:`decode_by_rule` expects them: m-tiles of the experts with rows x column
        blocks (comet.kernels.layer0.item_columns)."""
        per_expert, busy = self._expected_rows(num_tokens)
        t = self.tile
        cols = item_columns(t.gemm.block_n0, self.cfg.fp8 is not None)
        return (busy * -(-per_expert // t.gemm.block_m)
                * -(-self.cfg.intermediate_size // cols))

    def _tail_rows_fit(self, num_tokens: int) -> bool:
        """Whether the m-tiles of a call with ``num_tokens``, rows expected as
        :meth:`decode_by_rule` expects them, have at most ``TAIL_ROWS`` rows."""
        per_expert, _ = self._expected_rows(num_tokens)
        return min(per_expert, self.tile.gemm.block_m) <= TAIL_ROWS.value

    def live_rows_by_rule(self, num_tokens: int) -> bool:
        """Whether a gathered layer0's call with ``num_tokens`` on this rank loads only
        its tiles' own A rows: each expert's rows, expected as :meth:`decode_by_rule`
        expects them, fill at most :data:`LIVE_ROWS_MAX_FILL` of an m-tile: the masks pay
        at a few rows per expert and cost full tiles (docs/notebook.md, "Small
        calls")."""
        per_expert, busy = self._expected_rows(num_tokens)
        return busy > 0 and per_expert <= LIVE_ROWS_MAX_FILL * self.tile.gemm.block_m

    def small_plan_by_rule(self, num_tokens: int) -> bool:
        """Whether a call with ``num_tokens`` on this rank plans in two launches: its
        tokens make at most ``Variant.small_plan_blocks`` of the plan's token blocks
        (the layout kernel's programs place one each, 16 of them at most) in at most
        :data:`SMALL_PLAN_STEPS` of the opening's steps (comet.kernels.plan.open_kernel
        counts a step of several blocks at a time, fewer the more experts there are)."""
        blocks = -(-num_tokens // plan_block_tokens(self.cfg.top_k))
        step = open_step_blocks(self.cfg.num_experts)
        return (blocks <= self.tile.variant.small_plan_blocks
                and -(-blocks // step) <= SMALL_PLAN_STEPS)

    def ws_gemm_by_rule(self, num_tokens: int) -> bool:
        """Whether an FP8 call with ``num_tokens`` on this rank runs its GEMMs on the
        warp-specialized kernel: each expert's rows, expected as :meth:`decode_by_rule`
        expects them, are at least the layer's ``Variant.fp8_ws_min_rows`` (large calls;
        the rule holds from some count on, the others' up to one)."""
        return self._rows_per_expert_reach(num_tokens, self.tile.variant.fp8_ws_min_rows)

    def ws_paired_by_rule(self, num_tokens: int) -> bool:
        """Whether a call on the warp-specialized kernel runs its GEMMs on paired m-tiles:
        each expert's rows, expected as :meth:`ws_gemm_by_rule` expects them, at least
        ``Variant.fp8_ws_paired_rows``."""
        return self._rows_per_expert_reach(num_tokens, self.tile.variant.fp8_ws_paired_rows)

    def _rows_per_expert_reach(self, num_tokens: int, rows: int) -> bool:
        """Whether some expert is busy and each one's expected rows are at least ``rows``."""
        per_expert, busy = self._expected_rows(num_tokens)
        return busy > 0 and per_expert >= rows

    def small_rows_by_rule(self, num_tokens: int) -> bool:
        """Whether an FP8 call with ``num_tokens`` on this rank runs on
        :meth:`TileConfig.small_rows_tile`: its GEMMs on the `tl` kernels (below
        :meth:`ws_gemm_by_rule`, whose items are 64-row boxes) and its layer0 items,
        expected as :meth:`stream_k_by_rule` expects them, at least a round of the
        programs. There the 16-row tiles ran 8-32-token calls 0.87-0.96x the 64-row
        ones' time; with less than a round (1-token qwen2-moe, phi3.5-moe) they were
        no faster, each program's item its own latency (docs/precision.md)."""
        if num_tokens not in self._small_rows:
            self._small_rows[num_tokens] = (
                self.may_small_rows and num_tokens > 0
                and not (self.may_ws_gemm and self.ws_gemm_by_rule(num_tokens))
                and not self._less_than_a_round(num_tokens))
        return self._small_rows[num_tokens]

    def _less_than_a_round(self, num_tokens: int) -> bool:
        """Whether layer0's expected items (:meth:`_expected_items`) leave programs idle."""
        return self._expected_items(num_tokens) < self.programs

    def _expected_rows(self, num_tokens: int) -> tuple[int, int]:
        """(rows per expert with rows, experts with rows) of this rank in a call where
        every rank sends as many tokens as this one, spread evenly over the experts: as
        many experts as there are rows, up to this rank's -- a 1-token Mixtral call at
        EP=1 has 2 experts with work, not 8."""
        c = self.cfg
        local = c.num_experts // self.world
        rows = -(-num_tokens * self.world * c.top_k * local // c.num_experts)
        busy = min(local, rows)
        return (-(-rows // busy) if busy else 0), busy

    def overrides_in(self, tile: TileConfig) -> dict[str, int]:
        """The tunable fields in which ``tile`` differs from the layer's TileConfig."""
        return {k: getattr(tile.gemm, k) for k in TUNABLE_TILE_FIELDS
                if getattr(tile.gemm, k) != getattr(self.tile.gemm, k)}
