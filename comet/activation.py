"""The experts' gated activation ``h = act(gate) * up``, and its variants.

Every MoE family comet runs computes its experts as ``down(act(gate) * up)`` on the two
halves of the first projection; they differ only in the activation of the gate half:

=====================  ============================================  =======================
family                 ``h``                                         :class:`GatedActivation`
=====================  ============================================  =======================
Mixtral, Qwen, ...     ``silu(g) * u``                               the default
Gemma-4                ``gelu_tanh(g) * u``                          ``kind="gelu_tanh"``
DeepSeek-V4, GLM-5     ``silu(min(g, L)) * clamp(u, -L, L)``         ``limit=L``
GPT-OSS, MiniMax-M3    ``min(g, L) sigmoid(a min(g, L))``            ``alpha=a, limit=L,``
                       ``* (clamp(u, -L, L) + 1)``                   ``up_offset=1``
=====================  ============================================  =======================

This module is the specification (torch, fp32): :func:`gated` and :func:`gated_grad` are
what :mod:`comet.reference`, the unfused baselines and the tests use, and what the
kernels' epilogues (:mod:`comet.kernels.activation`) are checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ActivationKind = Literal["silu", "gelu_tanh"]

#: ``gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + GELU_CUBIC x^3)))``, as torch's
#: ``gelu(approximate="tanh")``.
GELU_CUBIC = 0.044715
GELU_SCALE = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class GatedActivation:
    """``h = act(g') * (u' + up_offset)``, with ``g' = min(g, limit)`` and
    ``u' = clamp(u, -limit, limit)`` when ``limit`` is set (else ``g, u`` themselves).

    Args:
        kind: ``"silu"`` -- ``act(x) = x * sigmoid(alpha * x)`` -- or ``"gelu_tanh"``.
        alpha: the sigmoid's slope of ``"silu"`` (1: SiLU; GPT-OSS: 1.702).
        limit: clamp bound of the clamped SwiGLU (None: no clamp).
        up_offset: added to the up half (GPT-OSS: 1).
    """

    kind: ActivationKind = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation kind must be 'silu' or 'gelu_tanh', got {self.kind!r}")
        if self.kind == "gelu_tanh" and self.alpha != 1.0:
            raise ValueError("alpha is the slope of the 'silu' kind; gelu_tanh takes none")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"limit must be > 0 (or None), got {self.limit!r}")

    @property
    def is_default(self) -> bool:
        """Plain ``silu(g) * u``."""
        return self == SILU

    def describe(self) -> str:
        """A short readable form (``silu``, ``silu(alpha=1.702, limit=7, up+1)``)."""
        parts = [f"alpha={self.alpha:g}"] if self.alpha != 1.0 else []
        if self.limit is not None:
            parts.append(f"limit={self.limit:g}")
        if self.up_offset:
            parts.append(f"up{self.up_offset:+g}")
        return self.kind + (f"({', '.join(parts)})" if parts else "")


#: ``silu(g) * u``, what most families use.
SILU = GatedActivation()


def _clamped(gate: torch.Tensor, up: torch.Tensor, act: GatedActivation):
    if act.limit is None:
        return gate, up
    return gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)


def _act(g: torch.Tensor, act: GatedActivation) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(g), act'(g))`` in fp32."""
    if act.kind == "gelu_tanh":
        t = torch.tanh(GELU_SCALE * (g + GELU_CUBIC * g ** 3))
        value = 0.5 * g * (1 + t)
        slope = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * GELU_SCALE * (1 + 3 * GELU_CUBIC * g * g)
        return value, slope
    sig = torch.sigmoid(act.alpha * g)
    return g * sig, sig * (1 + act.alpha * g * (1 - sig))


def gated(gate: torch.Tensor, up: torch.Tensor, act: GatedActivation = SILU) -> torch.Tensor:
    """``h`` of the gate and up halves (same shapes), fp32."""
    g, u = _clamped(gate.float(), up.float(), act)
    return _act(g, act)[0] * (u + act.up_offset)


def gated_grad(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor,
               act: GatedActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` from ``dh``, the gradient of :func:`gated`'s output (fp32). A
    clamped value passes no gradient (as torch's ``clamp``: the bound itself passes)."""
    g0, u0 = gate.float(), up.float()
    g, u = _clamped(g0, u0, act)
    value, slope = _act(g, act)
    dg = dh * (u + act.up_offset) * slope
    du = dh * value
    if act.limit is not None:
        dg = dg * (g0 <= act.limit)
        du = du * (u0.abs() <= act.limit)
    return dg, du
