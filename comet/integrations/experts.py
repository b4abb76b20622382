"""Recognising a transformers experts module, checking that comet computes exactly its
function, and holding this rank's experts in the kernels' layout.

:func:`inspect_experts` accepts three kinds (see :mod:`comet.integrations.blocks`):
registry-dispatched fused experts (``"routed"``), Llama-4's dense fused experts
(``"dense"``) and per-expert ``ModuleList`` s of gated MLPs (``"legacy"``), and refuses
every variant comet's kernels do not compute -- biases, another activation, clamped or
soft-capped SwiGLU, a norm after each expert, ungated experts, interleaved gate/up columns,
identity experts -- with a :class:`NotImplementedError` that names each, after reading the
module's flags and parameters, probing its gate function, and running its own eager forward
on probe rows against :mod:`comet.reference`. Anything else is a :class:`TypeError`.

:class:`TransformersExperts` replaces the experts module inside a converted block: this
rank's experts (``w13 [El, H, 2F]`` interleaved, ``w2 [El, F, H]``), checkpointed under the
replaced module's keys, and called the way the block called the original.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comet import reference
from comet.config import MoEConfig
from comet.moe import LocalExperts
from comet.weights import gate_up_first, interleave_gate_up


def activation_name(act, owner: nn.Module | None = None) -> str:
    """A readable name of an activation: the config string that made it where one matches
    (``gelu_pytorch_tanh``), else transformers' registry name, else the class/function."""
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # pragma: no cover - transformers is what calls us
        ACT2CLS = {}
    cls = act if inspect.isfunction(act) or inspect.isbuiltin(act) else type(act)
    names = [k for k, v in ACT2CLS.items() if (v[0] if isinstance(v, tuple) else v) is cls]
    cfg = getattr(owner, "config", None)
    for attr in ("hidden_act", "hidden_activation", "mlp_hidden_act", "activation_function",
                 "hidden_activation_fn"):
        value = getattr(cfg, attr, None)
        if isinstance(value, str) and value in names:
            return value
    if names:
        return names[0]
    return getattr(act, "__name__", None) or type(act).__name__


def _is_silu(fn, device=None, dtype=torch.float32) -> bool:
    """``fn`` (one tensor in, one out) computes SiLU on values from -40 to 40."""
    probe = torch.linspace(-40.0, 40.0, 161, device=device, dtype=dtype)
    try:
        with torch.no_grad():
            got = fn(probe)
    except Exception:  # noqa: BLE001 - a function we cannot probe is not one we run
        return False
    want = F.silu(probe.float())
    return (isinstance(got, torch.Tensor) and got.shape == probe.shape
            and torch.allclose(got.float(), want, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-5))


def _param_home(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and dtype to probe ``module``'s functions with (CPU fp32 for meta weights)."""
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device, torch.float32
    return torch.device("cpu"), torch.float32


def _default_apply_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate as fn
    except ImportError:  # pragma: no cover - 4.x: no registry, no registry experts
        return None
    return fn


def _gate_reason(experts: nn.Module) -> str | None:
    """Why ``experts._apply_gate`` is not ``silu(gate) * up`` on a concatenated
    ``[gate | up]`` row, or None when it is."""
    device, dtype = _param_home(experts)
    apply_gate = getattr(type(experts), "_apply_gate", None)
    custom = apply_gate is not None and apply_gate is not _default_apply_gate()
    act = getattr(experts, "act_fn", None)
    if not custom:
        if act is None:
            return f"{type(experts).__name__} has no act_fn"
        if not _is_silu(act, device, dtype):
            return f"activation {activation_name(act, experts)} is not SiLU"
        return None
    gen = torch.Generator().manual_seed(0)
    f = 16
    probe = (torch.randn(64, 2 * f, generator=gen) * 12.0).clamp(-40.0, 40.0)
    probe[0] = torch.linspace(-40.0, 40.0, 2 * f)
    probe = probe.to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            got = experts._apply_gate(probe)
        want = F.silu(probe[:, :f].float()) * probe[:, f:].float()
        if got.shape == want.shape and torch.allclose(got.float(), want, rtol=1e-5, atol=1e-4):
            return None
    except Exception:  # noqa: BLE001 - refused below, with what we know
        pass
    limit = next((getattr(experts, n) for n in ("limit", "swiglu_limit")
                  if isinstance(getattr(experts, n, None), (int, float))), None)
    alpha = next((getattr(experts, n) for n in ("alpha", "swiglu_alpha")
                  if isinstance(getattr(experts, n, None), (int, float))), None)
    if limit is not None and alpha is not None:
        return (f"GPT-OSS clamped SwiGLU (alpha={alpha:g}, limit={limit:g}: "
                "(up + 1) * gate * sigmoid(alpha * gate), both clamped) is not supported yet")
    if limit is not None:
        return f"clamped SiLU gate (gate <= {limit:g}, |up| <= {limit:g}) is not supported yet"
    caps = sorted(n for n in list(vars(act)) + list(getattr(act, "_modules", {}))
                  if "softcap" in n.lower()) if act is not None else []
    if caps:
        return (f"soft-capped SwiGLU ({type(act).__name__}: {', '.join(caps)}) "
                "is not supported yet")
    what = (f"activation {activation_name(act, experts)}" if act is not None
            else f"{type(experts).__name__}._apply_gate")
    return f"gate function {type(experts).__name__}._apply_gate ({what}) is not silu(gate) * up"


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
_FUSED_KEYS = ("gate_up_proj", "down_proj")


def is_registry_experts(experts: nn.Module) -> bool:
    """``experts`` is dispatched through transformers' experts registry (its class was
    decorated with ``@use_experts_implementation``)."""
    forward = getattr(type(experts), "forward", None)
    return (callable(getattr(forward, "__wrapped__", None))
            and all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed")))


def _extra_state(experts: nn.Module) -> list[str]:
    """Parameters and buffers of a fused experts module beyond ``gate_up_proj`` and
    ``down_proj`` (comet would drop them)."""
    names = [n for n, _ in experts.named_parameters()] + [n for n, _ in experts.named_buffers()]
    return [n for n in names if n not in _FUSED_KEYS]


def _fused_reasons(experts: nn.Module, registry: bool) -> list[str]:
    """Why comet cannot run a fused experts module (empty: it can)."""
    reasons = []
    biases = [n for n, _ in experts.named_parameters() if n.endswith("bias")]
    if getattr(experts, "has_bias", False) or biases:
        reasons.append(f"expert biases ({', '.join(biases) or 'has_bias'}) are not supported yet")
    if registry and not getattr(experts, "has_gate", True):
        act = getattr(experts, "act_fn", None)
        name = activation_name(act, experts) if act is not None else "act_fn"
        reasons.append(f"ungated experts (up_proj -> {name} -> down_proj) are not supported yet")
        return reasons
    if registry and not getattr(experts, "is_concatenated", True):
        reasons.append("gate and up projections interleaved column by column "
                       "(is_concatenated=False) are not supported yet")
    if getattr(experts, "has_post_expert_norm", False):
        norm = getattr(experts, "post_expert_norm", None)
        reasons.append(f"a norm after each expert (post_expert_norm: {type(norm).__name__}) "
                       "is not supported yet")
    if registry or callable(getattr(experts, "_apply_gate", None)):
        gate = _gate_reason(experts)
    else:
        act = getattr(experts, "act_fn", None)
        device, dtype = _param_home(experts)
        gate = (None if act is not None and _is_silu(act, device, dtype) else
                f"activation {activation_name(act, experts) if act is not None else '?'} "
                "is not SiLU")
    if gate:
        reasons.append(gate)
    extra = [n for n in _extra_state(experts) if not n.endswith("bias")
             and not n.startswith("post_expert_norm")]
    if extra:
        reasons.append(f"extra expert state ({', '.join(extra)}) is not supported")
    return reasons


def _single_input_forward(experts: nn.Module) -> bool:
    """The experts' forward takes one tensor (Llama-4: ``experts(routed_in)``)."""
    try:
        params = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 and positional[0].default is inspect.Parameter.empty


def _routed_signature(experts: nn.Module) -> bool:
    """The experts' forward takes ``(hidden_states, top_k_index, top_k_weights)``."""
    try:
        params = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                p.POSITIONAL_OR_KEYWORD)]) == 3


def _fused_shapes(experts: nn.Module, transposed: bool) -> tuple[int, int, int] | None:
    """``(E, H, F)`` if ``gate_up_proj`` / ``down_proj`` fit the layout, else None."""
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)
            and gu.dim() == 3 and dn.dim() == 3):
        return None
    e, a, b = gu.shape
    if transposed:
        h, f2 = a, b
        want_down = (e, f2 // 2, h)
    else:
        f2, h = a, b
        want_down = (e, h, f2 // 2)
    if f2 % 2 or tuple(dn.shape) != want_down:
        return None
    return e, h, f2 // 2


@dataclass(frozen=True)
class ExpertsSpec:
    """What :func:`inspect_experts` found: how comet runs an experts module.

    Attributes:
        mode: ``"routed"`` (``experts(x, ids, weights)``), ``"dense"`` (``experts(x_all)``,
            ``E`` row blocks) or ``"legacy"`` (per-expert ``ModuleList``).
        layout: weight storage, see :class:`ExpertLayout`.
        num_experts, hidden_size, intermediate_size: E, H, F.
    """

    mode: str
    layout: ExpertLayout
    num_experts: int
    hidden_size: int
    intermediate_size: int


def _refuse(where: str, reasons: list[str]):
    raise NotImplementedError(f"comet cannot run the experts of {where}: " + "; ".join(reasons))


def inspect_experts(experts: nn.Module, where: str | None = None) -> ExpertsSpec:
    """Recognise an experts module and check that comet computes exactly its function.

    Raises:
        TypeError: not an experts module comet knows (neither registry-dispatched fused
            experts, nor Llama-4-style dense fused experts, nor a ``ModuleList`` of gated
            MLPs); the message says what it is.
        NotImplementedError: a known kind with a variant comet does not compute yet
            (biases, activation, clamped SwiGLU, post-expert norm, ungated, ...); the
            message names every such variant.
    """
    where = where or type(experts).__name__
    cls = type(experts).__name__
    registry = is_registry_experts(experts)
    fused = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
    dense = not registry and fused and _single_input_forward(experts)
    # Not dispatched through the registry but called like registry experts, with a gate
    # function of their own (Step-3.7): the gate and forward probes decide.
    routed = registry or (fused and not dense and callable(getattr(experts, "_apply_gate", None))
                          and _routed_signature(experts))
    if routed or dense:
        transposed = bool(getattr(experts, "is_transposed", False))
        if not registry:  # infer the layout from the shapes
            transposed = _fused_shapes(experts, True) is not None
        if registry and not getattr(experts, "has_gate", True):
            _refuse(where, _fused_reasons(experts, registry))
        sizes = _fused_shapes(experts, transposed)
        if sizes is None:
            raise TypeError(f"{where}: {cls} has no gate_up_proj / down_proj pair of 3-D "
                            "expert weights comet can read")
        reasons = _fused_reasons(experts, registry or routed)
        if reasons:
            _refuse(where, reasons)
        spec = ExpertsSpec("routed" if routed else "dense",
                           ExpertLayout("fused", transposed=transposed), *sizes)
        _probe_forward(experts, spec, where)
        return spec
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        first = experts[0]
        kinds = sorted({type(e).__name__ for e in experts})
        identity = sum(isinstance(e, nn.Identity) for e in experts)
        if identity and identity < len(experts):
            _refuse(where, [f"{identity} identity ('zero-computation') experts next to the "
                            f"{len(experts) - identity} routed ones are not supported yet"])
        if len(kinds) > 1:
            raise TypeError(f"{where}: per-expert modules of several kinds ({', '.join(kinds)})")
        for names in _LINEAR_NAMES:
            if all(isinstance(getattr(first, n, None), nn.Linear) for n in names):
                reasons = []
                if any(getattr(e, n).bias is not None for e in experts for n in names):
                    reasons.append("expert biases (nn.Linear bias) are not supported yet")
                act = getattr(first, "act_fn", None)
                if act is None or not _is_silu(act, *_param_home(first)):
                    name = activation_name(act, first) if act is not None else "?"
                    reasons.append(f"activation {name} is not SiLU")
                if reasons:
                    _refuse(where, reasons)
                f, h = getattr(first, names[0]).weight.shape
                return ExpertsSpec("legacy", ExpertLayout("linear", names=names),
                                   len(experts), h, f)
        raise TypeError(f"{where}: per-expert modules {', '.join(kinds)} are not gated MLPs "
                        "(gate_proj/up_proj/down_proj or w1/w3/w2 nn.Linear)")
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    identity = [n for n, m in experts.named_children() if isinstance(m, nn.Identity)]
    if (identity and isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)
            and gu.dim() == dn.dim() == 3 and gu.shape[0] > dn.shape[0]):
        _refuse(where, [f"{gu.shape[0] - dn.shape[0]} identity ('zero-computation') experts "
                        f"({', '.join(identity)}) next to the {dn.shape[0]} routed ones are "
                        "not supported yet"])
    shapes = _summarise_parameters(experts)
    raise TypeError(
        f"{where}: experts module {cls} ({shapes or 'no parameters'}) is neither dispatched "
        "through transformers' experts registry (3-D gate_up_proj/down_proj) nor a "
        "ModuleList of gated MLPs")


def _summarise_parameters(module: nn.Module, most: int = 4) -> str:
    """``name [shape]`` of a module's parameters, per-expert copies folded
    (``expert_*.fc1.weight [64, 64] x8``), at most ``most`` entries."""
    groups: dict[str, list] = {}
    for name, p in module.named_parameters():
        key = re.sub(r"(?<![A-Za-z])\d+", "*", name) + f" {list(p.shape)}"
        groups.setdefault(key, []).append(name)
    parts = [k + (f" x{len(v)}" if len(v) > 1 else "") for k, v in groups.items()]
    if len(parts) > most:
        parts = parts[:most] + [f"... ({len(parts) - most} more)"]
    return ", ".join(parts)


def _probe_forward(experts: nn.Module, spec: ExpertsSpec, where: str) -> None:
    """Run the experts' own eager forward on a few probe rows and compare with
    :func:`comet.reference.moe_forward` on the same weights; NotImplementedError if they
    differ (then the module computes something comet does not). Skipped for weights on
    the meta device."""
    w = experts.gate_up_proj
    if w.device.type == "meta":
        return
    e, h = spec.num_experts, spec.hidden_size
    gen = torch.Generator().manual_seed(1)
    w13, w2 = _fused_to_kernel(experts.gate_up_proj, experts.down_proj, spec.layout.transposed)
    forward = inspect.unwrap(type(experts).forward)
    with torch.no_grad():
        if spec.mode == "routed":
            picks = sorted({0, e - 1})        # two experts: cheap for any model size
            ids = torch.tensor([[picks[0]], [picks[-1]], [picks[-1]]], device=w.device)
            x = torch.randn(3, h, generator=gen).to(device=w.device, dtype=w.dtype)
            weights = torch.tensor([[0.75], [0.5], [1.25]], device=w.device, dtype=w.dtype)
            got = forward(experts, x, ids, weights)
        else:
            x = torch.randn(e, 2, h, generator=gen)
            x[:, 1] = 0.0                       # a zero row per expert, as unrouted slots are
            x = x.reshape(e * 2, h).to(device=w.device, dtype=w.dtype)
            ids = torch.arange(e, device=w.device).repeat_interleave(2).unsqueeze(1)
            weights = torch.ones(e * 2, 1, device=w.device, dtype=w.dtype)
            got = forward(experts, x)
        want = reference.moe_forward(x, ids, weights, w13, w2, round_to=x.dtype)
    tol = 1e-4 if w.dtype == torch.float32 else 5e-2
    scale = want.abs().max().clamp_min(1e-6)
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape
            and (got.float() - want).abs().max() <= tol * scale):
        raise NotImplementedError(
            f"comet cannot run the experts of {where}: {type(experts).__name__}.forward does "
            "not compute the SiLU-gated MLP comet runs (checked on probe rows)")


def expert_layout(experts: nn.Module) -> ExpertLayout:
    """The storage layout of a supported experts module (see :func:`inspect_experts`)."""
    return inspect_experts(experts).layout


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

    Called the way the replaced module was called, it runs the experts on comet through
    the block that owns it (:meth:`comet.CometMoE.experts_forward`):
    ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    (registry experts) or ``experts(routed_in [E*T, H]) -> [E*T, H]`` (dense experts).

    ``state_dict()`` writes ``gate_up_proj``/``down_proj`` (fused layout; with EP, this
    rank's ``[El, ...]`` slice) or ``{e}.{gate,up,down}.weight`` for this rank's experts
    under their *global* index ``e`` (per-expert layout). ``load_state_dict()`` accepts
    either layout: full ``[E, ...]`` fused tensors are sliced to this rank, per-expert keys
    of other ranks' experts are dropped. The saved tensors are copies, not views of the
    parameters.
    """

    _comet_block = None     # the owning CometMoEBlock (a plain attribute, not a child)

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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The replaced experts module's call, computed by comet (see the class doc)."""
        block = self._comet_block
        if block is None:
            raise RuntimeError("these experts are not attached to a CometMoEBlock "
                               "(build them with comet.integrations.from_module)")
        return block.call_experts(hidden_states, top_k_index, top_k_weights)

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
        fused = {k: state_dict.pop(prefix + k) for k in _FUSED_KEYS if prefix + k in state_dict}
        linear = {}
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.(\w+)\.weight$")
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = pattern.match(key)
            if m and any(m.group(2) in names for names in _LINEAR_NAMES):
                linear[(int(m.group(1)), m.group(2))] = state_dict.pop(key)
        if not fused and not linear and self.layout.kind == "fused":
            missing_keys.extend(prefix + k for k in _FUSED_KEYS)
        if fused:
            self._load_fused(fused, w13, w2, prefix, missing_keys, error_msgs)
        if linear or not fused and self.layout.kind == "linear":
            self._load_linear(linear, w13, w2, prefix, missing_keys, unexpected_keys)
        state_dict[prefix + "w13"], state_dict[prefix + "w2"] = w13, w2

    def _load_fused(self, fused, w13, w2, prefix, missing_keys, error_msgs) -> None:
        el, lo = w13.shape[0], self.first_expert
        if len(fused) < 2:
            missing_keys.extend(prefix + k for k in _FUSED_KEYS if k not in fused)
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
