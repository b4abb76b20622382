"""Which gated activation a transformers experts module computes, and on which columns.

comet's kernels compute the gated activations of :mod:`comet.activation`
(:class:`~comet.activation.GatedActivation`): SiLU, GELU-tanh, the clamped SiLU gate
(DeepSeek-V4, GLM-5) and GPT-OSS's clamped SwiGLU with ``up + 1``. A transformers module
states which one it computes only in code, so it is found by probing, not by class name:

* the candidates are read from what the module holds (:func:`candidates`): its activation
  function (``act_fn`` or ``activation_fn``, probed on values from -40 to 40: SiLU or
  GELU-tanh), its clamp bound (``limit`` / ``swiglu_limit``) and sigmoid slope
  (``alpha`` / ``swiglu_alpha``), with and without GPT-OSS's ``up + 1``;
* the module's gate function (``_apply_gate``, else its activation on the two halves of a
  gate-up row) runs on probe rows that reach past any clamp bound, and the candidate and
  gate/up column order (concatenated ``[gate | up]`` or alternating, GPT-OSS's
  ``[g0, u0, g1, u1, ...]``) that reproduce it in fp32 are taken (:func:`match_gate`);
* where none does, :func:`gate_refusal` / :func:`gate_function_refusal` /
  :func:`ungated_reason` say why (a soft cap, an activation of another kind, no gate).

This is one step of recognising an experts module
(:func:`comet.integrations.experts.inspect_experts`), kept apart because it reads only the
gate function: the experts' whole forward, weights included, is checked afterwards
against :mod:`comet.reference` with what is found here.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from comet.activation import GatedActivation, gated

#: Attributes a module keeps its activation function in (transformers' names).
_ACTIVATION_ATTRS = ("act_fn", "activation_fn")

#: The activation kinds comet computes (:class:`comet.activation.GatedActivation`).
_KINDS = ("silu", "gelu_tanh")

#: How a gate-up row ``[..., 2F]`` splits into ``(gate, up)``, by column order.
_GATE_UP_SPLITS = {
    "concatenated": lambda t: t.chunk(2, dim=-1),
    "alternating": lambda t: (t[..., 0::2], t[..., 1::2]),
}


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


def _activation_attr(owner) -> str | None:
    """The attribute of :data:`_ACTIVATION_ATTRS` that ``owner`` sets, or None."""
    return next((a for a in _ACTIVATION_ATTRS if getattr(owner, a, None) is not None), None)


def activation_of(owner):
    """``owner``'s activation function (``act_fn`` or ``activation_fn``), or None."""
    attr = _activation_attr(owner)
    return None if attr is None else getattr(owner, attr)


def param_home(module: nn.Module) -> torch.device:
    """Device to probe ``module``'s functions on (the CPU for meta weights)."""
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- candidates
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


def clamp_limit(owner) -> float | None:
    """``owner``'s clamp bound (``limit`` / ``swiglu_limit``), or None."""
    return _positive_number(owner, "limit", "swiglu_limit")


def candidates(owner: nn.Module) -> list[GatedActivation]:
    """The gated activations ``owner`` may compute, from what it holds: its activation
    function's kind (both kinds when it has none), its clamp bound and sigmoid slope if
    set, with and without GPT-OSS's ``up + 1``. Probing picks among them; none fits an
    activation function of another kind."""
    act = activation_of(owner)
    kinds = list(_KINDS) if act is None else _act_kinds(act, param_home(owner))
    limit = clamp_limit(owner)
    alpha = _positive_number(owner, "alpha", "swiglu_alpha")
    found = []
    for kind, a, lim, offset in itertools.product(kinds, dict.fromkeys((1.0, alpha or 1.0)),
                                                  dict.fromkeys((None, limit)), (0.0, 1.0)):
        if kind == "silu" or a == 1.0:
            found.append(GatedActivation(kind, a, lim, offset))
    return found


# --------------------------------------------------------------------------- gate function
@dataclass(frozen=True)
class GateMatch:
    """What a gate function was found to compute: ``activation`` on gate and up columns
    in ``order`` (a key of :data:`_GATE_UP_SPLITS`)."""

    activation: GatedActivation
    order: str = "concatenated"


def gate_function(owner: nn.Module):
    """``gate_up [..., 2F] -> h [..., F]`` as ``owner`` computes it: its ``_apply_gate``
    (registry experts, Step-3.7), else its activation function on the concatenated halves
    (Llama-4's dense experts, DBRX's stacked ones). None when it has neither."""
    apply_gate = getattr(owner, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate
    act = activation_of(owner)
    if act is None:
        return None

    def act_gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return act_gate


def match_gate(owner: nn.Module) -> GateMatch | None:
    """The candidate activation and column order that ``owner``'s gate function computes
    on probe rows (fp32, values up to 40 or twice the clamp bound, so the clamps bite), or
    None."""
    gate_fn = gate_function(owner)
    if gate_fn is None:
        return None
    device = param_home(owner)
    span = max(40.0, 2 * (clamp_limit(owner) or 0.0))
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
        for act in candidates(owner):
            if torch.allclose(got.float(), gated(gate, up, act), rtol=1e-5, atol=1e-4):
                return GateMatch(act, order)
    return None


# --------------------------------------------------------------------------- refusals
def gate_refusal(owner: nn.Module, what: str) -> str:
    """Why no gated activation comet computes matches ``owner``'s ``what`` (its gate
    function or forward): a soft cap, an activation function of another kind, or none of
    the candidates fits."""
    act = activation_of(owner)
    caps = sorted(n for n in list(vars(act)) + list(getattr(act, "_modules", {}))
                  if "softcap" in n.lower()) if act is not None else []
    if caps:
        return (f"soft-capped SwiGLU ({type(act).__name__}: {', '.join(caps)}) "
                "is not supported yet")
    found = candidates(owner)
    if act is not None and not found:
        return f"activation {activation_name(act, owner)} is not SiLU or GELU-tanh"
    tried = ", ".join(c.describe() for c in found)
    return (f"{what} computes none of the gated activations comet runs (tried {tried} on "
            "concatenated and alternating gate/up columns): not supported yet")


def gate_function_refusal(owner: nn.Module) -> str:
    """Why ``owner``'s gate function (:func:`gate_function`) matches no candidate, naming
    that function."""
    cls = type(owner).__name__
    if callable(getattr(owner, "_apply_gate", None)):
        return gate_refusal(owner, f"gate function {cls}._apply_gate")
    attr = _activation_attr(owner)
    if attr is not None:
        return gate_refusal(owner, f"{cls}.{attr}(gate) * up")
    return f"{cls} has no gate function (_apply_gate, {' or '.join(_ACTIVATION_ATTRS)})"


def ungated_reason(experts: nn.Module) -> str:
    """The refusal of experts without a gate projection (``up -> act -> down``)."""
    act = activation_of(experts)
    name = activation_name(act, experts) if act is not None else "act_fn"
    return f"ungated experts (up_proj -> {name} -> down_proj) are not supported yet"
