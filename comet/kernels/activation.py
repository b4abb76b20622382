"""The gated activation in the kernels: layer0's epilogue and the backward's pointwise pass.

:class:`Act` is the constexpr form of a :class:`comet.activation.GatedActivation` (a
field of :class:`comet.kernels.group_gemm.GemmTile`), so each variant compiles to its own
epilogue and the default SiLU one is the code it always was. GELU-tanh is computed as
``x * sigmoid(2 z)`` with ``z = sqrt(2/pi) (x + 0.044715 x^3)`` -- the same function as
``x/2 (1 + tanh z)``, on the sigmoid the SiLU epilogue already uses.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import triton
import triton.language as tl

from comet.activation import GELU_CUBIC, GELU_SCALE, SILU, GatedActivation
from comet.constants import constexpr


class Act(NamedTuple):
    """Constexpr form of :class:`comet.activation.GatedActivation`."""

    GELU: tl.constexpr       # gelu_tanh; else x * sigmoid(ALPHA * x)
    ALPHA: tl.constexpr
    CLAMP: tl.constexpr      # gate <= LIMIT, |up| <= LIMIT
    LIMIT: tl.constexpr
    UP_OFFSET: tl.constexpr


#: GELU-tanh as ``x * sigmoid(GELU_SLOPE * (x + GELU_X3 * x^3))``.
GELU_SLOPE = constexpr(2.0 * GELU_SCALE)
GELU_X3 = constexpr(GELU_CUBIC)


@functools.lru_cache(maxsize=16)
def act_tile(activation: GatedActivation = SILU) -> Act:
    a = activation
    return Act(*(constexpr(v) for v in (
        a.kind == "gelu_tanh", float(a.alpha), a.limit is not None,
        float(a.limit or 0.0), float(a.up_offset))))


@triton.jit
def _act_value_slope(g, act):
    """``(act(g), act'(g))``, fp32."""
    if act.GELU:
        s = tl.sigmoid(GELU_SLOPE * (g + GELU_X3 * g * g * g))
        slope = s + g * s * (1.0 - s) * GELU_SLOPE * (1.0 + 3.0 * GELU_X3 * g * g)
    elif act.ALPHA == 1.0:
        s = tl.sigmoid(g)
        slope = s * (1.0 + g * (1.0 - s))
    else:
        s = tl.sigmoid(act.ALPHA * g)
        slope = s * (1.0 + act.ALPHA * g * (1.0 - s))
    return g * s, slope


@triton.jit
def _clamped(g, u, act):
    if act.CLAMP:
        g = tl.minimum(g, act.LIMIT)
        u = tl.clamp(u, -act.LIMIT, act.LIMIT)
    return g, u


@triton.jit
def gated(gate, up, act):
    """``h = act(gate) * (up + UP_OFFSET)`` on fp32 tiles (clamped first with ``CLAMP``)."""
    g, u = _clamped(gate, up, act)
    if act.GELU:
        value = g * tl.sigmoid(GELU_SLOPE * (g + GELU_X3 * g * g * g))
    elif act.ALPHA == 1.0:
        value = g * tl.sigmoid(g)
    else:
        value = g * tl.sigmoid(act.ALPHA * g)
    if act.UP_OFFSET != 0.0:
        u = u + act.UP_OFFSET
    return value * u


@triton.jit
def gated_grad(gate, up, dh, act):
    """``(h, d gate, d up)`` for the output gradient ``dh`` (fp32 tiles); a clamped value
    passes no gradient, the bound itself does (as torch's ``clamp``)."""
    g, u = _clamped(gate, up, act)
    value, slope = _act_value_slope(g, act)
    if act.UP_OFFSET != 0.0:
        u = u + act.UP_OFFSET
    dg = dh * u * slope
    du = dh * value
    if act.CLAMP:
        dg = tl.where(gate <= act.LIMIT, dg, 0.0)
        du = tl.where(tl.abs(up) <= act.LIMIT, du, 0.0)
    return value * u, dg, du
