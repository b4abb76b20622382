"""One rank's forward call on the fused kernels, as phases.

A call is

    open (epoch, counts, scan + exchange push) -> plan (exchange wait + layout, place)
    -> layer0 -> layer1 -> combine

(a tensor- or hybrid-parallel layout first writes its shard slots from the caller's
routing: :mod:`comet.kernels.mesh_routing`).

:class:`ForwardCall` builds every launch's arguments once -- the call's inputs are staged at
fixed addresses (comet.runtime.staging), so the same launches serve every call and a CUDA
graph can replay them -- and hands the phases out in order. A rank on its own GPU runs
them back to back (:class:`comet.runtime.layer.FusedMoE`, one graph per variant); the
virtual-rank driver (:mod:`comet.runtime.virtual`) runs each phase on every rank before
the next, producer roles before consumer roles, which is what lets W ranks share one
process under the Triton interpreter.

``mode`` decomposes a call for the benchmark: ``"sequential"`` runs each layer's roles one
after the other (no overlap), ``"compute_only"`` runs the GEMMs on rows already in place
without waiting, ``"comm_only"`` moves the data without GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from comet.config import TileConfig
from comet.constants import ROLE_COMM, ROLE_COMPUTE, ROLE_FUSED, interpreting
from comet.kernels.combine import combine_of
from comet.kernels.layer0 import Dispatch, layer0_gemm
from comet.kernels.fp8_gemm import (LAYER0_BLOCK_N, Fp8Gather, Fp8OwnRows, MTiles,
                                     fused_fp8_gemm)
from comet.kernels.fp8_ws import PAIRED_ROWS, WsH, WsLaunch, ws_gemm
from comet.kernels.fp8_roles import (HomeQuant, home_quant, home_quantizer,
                                     launch_quantize_home, packed_views)
from comet.kernels.layer1 import column_splits, launch_release_sources, layer1_gemm
from comet.kernels.mesh_routing import ShardRouting, launch_shard_routing
from comet.kernels.stage_routing import RoutingStage, launch_stage_routing
from comet.mesh import Convention, MeshLayout
from comet.quant import Fp8Weight
from comet.scheduler.shared_tensor import layout_decomposition
from comet.kernels.plan import (Chunking, Routing, launch_counts, launch_layout,
                                launch_open, launch_place, paired_tiles, plan_block_tokens)
from comet.kernels.sync import Trace
from comet.runtime.launches import CombineLaunch, Layer0Launch, Layer1Launch
from comet.runtime.strategies import progress_of, scatter_homes, strategy_for
from comet.runtime.workspace import Workspace

MODES = ("fused", "sequential", "compute_only", "comm_only")

#: The dim along which the fused kernels decompose each layer's shared tensor: layer0's
#: GEMM starts on row tiles as their rows land, layer1 hands out column splits.
KERNEL_DECOMPOSITION = {"layer0": "m", "layer1": "n"}


def kernel_decomposition(mesh: MeshLayout, convention: Convention = "sequence"
                         ) -> dict[str, tuple[str, ...]]:
    """The shared-tensor analysis of ``mesh``'s layers (:func:`comet.scheduler.
    shared_tensor.layout_decomposition`), checked against the decomposition the kernels
    implement: NotImplementedError, naming the layer, where the analysis does not allow
    it. A layer is built only for a layout whose analysis says the kernels are sound."""
    found = layout_decomposition(mesh, convention)
    for layer, dim in KERNEL_DECOMPOSITION.items():
        if dim not in found[layer]:
            raise NotImplementedError(
                f"{layer} of a {mesh} layout ({convention}) cannot be decomposed along "
                f"{dim!r} (the analysis allows {found[layer] or 'no dim'}); the fused "
                "kernels decompose it so")
    return found

Phase = Callable[[], None]


class CallInputs(NamedTuple):
    """A call's inputs as the kernels read them: device scalars and the routing rows
    (``[max_tokens, k]``, of which the call's are read)."""

    x_addr: torch.Tensor     # int64 [1]: address of x [M, H]
    y_addr: torch.Tensor     # int64 [1]: address of the output y [M, H]
    num_tokens: torch.Tensor  # int64 [1]: M
    split0: torch.Tensor     # int64 [1]: layer0's comm blocks
    split1: torch.Tensor     # int64 [1]: layer1's comm blocks
    ids: torch.Tensor        # int64 [rows, k]
    weights: torch.Tensor    # fp32 [rows, k]


class Grids(NamedTuple):
    """Programs of each launch: fused and compute launches, comm-only launches of each
    layer, the combine."""

    compute: int
    layer0_comm: int
    layer1_comm: int
    combine: int


def plan_phases(ws: Workspace, routing: Routing, tile: TileConfig, *, small: bool = False,
                stage: RoutingStage | None = None, quant: HomeQuant | None = None
                ) -> tuple[Phase, Phase]:
    """``(open, plan)`` of a call: (with ``stage``, copy the caller's routing into the
    staged rows,) open it, count, and push this rank's counts to every peer (the scan's
    last program); then wait for every peer's counts (the layout kernel's programs) and
    build the offsets, tile table and send list. ``small``: in two launches, the open in
    one program and the send list by the layout kernel (comet.kernels.plan), for calls
    of a few token blocks (``Variant.small_plan_blocks``), whose opening also runs an FP8
    layer's home quantization ``quant`` (else a launch of its own in layer0's phases)."""
    count_exchange = ws.exchange(in_plan=True)
    chunking, cfg = Chunking.of(tile), ws.cfg

    def open_call() -> None:
        if small:
            launch_open(ws.plan, routing, ws.input_word, ws.sync, ws.shape, count_exchange,
                        ws.counters, stage, quant)
            return
        if stage is not None:
            launch_stage_routing(stage)
        ws.begin_call()
        launch_counts(ws.plan, routing, ws.input_word, ws.sync, ws.shape, count_exchange)

    def plan() -> None:
        launch_layout(ws.plan, count_exchange, ws.sync, ws.shape, chunking, tile.gemm.block_m,
                      tile.gemm.local_head_tiles, routing, ws.input_word, cfg.max_tokens,
                      place=small)
        if not small:
            launch_place(ws.plan, routing, ws.input_word, ws.epoch, cfg.max_tokens,
                         ws.shape)
    return open_call, plan


def dispatch_of(ws: Workspace, x_addr: torch.Tensor, homes, gather: bool = False
                ) -> Dispatch:
    """layer0's :class:`~comet.kernels.layer0.Dispatch` of ``ws`` for the input whose
    address is in ``x_addr`` (``homes``: what the layer1 strategy needs sent with rows;
    ``gather``: a row per token and destination, pairs as index entries)."""
    return Dispatch(x_addr, ws.plan.send, ws.plan.entries, ws.plan.entry_count, ws.peers.a0,
                    ws.recv, homes, ws.peers.flag0, ws.chunk_slots, ws.cfg.max_tokens,
                    ws.count.l0_dispatch, ws.gather_targets() if gather else None,
                    ws.count.l0_parts)


@dataclass
class ForwardCall:
    """One variant of a rank's forward call (``tile``, ``mode``, whether layer0 has comm
    blocks), on the staged ``inputs``; :meth:`stages` lists its phases.

    ``w13``: ``[El, H, 2F]`` interleaved (comet.weights); ``w2``: ``[El, F, H]`` -- or,
    for an FP8 layer (``ws.cfg.fp8``), :class:`comet.quant.Fp8Weight` ``[El, 2F, H]``
    (gate rows, then up rows) and ``[El, H, F]``.
    ``cooperative``: fused launches guarantee co-residency (a rank on a GPU of its own;
    virtual ranks sharing one launch without it, their grids sized to fit side by side).
    ``roles_apart``: every layer's roles as separate launches, producers first, even in
    fused mode (the virtual-rank driver; the interpreter always does so).
    ``trace``: per layer, a ``[programs, MAX_TRACE_EVENTS, 4]`` buffer the layer's fused
    launch stamps (``comet bench --timeline``). ``b13 [El, 2F]`` (W13's columns),
    ``b2 [El, H]``: expert biases (``cfg.expert_bias``), else None; the activation is
    the workspace config's. ``shard_routing``: a (tp, ep) layout's first launch, which
    writes ``inputs.ids`` / ``inputs.weights`` (shard slots) from the caller's routing
    (:mod:`comet.kernels.mesh_routing`); None for expert parallelism, whose staged
    routing the kernels read as it is. ``routing_stage``: the copy of the caller's
    routing into the staged rows the plan reads -- the very first launch
    (:mod:`comet.kernels.stage_routing`), or part of a small call's one-program opening
    (comet.kernels.plan.open_kernel); None where the rows are written already."""

    ws: Workspace
    w13: torch.Tensor | Fp8Weight
    w2: torch.Tensor | Fp8Weight
    tile: TileConfig
    inputs: CallInputs
    grids: Grids
    mode: str = "fused"
    layer0_comm: bool = True
    cooperative: bool = True
    roles_apart: bool = False
    trace: dict[str, torch.Tensor] | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    shard_routing: ShardRouting | None = None
    routing_stage: RoutingStage | None = None
    _phases: list[Phase] | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        ws, tile = self.ws, self.tile
        self.strategy = strategy_for(tile, self.mode)
        # The interpreter runs one program at a time: a fused launch would have its comm
        # programs wait for compute programs that have not run, so roles go one by one.
        self.fused = self.mode == "fused" and not interpreting() and not self.roles_apart
        traces = self.trace or {}
        self._quiet = Trace.off()
        self._trace = {name: Trace.on(traces[name]) if name in traces else self._quiet
                       for name in ("layer0", "layer1")}
        homes = self.strategy.homes(ws) if self.strategy.sends_homes else None
        self.fp8 = ws.cfg.fp8 is not None
        # The warp-specialized GEMMs serve the calls whose layer1 scatters: fused ones
        # (the decomposed modes run the reduce strategy, whose comm role counts GEMM
        # tiles). An FP8 layer has the field on only where the kernel fits it
        # (runtime.layer.layer_tile); a bf16 layer ignores it.
        self.ws_gemm = (self.fp8 and tile.variant.fp8_ws_min_rows > 0
                        and self.strategy.name == "scatter")
        if self.fp8:
            dispatch, gemm0, item0, gemm1, item1 = self._fp8_layers(homes)
            splits = column_splits(tile, ws.cfg.hidden_size)
            if self.ws_gemm:
                self.ws_layer0, self.ws_layer1 = self._ws_layers()
                self._progress = progress_of(ws)
        else:
            gather = tile.variant.layer0_gather
            rows = None
            if gather:
                rows = (ws.gathered_rows(self.inputs.x_addr, self.inputs.num_tokens)
                        if tile.variant.layer0_own_in_place else ws.gathered_rows())
            dispatch = dispatch_of(ws, self.inputs.x_addr, homes, gather)
            gemm0, item0 = layer0_gemm(ws.local.a0, self.w13, ws.h, tile, gated=True,
                                       activation=ws.cfg.activation, bias=self.b13, rows=rows)
            gemm1, item1, splits = layer1_gemm(ws.h, self.w2, ws.out1, tile, bias=self.b2)
        self.layer0 = Layer0Launch(
            dispatch, gemm0, item0, ws.plan.tiles, ws.plan.segments,
            ws.layer0_work(tile.variant.layer0_stream_k, tile.variant.layer0_tail_split),
            ws.sync, self.inputs.split0, ws.shape, tile)
        self.layer1 = Layer1Launch(self.strategy, ws, gemm1, item1, splits, tile,
                                   self.inputs.split1)
        self.combine = CombineLaunch(
            combine_of(self.strategy.parts(ws), self.inputs.y_addr, self.inputs.num_tokens,
                       tile), ws.local.flag1, ws.cfg.max_tokens, ws.sync, tile)
        self._routing = Routing.of(self.inputs.ids, self.inputs.weights,
                                   self.inputs.num_tokens)

    def _fp8_layers(self, homes) -> tuple:
        """``(dispatch, layer0 operands, item, layer1 operands, item)`` of an FP8 layer
        (``ws.cfg.fp8``): the dispatch sends the rows :attr:`quantize` packed on this
        rank, layer0 runs the block-scaled GEMM on them and quantizes h in its epilogue,
        layer1 runs it on h (:func:`comet.runtime.layer.fp8_tile`: the tile it runs)."""
        ws, tile = self.ws, self.tile
        h = ws.cfg.hidden_size
        self.quantize = home_quantizer(ws.home_rows, h)
        gather = tile.variant.layer0_gather
        dispatch = dispatch_of(ws, ws.home_addr, homes, gather)._replace(
            row_bytes=ws.home_rows.shape[1])
        rows, scales = packed_views(ws.local.a0, h)
        promotion = ws.cfg.fp8.promotion(warp_specialized=False)
        gemm0, item0 = fused_fp8_gemm(rows, scales, self.w13, ws.h, ws.h_scale,
                                      block_m=tile.gemm.block_m, block_n=LAYER0_BLOCK_N,
                                      group_m=tile.gemm.group_m, activation=ws.cfg.activation,
                                      promotion_k=promotion,
                                      gather=self._fp8_gather() if gather else None)
        gemm1, item1 = fused_fp8_gemm(ws.h, ws.h_scale, self.w2, ws.out1, None,
                                      block_m=tile.gemm.block_m, block_n=tile.gemm.block_n1,
                                      group_m=tile.gemm.group_m, promotion_k=promotion)
        return dispatch, gemm0, item0, gemm1, item1

    def _ws_layers(self) -> tuple[WsLaunch, WsLaunch]:
        """layer0's and layer1's GEMMs on the warp-specialized kernel
        (``Variant.fp8_ws_min_rows``): over the plan's m-tiles, layer0 from the rows the
        dispatch placed (or, gathered, through its index) into h in FP8 groups, layer1
        from h, scattering each weighted row into its token's slot as the fused kernel's
        epilogue does -- on paired m-tiles (``Variant.fp8_ws_paired_rows``: the plan's
        rows in tiles of twice its rows, :attr:`paired`, one B box at a time; layer0 only
        on placed rows)."""
        ws, cfg = self.ws, self.ws.cfg
        t = ws.plan.tiles
        tiles = MTiles(t.expert, t.row_start, t.row_end, t.num)
        self.paired = None
        if self.tile.variant.fp8_ws_paired_rows > 0:
            self.paired = MTiles(*(torch.empty_like(x) for x in tiles))
        if self.tile.variant.layer0_gather:
            a, a_scale = self._ws_gather(), None
        else:
            a, a_scale = packed_views(ws.local.a0, cfg.hidden_size)
        kw = dict(group_m=self.tile.gemm.group_m,
                  promotion_k=cfg.fp8.promotion(warp_specialized=True))
        pair0 = self.paired is not None and not self.tile.variant.layer0_gather
        layer0 = ws_gemm(a, a_scale, self.w13, self.paired if pair0 else tiles,
                         WsH(ws.h, ws.h_scale), activation=cfg.activation, paired=pair0, **kw)
        layer1 = ws_gemm(ws.h, ws.h_scale, self.w2, self.paired or tiles, scatter_homes(ws),
                         scatter=True, paired=self.paired is not None, **kw)
        return layer0, layer1

    def pair_tiles(self) -> None:
        """:attr:`paired` from this call's plan (comet.kernels.plan.paired_tiles)."""
        paired_tiles(self.ws.plan.segments, self.paired, self.ws.shape, PAIRED_ROWS)

    def _ws_gather(self) -> Fp8Gather:
        """Where the warp-specialized layer0 reads its rows after a gathered dispatch, on
        its one rank: every index entry is one of its own tokens, packed in its home rows
        (``Variant.layer0_own_in_place``: none copied) or copied into ``a0``."""
        ws = self.ws
        tokens = (ws.home_rows if self.tile.variant.layer0_own_in_place
                  else ws.local.a0[:ws.cfg.max_tokens])
        return Fp8Gather(ws.gathered_rows().src, tokens, ws.home_rows.shape[1])

    def release_layer1(self) -> None:
        """After the warp-specialized layer1: every source told its rows landed (the
        fused kernel's last program does so)."""
        launch_release_sources(progress=self._progress, sync=self.ws.sync)

    def _fp8_gather(self) -> Fp8Gather:
        """Where layer0's FP8 GEMM reads its rows after a gathered dispatch: the packed
        token rows in ``a0``'s memory through ``a0_src``, this rank's own in its home rows
        (``Variant.layer0_own_in_place``: they are packed there before the dispatch, so
        none needs copying)."""
        ws = self.ws
        g = ws.gathered_rows()
        row_bytes, base = ws.home_rows.shape[1], ws.rank * ws.cfg.max_tokens
        own = None
        if self.tile.variant.layer0_own_in_place:
            delta = ws.home_rows.data_ptr() - (g.tokens.data_ptr() + base * row_bytes)
            own = Fp8OwnRows(delta, base, ws.cfg.max_tokens)
        return Fp8Gather(g.src, g.tokens, row_bytes, own)

    def _small_plan(self) -> bool:
        """Whether this call plans in two launches (``Variant.small_plan_blocks``)."""
        return self.tile.variant.small_plan_blocks > 0

    def _quantizes(self) -> bool:
        """Whether this call quantizes its home rows: an FP8 one, unless it computes only."""
        return self.fp8 and self.mode != "compute_only"

    def quantizes_in_open(self) -> bool:
        """Whether this call's home quantization runs on programs of its plan's opening (a
        small call's plan: one launch fewer) rather than in a launch of its own."""
        return self._quantizes() and self._small_plan()

    def _open_quant(self) -> HomeQuant | None:
        """The home quantization as the opening runs it: row programs for the most tokens
        a small plan takes (:meth:`quantizes_in_open`; else None)."""
        if not self.quantizes_in_open():
            return None
        tokens = self.tile.variant.small_plan_blocks * plan_block_tokens(self.ws.cfg.top_k)
        out, t, _ = self.quantize
        return home_quant(self.inputs.x_addr, self.ws.out1, self.inputs.num_tokens, out, t,
                          tokens)

    def quantize_home(self) -> None:
        """An FP8 layer's first step of layer0: this rank's rows quantized, once, before
        any of them crosses (into ``ws.home_rows``, which the dispatch sends)."""
        launch_quantize_home(self.inputs.x_addr, self.ws.out1, self.inputs.num_tokens,
                             *self.quantize)

    # ------------------------------------------------------------------ phases
    def stages(self) -> list[tuple[str, list[Phase]]]:
        """``(name, phases)`` of the call in order: "plan", "layer0", "layer1",
        "combine" (the phases a timer reports)."""
        # The routing is staged in the plan's opening unless a (tp, ep) layout's shard
        # routing, which reads the staged rows, must run between the two.
        shards, stage = self.shard_routing, self.routing_stage
        plan = list(plan_phases(self.ws, self._routing, self.tile,
                                small=self._small_plan(),
                                stage=stage if shards is None else None,
                                quant=self._open_quant()))
        if shards is not None:
            plan.insert(0, lambda: launch_shard_routing(shards))
            if stage is not None:
                plan.insert(0, lambda: launch_stage_routing(stage))
        return [("plan", plan),
                ("layer0", self._layer0_phases()), ("layer1", self._layer1_phases()),
                ("combine", self._combine_phases())]

    def phases(self) -> list[Phase]:
        """Every phase of :meth:`stages` in order; built once (a call's launches are fixed
        when it is built, and a layer's calls ask for them on every user call)."""
        if self._phases is None:
            self._phases = [phase for _, phases in self.stages() for phase in phases]
        return self._phases

    def run(self) -> None:
        for phase in self.phases():
            phase()

    # ------------------------------------------------------------------ launches
    def launch_layer0(self, role: int, grid: int, *, wait: bool = True,
                      trace: Trace | None = None, cooperative: bool = False) -> None:
        """layer0 of this call in ``role`` on ``grid`` programs (untraced by default)."""
        self.layer0(grid, role, wait=wait, trace=trace or self._quiet, cooperative=cooperative)

    def launch_layer1(self, role: int, grid: int, *, wait: bool = True,
                      trace: Trace | None = None, cooperative: bool = False) -> None:
        """layer1 of this call (its strategy's kernel) in ``role`` on ``grid`` programs."""
        self.layer1(grid, role, wait=wait, trace=trace or self._quiet, cooperative=cooperative)

    def _layer0_phases(self) -> list[Phase]:
        """Fused with comm blocks as one launch; else the comm role (unless computing
        only), then the compute role (unless communicating only) as two."""
        mode, grids = self.mode, self.grids
        phases = ([self.quantize_home] if self._quantizes() and not self._small_plan()
                  else [])
        if self.ws_gemm:    # the dispatch on every program, then the GEMM
            pair = [self.pair_tiles] if self.paired is not None else []
            return phases + [lambda: self.launch_layer0(ROLE_COMM, grids.compute), *pair,
                             lambda: self.ws_layer0(grids.compute)]
        if self.fused and self.layer0_comm:
            return phases + [lambda: self.launch_layer0(ROLE_FUSED, grids.compute,
                                                        trace=self._trace["layer0"],
                                                        cooperative=self.cooperative)]
        if mode != "compute_only":
            phases.append(lambda: self.launch_layer0(ROLE_COMM, grids.layer0_comm))
        if mode != "comm_only":
            phases.append(lambda: self.launch_layer0(ROLE_COMPUTE, grids.compute,
                                                     wait=mode != "compute_only"))
        return phases

    def _layer1_phases(self) -> list[Phase]:
        """The scatter on every program; the reduce kernel fused (any split, read on the
        device), or its compute role then its comm role."""
        mode, grids = self.mode, self.grids
        if self.ws_gemm:
            return [lambda: self.ws_layer1(grids.compute), self.release_layer1]
        if self.strategy.comm_blocks(1) == 0 or self.fused:
            return [lambda: self.launch_layer1(ROLE_FUSED, grids.compute,
                                               trace=self._trace["layer1"],
                                               cooperative=self.cooperative)]
        phases = []
        if mode != "comm_only":
            phases.append(lambda: self.launch_layer1(ROLE_COMPUTE, grids.compute))
        if mode != "compute_only":
            phases.append(lambda: self.launch_layer1(ROLE_COMM, grids.layer1_comm,
                                                     wait=mode != "comm_only"))
        return phases

    def _combine_phases(self) -> list[Phase]:
        if self.mode == "compute_only":
            return []
        return [lambda: self.combine(self.grids.combine)]
