"""Converting one transformers MoE block into a :class:`comet.CometMoE`.

The replacement, :class:`CometMoEBlock`, is a ``CometMoE`` that keeps the replaced block's
surface:

* ``gate`` is the block's own router module, reused as is. Routing numerics stay exactly
  those of transformers, hooks on the router keep firing (transformers 5.x records router
  logits with a hook on the router class), and ``gate.*`` checkpoint keys are unchanged.
  Routers that compute the top-k themselves (5.x; DeepSeek-V3 in 4.x) are called and their
  ``(ids, weights)`` passed on; plain ``nn.Linear`` gates (4.x) give logits that
  :func:`comet.reference.route` turns into routing with the block's settings.
* ``experts`` is a :class:`TransformersExperts`: this rank's experts in the kernels' layout
  (``w13 [El, H, 2F]``, ``w2 [El, F, H]``), saved and loaded under the replaced experts
  module's keys (fused ``gate_up_proj``/``down_proj`` or per-expert ``nn.Linear`` keys).
* ``shared_expert`` / ``shared_experts`` / ``shared_expert_gate`` are the block's modules.
* ``forward`` returns what the replaced block returned: ``(hidden, router_logits)`` for the
  4.x blocks with a ``nn.Linear`` gate, a tensor otherwise.

The object is also an instance of the replaced block's class (see :func:`_block_class`), so
transformers' ``isinstance``-based output recorders (4.5x records router logits on the
block class) keep working.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comet import reference
from comet.config import MoEConfig
from comet.moe import CometMoE, LocalExperts
from comet.weights import gate_up_first, interleave_gate_up


@dataclass(frozen=True)
class Family:
    """How one transformers MoE block family maps onto :class:`comet.MoEConfig`.

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


#: Supported block classes (by class name, identical in transformers 4.4x and 5.x).
FAMILIES: dict[str, Family] = {
    "MixtralSparseMoeBlock": Family("Mixtral", always_renormalize=True),
    "Qwen2MoeSparseMoeBlock": Family("Qwen2-MoE", shared="shared_expert",
                                     shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": Family("Qwen3-MoE"),
    "OlmoeSparseMoeBlock": Family("OLMoE"),
    "DeepseekV3MoE": Family("DeepSeek-V3", router="sigmoid", grouped=True,
                            shared="shared_experts"),
}


def family_of(block: nn.Module) -> Family:
    """The :class:`Family` of ``block``; TypeError naming the class if unsupported."""
    name = type(block).__name__
    try:
        return FAMILIES[name]
    except KeyError:
        raise TypeError(
            f"comet cannot convert MoE block class {type(block).__module__}.{name}; "
            f"supported: {', '.join(FAMILIES)}") from None


# --------------------------------------------------------------------------- reading a block
def _lookup(block: nn.Module, *names: str):
    """First of ``names`` found on the block, its router, or its config (the attribute
    moved between these across transformers versions)."""
    gate = getattr(block, "gate", None)
    experts = getattr(block, "experts", None)
    owners = [block, gate]
    for owner in (block, gate, experts):
        cfg = getattr(owner, "config", None)
        if cfg is not None:
            owners.append(cfg)
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if value is not None:
                return value
    raise ValueError(f"cannot read {' / '.join(names)} from {type(block).__name__} "
                     "(looked on the block, its gate and its config)")


def _check_silu(act: nn.Module, where: str) -> None:
    probe = torch.linspace(-4.0, 4.0, 17)
    if not torch.allclose(act(probe), F.silu(probe)):
        raise NotImplementedError(
            f"{where} uses activation {type(act).__name__}; comet experts are SiLU-gated")


@dataclass(frozen=True)
class ExpertLayout:
    """How the replaced experts module stores its weights (and so its checkpoint keys).

    ``kind == "fused"``: ``gate_up_proj [E, 2F, H]`` (gate rows first) and
    ``down_proj [E, H, F]``, or ``[E, H, 2F]`` / ``[E, F, H]`` when ``transposed``.
    ``kind == "linear"``: per-expert ``{e}.{gate|up|down}.weight`` of ``nn.Linear``
    (``[F, H]``, ``[F, H]``, ``[H, F]``), ``names`` being ``(gate, up, down)``.
    """

    kind: str
    transposed: bool = False
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


_LINEAR_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def expert_layout(experts: nn.Module) -> ExpertLayout:
    """Recognise a transformers experts module; NotImplementedError if comet can't run it."""
    where = type(experts).__name__
    gate_up = getattr(experts, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:
        if (getattr(experts, "has_bias", False)
                or getattr(experts, "gate_up_proj_bias", None) is not None):
            raise NotImplementedError(f"{where} has expert biases; comet experts have none")
        if not getattr(experts, "is_concatenated", True):
            raise NotImplementedError(f"{where} interleaves gate and up columns")
        if getattr(experts, "has_post_expert_norm", False):
            raise NotImplementedError(f"{where} has a post-expert norm")
        _check_silu(experts.act_fn, where)
        return ExpertLayout("fused", transposed=bool(getattr(experts, "is_transposed", False)))
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        first = experts[0]
        for names in _LINEAR_NAMES:
            if all(isinstance(getattr(first, n, None), nn.Linear) for n in names):
                if any(getattr(e, n).bias is not None for e in experts for n in names):
                    raise NotImplementedError(f"{where} has expert biases; comet experts have none")
                _check_silu(first.act_fn, type(first).__name__)
                return ExpertLayout("linear", names=names)
    raise NotImplementedError(
        f"unrecognised experts module {where}: expected fused gate_up_proj/down_proj tensors "
        "or a ModuleList of gated MLPs (w1/w3/w2 or gate_proj/up_proj/down_proj)")


def expert_sizes(experts: nn.Module, layout: ExpertLayout) -> tuple[int, int, int]:
    """``(E, H, F)`` of a transformers experts module."""
    if layout.kind == "fused":
        e, a, b = experts.gate_up_proj.shape
        return (e, a, b // 2) if layout.transposed else (e, b, a // 2)
    f, h = getattr(experts[0], layout.names[0]).weight.shape
    return len(experts), h, f


def _fused_to_kernel(gate_up: torch.Tensor, down: torch.Tensor,
                     transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused transformers tensors (any leading expert count) -> ``(w13, w2)`` views."""
    if transposed:
        return gate_up, down
    return gate_up.transpose(1, 2), down.transpose(1, 2)


def _linear_to_kernel(gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ``nn.Linear`` weights ``[F, H], [F, H], [H, F]`` -> ``([H, 2F], [F, H])``."""
    return torch.cat([gate, up], dim=0).t(), down.t()


def kernel_weights(experts: nn.Module, layout: ExpertLayout,
                   lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[lo, hi)`` of a transformers experts module as new contiguous
    ``w13 [hi-lo, H, 2F]`` (interleaved, :mod:`comet.weights`) and ``w2 [hi-lo, F, H]``."""
    with torch.no_grad():
        if layout.kind == "fused":
            w13, w2 = _fused_to_kernel(experts.gate_up_proj[lo:hi], experts.down_proj[lo:hi],
                                       layout.transposed)
            return interleave_gate_up(w13), w2.contiguous()
        g, u, d = layout.names
        pairs = [_linear_to_kernel(getattr(m, g).weight, getattr(m, u).weight,
                                   getattr(m, d).weight) for m in experts[lo:hi]]
        return (torch.stack([interleave_gate_up(p[0]) for p in pairs]),
                torch.stack([p[1] for p in pairs]).contiguous())


# --------------------------------------------------------------------------- experts module
class TransformersExperts(LocalExperts):
    """This rank's experts (``w13 [El, H, 2F]`` interleaved, ``w2 [El, F, H]``; see
    :class:`comet.moe.LocalExperts`), checkpointed in the models' layout under the
    keys of the transformers experts module they replace.

    ``state_dict()`` writes ``gate_up_proj``/``down_proj`` (fused layout; with EP, this
    rank's ``[El, ...]`` slice) or ``{e}.{gate,up,down}.weight`` for this rank's experts
    under their *global* index ``e`` (per-expert layout). ``load_state_dict()`` accepts
    either layout: full ``[E, ...]`` fused tensors are sliced to this rank, per-expert keys
    of other ranks' experts are dropped. The saved tensors are copies, not views of the
    parameters.
    """

    def __init__(self, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor,
                 layout: ExpertLayout, first_expert: int, requires_grad: bool = True):
        super().__init__(cfg, w13.shape[0], device="meta")
        self.w13 = nn.Parameter(w13, requires_grad=requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=requires_grad)
        self.layout = layout
        self.num_experts = cfg.num_experts
        self.first_expert = first_expert

    def extra_repr(self) -> str:
        el = self.w13.shape[0]
        return (f"experts [{self.first_expert}, {self.first_expert + el}) of {self.num_experts}, "
                f"checkpoint layout={self.layout.kind}")

    def _checkpoint_entries(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        f = w2.shape[1]
        w13 = gate_up_first(w13)   # checkpoints keep the models' layout
        if self.layout.kind == "fused":
            if self.layout.transposed:
                return {"gate_up_proj": w13, "down_proj": w2.clone()}
            return {"gate_up_proj": w13.transpose(1, 2).contiguous(),
                    "down_proj": w2.transpose(1, 2).contiguous()}
        g, u, d = self.layout.names
        out = {}
        for i in range(w13.shape[0]):
            e = self.first_expert + i
            out[f"{e}.{g}.weight"] = w13[i, :, :f].t().contiguous()
            out[f"{e}.{u}.weight"] = w13[i, :, f:].t().contiguous()
            out[f"{e}.{d}.weight"] = w2[i].t().contiguous()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        w13, w2 = (self.w13, self.w2) if keep_vars else (self.w13.detach(), self.w2.detach())
        for key, value in self._checkpoint_entries(w13, w2).items():
            destination[prefix + key] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        if prefix + "w13" not in state_dict and prefix + "w2" not in state_dict:
            self._translate_checkpoint(state_dict, prefix, missing_keys, unexpected_keys,
                                       error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _translate_checkpoint(self, state_dict, prefix, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Replace transformers expert keys under ``prefix`` by ``w13``/``w2`` entries.

        Anything this rank lacks is reported under the transformers key names, and the
        current values stand in so torch does not report ``w13``/``w2`` a second time.
        """
        w13, w2 = self.w13.detach().clone(), self.w2.detach().clone()
        fused = {k: state_dict.pop(prefix + k) for k in ("gate_up_proj", "down_proj")
                 if prefix + k in state_dict}
        linear = {}
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.(\w+)\.weight$")
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = pattern.match(key)
            if m and any(m.group(2) in names for names in _LINEAR_NAMES):
                linear[(int(m.group(1)), m.group(2))] = state_dict.pop(key)
        if not fused and not linear and self.layout.kind == "fused":
            missing_keys.extend(prefix + k for k in ("gate_up_proj", "down_proj"))
        if fused:
            self._load_fused(fused, w13, w2, prefix, missing_keys, error_msgs)
        if linear or not fused and self.layout.kind == "linear":
            self._load_linear(linear, w13, w2, prefix, missing_keys, unexpected_keys)
        state_dict[prefix + "w13"], state_dict[prefix + "w2"] = w13, w2

    def _load_fused(self, fused, w13, w2, prefix, missing_keys, error_msgs) -> None:
        el, lo = w13.shape[0], self.first_expert
        if len(fused) < 2:
            missing_keys.extend(prefix + k for k in ("gate_up_proj", "down_proj") if k not in fused)
            return
        gate_up, down = fused["gate_up_proj"], fused["down_proj"]
        # A full [E, ...] tensor is sliced to this rank; an [El, ...] one is this rank's own
        # shard as saved by state_dict() under the same expert-parallel layout.
        rows = gate_up.shape[0]
        if rows == self.num_experts:
            gate_up, down = gate_up[lo:lo + el], down[lo:lo + el]
        elif rows != el:
            error_msgs.append(
                f"size mismatch for {prefix}gate_up_proj: {rows} experts in the checkpoint, "
                f"expected {self.num_experts} (all) or {el} (this rank's shard)")
            return
        new13, new2 = _fused_to_kernel(gate_up, down, self.layout.transposed
                                       if self.layout.kind == "fused" else False)
        if new13.shape != w13.shape or new2.shape != w2.shape:
            error_msgs.append(
                f"size mismatch for {prefix}gate_up_proj/down_proj: checkpoint gives "
                f"{tuple(new13.shape)}/{tuple(new2.shape)} in kernel layout, the layer has "
                f"{tuple(w13.shape)}/{tuple(w2.shape)}")
            return
        w13.copy_(interleave_gate_up(new13))
        w2.copy_(new2)

    def _load_linear(self, linear, w13, w2, prefix, missing_keys, unexpected_keys) -> None:
        el, lo = w13.shape[0], self.first_expert
        names = self.layout.names
        if linear and not any(n in names for _, n in linear):
            names = next(ns for ns in _LINEAR_NAMES if any(n in ns for _, n in linear))
        for (e, n) in linear:
            if e >= self.num_experts or n not in names:
                unexpected_keys.append(f"{prefix}{e}.{n}.weight")
        for i in range(el):
            e = lo + i
            try:
                parts = [linear[(e, n)] for n in names]
            except KeyError:
                missing_keys.extend(f"{prefix}{e}.{n}.weight" for n in names
                                    if (e, n) not in linear)
                continue
            a, b = _linear_to_kernel(*parts)
            w13[i].copy_(interleave_gate_up(a))
            w2[i].copy_(b)


# --------------------------------------------------------------------------- the block
class CometMoEBlock(CometMoE):
    """A transformers MoE block running on comet (build it with :func:`from_module`).

    Shapes: ``forward(hidden_states)`` takes ``[batch, seq, H]`` (or ``[tokens, H]``) and
    returns the same shape, as a ``(hidden, router_logits [tokens, E])`` tuple when the
    replaced block returned one (transformers 4.x with a ``nn.Linear`` gate).

    Attributes:
        family: the :class:`Family` name, e.g. ``"Mixtral"``.
        returns_router_logits: forward returns ``(hidden, router_logits)``.
        jitter_noise: Mixtral's training-time input jitter (0 disables).
    """

    def __init__(self, block: nn.Module, *, group=None, max_tokens: int | None = None,
                 comm_blocks: int | tuple[int, int] | None = None,
                 tuned_config_folder: str | None = None):
        family = family_of(block)
        layout = expert_layout(block.experts)
        e, h, f = expert_sizes(block.experts, layout)
        w_ref = (block.experts.gate_up_proj if layout.kind == "fused"
                 else getattr(block.experts[0], layout.names[0]).weight)
        settings = dict(num_experts=e, top_k=int(_lookup(block, "top_k", "num_experts_per_tok")),
                        hidden_size=h, intermediate_size=f, router=family.router,
                        dtype=w_ref.dtype)
        if max_tokens is not None:
            settings["max_tokens"] = max_tokens
        if not family.always_renormalize:
            settings["renormalize"] = bool(_lookup(block, "norm_topk_prob"))
        if family.grouped:
            settings.update(n_group=int(_lookup(block, "n_group", "num_group")),
                            topk_group=int(_lookup(block, "topk_group")),
                            routed_scaling_factor=float(_lookup(block, "routed_scaling_factor")),
                            score_correction_bias=True)
        shared = getattr(block, family.shared) if family.shared else None
        if shared is not None:
            expert_layout(nn.ModuleList([shared]))  # same checks: gated SiLU, no biases
            shared_f = shared.gate_proj.weight.shape[0]
            count = getattr(getattr(block, "config", None), "n_shared_experts", None) or 1
            settings.update(num_shared_experts=int(count), shared_intermediate_size=shared_f,
                            shared_expert_gate=family.shared_gate is not None)
        where = f"{type(block).__name__} ({family.name})"
        try:
            super().__init__(group=group, device="meta", comm_blocks=comm_blocks,
                             tuned_config_folder=tuned_config_folder, **settings)
        except ValueError as err:
            raise ValueError(f"cannot convert {where}: {err}") from err

        self.family = family.name
        self.gate = block.gate
        lo = self.par.rank * (e // self.par.world_size)
        w13, w2 = kernel_weights(block.experts, layout, lo, lo + e // self.par.world_size)
        self.experts = TransformersExperts(self.cfg, w13, w2, layout, lo,
                                           requires_grad=w_ref.requires_grad)
        self._shared_name = family.shared
        if shared is not None:
            # Reuse the block's modules: their keys, hooks and numerics stay as they were.
            del self.shared_expert
            setattr(self, family.shared, shared)
            self.shared_expert_gate = (getattr(block, family.shared_gate)
                                       if family.shared_gate else None)
        self.returns_router_logits = isinstance(block.gate, nn.Linear)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.train(block.training)

    def extra_repr(self) -> str:
        return f"family={self.family}, " + super().extra_repr()

    def forward(self, hidden_states: torch.Tensor):
        """``[batch, seq, H]`` or ``[tokens, H]`` -> same shape (plus router logits
        ``[tokens, E]`` when :attr:`returns_router_logits`)."""
        self.check_inputs(hidden_states, None, None)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()  # the fused kernels read rows
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits, topk_weights, topk_ids = self.route(x)
        # Router-made ids are in range by construction: skip the validation (and its host
        # read) that CometMoE.forward applies to user-supplied routing.
        y = self.experts_forward(x, topk_ids, topk_weights.float())
        if self._shared_name is not None:
            y = y + self.shared_forward(x)
        y = y.to(hidden_states.dtype).view(shape)
        return (y, logits) if self.returns_router_logits else y

    def route(self, x: torch.Tensor):
        """``x [M, H]`` -> ``(router_logits [M, E] or None, topk_weights [M, k],
        topk_ids [M, k])`` with the replaced block's router."""
        out = self.gate(x)
        if isinstance(out, torch.Tensor):
            # transformers 4.x: a nn.Linear gate, routing was done by the block itself.
            weights, ids = reference.route(out, self.cfg, None)
            return out, weights, ids
        if len(out) == 3:  # 5.x routers: (logits, weights, ids)
            return out
        # 4.x DeepSeek-V3 router: (ids, weights), no logits.
        ids, weights = out if not out[0].is_floating_point() else out[::-1]
        return None, weights, ids

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        s = getattr(self, self._shared_name)(x).float()
        if self.shared_expert_gate is not None:
            s = s * torch.sigmoid(self.shared_expert_gate(x).float())
        return s


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
                   {"__module__": __name__, "__doc__": CometMoEBlock.__doc__})
        _CLASSES[original] = cls
    return cls


def from_module(block: nn.Module, group=None, *, max_tokens: int | None = None,
                comm_blocks: int | tuple[int, int] | None = None,
                tuned_config_folder: str | None = None) -> CometMoEBlock:
    """Convert one transformers MoE block into a :class:`CometMoEBlock`.

    Args:
        block: a supported block (see :data:`FAMILIES`), with per-expert ``nn.Linear``
            experts (transformers 4.x) or fused 3-D expert tensors (5.x).
        group: expert-parallel process group (default: the world when torch.distributed
            is initialised, else one rank). Rank ``r`` keeps experts ``[r*El, (r+1)*El)``;
            every rank must pass the same block weights.
        max_tokens: most tokens per rank per call (default: :class:`comet.MoEConfig`'s).
        comm_blocks, tuned_config_folder: see :class:`comet.CometMoE`.

    Returns:
        The replacement, on the block's device and dtype, sharing its router and shared
        expert modules (the block itself is left untouched).

    Raises:
        TypeError: unsupported block class. NotImplementedError: unsupported experts
        (biases, non-SiLU activation). ValueError: the group size does not divide the
        number of experts, or sizes comet cannot run.
    """
    family_of(block)
    return _block_class(type(block))(block, group=group, max_tokens=max_tokens,
                                     comm_blocks=comm_blocks,
                                     tuned_config_folder=tuned_config_folder)
