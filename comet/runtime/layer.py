"""``FusedMoE``: one expert-parallel MoE layer on the fused kernels, for one rank.

A call (no host synchronisation anywhere):

1. the inputs are checked (comet.runtime.inputs) and staged at fixed addresses
   (comet.runtime.staging); the block split and the tile are chosen
   (comet.runtime.selection);
2. the call's phases (comet.runtime.forward) -- open and plan (count exchange, tile
   table), layer0 (dispatch + gated GroupGEMM), layer1 (GroupGEMM + reduce-and-send, or
   the scatter epilogue), combine -- run from a CUDA graph of its variant
   (comet.runtime.graphs);
3. errors of earlier calls (or of this one, with ``check_errors="sync"``) are raised
   (comet.runtime.errors).

The backward (comet.runtime.backward) runs the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch

from comet.config import MoEConfig, ParallelConfig, TileConfig, check_layout
from comet.constants import interpreting
from comet.kernels.combine import COMBINE_PROGRAMS_PER_SM
from comet.kernels.fp8_gemm import MIN_BLOCK_K, fused_k_step
from comet.kernels.fp8_ws import fits as ws_fits
from comet.kernels.layer0 import check_gather, one_dot_tiles
from comet.runtime import topology
from comet.runtime.backward import BACKWARD_SCALARS, BackwardCall, GradBuffers
from comet.runtime.errors import TIMEOUT_CODE, ErrorReports
from comet.kernels.mesh_routing import shard_routing
from comet.kernels.stage_routing import RoutingStage
from comet.mesh import Convention, MeshLayout
from comet.runtime.forward import MODES, CallInputs, ForwardCall, Grids
from comet.runtime.graphs import CallGraphs
from comet.runtime.inputs import check_inputs
from comet.runtime.selection import Selector
from comet.runtime.staging import StagedScalars, StaticInputs, aligned
from comet.runtime.strategies import gather_pays, scatter_pays
from comet.runtime.workspace import (TIMEOUT_ENV, Workspace, allocate_symmetric,
                                     allocate_virtual, timeout_ns)
from comet.quant import Fp8Weight, fp8_experts
from comet.weights import interleave_gate_up

#: A layer's timeout setting before its first call (never an environment value).
_NOT_WRITTEN = object()


@dataclass
class PhaseTimer:
    """Times the phases of a call ("plan", "layer0", "layer1", "combine") with CUDA events
    (host clock on the CPU). Read with :meth:`elapsed_us` after a synchronize."""

    events: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.events[name] = (start, end)

    def elapsed_us(self) -> dict[str, float]:
        out = {}
        for name, (start, end) in self.events.items():
            if isinstance(start, float):
                out[name] = (end - start) * 1e6
            else:
                out[name] = start.elapsed_time(end) * 1e3
        return out


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (read from the device, never assumed)."""
    return topology.sm_count(device.index if device.index is not None
                             else torch.cuda.current_device())


def default_tile(mesh: MeshLayout | None = None, convention: Convention = "sequence",
                 cfg: MoEConfig | None = None) -> TileConfig:
    """Hopper tiles on a GPU, tiny ones under the interpreter; layer1 the scatter epilogue
    unless the layout is one where the reduce pays (:func:`scatter_pays`); for the
    model ``cfg``, layer0's gathered dispatch where it pays (:func:`gather_pays`) and
    layer0's items are one dot each -- in bf16 only: an FP8 layer's gathered K loop
    (pointer loads instead of TMA boxes) costs more than the copies it saves
    (docs/precision.md), so FP8 gathers only when asked."""
    tile = TileConfig.small() if interpreting() else TileConfig()
    mesh = mesh or MeshLayout()
    if not scatter_pays(mesh.tp, mesh.ep, convention):
        tile = tile.with_fields(layer1_scatter=False)
    if (cfg is not None and cfg.fp8 is None and gather_pays(cfg.top_k, mesh.ep)
            and one_dot_tiles(tile.gemm.block_n0, cfg.intermediate_size // mesh.tp)):
        tile = tile.with_fields(layer0_gather=True)
    return tile


#: Most rows of an FP8 m-tile: layer0's gate and up accumulators and each K step's two
#: products, fp32 [BLOCK_M, 128] each, fit the registers of 8 warps at 64 rows; at 128
#: they spilled (sm_90, triton 3.6: tests/sm90_compile.py).
FP8_BLOCK_M = 64
#: TileConfig fields only an FP8 layer reads (``Variant.fp8_ws_min_rows``,
#: ``fp8_ws_paired_rows``, ``GemmConfig.small_block_m``).
FP8_ONLY_FIELDS = ("fp8_ws_min_rows", "fp8_ws_paired_rows", "small_block_m")
_FP8_ONLY_DEFAULTS = {n: v for n, v in TileConfig().flat().items() if n in FP8_ONLY_FIELDS}


def fp8_tile(tile: TileConfig, warp_specialized: bool = False) -> TileConfig:
    """``tile`` as an FP8 layer runs it: layer0's stream-K and tail splits and layer1's
    K splits cut the block-scaled K loop (an FP8 work item is two dots of 128 columns).
    With layer0's gathered dispatch (``layer0_own_in_place``: this rank's own rows read
    where they were packed, its home rows), the gathered K loop always loads only a
    tile's own rows, so the variant has no live-row switch for the Selector to turn.
    ``warp_specialized``: the layer can run large calls' GEMMs on comet.kernels.fp8_ws
    (:func:`ws_gemm_fits`); ``Variant.fp8_ws_min_rows`` and ``fp8_ws_paired_rows`` stay
    on only then (with a gathered dispatch that kernel reads A's rows through the index,
    ``A_GATHER``)."""
    v = tile.variant
    ws_rows, paired = ((v.fp8_ws_min_rows, v.fp8_ws_paired_rows) if warp_specialized
                       else (0, 0))
    return tile.with_fields(layer0_live_rows=False, fp8_ws_min_rows=ws_rows,
                            fp8_ws_paired_rows=paired,
                            block_m=min(tile.gemm.block_m, FP8_BLOCK_M))


def ws_gemm_fits(mesh: MeshLayout, w13: Fp8Weight, w2: Fp8Weight) -> bool:
    """Whether an FP8 layer may run its GEMMs on the warp-specialized kernel: a layer of
    one rank (the kernel waits for no peer's rows), on a GPU (Gluon has no interpreter),
    weights whose scale blocks the kernel reads (:func:`comet.kernels.fp8_ws.fits`)."""
    return (mesh.tp * mesh.ep == 1 and not interpreting()
            and ws_fits(w13, gated=True) and ws_fits(w2, gated=False))


def layer_tile(tile: TileConfig | None, mesh: MeshLayout, convention: Convention,
               cfg: MoEConfig, weights: tuple[Fp8Weight, Fp8Weight] | None = None
               ) -> TileConfig:
    """The TileConfig a layer runs: ``tile``, or the layout's default for ``cfg`` (for an
    FP8 layer, :func:`fp8_tile` of it, warp-specialized where :func:`ws_gemm_fits` its
    ``weights``; a bf16 layer's has the FP8-only fields (:data:`FP8_ONLY_FIELDS`) at their
    defaults, whatever was asked, so that its tuned tables serve it); ValueError
    for one its kernels' shapes cannot run (a gather without one-dot items)."""
    tile = tile or default_tile(mesh, convention, cfg)
    if cfg.fp8 is not None:
        return fp8_tile(tile, weights is not None and ws_gemm_fits(mesh, *weights))
    flat = tile.flat()
    reset = {n: v for n, v in _FP8_ONLY_DEFAULTS.items() if flat[n] != v}
    if reset:
        tile = tile.with_fields(**reset)
    if tile.variant.layer0_gather:
        check_gather(tile.gemm.block_n0, mesh.kernel_config(cfg).intermediate_size)
    return tile


def _kernel_layout(w13_layout: str, w13: torch.Tensor, b13: torch.Tensor | None,
                   b2: torch.Tensor | None) -> tuple:
    """``(w13, b13, b2)`` with W13's columns (and b13's, the same columns) in the kernels'
    interleaved layout (:mod:`comet.weights`): copies from ``"gate_up"``, as given from
    ``"interleaved"``."""
    if w13_layout != "gate_up":
        return w13, b13, b2
    return interleave_gate_up(w13), None if b13 is None else interleave_gate_up(b13), b2


def expert_weights(cfg: MoEConfig, mesh: MeshLayout, w13, w2,
                   w13_scale_inv: torch.Tensor | None = None,
                   w2_scale_inv: torch.Tensor | None = None) -> tuple:
    """``(w13, w2)`` as the layer keeps them: the tensors as given, or for an FP8 layer
    (``cfg.fp8``) :class:`comet.quant.Fp8Weight` ``[El, 2F, H]`` and ``[El, H, F]``
    (from Fp8Weights, or e4m3 tensors and their ``*_scale_inv`` in ``cfg.fp8.blocks``;
    :func:`comet.quant.fp8_experts`), contiguous, each with a K step of the fused K loop
    of at least :data:`comet.kernels.fp8_gemm.MIN_BLOCK_K`. TypeError / ValueError
    before anything is allocated."""
    if cfg.fp8 is None:
        if isinstance(w13, Fp8Weight) or isinstance(w2, Fp8Weight):
            raise ValueError("FP8 experts (Fp8Weight) need cfg.fp8 = comet.quant.Fp8()")
        if w13_scale_inv is not None or w2_scale_inv is not None:
            raise ValueError("scale_inv given, but cfg.fp8 is None (a bf16 layer)")
        return w13, w2
    weights = fp8_experts(w13, w2, cfg.num_experts // mesh.ep, cfg.hidden_size,
                          cfg.intermediate_size // mesh.tp, cfg.fp8.blocks, w13_scale_inv,
                          w2_scale_inv)
    out = []
    for name, w in zip(("w13", "w2"), weights):
        if fused_k_step(w) < MIN_BLOCK_K:
            raise ValueError(f"FP8 {name}'s K blocks of {w.block_shape()[1]} leave the fused "
                             f"K loop steps below {MIN_BLOCK_K} values")
        out.append(w if w.weight.is_contiguous() else
                   dataclasses.replace(w, weight=w.weight.contiguous()))
    return tuple(out)


def mesh_of(mesh: MeshLayout | None, world: int) -> MeshLayout:
    """The layout of ``world`` ranks: ``mesh``, or expert parallelism over all of them."""
    return mesh if mesh is not None else MeshLayout(tp=1, ep=world)


def _output_bias(cfg: MoEConfig, mesh: MeshLayout, rank: int, b2, w2):
    """The output bias a rank's kernels add: its own, or zeros on the TP ranks past the
    first of a layout with biases (the shards' partial sums add ``b2`` once; every rank
    compiles the same kernels)."""
    if cfg.expert_bias and b2 is None:
        return torch.zeros(w2.shape[0], w2.shape[2], dtype=w2.dtype, device=w2.device)
    return b2


def _check_fp8_layer(cfg: MoEConfig, w13_layout: str, b13: torch.Tensor | None,
                     b2: torch.Tensor | None) -> None:
    """NotImplementedError for what an FP8 layer cannot run yet, ValueError for what it
    never will."""
    if cfg.expert_bias or b13 is not None or b2 is not None:
        raise NotImplementedError("FP8 experts with biases (cfg.expert_bias) are not "
                                  "supported yet")
    if w13_layout != "gate_up":
        raise ValueError(f"FP8 w13 is [El, 2F, H] with its gate rows, then its up rows "
                         f"(w13_layout 'gate_up'), got w13_layout {w13_layout!r}")


@dataclass(frozen=True)
class Residency:
    """How one rank's launches share its GPU.

    cooperative: fused launches are co-resident by the launch attribute (a rank with a
        GPU of its own); ranks that share one GPU cannot be, their grids sized to fit
        side by side instead (comet.runtime.virtual).
    combine_per_program: combine programs per program of the fused grid.
    group_barrier: :meth:`FusedMoE.reset` waits for the group's ranks with a
        torch.distributed barrier (ranks of one process need none: the device's
        synchronize covers them).
    """

    cooperative: bool
    combine_per_program: int
    group_barrier: bool


#: A rank alone on its GPU, in a process of its own.
ALONE = Residency(cooperative=True, combine_per_program=COMBINE_PROGRAMS_PER_SM,
                  group_barrier=True)


class FusedMoE:
    """The routed-expert part of an MoE layer on the fused kernels (one rank's view).

    Args:
        cfg: layer shape; ``cfg.max_tokens`` sizes the workspaces.
        w13: ``[El, H, 2F]`` this rank's experts, CUDA, in the layout ``w13_layout`` says.
        w2: ``[El, F, H]``.
            With ``cfg.fp8`` (FP8 experts, forward only): :class:`comet.quant.Fp8Weight`
            ``[El, 2F, H]`` (gate rows, then up rows; ``w13_layout`` ``"gate_up"``) and
            ``[El, H, F]``, or e4m3 tensors of those shapes with their fp32
            ``w13_scale_inv`` / ``w2_scale_inv`` in ``cfg.fp8.blocks``
            (:func:`expert_weights`).
        w13_layout: ``"gate_up"`` (all gate columns, then all up columns, as models store
            them): the layer keeps its own copy in the kernels' interleaved layout, which
            costs W13's memory again; ``"interleaved"`` (:mod:`comet.weights`, e.g. from
            :func:`comet.weights.interleave_gate_up_`): used as is, no copy -- what
            :class:`comet.moe.CometMoE` passes.
        group: the process group of the layer's ranks (None: the world if initialised,
            else one rank). Collective: all ranks construct it together.
        mesh: the (tp, ep) layout of the group's ranks (:class:`comet.mesh.MeshLayout`;
            None: expert parallelism over all of them). ``w13``/``w2``/biases are then
            this rank's shard (:meth:`~comet.mesh.MeshLayout.shard`: ``[El, H, 2F/tp]``,
            ``[El, F/tp, H]``; ``b2`` on TP rank 0 only). Forward only: a TP layout's
            :meth:`backward` raises NotImplementedError.
        convention: how a TP layout's ranks pass tokens (:data:`comet.mesh.CONVENTIONS`):
            ``"sequence"``, each its own; ``"replicated"``, a TP group the same ones
            (the same count, rows and routing, as after an attention all-reduce: a
            contract the layer cannot check without a collective -- ranks that break it
            get wrong outputs, not an error; ``CometMoE(check_replicated=True)`` checks
            it with one). Either way a rank gets its own tokens'
            full outputs.
        tile: tile configuration (default: Hopper tiles); its ``decode_*`` fields give
            calls too small to fill the GPU their own GEMM tiles, and a tuned table may
            set its :data:`comet.config.TUNABLE_TILE_FIELDS` per token bucket
            (:meth:`Selector.tile_for <comet.runtime.selection.Selector.tile_for>`).
        tuned_config_folder: extra folder of ``comet tune`` tables.
        check_errors: ``"lazy"`` raise a failed call's error at a later call (no sync);
            ``"sync"`` synchronise after every call and raise at once (debugging).
        use_graphs: replay fused calls from a CUDA graph (cuts host work per call from
            ~60 launches to ~10 small ops). Inside a user's own graph capture, calls are
            recorded eagerly instead.

    Errors: a peer that does not make the call, hangs or crashes makes every rank's call
    raise :class:`~comet.runtime.errors.CometTimeoutError` within ``COMET_TIMEOUT_S``
    (default 10 s); the layer then raises :class:`~comet.runtime.errors.CometError` until
    :meth:`reset` has been called on every rank. Bad routing (an id outside ``[-1, E)``,
    a NaN or infinite weight) is checked on the device and raised as
    :class:`~comet.runtime.errors.CometInputError` by a later call (with ``"sync"``: by
    the same call) *after* that call's work was issued, so every rank still makes the
    same calls; the bad slots count as "no expert" and the layer stays usable.
    """

    def __init__(self, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor, group=None,
                 tile: TileConfig | None = None, tuned_config_folder: str | None = None,
                 check_errors: str = "lazy", use_graphs: bool = True,
                 w13_layout: str = "gate_up", b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, mesh: MeshLayout | None = None,
                 convention: Convention = "sequence",
                 w13_scale_inv: torch.Tensor | None = None,
                 w2_scale_inv: torch.Tensor | None = None):
        par = ParallelConfig.from_group(group)
        mesh = mesh_of(mesh, par.world_size)
        w13, w2 = expert_weights(cfg, mesh, w13, w2, w13_scale_inv, w2_scale_inv)
        self.validate(cfg, par, w13, w2, w13_layout, b13, b2, mesh, convention)
        weights = (w13, w2) if cfg.fp8 is not None else None
        tile = layer_tile(tile, mesh, convention, cfg, weights)   # before any buffer (a collective)
        kernel_cfg = mesh.kernel_config(cfg)
        with torch.inference_mode(False):   # see _build
            if par.world_size == 1:
                ws = allocate_virtual(kernel_cfg, 1, w13.device, tile)[0]
            else:
                ws = allocate_symmetric(kernel_cfg, group, w13.device, tile)
        programs = sm_count(w13.device) if w13.device.type == "cuda" else 4
        self._build(ws, cfg, w13, w2, b13, b2, w13_layout, group, par, tile, programs,
                    ALONE, tuned_config_folder, check_errors, use_graphs, mesh, convention)

    @classmethod
    def on_workspace(cls, ws: Workspace, cfg: MoEConfig, w13: torch.Tensor,
                     w2: torch.Tensor, par: ParallelConfig, tile: TileConfig, programs: int,
                     residency: Residency, *, group=None,
                     tuned_config_folder: str | None = None, check_errors: str = "lazy",
                     use_graphs: bool = True, w13_layout: str = "gate_up",
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     mesh: MeshLayout | None = None,
                     convention: Convention = "sequence") -> "FusedMoE":
        """Rank ``par.rank`` of a layer on a workspace allocated already (``ws``, with
        ``tile``; :func:`~comet.runtime.workspace.allocate_virtual` for ranks that share
        a process: :func:`comet.runtime.virtual.virtual_group`), its fused grids of
        ``programs`` launched as ``residency`` says. Other arguments as for the
        constructor."""
        mesh = mesh_of(mesh, par.world_size)
        w13, w2 = expert_weights(cfg, mesh, w13, w2)
        cls.validate(cfg, par, w13, w2, w13_layout, b13, b2, mesh, convention)
        layer = cls.__new__(cls)
        layer._build(ws, cfg, w13, w2, b13, b2, w13_layout, group, par, tile, programs,
                     residency, tuned_config_folder, check_errors, use_graphs, mesh,
                     convention)
        return layer

    @staticmethod
    def validate(cfg: MoEConfig, par: ParallelConfig, w13: torch.Tensor, w2: torch.Tensor,
                 w13_layout: str, b13: torch.Tensor | None, b2: torch.Tensor | None,
                 mesh: MeshLayout, convention: Convention) -> None:
        """Raise ValueError where rank ``par.rank``'s weights, biases or layout cannot make
        this layer (before any collective)."""
        if mesh.world != par.world_size:
            raise ValueError(f"a {mesh} layout has {mesh.world} ranks, but the process group "
                             f"has {par.world_size}")
        mesh.home_fanout(convention)      # checks the convention's name
        check_layout(cfg, ParallelConfig(mesh.ep, par.rank // mesh.tp))
        mesh.check(cfg.num_experts, cfg.intermediate_size)
        if w13_layout not in ("gate_up", "interleaved"):
            raise ValueError(f"w13_layout must be 'gate_up' or 'interleaved', got "
                             f"{w13_layout!r}")
        el = cfg.num_experts // mesh.ep
        h, f = cfg.hidden_size, cfg.intermediate_size // mesh.tp
        if cfg.fp8 is not None:
            _check_fp8_layer(cfg, w13_layout, b13, b2)
            return      # the weights: expert_weights
        if tuple(w13.shape) != (el, h, 2 * f) or tuple(w2.shape) != (el, f, h):
            raise ValueError(f"expected w13 [{el}, {h}, {2 * f}] and w2 [{el}, {f}, {h}] "
                             f"(this rank's shard of a {mesh} layout), got "
                             f"{list(w13.shape)} and {list(w2.shape)}")
        # Only TP rank 0 of a layout adds the output bias (the shards' partial sums add
        # it once): the other ranks pass none.
        b2_expected = cfg.expert_bias and mesh.coords(par.rank)[1] == 0
        if (b13 is not None) != cfg.expert_bias or (b2 is not None and not cfg.expert_bias):
            raise ValueError("cfg.expert_bias needs both b13 and b2" if cfg.expert_bias
                             else "b13/b2 given but cfg.expert_bias is False")
        if b2_expected and b2 is None:
            raise ValueError("cfg.expert_bias needs both b13 and b2")
        for name, b, shape in (("b13", b13, (el, 2 * f)), ("b2", b2, (el, h))):
            if b is not None and (tuple(b.shape) != shape or b.dtype != w13.dtype
                                  or b.device != w13.device or not b.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {list(shape)} {w13.dtype} tensor "
                                 f"on {w13.device}, got {list(b.shape)} {b.dtype} on {b.device}")

    def _build(self, ws: Workspace, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor,
               b13: torch.Tensor | None, b2: torch.Tensor | None, w13_layout: str, group,
               par: ParallelConfig, tile: TileConfig, programs: int, residency: Residency,
               tuned_config_folder: str | None, check_errors: str, use_graphs: bool,
               mesh: MeshLayout, convention: Convention) -> None:
        # State the calls update in place must not be inference tensors, or a layer first
        # built under torch.inference_mode() (a server's warm-up) fails every later call
        # made outside it.
        with torch.inference_mode(False):
            if cfg.fp8 is None:
                w13, self.b13, self.b2 = _kernel_layout(
                    w13_layout, w13, b13, _output_bias(cfg, mesh, par.rank, b2, w2))
            else:
                self.b13 = self.b2 = None
            self._setup(ws, w13, w2, group, par, tile, programs, residency,
                        tuned_config_folder, check_errors, use_graphs, cfg, mesh, convention)

    def _setup(self, ws: Workspace, w13, w2, group, par: ParallelConfig, tile: TileConfig,
               programs: int, residency: Residency, tuned_config_folder: str | None,
               check_errors: str, use_graphs: bool, cfg: MoEConfig, mesh: MeshLayout,
               convention: Convention) -> None:
        # cfg: the layer as the caller routes it; ws.cfg: what the kernels run (the same,
        # or a (tp, ep) layout's shard experts: comet.mesh).
        self.cfg, self.par, self.group, self.ws = cfg, par, group, ws
        self.mesh, self.convention = mesh, convention
        self.w13, self.w2 = w13, w2
        self.device = w13.device
        self.tile = tile
        self.residency = residency
        # The shared-tensor analyzer's answer for every layout (layer0 by rows, layer1 by
        # columns) is the kernels' decomposition: tests/test_shared_tensor.py checks it
        # (comet.runtime.forward.kernel_decomposition), not every construction.
        ws.fanout, ws.tp = mesh.home_fanout(convention), mesh.tp
        self.selection = Selector(ws.cfg, par.world_size, tile, programs, self.device,
                                  tuned_config_folder, mesh.table_layout(convention))
        self.errors = ErrorReports(ws.local.error, par.rank, cfg.num_experts, check_errors,
                                   slots_per_choice=mesh.tp)
        self.graphs = CallGraphs(self.device, use_graphs)
        self._static = StaticInputs(cfg, self.device)
        self._shard_routing = None
        if mesh.tp > 1:
            rows, slots = cfg.max_tokens, ws.cfg.top_k
            s = self._static
            self._shard_routing = shard_routing(
                s.ids, s.weights, s.num_tokens,
                torch.full((rows, slots), -1, dtype=torch.int64, device=self.device),
                torch.zeros(rows, slots, dtype=torch.float32, device=self.device),
                num_experts=cfg.num_experts, ep=mesh.ep, tp=mesh.tp,
                kept=mesh.coords(par.rank)[1] if convention == "replicated" else -1)
        # The COMET_TIMEOUT_S that ws.timeout was last written from (first call: written)
        self._timeout_setting: object = _NOT_WRITTEN
        # Per variant: its call and the segments a user's call issues.
        self._calls: dict[tuple, tuple[ForwardCall, list]] = {}
        self.last_comm_blocks: tuple[int, int] | None = None
        self.last_tile: TileConfig | None = None
        # Whether the last call ran its GEMMs on the warp-specialized FP8 kernel.
        self.last_ws_gemm = False
        self._grad: GradBuffers | None = None     # the backward's scratch, on first use
        self._backward_scalars: StagedScalars | None = None
        self._backward_calls: dict[tuple[bool, bool], BackwardCall] = {}

    @property
    def programs(self) -> int:
        """Programs of the fused kernels' grids (the device's SM count, or a virtual rank's
        share of it); the block split is chosen for this many."""
        return self.selection.programs

    @programs.setter
    def programs(self, n: int) -> None:
        self.selection.programs = n

    @property
    def check_errors(self) -> str:
        """``"lazy"`` or ``"sync"`` (see the class doc); may be changed between calls."""
        return self.errors.mode

    @check_errors.setter
    def check_errors(self, mode: str) -> None:
        if mode not in ("lazy", "sync"):
            raise ValueError(f"check_errors must be 'lazy' or 'sync', got {mode!r}")
        self.errors.mode = mode

    # ------------------------------------------------------------------ selection
    @property
    def last_decode(self) -> bool:
        """Whether the last call's layer1 ran on the decode tile."""
        return (self.last_tile is not None
                and self.last_tile.gemm.block_n1 != self.tile.gemm.block_n1)

    @property
    def last_tile_overrides(self) -> dict[str, int]:
        """The tunable tile fields in which the last call's tile differed from the
        layer's TileConfig (a tuned bucket's choice, or the call's override)."""
        return {} if self.last_tile is None else self.selection.overrides_in(self.last_tile)

    # ------------------------------------------------------------------ forward
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 comm_blocks=None, mode: str = "fused", timer: PhaseTimer | None = None,
                 decode_tile: bool | None = None,
                 tile_overrides: dict[str, int] | None = None,
                 trace: dict[str, torch.Tensor] | None = None, *,
                 checked: bool = False) -> torch.Tensor:
        """Routed experts of ``x [M, H]`` -> ``[M, H]`` in ``x.dtype``.

        ``checked``: the caller already passed these inputs through
        :func:`comet.runtime.inputs.check_inputs` with this layer's shape, dtype and
        device, contiguous (:class:`comet.moe.CometMoE` does, once per call).

        ``comm_blocks`` (an int for both layers, or a pair), ``decode_tile`` and
        ``tile_overrides`` (values of :data:`comet.config.TUNABLE_TILE_FIELDS`) override
        the per-call selection (``self.selection``: :class:`~comet.runtime.selection.
        Selector`'s ``comm_blocks`` and ``tile_for``).
        ``mode`` decomposes the call (comet.runtime.forward), ``timer`` times its phases,
        ``trace`` has its fused launches stamp their work (``comet bench``); a timed or
        traced call runs without a graph.

        Every rank of the group must make the same sequence of calls. On a GPU, calls
        replay a CUDA graph captured on the second call of the same variant (mode, tile,
        whether layer0 has comm blocks; the first compiles the kernels): the host then
        issues about ten small operations.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if self.cfg.fp8 is not None and torch.is_grad_enabled() and any(
                t.requires_grad for t in (x, topk_weights)):
            raise NotImplementedError("FP8 experts run the forward only: call the layer "
                                      "under torch.no_grad() (or on inputs that need no "
                                      "gradient)")
        m = x.shape[0] if checked else self._check(x, topk_ids, topk_weights)
        self.errors.check_usable()
        if comm_blocks is None and decode_tile is None and tile_overrides is None:
            split, tile = self.selection.for_call(m)
        else:
            split = self.selection.comm_blocks(m, comm_blocks)
            tile = self.selection.tile_for(m, decode_tile, tile_overrides)
        y = self._launch(x, topk_ids, topk_weights, split, mode, timer, tile, trace)
        self.errors.after_launch()
        return y

    def _check(self, x, topk_ids, topk_weights) -> int:
        return check_inputs(self.cfg, x, topk_ids, topk_weights, dtype=self.cfg.dtype,
                            device=self.device, rank=self.par.rank, contiguous=True)

    def _refresh_timeout(self) -> None:
        setting = os.environ.get(TIMEOUT_ENV)
        if setting != self._timeout_setting:
            self.ws.timeout.fill_(timeout_ns(setting))
            self._timeout_setting = setting

    def _grids(self) -> Grids:
        grid = self.programs
        return Grids(grid, grid, grid, grid * self.residency.combine_per_program)

    def _call(self, mode: str, layer0_comm: bool, tile: TileConfig,
              trace: dict[str, torch.Tensor] | None = None) -> ForwardCall:
        """The forward call of one variant on the staged inputs, built once (a traced
        one each time: it writes into the caller's buffers)."""
        key = (mode, layer0_comm, tile)
        found = self._calls.get(key) if trace is None else None
        if found is None:
            s, shards = self._static, self._shard_routing
            ids, weights = ((s.ids, s.weights) if shards is None
                            else (shards.shard_ids, shards.shard_weights))
            inputs = CallInputs(s.addr[0:1], s.addr[1:2], s.num_tokens, s.split[0:1],
                                s.split[1:2], ids, weights)
            stage = RoutingStage(s.routing_addr, s.num_tokens, s.ids, s.weights)
            call = ForwardCall(self.ws, self.w13, self.w2, tile, inputs, self._grids(), mode,
                               layer0_comm, cooperative=self.residency.cooperative, trace=trace,
                               b13=self.b13, b2=self.b2, shard_routing=shards,
                               routing_stage=stage)
            if trace is not None:
                return call
            # The error words' snapshot ends the call's device work (in its graph).
            found = self._calls[key] = (call, [(True, [*call.phases(),
                                                       self.errors.snapshot])])
        return found[0]

    def _launch(self, x, topk_ids, topk_weights, split: tuple[int, int], mode: str,
                timer: PhaseTimer | None, tile: TileConfig,
                trace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Stage the inputs and issue one call's work (graph replay when possible)."""
        m = x.shape[0]
        n0, n1 = split
        # The call's first launch copies the routing into the staged rows (no host copy
        # for int64 ids and fp32 weights; rows past m are never read: the plan stops at m).
        ids = (topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous()
               else topk_ids.to(torch.int64).contiguous())
        weights = (topk_weights
                   if topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
                   else topk_weights.to(torch.float32).contiguous())
        key = (mode, n0 > 0, tile)
        entry = self._calls.get(key) if trace is None else None
        call = entry[0] if entry is not None else self._call(mode, n0 > 0, tile, trace)
        n1 = call.strategy.comm_blocks(n1)
        self.last_comm_blocks = (n0, n1)
        self.last_tile = tile
        self.last_ws_gemm = call.ws_gemm
        y = torch.empty_like(x)
        self._refresh_timeout()
        x = aligned(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        self._static.stage(x.data_ptr(), y.data_ptr(), m, n0, n1, ids.data_ptr(),
                           weights.data_ptr(), capturing)
        if timer is None and trace is None:
            segments = (entry or self._calls[key])[1]
        elif timer is None:
            segments = [(True, [*call.phases(), self.errors.snapshot])]
        else:
            segments = [(True, [self._timed(timer, name, phases)])
                        for name, phases in call.stages()]
            segments.append((True, [self.errors.snapshot]))
        # Only layer0's split changes the launches (0: two launches); layer1 is one launch
        # for any split, which the kernel reads on the device. The tile changes them all.
        self.graphs.run(key, segments, graphable=x.is_cuda and timer is None
                        and trace is None, capturing=capturing)
        return y

    def _timed(self, timer: PhaseTimer, name: str, phases):
        def run() -> None:
            with timer.phase(name, self.device):
                for phase in phases:
                    phase()
        return run

    # ------------------------------------------------------------------ errors
    def check_errors_now(self) -> None:
        """Synchronise and raise if any call so far failed (or had bad routing)."""
        self.errors.check_now()

    def reset(self) -> None:
        """Bring the layer back after a :class:`CometError`. Collective: every rank of
        the group calls it (it waits for every rank's calls in flight to end -- they end
        within the timeout, since a failed group gives up everywhere -- then zeroes flags,
        epochs and error words on every rank before any rank calls again)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._group_barrier()
        self.ws.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._group_barrier()
        self.errors.clear()

    def _group_barrier(self) -> None:
        if self.par.world_size > 1 and self.residency.group_barrier:
            import torch.distributed as dist
            dist.barrier(group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ backward
    def backward(self, dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, weight_grads: bool = True, comm_blocks=None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
        """Gradients of the call ``y = self(x, topk_ids, topk_weights)`` given ``dy =
        dL/dy [M, H]``, on the fused kernels (:mod:`comet.runtime.backward`): the
        dispatches of ``x`` and ``dy`` and the return of the ``dx`` rows overlap the
        GEMMs as in the forward. Collective, like a call.

        Returns ``(dx [M, H] in x's dtype, d topk_weights [M, k] in their dtype, dW13
        [El, H, 2F] in this layer's interleaved layout, dW2 [El, F, H])``; the weight
        gradients are None without ``weight_grads`` (frozen experts: two GEMMs fewer,
        the same exchanges). ``comm_blocks`` as for a call (default: the call's own).
        A layer with expert biases also returns ``(db13 [El, 2F] interleaved, db2 [El,
        H])`` (None without ``weight_grads``)."""
        if self.cfg.fp8 is not None:
            raise NotImplementedError("FP8 experts run the forward only: the fused backward "
                                      "needs experts in bf16")
        if self.mesh.tp > 1:
            raise NotImplementedError(
                f"the fused backward runs expert-parallel layouts only; this layer is a "
                f"{self.mesh} layout (train it with tp=1, or use comet.baseline)")
        self._check(x, topk_ids, topk_weights)
        if tuple(dy.shape) != tuple(x.shape) or dy.device != x.device:
            raise ValueError(f"dy must be {list(x.shape)} on {x.device}, got "
                             f"{list(dy.shape)} on {dy.device}")
        self.errors.check_usable()
        split = self.selection.comm_blocks(x.shape[0], comm_blocks)
        self._refresh_timeout()
        self.last_comm_blocks = split
        call = self._backward_variant(split[0] > 0, weight_grads).start(
            aligned(dy.to(x.dtype).contiguous()), aligned(x),
            topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous(), split)
        self.graphs.run(("backward", call.layer0_comm, call.weight_grads), call.segments())
        self.errors.snapshot()
        self.errors.after_launch()
        return call.results(topk_weights.dtype)

    def _backward_variant(self, layer0_comm: bool, weight_grads: bool) -> BackwardCall:
        """The backward of one launch variant, built on first use (with the backward's
        scratch): its phases read the staged scalars, so it serves every call."""
        key = (layer0_comm, weight_grads)
        if key not in self._backward_calls:
            with torch.inference_mode(False):
                if self._grad is None:
                    self._grad = GradBuffers.allocate(self.cfg, self.par.world_size,
                                                      self.device)
                if self._backward_scalars is None:
                    self._backward_scalars = StagedScalars(BACKWARD_SCALARS, self.device)
            self._backward_calls[key] = BackwardCall(
                self.ws, self.cfg, self.tile, self.w13, self.w2, self._grad,
                self._static.ids, self._static.weights, self._backward_scalars,
                self.programs, fused=not interpreting(), layer0_comm=layer0_comm,
                cooperative=self.residency.cooperative, weight_grads=weight_grads, b13=self.b13,
                b2=self.b2)
        return self._backward_calls[key]

    # ------------------------------------------------------------------ preload
    def preload(self, mode: str = "fused", backward: bool = False) -> None:
        """Compile, load and capture the kernels of every block-split and tile variant of
        ``mode`` on this rank alone, before the first call (with ``backward``, compile
        and load the backward's too). Local -- nothing reaches a peer -- so it needs no
        barrier; but not while this layer has a call in flight.

        It runs two calls per variant (the first compiles, the second captures the graph)
        with this rank's error word set, so every wait gives up at once and nothing is
        published or sent, then clears the word and the epoch. Why: CUDA may have to wait
        for the device to go idle to load a kernel module, and a rank's first call loads
        modules while its earlier kernels wait for peers. On W GPUs the peers get there
        anyway; virtual ranks sharing one GPU and one host thread would deadlock."""
        dev = self.device
        nothing = (torch.empty(0, self.cfg.hidden_size, dtype=self.cfg.dtype, device=dev),
                   torch.empty(0, self.cfg.top_k, dtype=torch.int64, device=dev),
                   torch.empty(0, self.cfg.top_k, dtype=torch.float32, device=dev))
        self.ws.fatal_word[0].fill_(TIMEOUT_CODE)
        for tile in self.selection.tile_variants():
            for split in ((1, 1), (0, 0)):
                for _ in range(2):
                    self._launch(*nothing, split, mode, None, tile)
        if backward:
            for split in ((1, 1), (0, 0)):
                for _ in range(2):
                    call = self._backward_variant(split[0] > 0, True).start(
                        nothing[0], *nothing, split)
                    self.graphs.run(("backward", call.layer0_comm, call.weight_grads),
                                    call.segments())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.ws.local.error.zero_()
        self.errors.clear()   # the calls' snapshots copied the error word set above
        for t in (self.ws.epoch, self.ws.counters):
            t.zero_()
