"""Other projects' MoE layers, timed by ``comet bench --peers`` beside comet's own.

comet's speedups are over its own unfused pipeline (:mod:`comet.baseline`); a user choosing
between comet and what they already run compares against the layers they would otherwise
use. Each peer is an optional package that comet never imports: only this module does,
inside the peer's ``load``, and only when ``--peers`` names it.

Every peer runs the benchmark's layer on the benchmark's weights and tokens: this rank's
experts ``w13 [El, H, 2F]`` (gate columns, then up columns) and ``w2 [El, F, H]``, the
experts split over the group (rank ``r`` owns experts ``[r*El, (r+1)*El)``), and the routing
given -- ``topk_ids`` / ``topk_weights [M, k]``, no router of the peer's own -- as
``layer(x [M, H], topk_ids, topk_weights) -> y [M, H]``, this rank's tokens' outputs.

* ``deepep`` -- DeepEP's intranode normal-mode dispatch and combine (NVLink, no NVSHMEM),
  around torch's grouped GEMM and a fused ``silu(gate) * up * weight``, as a DeepEP user
  writes the layer (its README's ``get_buffer``, ``get_dispatch_layout``, ``dispatch``,
  ``combine``). Built from source on the GPU machine by ``scripts/device/build_peers.sh``.
* ``megatron`` -- Megatron-Core's ``MoELayer`` with the alltoall token dispatcher and
  ``TEGroupedMLP`` experts (``moe_grouped_gemm``): Transformer Engine's grouped linear where
  TE imports, else the same module on a torch grouped-GEMM linear (``_TorchGroupedLinear``,
  Megatron's ``GroupedLinearFc1Builder`` protocol), which ``backend`` then says. The router
  is bypassed: the layer's router slot returns the given routing (:class:`_GivenRouting`).
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from comet.config import MoEConfig
from comet.grouped import grouped_mm

#: ``layer(x [M, H], topk_ids [M, k], topk_weights [M, k]) -> y [M, H]``.
Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PeerLayer:
    """A peer built for one config.

    layer: see :data:`Layer`; collective over the group, like comet's layer.
    backend: what runs, in words (versions, expert module, GEMM, dispatch), for the records.
    close: releases what the layer holds across ranks (collective), or None.
    """

    name: str
    layer: Layer
    backend: str
    close: Callable[[], None] | None = None


#: ``build(cfg, w13, w2, group, device) -> PeerLayer``; raises :class:`PeerUnavailable`.
Builder = Callable[[MoEConfig, torch.Tensor, torch.Tensor, object, torch.device], PeerLayer]


class PeerUnavailable(Exception):
    """A peer that cannot run a config here; the message says why."""


@dataclass(frozen=True)
class Peer:
    """A registered peer: ``load(device, world)`` imports its package and returns a
    :data:`Builder`, or why it cannot run here (a string)."""

    name: str
    load: Callable[[torch.device, int], Builder | str]


@dataclass
class Peers:
    """The peers of one config: those built, and why each other one asked for is not."""

    ready: list[PeerLayer] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every peer asked for, built or not."""
        return sorted([p.name for p in self.ready] + list(self.unavailable))

    def close(self) -> None:
        """Release every built peer (collective: all ranks call it at the same point)."""
        for p in self.ready:
            if p.close is not None:
                p.close()
        self.ready = []


def load_peers(names: Sequence[str], device: torch.device, world: int, group=None,
               registry: dict[str, Peer] | None = None) -> dict[str, Builder | str]:
    """Each named peer's builder (what its ``load`` returns), or why it cannot run; every
    rank gets the same answer (collective over ``group``). ``registry``: where the names
    are (default :data:`PEERS`; :data:`comet.bench.deepgemm.FP8_PEERS` for the FP8 GEMM
    peer)."""
    registry = PEERS if registry is None else registry
    loaded: dict[str, Builder | str] = {}
    for name in names:
        try:
            loaded[name] = registry[name].load(device, world)
        except Exception as err:  # an extension that fails to load, say: report and go on
            loaded[name] = f"failed to load: {type(err).__name__}: {err}"
    why = _agree({n: v if isinstance(v, str) else None for n, v in loaded.items()}, group)
    return {n: why[n] or loaded[n] for n in names}


def build_peers(loaded: dict[str, Builder | str], cfg: MoEConfig, w13: torch.Tensor,
                w2: torch.Tensor, group, device: torch.device) -> Peers:
    """Build every loaded peer for ``cfg`` on this rank's experts ``w13 [El, H, 2F]``,
    ``w2 [El, F, H]``; a peer that fails on any rank is unavailable on all of them."""
    built: dict[str, PeerLayer] = {}
    why: dict[str, str | None] = {}
    for name, builder in loaded.items():
        if isinstance(builder, str):
            why[name] = builder
            continue
        try:
            built[name], why[name] = builder(cfg, w13, w2, group, device), None
        except PeerUnavailable as err:
            why[name] = str(err)
        except Exception as err:  # report and go on: comet and the other peers still run
            why[name] = f"failed to build: {type(err).__name__}: {err}"
    why = _agree(why, group)
    peers = Peers()
    for name in loaded:
        if why[name] is None:
            peers.ready.append(built[name])
        else:
            # One built here but not on another rank is dropped without ``close``: closing is
            # collective (DeepEP's destroy waits for every rank's buffer).
            peers.unavailable[name] = why[name]
    return peers


def _agree(reasons: dict[str, str | None], group) -> dict[str, str | None]:
    """Per peer, the first rank's reason not to run it, on every rank (None: all can)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return reasons
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, reasons, group=group)
    return {name: next((r[name] for r in every if r[name] is not None), None)
            for name in reasons}


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "version unknown"


def _common_checks(cfg: MoEConfig) -> None:
    """Peers run the plain layer: SiLU-gated experts without biases."""
    if not cfg.activation.is_default or cfg.expert_bias:
        raise PeerUnavailable("peers run silu(gate) * up experts without biases only, not "
                              f"{cfg.activation.describe()}"
                              f"{' with expert biases' if cfg.expert_bias else ''}")


# --------------------------------------------------------------------------- DeepEP
#: SMs DeepEP's normal-mode kernels use: the value its README's example sets
#: (``Buffer.set_num_sms(24)``) and its intranode test tunes with.
DEEPEP_NUM_SMS = 24
#: Ranks DeepEP's intranode kernels reach over NVLink (``NUM_MAX_NVL_PEERS``); beyond them
#: its internode kernels need NVSHMEM, which the build leaves out.
DEEPEP_MAX_RANKS = 8


def _load_deepep(device: torch.device, world: int) -> Builder | str:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if not 2 <= world <= DEEPEP_MAX_RANKS:
        return (f"intranode normal mode runs on 2-{DEEPEP_MAX_RANKS} ranks of one host "
                f"(DeepEP has no config for {world})")
    try:
        import deep_ep
    except ImportError as err:
        return (f"deep_ep does not import ({err}): build and install it with "
                "scripts/device/build_peers.sh")
    if not hasattr(deep_ep.Buffer, "get_dispatch_layout"):
        return "this deep_ep has no v1 Buffer API (get_dispatch_layout/dispatch/combine)"

    def build(cfg, w13, w2, group, device):
        _common_checks(cfg)
        if cfg.dtype != torch.bfloat16:
            raise PeerUnavailable(f"DeepEP dispatches bf16 (or fp8) rows, not {cfg.dtype}")
        group = group if group is not None else dist.group.WORLD
        deep_ep.Buffer.set_num_sms(DEEPEP_NUM_SMS)
        # The README's get_buffer: room for the larger of the dispatch and combine configs.
        hidden_bytes = cfg.hidden_size * max(w13.element_size(), 2)
        configs = (deep_ep.Buffer.get_dispatch_config(group.size()),
                   deep_ep.Buffer.get_combine_config(group.size()))
        nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, group.size()) for c in configs)
        buffer = deep_ep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
        layer = DeepEPLayer(buffer, w13, w2, cfg.num_experts, deep_ep.topk_idx_t)
        return PeerLayer(
            "deepep", layer,
            f"DeepEP {_version('deep_ep')} intranode normal mode ({DEEPEP_NUM_SMS} SMs, "
            f"{nvl_bytes / 2**20:.0f} MiB NVLink buffer), torch grouped GEMM, "
            "torch.compile'd silu(gate)*up*weight, index_add top-k sum",
            buffer.destroy)
    return build


def weighted_silu_mul(gu: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * weight`` of ``gu [R, 2F]`` (gate columns, then up) and
    ``weights [R]`` -> ``[R, F]`` in ``gu``'s dtype, computed in fp32.

    The routing weight is applied here, before the second GEMM (as Megatron's weighted
    SwiGLU does), so the expert outputs need only be summed per token."""
    f = gu.shape[1] // 2
    return (F.silu(gu[:, :f].float()) * gu[:, f:].float() * weights[:, None]).to(gu.dtype)


@cache
def _compiled_weighted_silu_mul():
    """:func:`weighted_silu_mul` as one Inductor kernel, compiled once per process (for any
    row count: ``dynamic``), not once per config."""
    return torch.compile(weighted_silu_mul, dynamic=True)


class DeepEPLayer:
    """DeepEP intranode normal-mode dispatch and combine around torch's grouped GEMMs.

    Per call: ``get_dispatch_layout`` (tokens per rank and per expert, which ranks each
    token goes to), ``dispatch`` (each token's row once per destination rank, with its
    top-k ids rewritten to that rank's local experts, ``-1`` for the others', and its
    weights), the received (token, local expert) pairs sorted into expert-grouped rows,
    ``grouped_mm`` with W13, the weighted SiLU-gate (one fused kernel on a GPU),
    ``grouped_mm`` with W2, the pairs summed per received token, and ``combine`` (the
    rows back to their source ranks, summed over ranks, unweighted) with the handle that
    ``dispatch`` returned -- which holds the layout, so combine needs no routing.

    ``dispatch`` returns the received rows per local expert as a host list: the CPU waits
    on the GPU for it (one host sync per call, as in any DeepEP normal-mode layer without
    ``num_worst_tokens``), and the grouped GEMMs then need no other.
    """

    def __init__(self, buffer, w13: torch.Tensor, w2: torch.Tensor, num_experts: int,
                 topk_idx_dtype: torch.dtype):
        """``buffer``: a ``deep_ep.Buffer`` over the group; ``w13 [El, H, 2F]``,
        ``w2 [El, F, H]``: this rank's experts; ``num_experts``: E over all ranks;
        ``topk_idx_dtype``: the id dtype DeepEP was built for (``deep_ep.topk_idx_t``)."""
        self.buffer, self.w13, self.w2 = buffer, w13, w2
        self.num_experts, self.topk_idx_dtype = num_experts, topk_idx_dtype
        # Fused by Inductor on a GPU; the CPU (tests with a stand-in buffer) runs it eagerly.
        self.activation = _compiled_weighted_silu_mul() if w13.is_cuda else weighted_silu_mul

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        ids = topk_ids.to(self.topk_idx_dtype)
        weights = topk_weights.float()
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            ids, self.num_experts)
        recv_x, recv_ids, recv_weights, expert_rows, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=weights)
        y = self.experts(recv_x, recv_ids, recv_weights, expert_rows)
        out, _, _ = self.buffer.combine(y, handle)
        return out

    def experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                recv_weights: torch.Tensor, expert_rows: list[int]) -> torch.Tensor:
        """Received tokens ``recv_x [N, H]`` with their local expert ids ``recv_ids [N, k]``
        (``-1``: another rank's expert) and weights ``[N, k]`` -> ``[N, H]``, each row the
        weighted sum of its token's outputs from this rank's experts; ``expert_rows``
        (host) counts the pairs per local expert."""
        n, k = recv_ids.shape
        el = self.w13.shape[0]
        flat = recv_ids.reshape(-1)
        # Pairs ``token * k + slot`` grouped by local expert (stable: tokens in order inside
        # an expert); other ranks' slots sort last and are cut off.
        key = torch.where(flat >= 0, flat, torch.full_like(flat, el))
        pairs = torch.sort(key, stable=True).indices[:sum(expert_rows)]
        tokens = pairs // k
        offs = torch.tensor(expert_rows, dtype=torch.int32, device=recv_x.device).cumsum(
            0, dtype=torch.int32)
        gu = grouped_mm(recv_x.index_select(0, tokens), self.w13, expert_rows, offs)
        h = self.activation(gu, recv_weights.reshape(-1).index_select(0, pairs))
        out = grouped_mm(h, self.w2, expert_rows, offs)
        return out.new_zeros(n, out.shape[1]).index_add_(0, tokens, out)


# --------------------------------------------------------------------------- Megatron-Core
def _load_megatron(device: torch.device, world: int) -> Builder | str:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if not (dist.is_available() and dist.is_initialized()):
        return "needs torch.distributed (comet bench under torchrun: two or more GPUs)"
    try:
        with warnings.catch_warnings():
            # Its import warns of every optional package it lacks (Apex, TE optimizers...).
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
            from megatron.core.extensions.transformer_engine import HAVE_TE
            from megatron.core.transformer.moe.experts import (GroupedMLPSubmodules,
                                                               TEGroupedMLP)
            from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
            from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as err:
        return (f"megatron.core does not import ({err}): install the megatron-core wheel "
                "(scripts/fetch_peer_sources.sh, scripts/device/build_peers.sh)")

    def build(cfg, w13, w2, group, device):
        _common_checks(cfg)
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise PeerUnavailable("runs expert parallelism over every rank (Megatron's "
                                  "parallel_state), not a subgroup")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=world)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        if (ep_rank, ep_size) != (dist.get_rank(), world):
            raise PeerUnavailable(f"Megatron's EP group has this rank as {ep_rank} of "
                                  f"{ep_size}; comet's experts go by global rank")
        config = TransformerConfig(
            num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=1,
            ffn_hidden_size=cfg.intermediate_size, moe_ffn_hidden_size=cfg.intermediate_size,
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.top_k,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
            # TE's fused permutation where TE is (Megatron's MoE README: Hopper settings).
            moe_permute_fusion=HAVE_TE,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            # Megatron's fused SwiGLU with the routing weight folded in (weighted_swiglu).
            bias_activation_fusion=True,
            params_dtype=cfg.dtype, bf16=cfg.dtype == torch.bfloat16,
            fp16=cfg.dtype == torch.float16, expert_model_parallel_size=world,
            perform_initialization=False)
        if HAVE_TE:
            import transformer_engine
            from megatron.core.extensions.transformer_engine_spec_provider import (
                TESpecProvider)
            experts = TESpecProvider().grouped_mlp_modules(True)
            linear = f"Transformer Engine {transformer_engine.__version__} GroupedLinear"
        else:
            experts = _torch_grouped_experts(TEGroupedMLP, GroupedMLPSubmodules, w13, w2)
            linear = "torch grouped-GEMM linear (comet's adapter: no Transformer Engine)"
        # Megatron's default process groups: the parallel_state set up above.
        moe = MoELayer(config, MoESubmodules(experts=experts, router=_GivenRouting)
                       ).to(device).eval()
        if HAVE_TE:
            _load_te_weights(moe.experts, w13, w2)
        return PeerLayer(
            "megatron", MegatronLayer(moe, cfg.num_experts),
            f"megatron-core {_version('megatron-core')}: MoELayer, alltoall dispatcher, "
            f"{type(moe.experts).__name__} on {linear}, weighted SwiGLU fusion, "
            f"permute fusion {'on' if HAVE_TE else 'off (needs TE)'}; routing given")
    return build


class _GivenRouting(torch.nn.Module):
    """Megatron's router slot (``MoESubmodules.router``), returning the routing the
    benchmark sets instead of computing one: dense ``probs [M, E]`` and the boolean
    ``routing_map [M, E]``, the form Megatron's TopKRouter returns."""

    def __init__(self, config=None, pg_collection=None, is_mtp_layer=False):
        super().__init__()
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_layer_number(self, layer_number: int) -> None:
        """No per-layer state (the router protocol asks for it)."""

    def forward(self, hidden_states: torch.Tensor, padding_mask=None):
        return self.routing


class MegatronLayer:
    """Megatron-Core's ``MoELayer`` on the given routing: the whole ``MoELayer.forward``
    (dispatch preprocess and permutation, the alltoall of tokens and probs, the sort by
    local expert, the experts, the reverse, unpermute) with its router returning comet's
    top-k as Megatron's dense probs and routing map -- what Megatron's own router would
    hand the dispatcher (the scatter into ``[M, E]`` is part of the timed call)."""

    def __init__(self, moe, num_experts: int):
        self.moe, self.num_experts = moe, num_experts

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        dense = (x.shape[0], self.num_experts)
        probs = torch.zeros(dense, dtype=torch.float32, device=x.device).scatter_(
            1, topk_ids, topk_weights.float())
        routing_map = torch.zeros(dense, dtype=torch.bool, device=x.device).scatter_(
            1, topk_ids, True)
        self.moe.router.routing = (probs, routing_map)
        with torch.no_grad():
            y, _ = self.moe(x)
        return y


def _torch_grouped_experts(mlp_cls, submodules_cls, w13: torch.Tensor, w2: torch.Tensor):
    """Megatron's grouped-MLP module (``TEGroupedMLP``) on :class:`_TorchGroupedLinear`
    layers holding comet's weights (no copy)."""
    return partial(mlp_cls, submodules=submodules_cls(
        linear_fc1=partial(_TorchGroupedLinear, weight=w13),
        linear_fc2=partial(_TorchGroupedLinear, weight=w2)))


class _TorchGroupedLinear(torch.nn.Module):
    """A grouped linear of Megatron's ``GroupedLinearFc1Builder`` / ``Fc2Builder`` protocol
    on torch's grouped GEMM: ``forward(x [R, in], tokens_per_expert) -> (x @ W_e, None)``
    per expert's rows, ``weight [El, in, out]``."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *,
                 weight: torch.Tensor, bias: bool, **_megatron_kwargs):
        super().__init__()
        if tuple(weight.shape) != (num_local_experts, input_size, output_size) or bias:
            raise PeerUnavailable(
                f"Megatron asked for a [{num_local_experts}, {input_size}, {output_size}] "
                f"grouped linear{' with bias' if bias else ''}; comet's weight is "
                f"{list(weight.shape)}")
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]):
        offs = torch.tensor(tokens_per_expert, dtype=torch.int32, device=x.device).cumsum(
            0, dtype=torch.int32)
        return grouped_mm(x, self.weight, list(tokens_per_expert), offs), None

    def backward_dw(self) -> None:
        """Forward only: no weight gradients."""


def _load_te_weights(experts, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """comet's ``w13 [El, H, 2F]``, ``w2 [El, F, H]`` into TE's grouped linears, whose
    expert ``e`` holds ``weight{e} [out, in]`` (the gate rows, then the up rows, as
    Megatron's SwiGLU splits fc1's output in halves)."""
    with torch.no_grad():
        for e in range(w13.shape[0]):
            getattr(experts.linear_fc1, f"weight{e}").copy_(w13[e].t())
            getattr(experts.linear_fc2, f"weight{e}").copy_(w2[e].t())


PEERS: dict[str, Peer] = {
    "deepep": Peer("deepep", _load_deepep),
    "megatron": Peer("megatron", _load_megatron),
}
