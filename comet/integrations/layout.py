"""How a transformers experts module stores its weights, and the conversion to and from the
kernels' layout.

comet's kernels take ``w13 [E, H, 2F]`` (gate and up columns interleaved by blocks,
:mod:`comet.weights`) and ``w2 [E, F, H]``, with biases ``b13 [E, 2F]`` / ``b2 [E, H]``;
:mod:`comet.reference` takes the same with gate-then-up columns. transformers stores
experts in one of three layouts (:class:`ExpertLayout`): fused 3-D ``gate_up_proj`` /
``down_proj`` (transformers 5.x, Llama-4; gate/up concatenated or, GPT-OSS, alternating),
per-expert ``nn.Linear`` (a 4.x ``ModuleList``) or stacked 2-D ``[E*F, H]`` tensors
(DBRX). This module turns any of them, for a range of experts (and, for a tensor-parallel
layout, a range of their ``F`` columns: :func:`ffn_columns`), into the reference and the
kernel layouts (:func:`reference_weights`, :func:`kernel_weights`, and the biases), and
holds the inverse conversions that checkpoints in the model's own layout need
(:mod:`comet.integrations.local_experts`). Which layout a module has is found by
:func:`comet.integrations.experts.inspect_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from comet.weights import interleave_gate_up

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
    ``kind == "stacked"``: three 2-D tensors ``[E*F, H]`` at the paths ``names`` (under the
    experts module: DBRX's ``mlp.w1`` / ``mlp.v1`` / ``mlp.w2``), ``stacked_experts`` (E)
    experts of ``F`` rows each: expert ``e``'s rows ``[e*F, (e+1)*F)`` are its gate and up
    (``x @ gate.T``) and its down projection, used untransposed (``h @ down``); no biases.

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
    stacked_experts: int = 0


#: Per-expert ``nn.Linear`` names ``(gate, up, down)`` comet reads.
_LINEAR_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
#: Stacked 2-D tensor names ``(gate, up, down)`` comet reads (DBRX's first).
_STACKED_NAMES = (("w1", "v1", "w2"),) + _LINEAR_NAMES
_FUSED_KEYS = ("gate_up_proj", "down_proj")
#: Fused bias keys and the projections they belong to.
_FUSED_BIASES = {"gate_up_proj_bias": ("gate", "up"), "down_proj_bias": ("down",)}


# --------------------------------------------------------------------------- gate/up order
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


# --------------------------------------------------------------------------- F shards
def ffn_columns(t: torch.Tensor, dim: int, cols: range, gate_up: bool = False) -> torch.Tensor:
    """The F columns ``cols`` of ``t`` along ``dim`` (a copy): of its ``F`` entries, or
    with ``gate_up`` of each half of its gate-then-up ``2F`` ones -- a rank's F shard of a
    (tp, ep) layout (:meth:`comet.mesh.MeshLayout.ffn_range`)."""
    index = torch.arange(cols.start, cols.stop, device=t.device)
    if gate_up:
        index = torch.cat([index, t.shape[dim] // 2 + index])
    return t.index_select(dim, index)


# --------------------------------------------------------------------------- sizes
def expert_weight(experts: nn.Module, layout: ExpertLayout) -> torch.Tensor:
    """One weight tensor of the module (its dtype, device and ``requires_grad`` stand for
    all of its expert weights)."""
    if layout.kind == "fused":
        return experts.gate_up_proj
    if layout.kind == "stacked":
        return experts.get_parameter(layout.names[0])
    return getattr(experts[0], layout.names[0]).weight


def expert_sizes(experts: nn.Module, layout: ExpertLayout) -> tuple[int, int, int]:
    """``(E, H, F)`` of a transformers experts module."""
    if layout.kind == "fused":
        e, a, b = experts.gate_up_proj.shape
        return (e, a, b // 2) if layout.transposed else (e, b, a // 2)
    rows, h = expert_weight(experts, layout).shape
    if layout.kind == "stacked":
        return layout.stacked_experts, h, rows // layout.stacked_experts
    return len(experts), h, rows


# --------------------------------------------------------------------------- to the kernels
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


def _stacked_to_kernel(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked tensors ``[n*F, H]`` (any ``n``) -> ``(w13 [n, H, 2F]`` gate-then-up,
    ``w2 [n, F, H])``; ``w2`` is a view of ``down``."""
    gate, up, down = (t.reshape(-1, f, t.shape[-1]) for t in (gate, up, down))
    return torch.cat([gate, up], dim=1).transpose(1, 2), down


def _kernel_to_stacked(w13: torch.Tensor, w2: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_stacked_to_kernel`: gate-then-up ``w13 [n, H, 2F]`` and
    ``w2 [n, F, H]`` -> ``(gate, up, down)``, each ``[n*F, H]`` (``down`` a view of
    ``w2``; gate and up new tensors)."""
    f, h = w2.shape[1:]
    return (w13[..., :f].transpose(1, 2).reshape(-1, h),
            w13[..., f:].transpose(1, 2).reshape(-1, h), w2.reshape(-1, h))


def reference_weights(experts: nn.Module, layout: ExpertLayout, lo: int,
                      hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[lo, hi)`` as :mod:`comet.reference` takes them: ``w13 [n, H, 2F]``
    gate-then-up and ``w2 [n, F, H]`` (views of fused concatenated weights; autograd
    reaches the module's parameters either way)."""
    if layout.kind == "fused":
        return _fused_to_kernel(experts.gate_up_proj[lo:hi], experts.down_proj[lo:hi], layout)
    if layout.kind == "stacked":
        _, _, f = expert_sizes(experts, layout)
        gate, up, down = (experts.get_parameter(n)[lo * f:hi * f] for n in layout.names)
        return _stacked_to_kernel(gate, up, down, f)
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


def kernel_weights(experts: nn.Module, layout: ExpertLayout, lo: int, hi: int,
                   cols: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[lo, hi)`` of a transformers experts module as new contiguous
    ``w13 [hi-lo, H, 2F]`` (interleaved, :mod:`comet.weights`) and ``w2 [hi-lo, F, H]``;
    with ``cols``, only those F columns of gate and of up and those rows of W2
    (``2 * len(cols)`` and ``len(cols)`` wide)."""
    with torch.no_grad():
        w13, w2 = reference_weights(experts, layout, lo, hi)
        if cols is not None:
            w13, w2 = ffn_columns(w13, -1, cols, gate_up=True), ffn_columns(w2, 1, cols)
        return interleave_gate_up(w13), w2.clone(memory_format=torch.contiguous_format)


def kernel_biases(experts: nn.Module, layout: ExpertLayout, lo: int, hi: int,
                  cols: range | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Experts ``[lo, hi)``'s biases as new contiguous ``b13 [hi-lo, 2F]`` (columns
    interleaved as ``w13``'s; with ``cols``, those of gate and of up) and ``b2 [hi-lo,
    H]``, or ``(None, None)`` without any."""
    with torch.no_grad():
        b13, b2 = reference_biases(experts, layout, lo, hi)
        if b13 is None:
            return None, None
        if cols is not None:
            b13 = ffn_columns(b13, -1, cols, gate_up=True)
        return interleave_gate_up(b13), b2.clone(memory_format=torch.contiguous_format)
