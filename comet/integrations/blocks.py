"""Converting one transformers MoE block into a :class:`comet.CometMoE`.

A block is recognised by its structure, not by its class: an ``experts`` child next to the
block's router. Three kinds of experts module are understood:

* **routed** (transformers 5.x): a fused experts module with 3-D ``gate_up_proj`` /
  ``down_proj`` parameters whose forward is dispatched through transformers' experts
  registry (``@use_experts_implementation``), called by the block as
  ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. Whatever the block
  does around that call -- its router (softmax or sigmoid top-k, correction biases, group
  limits, Phi-3.5's sparsemixer, renormalisation, scaling), shared experts and their gates,
  norms, jitter, the tuple or tensor it returns -- runs unchanged: the replacement keeps
  the block's own ``forward`` and modules, and only the experts call goes to comet
  (:meth:`comet.CometMoE.experts_forward` with the block's ``(top_k_index,
  top_k_weights)``). Experts called the same way without the registry are taken on the
  same terms where their structure says what they compute: Step-3.7's fused experts with
  a gate function of their own, and DBRX's stacked experts (a child holding 2-D
  ``[E*F, H]`` gate, up and down tensors; called with the block's ``[batch, seq, H]``,
  they return that shape).
* **dense** (Llama-4): a fused experts module called as ``experts(routed_in [E*T, H])``,
  row block ``e`` holding expert ``e``'s input (the block scales each token by its router
  score *before* the experts). comet computes expert ``e`` on every non-zero row of block
  ``e`` (routing ``[E*T, 1]``, weight 1; an all-zero row gives zero in a bias-free gated
  MLP, so it is skipped) -- the same function, without the experts that no token chose.
  (Dense experts with biases are refused: there a zero row does not give zero.)
* **legacy** (transformers 4.x): a ``ModuleList`` of per-expert gated MLPs that the block
  loops over itself; routing then comes from the block's router module (``(ids, weights)``
  routers are called; for a plain ``nn.Linear`` gate, :data:`FAMILIES` gives the 4.x
  class's routing settings, applied by :func:`comet.reference.route`).

The experts must compute a function comet's kernels compute: per expert
``down(act(gate(x) + b_gate) * (up(x) + b_up)) + b_down``, ``act`` one of the gated
activations of :mod:`comet.activation` (SiLU, GELU-tanh, clamped SiLU, GPT-OSS's clamped
SwiGLU), biases optional, gate and up columns concatenated or alternating. The checks
(:mod:`comet.integrations.experts`, with :mod:`comet.integrations.gate` for the
activation) read the module's flags, weights and activation settings, probe its gate
function, and run its eager forward on a few probe rows against
:mod:`comet.reference`, so an experts module that computes something else is refused
(:class:`NotImplementedError`, naming the variant: a soft-capped or unknown gate, a norm
after each expert, ungated experts, identity experts) rather than converted wrong. The
block's :class:`comet.MoEConfig` carries what was found (``activation``,
``expert_bias``). Blocks whose experts are none of the three kinds raise
:class:`TypeError`.

The replacement, :class:`CometMoEBlock`, is a ``CometMoE`` that is also an instance of the
replaced block's class (see :func:`_block_class`): it adopts the block's child modules,
parameters, buffers and attributes (so ``gate`` / ``router``, shared experts and their
gates are the block's own objects, with their hooks, numerics and checkpoint keys), and
``experts`` becomes a :class:`~comet.integrations.local_experts.TransformersExperts`:
this rank's experts in the kernels' layout (``w13 [El, H, 2F]``, ``w2 [El, F, H]``, biases
``b13`` / ``b2``; converted by :mod:`comet.integrations.layout`), saved and loaded under
the replaced experts module's keys and layout. Under a (tp, ep) layout
(:class:`comet.mesh.MeshLayout`) they are its F shard of each of its experts
(``F / tp`` columns of gate and of up, those rows of W2), the rest of the block -- router,
shared experts -- replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from comet import reference
from comet.config import MoEConfig, TileConfig
from comet.integrations.experts import ExpertsSpec, inspect_experts
from comet.integrations.layout import expert_weight, kernel_biases, kernel_weights
from comet.integrations.local_experts import Fp8TransformersExperts, TransformersExperts
from comet.mesh import Convention
from comet.moe import CometMoE
from comet.quant import Fp8
from comet.runtime.inputs import check_inputs

# --------------------------------------------------------------------------- 4.x routing
@dataclass(frozen=True)
class Family:
    """Routing settings of a transformers 4.x MoE block whose ``nn.Linear`` gate gives only
    logits (the top-k was computed inside the block's forward, which a per-expert
    ``ModuleList`` block cannot hand to comet).

    Attributes:
        name: human name, for messages and docs.
        router: ``"softmax"`` or ``"sigmoid"`` scoring.
        always_renormalize: the family renormalises the top-k weights unconditionally
            (Mixtral); otherwise the block's ``norm_topk_prob`` decides.
        grouped: DeepSeek-V3 grouped top-k with ``e_score_correction_bias`` and
            ``routed_scaling_factor``.
        shared: attribute of the shared-expert MLP, or None.
        shared_gate: attribute of the shared expert's sigmoid gate (``Linear(H, 1)``), or None.
    """

    name: str
    router: str = "softmax"
    always_renormalize: bool = False
    grouped: bool = False
    shared: str | None = None
    shared_gate: str | None = None


#: transformers 4.x block classes with per-expert ``ModuleList`` experts (by class name).
#: Only these need a table: every block with registry-dispatched experts (transformers
#: 5.x) is converted from its structure, running its own routing code.
FAMILIES: dict[str, Family] = {
    "MixtralSparseMoeBlock": Family("Mixtral", always_renormalize=True),
    "Qwen2MoeSparseMoeBlock": Family("Qwen2-MoE", shared="shared_expert",
                                     shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": Family("Qwen3-MoE"),
    "OlmoeSparseMoeBlock": Family("OLMoE"),
    "DeepseekV3MoE": Family("DeepSeek-V3", router="sigmoid", grouped=True,
                            shared="shared_experts"),
}


# --------------------------------------------------------------------------- reading a block
def _router_of(block: nn.Module) -> nn.Module | None:
    """The block's router module: ``gate`` or ``router`` (a child)."""
    for name in ("gate", "router"):
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def _owners(block: nn.Module) -> list:
    """Where a block's settings may live: the block, its router, its experts, their
    configs (attributes moved between these across transformers versions and families)."""
    router, experts = _router_of(block), getattr(block, "experts", None)
    owners = [block, router, experts]
    for owner in (block, router, experts):
        cfg = getattr(owner, "config", None)
        if cfg is not None:
            owners.append(cfg)
            owners.append(getattr(cfg, "text_config", None))
    return [o for o in owners if o is not None]


def _lookup(block: nn.Module, *names: str, required: bool = True):
    """First of ``names`` set on the block, its router, its experts or their configs."""
    for owner in _owners(block):
        for name in names:
            value = getattr(owner, name, None)
            if value is not None and not isinstance(value, nn.Module):
                return value
    if not required:
        return None
    raise ValueError(f"cannot read {' / '.join(names)} from {type(block).__name__} "
                     "(looked on the block, its router, its experts and their configs)")


_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k",
                "top_k_experts", "router_topk", "n_activated_experts", "moe_top_k")


# --------------------------------------------------------------------------- the block
#: nn.Module's own bookkeeping: the replacement keeps its own (empty) hooks.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_ADOPTED_INTERNALS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _family_name(block: nn.Module) -> str:
    """The transformers model family of a block: ``mixtral`` for
    ``transformers.models.mixtral.modeling_mixtral``, else the module path."""
    parts = type(block).__module__.split(".")
    if len(parts) > 2 and parts[:2] == ["transformers", "models"]:
        return parts[2]
    return type(block).__module__


@dataclass(frozen=True)
class BlockSpec:
    """How :class:`CometMoEBlock` converts a block (see :func:`inspect_block`)."""

    experts: ExpertsSpec
    top_k: int
    family: str
    legacy: Family | None = None


def inspect_block(block: nn.Module) -> BlockSpec:
    """Recognise an MoE block and check comet can run it (nothing is changed).

    Raises:
        TypeError: not an MoE block comet recognises (no ``experts`` child, experts of an
            unknown kind, no router, a name clash with :class:`CometMoEBlock`).
        NotImplementedError: experts with a variant comet does not compute yet.
    """
    cls = type(block)
    where = f"{cls.__module__}.{cls.__name__}"
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        raise TypeError(f"{where} has no `experts` module: its experts are computed inside "
                        f"its own forward, which comet cannot take over")
    spec = inspect_experts(experts, where)
    legacy = None
    if spec.mode == "dense":
        top_k = 1       # every (token, expert) row is a token of its own
    else:
        top_k = _lookup(block, *_TOP_K_NAMES, required=False)
        if top_k is None:
            raise TypeError(f"{where}: cannot read the number of experts per token "
                            f"({' / '.join(_TOP_K_NAMES[:3])}, ...) from the block, its "
                            "router or its config")
        top_k = int(top_k)
    if spec.mode == "legacy":
        legacy = FAMILIES.get(cls.__name__)
        if legacy is None:
            raise TypeError(
                f"{where}: per-expert ModuleList experts are routed inside the block's own "
                "forward; comet takes that routing over only for the transformers 4.x "
                f"classes {', '.join(FAMILIES)}")
        if _router_of(block) is None:
            raise TypeError(f"{where}: no router module (gate or router)")
    _check_names(block, where)
    return BlockSpec(spec, top_k, _family_name(block), legacy)


def _check_names(block: nn.Module, where: str) -> None:
    """TypeError if the block's class or instance defines names :class:`CometMoEBlock`
    needs for itself (the replacement is both; one would shadow the other)."""
    ours = set()
    for k in CometMoEBlock.__mro__:
        if k not in nn.Module.__mro__:
            ours |= set(vars(k))
    ours -= {"__init__", "__module__", "__doc__", "__dict__", "__weakref__", "forward",
             "extra_repr", "__setstate__", "__annotations__", "__qualname__",
             "__firstlineno__", "__static_attributes__"}
    theirs = set()
    for k in type(block).__mro__:
        if k not in nn.Module.__mro__ and k is not object:
            theirs |= {n for n in vars(k) if not n.startswith("__")}
    clash = sorted((ours & theirs) | ((_INSTANCE_NAMES | ours) & set(vars(block))))
    if clash:
        raise TypeError(f"{where} defines {', '.join(clash)}, which CometMoEBlock uses itself")


#: Instance attributes CometMoE / CometMoEBlock set (an adopted block must not have them).
_INSTANCE_NAMES = frozenset({
    "cfg", "par", "group", "mesh", "convention", "comm_blocks", "tuned_config_folder",
    "fused_backward", "_fused", "_op_key", "family", "mode", "returns_router_logits",
    "_comet_input_cfg", "_comet_check_input", "_comet_legacy", "_comet_rows_per_token",
    "replicas", "rebalance_interval", "rebalance_window", "_rebalance_calls",
    "_held_slots"})


class CometMoEBlock(CometMoE):
    """A transformers MoE block running its routed experts on comet (build it with
    :func:`from_module`).

    It is the replaced block -- same class (as a base), same child modules, parameters,
    buffers and attributes, same ``forward`` code and return value -- except for
    ``experts``, a :class:`TransformersExperts` holding this rank's experts; the call the
    block makes to its experts runs :meth:`comet.CometMoE.experts_forward` with the
    block's own routing. Hooks registered on the block object itself are not carried over.

    Attributes:
        family: the transformers model family, e.g. ``"mixtral"`` (4.x blocks: the
            :class:`Family` name).
        mode: ``"routed"``, ``"dense"`` or ``"legacy"`` (module doc).
        returns_router_logits: legacy blocks: forward returns ``(hidden, router_logits)``
            (transformers 4.x with a ``nn.Linear`` gate). Other blocks return whatever the
            replaced block returned.
    """

    _replaced_class: type | None = None

    def __init__(self, block: nn.Module, *, group=None, mesh=None,
                 convention: Convention = "sequence", tp_group=None, ep_group=None,
                 max_tokens: int | None = None,
                 comm_blocks: int | tuple[int, int] | None = None,
                 tuned_config_folder: str | None = None, check_replicated: bool = False,
                 tile: TileConfig | None = None, redundant_experts: int = 0,
                 placement_nodes: int = 1, rebalance_interval: int | None = None,
                 rebalance_window: int | None = None):
        spec = inspect_block(block)
        xs = spec.experts
        experts = block.experts
        e, h, f = xs.num_experts, xs.hidden_size, xs.intermediate_size
        w_ref = expert_weight(experts, xs.layout)
        rows = e if xs.mode == "dense" else 1
        tokens = max_tokens if max_tokens is not None else MoEConfig.max_tokens
        settings = dict(num_experts=e, top_k=spec.top_k, hidden_size=h, intermediate_size=f,
                        dtype=w_ref.dtype, max_tokens=tokens * rows,
                        activation=xs.activation, expert_bias=bool(xs.layout.biases))
        if xs.fp8 is not None:      # the FP8 layer takes and returns bf16 rows
            settings.update(dtype=torch.bfloat16, fp8=Fp8(xs.fp8.blocks))
        if spec.legacy is not None:
            settings.update(self._legacy_settings(block, spec.legacy))
        where = f"{type(block).__name__} ({spec.family})"
        try:
            super().__init__(group=group, mesh=mesh, convention=convention,
                             tp_group=tp_group, ep_group=ep_group, device="meta",
                             comm_blocks=comm_blocks, tuned_config_folder=tuned_config_folder,
                             check_replicated=check_replicated, tile=tile,
                             redundant_experts=redundant_experts,
                             placement_nodes=placement_nodes,
                             rebalance_interval=rebalance_interval,
                             rebalance_window=rebalance_window, **settings)
            input_cfg = self.cfg.replace(max_tokens=tokens)
        except ValueError as err:
            raise ValueError(f"cannot convert {where}: {err}") from err
        # CometMoE built its replicas on the meta device, of meta experts; they are
        # built again below from the block's experts, where those live.
        placement = None if self.replicas is None else self.replicas.placement_config
        if xs.fp8 is not None:
            _check_fp8_layout(self, where)

        self._adopt(block)
        self.family = spec.legacy.name if spec.legacy else spec.family
        self.mode = xs.mode
        self._comet_rows_per_token = rows
        self._comet_input_cfg = input_cfg
        # Check the block's input where it is the experts' input space (a block that
        # projects to another width is checked at the experts call only).
        self._comet_check_input = int(_lookup(block, "hidden_size", "hidden_dim",
                                              required=False) or h) == h
        mine = self.mesh.expert_range(e, self.par.rank)
        tp_rank = self.mesh.coords(self.par.rank)[1]
        cols = self.ffn_range if self.mesh.tp > 1 else None     # None: every F column
        if xs.fp8 is not None:
            new_experts = Fp8TransformersExperts(self.cfg, experts, xs.fp8, mine.start,
                                                 len(mine))
        else:
            w13, w2 = kernel_weights(experts, xs.layout, mine.start, mine.stop, cols)
            b13, b2 = kernel_biases(experts, xs.layout, mine.start, mine.stop, cols)
            new_experts = TransformersExperts(self.cfg, w13, w2, xs.layout, mine.start,
                                              requires_grad=w_ref.requires_grad, b13=b13,
                                              b2=b2, ffn_cols=cols, adds_b2=tp_rank == 0)
        new_experts.__dict__["_comet_block"] = self   # plain attribute: not a submodule
        self._modules["experts"] = new_experts
        if placement is not None:
            self._build_replicas(placement, new_experts.w13.device)
        self._comet_legacy = spec.legacy
        self.returns_router_logits = (spec.legacy is not None
                                      and isinstance(_router_of(block), nn.Linear))

    # ------------------------------------------------------------------ construction
    def _start_fp8(self, fp8: Fp8) -> None:
        """FP8 experts come quantized from the checkpoint (:class:`Fp8TransformersExperts`,
        built once this layer is): nothing to quantize, and the state dict holds those
        FP8 tensors, so nothing to requantize after a load."""
        self.cfg = self.cfg.replace(fp8=fp8)

    @staticmethod
    def _legacy_settings(block: nn.Module, family: Family) -> dict:
        """:class:`MoEConfig` routing fields of a 4.x block (its gate gives only logits)."""
        settings = dict(router=family.router)
        if not family.always_renormalize:
            settings["renormalize"] = bool(_lookup(block, "norm_topk_prob"))
        if family.grouped:
            settings.update(n_group=int(_lookup(block, "n_group", "num_group")),
                            topk_group=int(_lookup(block, "topk_group")),
                            routed_scaling_factor=float(_lookup(block, "routed_scaling_factor")),
                            score_correction_bias=True)
        return settings

    def _adopt(self, block: nn.Module) -> None:
        """Take over the block's modules, parameters, buffers and attributes (the objects
        themselves), dropping what CometMoE built on the meta device in their place."""
        for name in ("gate", "experts", "shared_expert", "shared_expert_gate"):
            self._modules.pop(name, None)
            self.__dict__.pop(name, None)
        for name, value in vars(block).items():
            if name in _ADOPTED_INTERNALS:
                self.__dict__[name] = type(value)(value)
            elif name == "training":
                self.training = value
            elif name not in _MODULE_INTERNALS:
                self.__dict__[name] = value

    def extra_repr(self) -> str:
        return f"family={self.family}, mode={self.mode}, " + super().extra_repr()

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        """The replaced block's forward (same arguments, same return value), its experts
        call running on comet. Legacy (4.x) blocks: ``[batch, seq, H]`` or ``[tokens, H]``
        -> same shape, plus router logits ``[tokens, E]`` when
        :attr:`returns_router_logits`."""
        if self._comet_legacy is not None:
            return self._legacy_forward(*args, **kwargs)
        if self._comet_check_input:
            x = args[0] if args else kwargs.get("hidden_states")
            check_inputs(self._comet_input_cfg, x, None, None, dtype=self.rows_dtype,
                         device=self.experts.w13.device, rank=self.par.rank, batched=True)
        return self._replaced_class.forward(self, *args, **kwargs)

    def call_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None,
                     top_k_weights: torch.Tensor | None) -> torch.Tensor:
        """What the replaced experts module returned for this call, computed by comet.

        Routed experts: ``hidden [T, H]`` (stacked ones: ``[batch, seq, H]``),
        ``top_k_index [T, k]`` (ids outside ``[0, E)`` -- transformers' expert-parallel
        sentinels -- contribute nothing), ``top_k_weights [T, k]`` -> ``hidden``'s shape.
        Dense experts: ``routed_in [E*T, H]`` (row block ``e`` = expert ``e``'s inputs) ->
        ``[E*T, H]``. The result has the input's dtype."""
        w13, rows_dtype = self.experts.w13, self.rows_dtype
        shape, dtype = hidden_states.shape, hidden_states.dtype
        x = hidden_states.reshape(-1, shape[-1]).to(rows_dtype).contiguous()
        if top_k_index is None:
            if self.mode != "dense":
                raise TypeError(f"the experts of {self.family} take (hidden_states, "
                                "top_k_index, top_k_weights)")
            e = self.cfg.num_experts
            ids = torch.arange(e, device=x.device).repeat_interleave(x.shape[0] // e)
            ids = torch.where(x.ne(0).any(dim=-1), ids, -1).unsqueeze(1)
            weights = torch.ones(ids.shape, device=x.device, dtype=torch.float32)
        else:
            ids = top_k_index.reshape(x.shape[0], -1)
            weights = top_k_weights.reshape(x.shape[0], -1).float()
            if ids.shape[1] != self.cfg.top_k:
                raise ValueError(f"the {self.family} block routed {ids.shape[1]} experts per "
                                 f"token; comet was built for top_k={self.cfg.top_k}")
        check_inputs(self.cfg, x, None, None, dtype=rows_dtype, device=w13.device,
                     rank=self.par.rank)
        y = self.experts_forward(x, ids, weights)
        return y.to(dtype).reshape(shape)

    # ------------------------------------------------------------------ 4.x blocks
    def _legacy_forward(self, hidden_states: torch.Tensor):
        self.check_inputs(hidden_states, None, None)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()  # the fused kernels read rows
        jitter = float(getattr(self, "jitter_noise", 0.0) or 0.0)
        if self.training and jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter)
        logits, topk_weights, topk_ids = self._comet_route(x)
        # Router-made ids are in range by construction: skip the validation (and its host
        # read) that CometMoE.forward applies to user-supplied routing.
        y = self.experts_forward(x, topk_ids, topk_weights.float())
        fam = self._comet_legacy
        if fam.shared is not None:
            s = getattr(self, fam.shared)(x).float()
            if fam.shared_gate is not None:
                s = s * torch.sigmoid(getattr(self, fam.shared_gate)(x).float())
            y = y + s
        y = y.to(hidden_states.dtype).view(shape)
        return (y, logits) if self.returns_router_logits else y

    def _comet_route(self, x: torch.Tensor):
        """``x [M, H]`` -> ``(router_logits [M, E] or None, topk_weights [M, k],
        topk_ids [M, k])`` with the replaced (4.x) block's router."""
        out = _router_of(self)(x)
        if isinstance(out, torch.Tensor):
            # a nn.Linear gate: the routing was done by the block itself.
            bias = getattr(_router_of(self), "e_score_correction_bias", None)
            weights, ids = reference.route(out, self.cfg, bias)
            return out, weights, ids
        if len(out) == 3:  # (logits, weights, ids)
            return out
        # 4.x DeepSeek-V3 router: (ids, weights), no logits.
        ids, weights = out if not out[0].is_floating_point() else out[::-1]
        return None, weights, ids


def _check_fp8_layout(block: CometMoEBlock, where: str) -> None:
    """ValueError where ``block``'s layout cannot take FP8 experts from a checkpoint
    (raised before the block is converted)."""
    if block.mesh.tp > 1:
        raise ValueError(f"cannot convert {where}: FP8 experts under a tensor-parallel "
                         f"layout ({block.mesh}) are not supported yet: use expert "
                         "parallelism (tp=1)")
    if block.replicas is not None:
        raise ValueError(f"cannot convert {where}: FP8 experts with redundant experts (EPLB) "
                         "are not supported yet")


class _InitShim(nn.Module):
    """Ends CometMoE's ``super().__init__()`` chain at ``nn.Module``, so the replaced block's
    class can be a base (for ``isinstance``) without its ``__init__(config)`` running."""

    def __init__(self, *args, **kwargs):
        nn.Module.__init__(self)


_CLASSES: dict[type, type] = {}


def _block_class(original: type) -> type:
    """``Comet<Original>``: a :class:`CometMoEBlock` that is also an ``original``."""
    cls = _CLASSES.get(original)
    if cls is None:
        cls = type(f"Comet{original.__name__}", (CometMoEBlock, _InitShim, original),
                   {"__module__": __name__, "__doc__": CometMoEBlock.__doc__,
                    "_replaced_class": original})
        _CLASSES[original] = cls
    return cls


def from_module(block: nn.Module, group=None, *, mesh=None, convention: Convention = "sequence",
                tp_group=None, ep_group=None, max_tokens: int | None = None,
                comm_blocks: int | tuple[int, int] | None = None,
                tuned_config_folder: str | None = None,
                check_replicated: bool = False, tile: TileConfig | None = None,
                redundant_experts: int = 0, placement_nodes: int = 1,
                rebalance_interval: int | None = None, rebalance_window: int | None = None
                ) -> CometMoEBlock:
    """Convert one transformers MoE block into a :class:`CometMoEBlock`.

    Args:
        block: an MoE block (a module with an ``experts`` child and its router): fused
            registry experts (transformers 5.x, any family), Llama-4's dense experts,
            DBRX's stacked experts, or per-expert ``nn.Linear`` experts of the
            transformers 4.x classes in :data:`FAMILIES`.
        group: the process group of the block's ranks (default: the world when
            torch.distributed is initialised, else one rank). Without ``mesh``, expert
            parallelism: rank ``r`` keeps experts ``[r*El, (r+1)*El)``. Every rank must pass
            the same block weights.
        mesh, convention, tp_group, ep_group: a (tp, ep) layout of the ranks and how a TP
            group's ranks pass tokens, as for :class:`comet.CometMoE`: rank ``(i, t)``
            keeps experts ``[i*El, (i+1)*El)`` (``El = E / ep``), of each its F shard
            ``[t*F/tp, (t+1)*F/tp)``; inference only when ``tp > 1``.
        max_tokens: most tokens per rank per call (default: :class:`comet.MoEConfig`'s);
            dense (Llama-4) blocks size comet for ``E`` rows per token.
        comm_blocks, tuned_config_folder, check_replicated, tile: see
            :class:`comet.CometMoE`.
        redundant_experts, placement_nodes, rebalance_interval, rebalance_window:
            redundant experts (EPLB) and automatic rebalancing, as for
            :class:`comet.CometMoE` (docs/eplb.md); off by default. The checkpoint keys
            and layout do not change: the physical copies are not saved.

    Returns:
        The replacement, on the block's device and dtype, sharing the block's modules
        (router, shared experts, norms, ...) except the experts (the block itself is
        left as it was).

    Raises:
        TypeError: not an MoE block comet recognises (message: what it is).
        NotImplementedError: experts comet does not compute yet (message: every
            unsupported variant: soft-capped gate, post-expert norm, ungated, ...).
        ValueError: the group size does not divide the number of experts, or sizes comet
            cannot run (multiples of 16), or a layout that cannot shard the block (a
            group size other than ``tp * ep``, ``ep`` not dividing E, ``F / tp`` not a
            multiple of 16).
    """
    return _block_class(type(block))(block, group=group, mesh=mesh, convention=convention,
                                     tp_group=tp_group, ep_group=ep_group,
                                     max_tokens=max_tokens, comm_blocks=comm_blocks,
                                     tuned_config_folder=tuned_config_folder,
                                     check_replicated=check_replicated, tile=tile,
                                     redundant_experts=redundant_experts,
                                     placement_nodes=placement_nodes,
                                     rebalance_interval=rebalance_interval,
                                     rebalance_window=rebalance_window)
