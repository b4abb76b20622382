"""W expert-parallel ranks in one process.

Two drivers:

* :class:`VirtualEP` runs a call phase by phase: each phase of
  :class:`~comet.runtime.forward.ForwardCall` (or of the backward's call) on every rank
  before the next, the producer role of a layer before its consumer role (dispatch before
  the layer0 GroupGEMM, the layer1 GroupGEMM before its reduce-and-send). Under
  ``TRITON_INTERPRET=1`` this runs the very @triton.jit role functions of the fused
  kernels on the CPU, across ranks, over real peer-pointer tables; on one GPU it checks
  the cross-rank logic without NVLink.
* :func:`virtual_group` builds W real :class:`~comet.runtime.layer.FusedMoE` ranks on
  one device, whose workspaces point at each other, and :func:`concurrent_forward` /
  :func:`concurrent_backward` make their fused calls concurrently, one CUDA stream per
  rank, as W GPUs would.
"""

from __future__ import annotations

import functools

import torch

from comet.config import MoEConfig, ParallelConfig, TileConfig
from comet.constants import interpreting
from comet.kernels.mesh_routing import ShardRouting, shard_routing
from comet.mesh import Convention, MeshLayout
from comet.runtime.backward import BACKWARD_SCALARS, BackwardCall, GradBuffers
from comet.runtime.errors import raise_if_failed
from comet.runtime.forward import CallInputs, ForwardCall, Grids
from comet.runtime.layer import (FusedMoE, Residency, fp8_tile, layer_tile, mesh_of,
                                 sm_count)
from comet.runtime.staging import StagedScalars, address_of, aligned
from comet.runtime.workspace import allocate_virtual
from comet.weights import interleave_gate_up


#: Ranks sharing one GPU and one process: grids sized to fit side by side, not
#: cooperative launches; one combine program per program; no distributed barrier.
SHARED = Residency(cooperative=False, combine_per_program=1, group_barrier=False)


def virtual_group(cfg: MoEConfig, w13_shards: list[torch.Tensor],
                  w2_shards: list[torch.Tensor], tile: TileConfig | None = None,
                  programs: int | None = None, tuned_config_folder: str | None = None,
                  check_errors: str = "lazy", use_graphs: bool = True,
                  w13_layout: str = "gate_up", backward: bool = False,
                  b13_shards: list[torch.Tensor] | None = None,
                  b2_shards: list[torch.Tensor] | None = None,
                  mesh: MeshLayout | None = None,
                  convention: Convention = "sequence") -> list[FusedMoE]:
    """W ranks of one expert-parallel group in this process, on one device, whose
    workspaces point at each other: call them concurrently, one CUDA stream per rank
    (:func:`concurrent_forward`), to run the real cross-rank protocol without NVLink
    (tests). Each rank is :meth:`~FusedMoE.preload`-ed: one host thread cannot make peer
    calls while the device waits to load a module. ``programs`` (default: the SM count
    over W) is each rank's grid, so every rank's spinning kernel fits on the GPU beside
    the others' (launched without the cooperative attribute, which would not let them
    share it: :data:`SHARED`). ``backward``: preload the backward's kernels too.
    ``mesh``: the (tp, ep) layout of the W ranks (shards as
    :meth:`comet.mesh.MeshLayout.shard` gives them). Other arguments as for
    :class:`FusedMoE`."""
    world = len(w13_shards)
    mesh = mesh_of(mesh, world)
    device = w13_shards[0].device
    if world > 1 and check_errors == "sync":
        raise ValueError("check_errors='sync' cannot serve virtual ranks: a rank's "
                         "synchronize waits for its call, which needs the other ranks' "
                         "calls; use 'lazy' and check_errors_now() after the calls")
    tile = layer_tile(tile, mesh, convention, cfg)
    if programs is None:
        sms = sm_count(device) if device.type == "cuda" else 4 * world
        programs = max(1, sms // world)
    with torch.inference_mode(False):   # see FusedMoE._build
        spaces = allocate_virtual(mesh.kernel_config(cfg), world, device, tile)
    layers = []
    for r in range(world):
        layer = FusedMoE.on_workspace(
            spaces[r], cfg, w13_shards[r], w2_shards[r], ParallelConfig(world, r), tile,
            programs, SHARED, tuned_config_folder=tuned_config_folder,
            check_errors=check_errors, use_graphs=use_graphs, w13_layout=w13_layout,
            b13=None if b13_shards is None else b13_shards[r],
            b2=None if b2_shards is None else b2_shards[r], mesh=mesh,
            convention=convention)
        if device.type == "cuda":
            layer.preload(backward=backward)
        layers.append(layer)
    return layers


def _in_lockstep(calls) -> None:
    """Each phase of every rank's call before the next phase of any."""
    for step in zip(*(c.phases() for c in calls)):
        for phase in step:
            phase()


class VirtualEP:
    """Args:
        cfg: layer shape (``num_experts`` divisible by ``world``).
        w13_shards, w2_shards: per rank ``[El, H, 2F]`` (gate columns first; kept as the
            kernels' interleaved copy, :mod:`comet.weights`) and ``[El, F, H]``; with
            ``cfg.fp8``, :class:`comet.quant.Fp8Weight` ``[El, 2F, H]`` (gate rows first)
            and ``[El, H, F]``.
        tile: tile configuration (default: :meth:`TileConfig.small`).
        b13_shards, b2_shards: per rank ``[El, 2F]`` (gate first) and ``[El, H]`` expert
            biases (``cfg.expert_bias``), or None.
        mesh, convention: a (tp, ep) layout of the W ranks (:mod:`comet.mesh`; the shards
            are then :meth:`~comet.mesh.MeshLayout.shard`'s, ``b2`` zeros past TP rank
            0) and how its ranks pass tokens; None: expert parallelism.
    """

    def __init__(self, cfg: MoEConfig, w13_shards: list[torch.Tensor],
                 w2_shards: list[torch.Tensor], tile: TileConfig | None = None,
                 b13_shards: list[torch.Tensor] | None = None,
                 b2_shards: list[torch.Tensor] | None = None,
                 mesh: MeshLayout | None = None, convention: Convention = "sequence"):
        self.cfg = cfg
        self.world = len(w13_shards)
        self.mesh = mesh or MeshLayout(tp=1, ep=self.world)
        self.convention = convention
        # FP8 experts (cfg.fp8) stay as given: Fp8Weights [El, 2F, H], gate rows first.
        self.w13 = (list(w13_shards) if cfg.fp8 is not None
                    else [interleave_gate_up(w) for w in w13_shards])
        self.w2 = w2_shards
        self.b13 = ([interleave_gate_up(b) for b in b13_shards] if b13_shards is not None
                    else [None] * self.world)
        self.b2 = list(b2_shards) if b2_shards is not None else [None] * self.world
        self.device = w13_shards[0].device
        self.tile = tile or TileConfig.small()
        if cfg.fp8 is not None:
            self.tile = fp8_tile(self.tile)
        self.ws = allocate_virtual(self.mesh.kernel_config(cfg), self.world, self.device,
                                   self.tile)
        for ws in self.ws:
            ws.fanout, ws.tp = self.mesh.home_fanout(convention), self.mesh.tp
        self._grad: list[GradBuffers] | None = None

    def _shard_routing(self, r: int, ids: torch.Tensor, weights: torch.Tensor,
                       num_tokens: torch.Tensor) -> ShardRouting | None:
        """Rank ``r``'s shard-slot launch of a (tp, ep) layout (None for EP)."""
        mesh, cfg = self.mesh, self.cfg
        if mesh.tp == 1:
            return None
        slots = cfg.top_k * mesh.tp
        kept = mesh.coords(r)[1] if self.convention == "replicated" else -1
        return shard_routing(
            ids.to(torch.int64).contiguous(), weights.float().contiguous(), num_tokens,
            torch.full((cfg.max_tokens, slots), -1, dtype=torch.int64, device=self.device),
            torch.zeros(cfg.max_tokens, slots, device=self.device),
            num_experts=cfg.num_experts, ep=mesh.ep, tp=mesh.tp, kept=kept)

    def forward(self, xs: list[torch.Tensor], topk_ids: list[torch.Tensor],
                topk_weights: list[torch.Tensor], comm_programs: int = 2,
                compute_programs: int = 3, dispatchers: int | None = None
                ) -> list[torch.Tensor]:
        """Every rank's routed-expert output ``[M_r, H]`` (``x.dtype``), layer1 as the
        tile says (``layer1_scatter``: the scatter epilogue, else GEMM then reduce).

        ``dispatchers``: programs of layer0's dispatch launch (default ``comm_programs``,
        or one under the interpreter, where programs run one after another and the
        first takes every chunk anyway; more make a small call cut its chunks' copies
        into parts, ``CommConfig.dispatch_parts``)."""
        xs = [aligned(x) for x in xs]
        ys = [torch.empty_like(x) for x in xs]
        unused = torch.zeros(1, dtype=torch.int64, device=self.device)   # roles apart
        if dispatchers is None:
            dispatchers = 1 if interpreting() else comm_programs
        grids = Grids(compute_programs, dispatchers, comm_programs, compute_programs)
        calls = []
        for r, ws in enumerate(self.ws):
            m = torch.full((1,), xs[r].shape[0], dtype=torch.int64, device=self.device)
            shards = self._shard_routing(r, topk_ids[r], topk_weights[r], m)
            ids, weights = ((topk_ids[r], topk_weights[r]) if shards is None
                            else (shards.shard_ids, shards.shard_weights))
            inputs = CallInputs(address_of(xs[r]), address_of(ys[r]), m, unused, unused,
                                ids, weights)
            calls.append(ForwardCall(ws, self.w13[r], self.w2[r], self.tile, inputs, grids,
                                     "fused", layer0_comm=False, cooperative=False,
                                     roles_apart=True, b13=self.b13[r], b2=self.b2[r],
                                     shard_routing=shards))
        _in_lockstep(calls)
        for r in range(self.world):
            raise_if_failed(self.ws[r].fatal_word, r)
        return ys

    def backward(self, dys: list[torch.Tensor], xs: list[torch.Tensor],
                 topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor],
                 programs: int = 3, weight_grads: bool = True) -> list[tuple]:
        """Every rank's ``(dx, d topk_weights, dW13 (interleaved), dW2)`` -- and ``(db13
        (interleaved), db2)`` with expert biases -- of :meth:`forward`
        (:mod:`comet.runtime.backward`), phase by phase across ranks."""
        if self.mesh.tp > 1:
            raise NotImplementedError("the fused backward runs expert-parallel layouts only")
        if self._grad is None:
            self._grad = [GradBuffers.allocate(self.cfg, self.world, self.device)
                          for _ in range(self.world)]
        cfg, dev = self.cfg, self.device
        calls = [BackwardCall(self.ws[r], cfg, self.tile, self.w13[r], self.w2[r],
                              self._grad[r],
                              torch.full((cfg.max_tokens, cfg.top_k), -1, dtype=torch.int64,
                                         device=dev),
                              torch.zeros(cfg.max_tokens, cfg.top_k, device=dev),
                              StagedScalars(BACKWARD_SCALARS, dev), programs, fused=False,
                              layer0_comm=False, cooperative=False,
                              weight_grads=weight_grads, b13=self.b13[r], b2=self.b2[r]).start(
                                  aligned(dys[r].to(xs[r].dtype).contiguous()),
                                  aligned(xs[r]), topk_ids[r].to(torch.int64).contiguous(),
                                  topk_weights[r].float().contiguous(), (0, 0))
                 for r in range(self.world)]
        _in_lockstep(calls)
        for r in range(self.world):
            raise_if_failed(self.ws[r].fatal_word, r)
        return [c.results(topk_weights[r].dtype) for r, c in enumerate(calls)]


@functools.lru_cache(maxsize=None)
def _load_delay_kernel(device: int) -> None:
    """Launch the delay's spin once, before any rank's call is issued. Its first launch
    loads its module (CUDA loads modules lazily), which waits for the device to go idle:
    issued between two ranks' calls, it would wait for the first rank's kernel, which
    waits for the second rank's call, which the host has not issued -- a deadlock until
    the timeout (seen with the first delay of a fresh process). Here every call issued
    so far can finish."""
    with torch.cuda.device(device):
        torch.cuda._sleep(0)


def _on_streams(layers, streams, delay_cycles, return_exceptions, call) -> list:
    """``call(r, layer)`` for every rank on its own stream (after its delay); every rank's
    call is made even if an earlier one raised, then the first exception is raised (or,
    with ``return_exceptions``, returned in that rank's place)."""
    if delay_cycles and any(delay_cycles):
        _load_delay_kernel(torch.cuda.current_device())
    out = []
    for r, layer in enumerate(layers):
        with torch.cuda.stream(streams[r]):
            if delay_cycles and delay_cycles[r]:
                torch.cuda._sleep(int(delay_cycles[r]))
            try:
                out.append(call(r, layer))
            except Exception as e:  # noqa: BLE001 -- handed back or re-raised below
                out.append(e)
    if not return_exceptions:
        for item in out:
            if isinstance(item, Exception):
                raise item
    return out


def concurrent_forward(layers, xs: list[torch.Tensor], topk_ids: list[torch.Tensor],
                       topk_weights: list[torch.Tensor], streams: list[torch.cuda.Stream],
                       comm_blocks=None, delay_cycles: list[int] | None = None,
                       return_exceptions: bool = False) -> list:
    """One call of every rank of a :func:`virtual_group`, each on its own stream, with no
    synchronisation: a rank's call N + 1 may run beside another's call N, as on W GPUs.

    ``delay_cycles[r]``: a spin of that many SM clock cycles on rank ``r``'s stream before
    its call (drift; about 2000 cycles per microsecond on Hopper). Inputs must be ready on
    every stream (e.g. made before a synchronize). Every rank's call is made even if an
    earlier rank's raised (ranks must make the same calls); then, like
    ``asyncio.gather``, the first exception is raised, or with ``return_exceptions`` the
    failed ranks' entries are their exceptions."""
    return _on_streams(layers, streams, delay_cycles, return_exceptions,
                       lambda r, layer: layer(xs[r], topk_ids[r], topk_weights[r],
                                              comm_blocks=comm_blocks))


def concurrent_backward(layers, dys: list[torch.Tensor], xs: list[torch.Tensor],
                        topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor],
                        streams: list[torch.cuda.Stream], comm_blocks=None,
                        delay_cycles: list[int] | None = None,
                        return_exceptions: bool = False) -> list:
    """:meth:`FusedMoE.backward <comet.runtime.layer.FusedMoE.backward>` of every rank,
    as :func:`concurrent_forward` makes calls (the layers must have been preloaded with
    ``backward=True``)."""
    return _on_streams(layers, streams, delay_cycles, return_exceptions,
                       lambda r, layer: layer.backward(dys[r], xs[r], topk_ids[r],
                                                       topk_weights[r],
                                                       comm_blocks=comm_blocks))

