"""Recognising a transformers experts module: its kind, its weight layout, and whether its
forward computes what comet's kernels compute.

:func:`inspect_experts` accepts three kinds of call (see :mod:`comet.integrations.blocks`)
over three weight layouts (:class:`comet.integrations.layout.ExpertLayout`), recognised by
structure and probing, not by class name:

* ``"routed"``, called ``experts(hidden, top_k_index, top_k_weights)``: registry-dispatched
  fused experts (3-D ``gate_up_proj`` / ``down_proj``), fused experts with a gate function
  of their own and that call (Step-3.7), and stacked experts -- a child holding three 2-D
  ``[E*F, H]`` tensors for gate, up and down (DBRX's ``mlp.w1`` / ``mlp.v1`` /
  ``mlp.w2``);
* ``"dense"``, called ``experts(routed_in)``: Llama-4's fused experts;
* ``"legacy"``: per-expert ``ModuleList`` s of gated MLPs with ``nn.Linear`` projections.

Within them it converts the expert variants comet computes: the gated activation and the
gate/up column order (found by probing the gate function, :mod:`comet.integrations.gate`)
and expert biases (``gate_up_proj_bias`` / ``down_proj_bias``, ``nn.Linear`` biases; a
projection without one gets zeros). Every other variant -- a soft-capped or otherwise
unknown gate, a norm after each expert, ungated experts, identity experts, extra state --
is refused with a :class:`NotImplementedError` that names it. Last, the module's own eager
forward is run on probe rows against :mod:`comet.reference` with what was found
(:func:`_probe_forward`; per-expert MLPs: their forward picks the activation among the
candidates), so a module that computes something else is refused rather than converted
wrong. FP8 experts (transformers' ``FP8Experts``, :mod:`comet.integrations.fp8`) are
checked by their flags, dtypes, shapes and gate function, not run: their forward needs
transformers' GPU kernels. Anything that is none of the kinds, or whose weights comet cannot read, is a
:class:`TypeError`.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from comet import reference
from comet.activation import SILU, GatedActivation
from comet.integrations.fp8 import (FP8_STATE, Fp8Checkpoint, fp8_refusals,
                                    has_fp8_linear, is_fp8_experts, packed_refusal)
from comet.integrations.gate import (GateMatch, candidates, clamp_limit, gate_function,
                                     gate_function_refusal, gate_refusal, match_gate,
                                     ungated_reason)
from comet.integrations.layout import (_FUSED_BIASES, _FUSED_KEYS, _LINEAR_NAMES, _PARTS,
                                       _STACKED_NAMES, ExpertLayout, expert_weight,
                                       reference_biases, reference_weights)


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
        fp8: how FP8 experts store their weights and scales (None: not FP8).
    """

    mode: str
    layout: ExpertLayout
    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: GatedActivation = SILU
    fp8: Fp8Checkpoint | None = None


# --------------------------------------------------------------------------- structure
def is_registry_experts(experts: nn.Module) -> bool:
    """``experts`` is dispatched through transformers' experts registry (its class was
    decorated with ``@use_experts_implementation``)."""
    forward = getattr(type(experts), "forward", None)
    return (callable(getattr(forward, "__wrapped__", None))
            and all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed")))


def _positional(experts: nn.Module) -> list[inspect.Parameter] | None:
    """The positional parameters of the experts' forward after ``self`` (None where it
    has no readable signature)."""
    try:
        params = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _single_input_forward(experts: nn.Module) -> bool:
    """The experts' forward takes one tensor (Llama-4: ``experts(routed_in)``)."""
    positional = _positional(experts)
    return (positional is not None and len(positional) == 1
            and positional[0].default is inspect.Parameter.empty)


def _routed_signature(experts: nn.Module) -> bool:
    """The experts' forward takes ``(hidden_states, top_k_index, top_k_weights)``."""
    positional = _positional(experts)
    return positional is not None and len(positional) == 3


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


def _extra_state(experts: nn.Module, known: set[str], skip: tuple[str, ...] = ()) -> list[str]:
    """The refusal of parameters and buffers of ``experts`` other than ``known`` (and
    those under the prefixes ``skip``, reported otherwise), or nothing."""
    names = [n for n, _ in experts.named_parameters()] + [n for n, _ in experts.named_buffers()]
    extra = [n for n in names if n not in known and not n.startswith(skip)]
    return [f"extra expert state ({', '.join(extra)}) is not supported"] if extra else []


def _fused_reasons(experts: nn.Module, biases: frozenset[str],
                   also_known: tuple[str, ...] = ()) -> list[str]:
    """Why comet cannot run a gated fused experts module, its gate function and biases
    aside (empty: it can); ``also_known``: more state it reads (FP8 scales)."""
    reasons = []
    if getattr(experts, "has_post_expert_norm", False):
        norm = getattr(experts, "post_expert_norm", None)
        reasons.append(f"a norm after each expert (post_expert_norm: {type(norm).__name__}) "
                       "is not supported yet")
    known = set(_FUSED_KEYS) | set(also_known) | {
        k for k, parts in _FUSED_BIASES.items() if biases & set(parts)}
    return reasons + _extra_state(experts, known, skip=("post_expert_norm",))


#: Where a stacked experts module (or the child holding its weights) keeps E.
_EXPERT_COUNT_NAMES = ("num_experts", "moe_num_experts", "num_local_experts",
                       "n_routed_experts")


def _stacked_weights(experts: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    """``(child, names)`` where a child of ``experts`` holds exactly three 2-D parameters
    of its own (``names``: DBRX's ``mlp`` with ``w1``, ``v1``, ``w2``), else None."""
    for child, module in experts.named_children():
        params = dict(module.named_parameters(recurse=False))
        if len(params) == 3 and all(p.dim() == 2 for p in params.values()):
            return child, tuple(params)
    return None


def _stacked_count(*owners) -> int | None:
    """The number of experts the first of ``owners`` that states it gives
    (:data:`_EXPERT_COUNT_NAMES`), or None."""
    for owner in owners:
        for name in _EXPERT_COUNT_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


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


# --------------------------------------------------------------------------- inspection
def _refuse(where: str, reasons: list[str]):
    raise NotImplementedError(f"comet cannot run the experts of {where}: " + "; ".join(reasons))


def _gate_or_refuse(owner: nn.Module, where: str, reasons: list[str]) -> GateMatch:
    """What ``owner``'s gate function computes (:func:`comet.integrations.gate.match_gate`);
    NotImplementedError naming ``reasons`` -- and the gate's own, where it matches nothing
    -- if there are any."""
    match = match_gate(owner)
    if match is None:
        reasons = reasons + [gate_function_refusal(owner)]
    if reasons:
        _refuse(where, reasons)
    return match


def inspect_experts(experts: nn.Module, where: str | None = None) -> ExpertsSpec:
    """Recognise an experts module and find the function comet runs for it: layout,
    gated activation, biases (see the module doc).

    Raises:
        TypeError: not an experts module comet knows (neither registry-dispatched fused
            experts, nor Llama-4-style dense fused experts, nor stacked 2-D expert
            weights called like registry experts, nor a ``ModuleList`` of gated MLPs), or
            weights of such a module that comet cannot read; the message says what it is.
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
    stacked = None if fused or isinstance(experts, nn.ModuleList) else _stacked_weights(experts)
    if stacked is not None and _routed_signature(experts):
        return _inspect_stacked(experts, where, *stacked)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        kinds = sorted({type(e).__name__ for e in experts})
        if has_fp8_linear(experts):
            _refuse(where, ["per-expert FP8 linears (a ModuleList of FP8Linear MLPs) are not "
                            "supported yet: comet converts fused FP8Experts"])
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
        "through transformers' experts registry (3-D gate_up_proj/down_proj) nor stacked "
        "2-D [E*F, H] expert weights nor a ModuleList of gated MLPs")


def _inspect_fused(experts: nn.Module, where: str, registry: bool, dense: bool) -> ExpertsSpec:
    """:func:`inspect_experts` of fused (3-D ``gate_up_proj`` / ``down_proj``) experts."""
    cls = type(experts).__name__
    if registry and not getattr(experts, "has_gate", True):
        _refuse(where, [ungated_reason(experts)])
    packed = packed_refusal(experts) if is_fp8_experts(experts) else None
    if packed:
        _refuse(where, [packed])
    transposed = bool(getattr(experts, "is_transposed", False))
    if not registry:  # infer the layout from the shapes
        transposed = _fused_shapes(experts, True) is not None
    sizes = _fused_shapes(experts, transposed)
    if sizes is None:
        raise TypeError(f"{where}: {cls} has no gate_up_proj / down_proj pair of 3-D "
                        "expert weights comet can read")
    biases, reasons = _fused_bias_parts(experts, registry, sizes)
    fp8, quantized = None, is_fp8_experts(experts)
    if quantized:
        fp8, fp8_reasons = fp8_refusals(experts, sizes, transposed, biases)
        reasons += fp8_reasons
        if dense:
            reasons.append("dense FP8 experts (called as experts(routed_in)) are not "
                           "supported yet")
    reasons += _fused_reasons(experts, biases, FP8_STATE if quantized else ())
    if dense and biases:
        reasons.append("expert biases on dense experts (called as experts(routed_in)) are "
                       "not supported: comet skips the all-zero rows of unrouted slots, "
                       "which a bias would not leave zero")
    match = _gate_or_refuse(experts, where, reasons)
    if fp8 is not None and match.order != "concatenated":
        _refuse(where, [f"FP8 experts with {match.order} gate/up rows are not supported: "
                        "comet runs the gate rows, then the up rows, without a copy"])
    layout = ExpertLayout("fused", transposed=transposed, gate_up=match.order, biases=biases)
    spec = ExpertsSpec("dense" if dense else "routed", layout, *sizes,
                       activation=match.activation, fp8=fp8)
    if not quantized:   # an FP8 forward needs transformers' GPU kernels: not probed
        _probe_forward(experts, spec, where)
    return spec


def _inspect_stacked(experts: nn.Module, where: str, child: str,
                     names: tuple[str, ...]) -> ExpertsSpec:
    """:func:`inspect_experts` of stacked experts: the child ``child`` of ``experts`` holds
    three 2-D parameters ``names``, which must be gate, up and down ``[E*F, H]``."""
    cls = type(experts).__name__
    holder = experts.get_submodule(child)
    roles = next((r for r in _STACKED_NAMES if set(r) == set(names)), None)
    if roles is None:
        known = " or ".join("/".join(r) for r in _STACKED_NAMES)
        raise TypeError(f"{where}: {cls}.{child} holds 2-D weights {', '.join(names)}, which "
                        f"comet cannot tell apart as gate, up and down (it reads {known})")
    e = _stacked_count(experts, holder)
    if e is None:
        raise TypeError(f"{where}: cannot read how many experts {cls}.{child} stacks "
                        f"({' / '.join(_EXPERT_COUNT_NAMES)} on {cls} or {child})")
    paths = tuple(f"{child}.{n}" for n in roles)
    weights = [experts.get_parameter(p) for p in paths]
    rows, h = weights[0].shape
    if rows % e or any(w.shape != weights[0].shape for w in weights):
        shapes = ", ".join(f"{p} {list(w.shape)}" for p, w in zip(paths, weights))
        raise TypeError(f"{where}: the stacked expert weights of {cls} ({shapes}) are not "
                        f"gate, up and down of one shape [E*F, H] with E = {e} experts")
    # The gate function is the holder's (DBRX: mlp.activation_fn), else the module's own.
    owner = holder if gate_function(holder) is not None else experts
    match = _gate_or_refuse(owner, where, _extra_state(experts, set(paths)))
    layout = ExpertLayout("stacked", names=paths, stacked_experts=e)
    spec = ExpertsSpec("routed", layout, e, h, rows // e, activation=match.activation)
    _probe_forward(experts, spec, where)
    return spec


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
        _refuse(where, [gate_refusal(first, f"per-expert MLP {type(first).__name__}.forward")])
    return ExpertsSpec("legacy", layout, len(experts), h, f, activation)


def expert_layout(experts: nn.Module) -> ExpertLayout:
    """The storage layout of a supported experts module (see :func:`inspect_experts`)."""
    return inspect_experts(experts).layout


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
    not). Skipped for weights on the meta device.

    Routed experts get ``[T, H]`` rows, as the registry's callers pass them; stacked ones
    (DBRX) ``[1, T, H]``, as their block passes ``[batch, seq, H]``: either must return
    its input's shape, which is what the replacement returns."""
    w = expert_weight(experts, spec.layout)
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
            called = x.unsqueeze(0) if spec.layout.kind == "stacked" else x
            got = forward(experts, called, torch.tensor(picks, device=w.device)[local], weights)
        else:
            w13, w2 = reference_weights(experts, spec.layout, 0, e)
            b13, b2 = reference_biases(experts, spec.layout, 0, e)
            x = torch.randn(e, 2, h, generator=gen)
            x[:, 1] = 0.0                       # a zero row per expert, as unrouted slots are
            x = x.to(device=w.device, dtype=w.dtype)
            x = _scaled(x, torch.bmm(x.float(), w13.float()), span).reshape(e * 2, h)
            local = torch.arange(e, device=w.device).repeat_interleave(2).unsqueeze(1)
            weights = torch.ones(e * 2, 1, device=w.device, dtype=w.dtype)
            called = x
            got = forward(experts, x)
        want = reference.moe_forward(x, local, weights, w13, w2, round_to=x.dtype,
                                     activation=spec.activation, b13=b13, b2=b2)
    if not _matches(got, want.reshape(called.shape), w.dtype):
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
    """The candidate activation (:func:`comet.integrations.gate.candidates`) with which the
    first and the last expert's own forward matches :func:`comet.reference.expert_mlp` on
    probe rows, or None. For weights on the meta device (nothing to probe) the plainest
    candidate."""
    first = experts[0]
    found = candidates(first)
    w = getattr(first, layout.names[0]).weight
    if w.device.type == "meta" or not found:
        return found[0] if found else None
    gen = torch.Generator().manual_seed(1)
    probes = []
    with torch.no_grad():
        for i in sorted({0, len(experts) - 1}):
            w13, w2 = reference_weights(experts, layout, i, i + 1)
            b13, b2 = reference_biases(experts, layout, i, i + 1)
            x = torch.randn(8, w13.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
            x = _scaled(x, x.float() @ w13[0].float(), _probe_span(clamp_limit(first)))
            probes.append((x, experts[i](x), w13[0], w2[0], b13, b2))
        for act in found:
            if all(_matches(got, reference.expert_mlp(
                    x, w13, w2, round_to=x.dtype, activation=act,
                    b13=None if b13 is None else b13[0], b2=None if b2 is None else b2[0]),
                    w.dtype) for x, got, w13, w2, b13, b2 in probes):
                return act
    return None
