"""Recognising a transformers experts module, finding the function it computes among those
comet runs, and holding this rank's experts in the kernels' layout.

:func:`inspect_experts` accepts three kinds (see :mod:`comet.integrations.blocks`):
registry-dispatched fused experts (``"routed"``), Llama-4's dense fused experts
(``"dense"``) and per-expert ``ModuleList`` s of gated MLPs (``"legacy"``). Within them it
converts the expert variants comet computes, recognised by structure and probing, not by
class name:

* the gated activation (:class:`comet.activation.GatedActivation`): SiLU, GELU-tanh, the
  clamped SiLU gate (DeepSeek-V4, GLM-5), GPT-OSS's clamped SwiGLU with ``up + 1``.
  Candidates are read from the module (its ``act_fn``, ``limit`` / ``swiglu_limit``,
  ``alpha`` / ``swiglu_alpha``); the one its gate function (or, per-expert MLPs, its
  forward) computes on probe values is taken;
* expert biases (``gate_up_proj_bias`` / ``down_proj_bias``, ``nn.Linear`` biases; a
  projection without one gets zeros);
* gate and up columns concatenated (``[gate | up]``) or alternating (GPT-OSS:
  ``[g0, u0, g1, u1, ...]``), whichever the gate function reads.

Every other variant -- a soft-capped or otherwise unknown gate, a norm after each expert,
ungated experts, identity experts -- is refused with a :class:`NotImplementedError` that
names it; the module's own eager forward is finally run on probe rows against
:mod:`comet.reference` with what was found. Anything else is a :class:`TypeError`.

:class:`TransformersExperts` replaces the experts module inside a converted block: this
rank's experts (``w13 [El, H, 2F]`` interleaved, ``w2 [El, F, H]``, and the biases
``b13 [El, 2F]`` / ``b2 [El, H]`` where the module had them), checkpointed under the
replaced module's keys and layout, and called the way the block called the original.
"""

from __future__ import annotations

import inspect
import itertools
import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from comet import reference
from comet.activation import SILU, GatedActivation, gated
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


def _param_home(module: nn.Module) -> torch.device:
    """Device to probe ``module``'s functions on (the CPU for meta weights)."""
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- activation
#: The activation kinds comet computes (:class:`comet.activation.GatedActivation`).
_KINDS = ("silu", "gelu_tanh")

#: How a gate-up row ``[..., 2F]`` splits into ``(gate, up)``, by column order.
_GATE_UP_SPLITS = {
    "concatenated": lambda t: t.chunk(2, dim=-1),
    "alternating": lambda t: (t[..., 0::2], t[..., 1::2]),
}


def _act_kinds(act, device) -> list[str]:
    """The kinds of :data:`_KINDS` that ``act`` (one tensor in, one out) computes on
    values from -40 to 40 (none where it computes another function or takes other
    arguments)."""
    probe = torch.linspace(-40.0, 40.0, 161, device=device)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001 - a function we cannot probe is not one we run
        return []
    if not (isinstance(got, torch.Tensor) and got.shape == probe.shape):
        return []
    ones = torch.ones_like(probe)
    return [k for k in _KINDS if torch.allclose(
        got.float(), gated(probe, ones, GatedActivation(kind=k)), rtol=1e-5, atol=1e-5)]


def _positive_number(owner, *names: str) -> float | None:
    """The first of ``names`` that ``owner`` sets to a finite positive number (an infinite
    clamp bound, as Step-3.7 keeps for "no clamp", is none)."""
    for name in names:
        value = getattr(owner, name, None)
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            return float(value)
    return None


def _clamp_limit(owner) -> float | None:
    return _positive_number(owner, "limit", "swiglu_limit")


def _candidates(owner, act, device) -> list[GatedActivation]:
    """The gated activations ``owner`` may compute, from what it holds: its ``act_fn``'s
    kind (both kinds when it has none), its clamp bound and sigmoid slope if set, with and
    without GPT-OSS's ``up + 1``. Probing picks among them; none fits an ``act_fn`` of
    another kind."""
    kinds = list(_KINDS) if act is None else _act_kinds(act, device)
    limit = _clamp_limit(owner)
    alpha = _positive_number(owner, "alpha", "swiglu_alpha")
    found = []
    for kind, a, lim, offset in itertools.product(kinds, dict.fromkeys((1.0, alpha or 1.0)),
                                                  dict.fromkeys((None, limit)), (0.0, 1.0)):
        if kind == "silu" or a == 1.0:
            found.append(GatedActivation(kind, a, lim, offset))
    return found


@dataclass(frozen=True)
class GateMatch:
    """What a gate function was found to compute: ``activation`` on gate and up columns
    in ``order`` (a key of :data:`_GATE_UP_SPLITS`)."""

    activation: GatedActivation
    order: str = "concatenated"


def _gate_function(experts: nn.Module):
    """``gate_up [..., 2F] -> h [..., F]`` as the fused experts compute it: their
    ``_apply_gate`` (registry experts, Step-3.7), else ``act_fn`` on the concatenated
    halves (Llama-4's dense experts). None when they have neither."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate
    act = getattr(experts, "act_fn", None)
    if act is None:
        return None

    def act_gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return act_gate


def _match_gate(experts: nn.Module) -> GateMatch | None:
    """The candidate activation and column order that the experts' gate function computes
    on probe rows (fp32, values up to 40 or twice the clamp bound, so the clamps bite), or
    None."""
    gate_fn = _gate_function(experts)
    if gate_fn is None:
        return None
    device = _param_home(experts)
    candidates = _candidates(experts, getattr(experts, "act_fn", None), device)
    span = max(40.0, 2 * (_clamp_limit(experts) or 0.0))
    gen = torch.Generator().manual_seed(0)
    probe = (torch.randn(64, 32, generator=gen) * 0.3 * span).clamp(-span, span)
    probe[0] = torch.linspace(-span, span, 32)
    probe = probe.to(device)
    try:
        with torch.no_grad():
            got = gate_fn(probe)
    except Exception:  # noqa: BLE001 - refused by the caller, with what we know
        return None
    if not (isinstance(got, torch.Tensor) and got.shape == (64, 16)):
        return None
    for order, split in _GATE_UP_SPLITS.items():
        gate, up = split(probe)
        for act in candidates:
            if torch.allclose(got.float(), gated(gate, up, act), rtol=1e-5, atol=1e-4):
                return GateMatch(act, order)
    return None


def _gate_refusal(owner: nn.Module, what: str) -> str:
    """Why no gated activation comet computes matches ``owner``'s ``what`` (its gate
    function or forward): a soft cap, an ``act_fn`` of another kind, or none of the
    candidates fits."""
    act = getattr(owner, "act_fn", None)
    caps = sorted(n for n in list(vars(act)) + list(getattr(act, "_modules", {}))
                  if "softcap" in n.lower()) if act is not None else []
    if caps:
        return (f"soft-capped SwiGLU ({type(act).__name__}: {', '.join(caps)}) "
                "is not supported yet")
    candidates = _candidates(owner, act, _param_home(owner))
    if act is not None and not candidates:
        return f"activation {activation_name(act, owner)} is not SiLU or GELU-tanh"
    tried = ", ".join(c.describe() for c in candidates)
    return (f"{what} computes none of the gated activations comet runs (tried {tried} on "
            "concatenated and alternating gate/up columns): not supported yet")


# --------------------------------------------------------------------------- layout
#: The three projections of a gated expert, as :attr:`ExpertLayout.biases` names them.
_PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLayout:
    """How the replaced experts module stores its weights (and so its checkpoint keys).

    ``kind == "fused"``: ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``, or
    ``[E, H, 2F]`` / ``[E, F, H]`` when ``transposed``; biases ``gate_up_proj_bias
    [E, 2F]`` and ``down_proj_bias [E, H]``.
    ``kind == "linear"``: per-expert ``{e}.{gate|up|down}.weight`` (and ``.bias``) of
    ``nn.Linear`` (``[F, H]``, ``[F, H]``, ``[H, F]``), ``names`` being ``(gate, up, down)``.

    ``gate_up``: the order of the gate and up columns (rows when not transposed) of the
    fused ``2F`` dimension, weights and bias alike: ``"concatenated"`` (all gate, then all
    up) or ``"alternating"`` (GPT-OSS: gate ``0::2``, up ``1::2``). ``biases``: the
    projections (of :data:`_PARTS`) that carry a bias; comet holds zeros for the others.
    """

    kind: str
    transposed: bool = False
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    gate_up: str = "concatenated"
    biases: frozenset[str] = field(default_factory=frozenset)


_LINEAR_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
_FUSED_KEYS = ("gate_up_proj", "down_proj")
#: Fused bias keys and the projections they belong to.
_FUSED_BIASES = {"gate_up_proj_bias": ("gate", "up"), "down_proj_bias": ("down",)}


def _gate_then_up(t: torch.Tensor, order: str) -> torch.Tensor:
    """A ``[..., 2F]`` tensor with gate/up columns in ``order`` -> gate columns, then up
    columns (``t`` itself when already so)."""
    if order == "alternating":
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    return t


def _models_order(t: torch.Tensor, order: str) -> torch.Tensor:
    """Inverse of :func:`_gate_then_up`: gate-then-up ``[..., 2F]`` -> ``order``."""
    if order == "alternating":
        f = t.shape[-1] // 2
        return torch.stack([t[..., :f], t[..., f:]], dim=-1).flatten(-2)
    return t


def is_registry_experts(experts: nn.Module) -> bool:
    """``experts`` is dispatched through transformers' experts registry (its class was
    decorated with ``@use_experts_implementation``)."""
    forward = getattr(type(experts), "forward", None)
    return (callable(getattr(forward, "__wrapped__", None))
            and all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed")))


def _fused_bias_parts(experts: nn.Module, registry: bool,
                      sizes: tuple[int, int, int]) -> tuple[frozenset[str], list[str]]:
    """The projections a fused experts module has biases for, and why its biases cannot be
    taken (wrong shapes). Registry experts add their biases iff ``has_bias``: without it
    any bias parameter is extra state, reported by :func:`_fused_reasons`."""
    if registry and not getattr(experts, "has_bias", False):
        return frozenset(), []
    e, h, f = sizes
    want = {"gate_up_proj_bias": (e, 2 * f), "down_proj_bias": (e, h)}
    parts, reasons = set(), []
    for key, shape in want.items():
        bias = getattr(experts, key, None)
        if not isinstance(bias, torch.Tensor):
            continue
        if tuple(bias.shape) != shape:
            reasons.append(f"expert bias {key} {list(bias.shape)} is not {list(shape)}")
        parts.update(_FUSED_BIASES[key])
    return frozenset(parts), reasons


def _ungated_reason(experts: nn.Module) -> str:
    act = getattr(experts, "act_fn", None)
    name = activation_name(act, experts) if act is not None else "act_fn"
    return f"ungated experts (up_proj -> {name} -> down_proj) are not supported yet"


def _fused_reasons(experts: nn.Module, biases: frozenset[str]) -> list[str]:
    """Why comet cannot run a gated fused experts module, its gate function and biases
    aside (empty: it can)."""
    reasons = []
    if getattr(experts, "has_post_expert_norm", False):
        norm = getattr(experts, "post_expert_norm", None)
        reasons.append(f"a norm after each expert (post_expert_norm: {type(norm).__name__}) "
                       "is not supported yet")
    known = set(_FUSED_KEYS) | {k for k, parts in _FUSED_BIASES.items() if biases & set(parts)}
    names = [n for n, _ in experts.named_parameters()] + [n for n, _ in experts.named_buffers()]
    extra = [n for n in names if n not in known and not n.startswith("post_expert_norm")]
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
        layout: weight storage (gate/up order and biases included), see
            :class:`ExpertLayout`.
        num_experts, hidden_size, intermediate_size: E, H, F.
        activation: the experts' gated activation.
    """

    mode: str
    layout: ExpertLayout
    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: GatedActivation = SILU


def _refuse(where: str, reasons: list[str]):
    raise NotImplementedError(f"comet cannot run the experts of {where}: " + "; ".join(reasons))


def inspect_experts(experts: nn.Module, where: str | None = None) -> ExpertsSpec:
    """Recognise an experts module and find the function comet runs for it: layout,
    gated activation, biases (see the module doc).

    Raises:
        TypeError: not an experts module comet knows (neither registry-dispatched fused
            experts, nor Llama-4-style dense fused experts, nor a ``ModuleList`` of gated
            MLPs); the message says what it is.
        NotImplementedError: a known kind with a variant comet does not compute yet
            (a gate function matching none of its activations, post-expert norm, ungated,
            ...); the message names every such variant.
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
        return _inspect_fused(experts, where, registry, dense)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        kinds = sorted({type(e).__name__ for e in experts})
        identity = sum(isinstance(e, nn.Identity) for e in experts)
        if identity and identity < len(experts):
            _refuse(where, [f"{identity} identity ('zero-computation') experts next to the "
                            f"{len(experts) - identity} routed ones are not supported yet"])
        if len(kinds) > 1:
            raise TypeError(f"{where}: per-expert modules of several kinds ({', '.join(kinds)})")
        for names in _LINEAR_NAMES:
            if all(isinstance(getattr(experts[0], n, None), nn.Linear) for n in names):
                return _inspect_linear(experts, names, where)
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


def _inspect_fused(experts: nn.Module, where: str, registry: bool, dense: bool) -> ExpertsSpec:
    """:func:`inspect_experts` of fused (3-D ``gate_up_proj`` / ``down_proj``) experts."""
    cls = type(experts).__name__
    if registry and not getattr(experts, "has_gate", True):
        _refuse(where, [_ungated_reason(experts)])
    transposed = bool(getattr(experts, "is_transposed", False))
    if not registry:  # infer the layout from the shapes
        transposed = _fused_shapes(experts, True) is not None
    sizes = _fused_shapes(experts, transposed)
    if sizes is None:
        raise TypeError(f"{where}: {cls} has no gate_up_proj / down_proj pair of 3-D "
                        "expert weights comet can read")
    biases, reasons = _fused_bias_parts(experts, registry, sizes)
    reasons += _fused_reasons(experts, biases)
    if dense and biases:
        reasons.append("expert biases on dense experts (called as experts(routed_in)) are "
                       "not supported: comet skips the all-zero rows of unrouted slots, "
                       "which a bias would not leave zero")
    match = _match_gate(experts)
    if match is None:
        reasons.append(_fused_gate_refusal(experts))
    if reasons:
        _refuse(where, reasons)
    layout = ExpertLayout("fused", transposed=transposed, gate_up=match.order, biases=biases)
    spec = ExpertsSpec("dense" if dense else "routed", layout, *sizes,
                       activation=match.activation)
    _probe_forward(experts, spec, where)
    return spec


def _fused_gate_refusal(experts: nn.Module) -> str:
    """Why the fused experts' gate function matches no candidate activation."""
    cls = type(experts).__name__
    if callable(getattr(experts, "_apply_gate", None)):
        return _gate_refusal(experts, f"gate function {cls}._apply_gate")
    if getattr(experts, "act_fn", None) is not None:
        return _gate_refusal(experts, f"{cls}.act_fn(gate) * up")
    return f"{cls} has no gate function (_apply_gate or act_fn)"


def _inspect_linear(experts: nn.ModuleList, names: tuple[str, str, str],
                    where: str) -> ExpertsSpec:
    """:func:`inspect_experts` of a ``ModuleList`` of gated MLPs with ``nn.Linear``
    projections ``names``: its biases, and the activation its forward computes."""
    first = experts[0]
    f, h = getattr(first, names[0]).weight.shape
    biases = frozenset(part for part, n in zip(_PARTS, names)
                       if any(getattr(m, n).bias is not None for m in experts))
    layout = ExpertLayout("linear", names=names, biases=biases)
    activation = _linear_activation(experts, layout)
    if activation is None:
        _refuse(where, [_gate_refusal(first, f"per-expert MLP {type(first).__name__}.forward")])
    return ExpertsSpec("legacy", layout, len(experts), h, f, activation)


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


# --------------------------------------------------------------------------- forward probes
def _probe_span(limit: float | None) -> float:
    """Largest gate/up pre-activation of the forward probes: past any clamp bound."""
    return 2.0 * limit if limit else 8.0


def _scaled(x: torch.Tensor, pre: torch.Tensor, span: float) -> torch.Tensor:
    """``x`` scaled so that the largest pre-activation ``pre`` it gave reaches ``span``
    (random weights alone rarely reach a clamp bound)."""
    return x * (span / pre.float().abs().max().clamp_min(1e-6)).to(x.dtype)


def _matches(got, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """``got`` is ``want`` within the probes' tolerance (relative to ``want``'s largest)."""
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    scale = want.abs().max().clamp_min(1e-6)
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and bool((got.float() - want).abs().max() <= tol * scale))


def _probe_forward(experts: nn.Module, spec: ExpertsSpec, where: str) -> None:
    """Run the experts' own eager forward on a few probe rows and compare with
    :func:`comet.reference.moe_forward` on the same weights, activation and biases;
    NotImplementedError if they differ (then the module computes something comet does
    not). Skipped for weights on the meta device."""
    w = experts.gate_up_proj
    if w.device.type == "meta":
        return
    e, h = spec.num_experts, spec.hidden_size
    gen = torch.Generator().manual_seed(1)
    span = _probe_span(spec.activation.limit)
    forward = inspect.unwrap(type(experts).forward)
    with torch.no_grad():
        if spec.mode == "routed":
            picks = sorted({0, e - 1})        # two experts: cheap for any model size
            w13, w2, b13, b2 = _picked(experts, spec.layout, picks)
            local = torch.tensor([[0], [len(picks) - 1], [len(picks) - 1]], device=w.device)
            x = torch.randn(3, h, generator=gen).to(device=w.device, dtype=w.dtype)
            x = _scaled(x, torch.einsum("th,ehf->etf", x.float(), w13.float()), span)
            weights = torch.tensor([[0.75], [0.5], [1.25]], device=w.device, dtype=w.dtype)
            got = forward(experts, x, torch.tensor(picks, device=w.device)[local], weights)
        else:
            w13, w2 = reference_weights(experts, spec.layout, 0, e)
            b13, b2 = reference_biases(experts, spec.layout, 0, e)
            x = torch.randn(e, 2, h, generator=gen)
            x[:, 1] = 0.0                       # a zero row per expert, as unrouted slots are
            x = x.to(device=w.device, dtype=w.dtype)
            x = _scaled(x, torch.bmm(x.float(), w13.float()), span).reshape(e * 2, h)
            local = torch.arange(e, device=w.device).repeat_interleave(2).unsqueeze(1)
            weights = torch.ones(e * 2, 1, device=w.device, dtype=w.dtype)
            got = forward(experts, x)
        want = reference.moe_forward(x, local, weights, w13, w2, round_to=x.dtype,
                                     activation=spec.activation, b13=b13, b2=b2)
    if not _matches(got, want, w.dtype):
        raise NotImplementedError(
            f"comet cannot run the experts of {where}: {type(experts).__name__}.forward does "
            f"not compute the gated MLP comet runs ({_describe_variant(spec)}; checked on "
            "probe rows)")


def _describe_variant(spec: ExpertsSpec) -> str:
    """``silu(alpha=1.702, limit=7, up+1), biases on gate/up/down, gate/up alternating``."""
    biases = "/".join(p for p in _PARTS if p in spec.layout.biases) or "none"
    return (f"{spec.activation.describe()}, biases on {biases}, "
            f"gate/up {spec.layout.gate_up}")


def _picked(experts: nn.Module, layout: ExpertLayout, picks: list[int]):
    """``(w13, w2, b13, b2)`` of the experts ``picks`` in the reference layout (the biases
    None without any)."""
    parts = [reference_weights(experts, layout, i, i + 1)
             + reference_biases(experts, layout, i, i + 1) for i in picks]
    return tuple(None if t[0] is None else torch.cat(t) for t in zip(*parts))


def _linear_activation(experts: nn.ModuleList, layout: ExpertLayout) -> GatedActivation | None:
    """The candidate activation (:func:`_candidates`) with which the first and the last
    expert's own forward matches :func:`comet.reference.expert_mlp` on probe rows, or None.
    For weights on the meta device (nothing to probe) the plainest candidate."""
    first = experts[0]
    candidates = _candidates(first, getattr(first, "act_fn", None), _param_home(first))
    w = getattr(first, layout.names[0]).weight
    if w.device.type == "meta" or not candidates:
        return candidates[0] if candidates else None
    gen = torch.Generator().manual_seed(1)
    probes = []
    with torch.no_grad():
        for i in sorted({0, len(experts) - 1}):
            w13, w2 = reference_weights(experts, layout, i, i + 1)
            b13, b2 = reference_biases(experts, layout, i, i + 1)
            x = torch.randn(8, w13.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
            x = _scaled(x, x.float() @ w13[0].float(), _probe_span(_clamp_limit(first)))
            probes.append((x, experts[i](x), w13[0], w2[0], b13, b2))
        for act in candidates:
            if all(_matches(got, reference.expert_mlp(
                    x, w13, w2, round_to=x.dtype, activation=act,
                    b13=None if b13 is None else b13[0], b2=None if b2 is None else b2[0]),
                    w.dtype) for x, got, w13, w2, b13, b2 in probes):
                return act
    return None


# --------------------------------------------------------------------------- weights
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
                     layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused transformers tensors (any leading expert count) -> ``(w13 [.., H, 2F]``
    gate-then-up, ``w2 [.., F, H])``: views, but for alternating gate/up columns."""
    if not layout.transposed:
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    return _gate_then_up(gate_up, layout.gate_up), down


def _linear_to_kernel(gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ``nn.Linear`` weights ``[F, H], [F, H], [H, F]`` -> ``([H, 2F], [F, H])``."""
    return torch.cat([gate, up], dim=0).t(), down.t()


def reference_weights(experts: nn.Module, layout: ExpertLayout, lo: int,
                       hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[lo, hi)`` as :mod:`comet.reference` takes them: ``w13 [n, H, 2F]``
    gate-then-up and ``w2 [n, F, H]`` (views of fused concatenated weights; autograd
    reaches the module's parameters either way)."""
    if layout.kind == "fused":
        return _fused_to_kernel(experts.gate_up_proj[lo:hi], experts.down_proj[lo:hi], layout)
    g, u, d = layout.names
    pairs = [_linear_to_kernel(getattr(m, g).weight, getattr(m, u).weight,
                               getattr(m, d).weight) for m in experts[lo:hi]]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _bias_or_zeros(bias: torch.Tensor | None, shape: tuple[int, ...],
                   like: torch.Tensor) -> torch.Tensor:
    """``bias``, or zeros of ``shape`` for a projection without one."""
    if bias is not None:
        return bias
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def reference_biases(experts: nn.Module, layout: ExpertLayout, lo: int, hi: int
                      ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Experts ``[lo, hi)``'s biases as :mod:`comet.reference` takes them: ``b13 [n, 2F]``
    gate-then-up and ``b2 [n, H]``, zeros for a projection without one; ``(None, None)``
    when the module has no expert biases."""
    if not layout.biases:
        return None, None
    if layout.kind == "fused":
        w = experts.gate_up_proj
        _, h, f = expert_sizes(experts, layout)
        n = w[lo:hi].shape[0]
        gate_up = getattr(experts, "gate_up_proj_bias", None)
        down = getattr(experts, "down_proj_bias", None)
        b13 = _bias_or_zeros(None if gate_up is None else gate_up[lo:hi], (n, 2 * f), w)
        b2 = _bias_or_zeros(None if down is None else down[lo:hi], (n, h), w)
        return _gate_then_up(b13, layout.gate_up), b2
    b13, b2 = [], []
    for m in experts[lo:hi]:
        gate, up, down = (getattr(m, n) for n in layout.names)
        w = gate.weight
        b13.append(torch.cat([_bias_or_zeros(gate.bias, (gate.out_features,), w),
                              _bias_or_zeros(up.bias, (up.out_features,), w)]))
        b2.append(_bias_or_zeros(down.bias, (down.out_features,), w))
    return torch.stack(b13), torch.stack(b2)


def kernel_weights(experts: nn.Module, layout: ExpertLayout,
                   lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[lo, hi)`` of a transformers experts module as new contiguous
    ``w13 [hi-lo, H, 2F]`` (interleaved, :mod:`comet.weights`) and ``w2 [hi-lo, F, H]``."""
    with torch.no_grad():
        w13, w2 = reference_weights(experts, layout, lo, hi)
        return interleave_gate_up(w13), w2.clone(memory_format=torch.contiguous_format)


def kernel_biases(experts: nn.Module, layout: ExpertLayout, lo: int, hi: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Experts ``[lo, hi)``'s biases as new contiguous ``b13 [hi-lo, 2F]`` (columns
    interleaved as ``w13``'s) and ``b2 [hi-lo, H]``, or ``(None, None)`` without any."""
    with torch.no_grad():
        b13, b2 = reference_biases(experts, layout, lo, hi)
        if b13 is None:
            return None, None
        return interleave_gate_up(b13), b2.clone(memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------- experts module
class TransformersExperts(LocalExperts):
    """This rank's experts (``w13 [El, H, 2F]`` interleaved, ``w2 [El, F, H]``, and with
    ``cfg.expert_bias`` ``b13 [El, 2F]`` / ``b2 [El, H]``; see
    :class:`comet.moe.LocalExperts`), checkpointed in the models' layout under the keys of
    the transformers experts module they replace.

    Called the way the replaced module was called, it runs the experts on comet through
    the block that owns it (:meth:`comet.CometMoE.experts_forward`):
    ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    (registry experts) or ``experts(routed_in [E*T, H]) -> [E*T, H]`` (dense experts).

    ``state_dict()`` writes ``gate_up_proj``/``down_proj`` and the biases the module had
    (``gate_up_proj_bias``/``down_proj_bias``), gate and up in the module's column order
    (fused layout; with EP, this rank's ``[El, ...]`` slice), or
    ``{e}.{gate,up,down}.weight`` (and ``.bias``) for this rank's experts under their
    *global* index ``e`` (per-expert layout). ``load_state_dict()`` accepts either layout:
    full ``[E, ...]`` fused tensors are sliced to this rank, per-expert keys of other
    ranks' experts are dropped. The saved tensors are copies, not views of the parameters.
    """

    _comet_block = None     # the owning CometMoEBlock (a plain attribute, not a child)

    def __init__(self, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor,
                 layout: ExpertLayout, first_expert: int, requires_grad: bool = True,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        super().__init__(cfg, w13.shape[0], device="meta")
        self.w13 = nn.Parameter(w13, requires_grad=requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=requires_grad)
        if cfg.expert_bias:
            self.b13 = nn.Parameter(b13, requires_grad=requires_grad)
            self.b2 = nn.Parameter(b2, requires_grad=requires_grad)
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

    # ------------------------------------------------------------------ saving
    def _checkpoint_entries(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                            b2: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """This rank's experts under the replaced module's keys, in its layout."""
        layout = self.layout
        w13 = gate_up_first(w13)   # checkpoints keep the models' layout
        b13 = None if b13 is None else gate_up_first(b13)
        if layout.kind == "fused":
            gate_up = _models_order(w13, layout.gate_up)
            out = ({"gate_up_proj": gate_up} if layout.transposed
                   else {"gate_up_proj": gate_up.transpose(1, 2).contiguous()})
            if layout.biases & {"gate", "up"}:
                out["gate_up_proj_bias"] = _models_order(b13, layout.gate_up)
            out["down_proj"] = (w2.clone() if layout.transposed
                                else w2.transpose(1, 2).contiguous())
            if "down" in layout.biases:
                out["down_proj_bias"] = b2.clone()
            return out
        f = w2.shape[1]
        out = {}
        for i in range(w13.shape[0]):
            e = self.first_expert + i
            weights = (w13[i, :, :f].t(), w13[i, :, f:].t(), w2[i].t())
            biases = (None, None, None) if b13 is None else (b13[i, :f], b13[i, f:], b2[i])
            for part, name, weight, bias in zip(_PARTS, layout.names, weights, biases):
                out[f"{e}.{name}.weight"] = weight.contiguous()
                if part in layout.biases:
                    out[f"{e}.{name}.bias"] = bias.clone()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        params = (self.w13, self.w2, self.b13, self.b2)
        if not keep_vars:
            params = tuple(None if p is None else p.detach() for p in params)
        for key, value in self._checkpoint_entries(*params).items():
            destination[prefix + key] = value

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        if prefix + "w13" not in state_dict and prefix + "w2" not in state_dict:
            self._translate_checkpoint(state_dict, prefix, missing_keys, unexpected_keys,
                                       error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _translate_checkpoint(self, state_dict, prefix, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Replace transformers expert keys under ``prefix`` by ``w13``/``w2`` (and
        ``b13``/``b2``) entries.

        The checkpoint is read into this rank's tensors in the gate-then-up layout
        (``cur``), interleaved at the end. Anything this rank lacks is reported under the
        transformers key names, and the current values stand in so torch does not report
        ``w13``/``w2`` a second time. Bias keys are taken only by experts with biases (to
        others they are unexpected, as to the replaced module).
        """
        cur = {"w13": gate_up_first(self.w13.detach()), "w2": self.w2.detach().clone()}
        if self.b13 is not None:
            cur.update(b13=gate_up_first(self.b13.detach()), b2=self.b2.detach().clone())
        fused_keys = _FUSED_KEYS + (tuple(_FUSED_BIASES) if self.b13 is not None else ())
        fused = {k: state_dict.pop(prefix + k) for k in fused_keys if prefix + k in state_dict}
        linear = {}
        kinds = "weight|bias" if self.b13 is not None else "weight"
        pattern = re.compile(re.escape(prefix) + rf"(\d+)\.(\w+)\.({kinds})$")
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = pattern.match(key)
            if m and any(m.group(2) in names for names in _LINEAR_NAMES):
                linear[(int(m.group(1)), m.group(2), m.group(3))] = state_dict.pop(key)
        if not fused and not linear and self.layout.kind == "fused":
            missing_keys.extend(prefix + k for k in self._wanted_fused_keys())
        if fused:
            self._load_fused(fused, cur, prefix, missing_keys, error_msgs)
        if linear or not fused and self.layout.kind == "linear":
            self._load_linear(linear, cur, prefix, missing_keys, unexpected_keys)
        for name, value in cur.items():
            interleaved = name in ("w13", "b13")
            state_dict[prefix + name] = interleave_gate_up(value) if interleaved else value

    def _wanted_fused_keys(self) -> list[str]:
        """The fused keys a checkpoint of these experts has: weights, and the biases of
        the projections that carry one."""
        biases = self.layout.biases if self.b13 is not None else frozenset()
        return list(_FUSED_KEYS) + [k for k, parts in _FUSED_BIASES.items()
                                    if biases & set(parts)]

    def _fused_format(self) -> ExpertLayout:
        """How fused checkpoint tensors are laid out: as this module's own when it was
        fused, else transformers 5.x's default (``[E, 2F, H]``, concatenated)."""
        return self.layout if self.layout.kind == "fused" else ExpertLayout("fused")

    def _load_fused(self, fused, cur, prefix, missing_keys, error_msgs) -> None:
        el, lo = cur["w13"].shape[0], self.first_expert
        missing_keys.extend(prefix + k for k in self._wanted_fused_keys() if k not in fused)
        # A full [E, ...] tensor is sliced to this rank; an [El, ...] one is this rank's own
        # shard as saved by state_dict() under the same expert-parallel layout.
        shard = {}
        for key, value in fused.items():
            if value.shape[0] == self.num_experts:
                shard[key] = value[lo:lo + el]
            elif value.shape[0] == el:
                shard[key] = value
            else:
                error_msgs.append(
                    f"size mismatch for {prefix}{key}: {value.shape[0]} experts in the "
                    f"checkpoint, expected {self.num_experts} (all) or {el} (this rank's shard)")
        fmt = self._fused_format()
        if "gate_up_proj" in shard and "down_proj" in shard:
            new13, new2 = _fused_to_kernel(shard["gate_up_proj"], shard["down_proj"], fmt)
            self._copy(cur, {"w13": new13, "w2": new2}, f"{prefix}gate_up_proj/down_proj",
                       error_msgs)
        if "gate_up_proj_bias" in shard:
            self._copy(cur, {"b13": _gate_then_up(shard["gate_up_proj_bias"], fmt.gate_up)},
                       f"{prefix}gate_up_proj_bias", error_msgs)
        if "down_proj_bias" in shard:
            self._copy(cur, {"b2": shard["down_proj_bias"]}, f"{prefix}down_proj_bias",
                       error_msgs)

    @staticmethod
    def _copy(cur, new, what, error_msgs) -> None:
        """Copy ``new`` into ``cur`` (same keys) when every shape fits, else report."""
        if any(new[k].shape != cur[k].shape for k in new):
            error_msgs.append(
                f"size mismatch for {what}: checkpoint gives "
                f"{'/'.join(str(tuple(v.shape)) for v in new.values())} in the reference "
                f"layout, the layer has {'/'.join(str(tuple(cur[k].shape)) for k in new)}")
            return
        for k, v in new.items():
            cur[k].copy_(v)

    def _load_linear(self, linear, cur, prefix, missing_keys, unexpected_keys) -> None:
        el, lo, f = cur["w13"].shape[0], self.first_expert, cur["w2"].shape[1]
        names = self.layout.names
        if linear and not any(n in names for _, n, _ in linear):
            names = next(ns for ns in _LINEAR_NAMES if any(n in ns for _, n, _ in linear))
        for (e, n, kind) in linear:
            if e >= self.num_experts or n not in names:
                unexpected_keys.append(f"{prefix}{e}.{n}.{kind}")
        biased = self.layout.biases if self.b13 is not None else frozenset()
        for i in range(el):
            e = lo + i
            wanted = [(e, n, "weight") for n in names] + [
                (e, n, "bias") for part, n in zip(_PARTS, names) if part in biased]
            missing_keys.extend(f"{prefix}{e}.{n}.{kind}" for e, n, kind in wanted
                                if (e, n, kind) not in linear)
            if all((e, n, "weight") in linear for n in names):
                a, b = _linear_to_kernel(*(linear[(e, n, "weight")] for n in names))
                cur["w13"][i].copy_(a)
                cur["w2"][i].copy_(b)
            if self.b13 is not None:
                slots = (cur["b13"][i, :f], cur["b13"][i, f:], cur["b2"][i])
                for n, slot in zip(names, slots):
                    if (e, n, "bias") in linear:
                        slot.copy_(linear[(e, n, "bias")])
