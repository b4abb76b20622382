"""The backward of ``h = SiLU(gate) * up`` (or another gated activation,
:mod:`comet.activation`) in one pass (:mod:`comet.baseline_backward`).

Per expert row ``i`` and column ``j`` of ``F``, from the recomputed ``gate/up``
(``[R, 2F]``, W13's column layout), ``dh_u = dy @ W2^T`` (``[R, F]``, not yet weighted)
and the row's routing weight ``w``::

    h       = SiLU(g) * u                      (model dtype, as the forward stored it)
    dg, du  = w * dh_u * u * SiLU'(g),  w * dh_u * SiLU(g)
    d w     = sum_j dh_u * h                   (the routing weight's gradient, fp32)

The fused backward (comet.runtime.backward) runs it on its capacity-sized row buffers with
the row count read on the device (no host sync), and stores ``w * h`` -- what ``dW2``
needs -- instead of ``h``.

As separate torch ops this is about ten passes over ``[R, F]`` fp32 temporaries, a large
share of a training step's device time (benchmarks/results/2026-11-23/README.md, "Eleventh
session"); here each element is read and written once, in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comet.activation import SILU, GatedActivation
from comet.constants import constexpr
from comet.kernels.activation import act_tile, gated_grad
from comet.weights import GATE_UP_BLOCK

#: Rows of one program's tile; its columns are one gate/up block (:data:`GATE_UP_BLOCK`),
#: so each load is a contiguous run the compiler can vectorize.
BLOCK_ROWS = 16
_ROW_TILE = constexpr(BLOCK_ROWS)
NUM_WARPS = 4


@triton.jit
def _block(gu_ptr, dhu_ptr, dgu_ptr, h_ptr, r64, row_ok, w, col0, width, F,
           stride_gu, stride_dhu, INTERLEAVED: tl.constexpr, BLOCK_F: tl.constexpr,
           SCALE_H: tl.constexpr, act):
    """Columns ``[col0, col0 + width)`` of F, one gate/up block; returns the block's share
    of the weight gradient; stores ``h`` (``w * h`` with ``SCALE_H``). Interleaved, the block's gates start at ``2 * col0`` and its
    ups ``width`` later (the last, partial block included: :mod:`comet.weights`);
    otherwise all gates come first, then all ups."""
    if INTERLEAVED:
        gate0 = 2 * col0
        up0 = gate0 + width
    else:
        gate0 = col0
        up0 = F + col0
    c = tl.arange(0, BLOCK_F)
    ok = row_ok[:, None] & (c < width)[None, :]
    gate_at = r64[:, None] * stride_gu + (gate0 + c)[None, :]
    up_at = r64[:, None] * stride_gu + (up0 + c)[None, :]
    g = tl.load(gu_ptr + gate_at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + up_at, mask=ok, other=0.0).to(tl.float32)
    dhu = tl.load(dhu_ptr + r64[:, None] * stride_dhu + (col0 + c)[None, :], mask=ok,
                  other=0.0).to(tl.float32)
    dh = dhu * w[:, None]
    h, dg, du = gated_grad(g, u, dh, act)
    h = h.to(h_ptr.dtype.element_ty)
    if SCALE_H:
        stored = (h.to(tl.float32) * w[:, None]).to(h_ptr.dtype.element_ty)
    else:
        stored = h
    tl.store(h_ptr + r64[:, None] * F + (col0 + c)[None, :], stored, mask=ok)
    tl.store(dgu_ptr + gate_at, dg.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(dgu_ptr + up_at, du.to(dgu_ptr.dtype.element_ty), mask=ok)
    return tl.sum(dhu * h.to(tl.float32), axis=1)


@triton.jit
def act_backward_kernel(gu_ptr, dhu_ptr, weight_ptr, dgu_ptr, h_ptr, dweight_ptr,
                        rows, rows_ptr, F, stride_gu, stride_dhu,
                        INTERLEAVED: tl.constexpr, GATE_UP: tl.constexpr,
                        ROWS_ON_DEVICE: tl.constexpr, SCALE_H: tl.constexpr, act):
    """Row blocks strided over the programs; ``ROWS_ON_DEVICE``: the row count is
    ``rows_ptr[0]``, else ``rows``."""
    if ROWS_ON_DEVICE:
        rows = tl.load(rows_ptr)
    full = F // GATE_UP
    tail = F - full * GATE_UP
    for blk in range(tl.program_id(0), tl.cdiv(rows, _ROW_TILE), tl.num_programs(0)):
        r = blk * _ROW_TILE + tl.arange(0, _ROW_TILE)
        row_ok = r < rows
        r64 = r.to(tl.int64)
        w = tl.load(weight_ptr + r64, mask=row_ok, other=0.0)
        d_weight = tl.zeros([_ROW_TILE], dtype=tl.float32)
        for b in range(0, full):
            d_weight += _block(gu_ptr, dhu_ptr, dgu_ptr, h_ptr, r64, row_ok, w, b * GATE_UP,
                               GATE_UP, F, stride_gu, stride_dhu, INTERLEAVED, GATE_UP,
                               SCALE_H, act)
        if tail > 0:
            d_weight += _block(gu_ptr, dhu_ptr, dgu_ptr, h_ptr, r64, row_ok, w,
                               full * GATE_UP, tail, F, stride_gu, stride_dhu, INTERLEAVED,
                               GATE_UP, SCALE_H, act)
        tl.store(dweight_ptr + r64, d_weight, mask=row_ok)


def act_backward(gu: torch.Tensor, dh_u: torch.Tensor, weight: torch.Tensor,
                 interleaved: bool, activation: GatedActivation = SILU
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gu [R, 2F]``, ``dh_u [R, F]`` (model dtype, unit stride along columns),
    ``weight [R]`` fp32 -> ``(d gate/up [R, 2F] like gu, h [R, F], d weight [R] fp32)``."""
    rows, f = dh_u.shape
    dgu = torch.empty_like(gu)
    h = torch.empty(rows, f, dtype=gu.dtype, device=gu.device)
    d_weight = torch.empty(rows, dtype=torch.float32, device=gu.device)
    if rows:
        act_backward_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            gu_ptr=gu, dhu_ptr=dh_u, weight_ptr=weight.contiguous(), dgu_ptr=dgu, h_ptr=h,
            dweight_ptr=d_weight, rows=rows, rows_ptr=d_weight, F=f,
            stride_gu=gu.stride(0), stride_dhu=dh_u.stride(0), INTERLEAVED=interleaved,
            GATE_UP=GATE_UP_BLOCK, ROWS_ON_DEVICE=False, SCALE_H=False,
            act=act_tile(activation), num_warps=NUM_WARPS)
    return dgu, h, d_weight


def act_backward_rows(gu: torch.Tensor, dh_u: torch.Tensor, weight: torch.Tensor,
                      rows: torch.Tensor, dgu: torch.Tensor, hw: torch.Tensor,
                      d_weight: torch.Tensor, programs: int,
                      activation: GatedActivation = SILU) -> None:
    """The fused backward's form, into given buffers: the first ``rows[0]`` (device int32)
    rows of ``gu [cap, 2F]`` (interleaved), ``dh_u [cap, F]``, ``weight [cap]`` ->
    ``dgu`` (may be ``gu`` itself: each element is read before it is written, by the same
    thread), ``hw = w * h [cap, F]``, ``d_weight [cap]``; on ``programs`` programs."""
    f = dh_u.shape[1]
    act_backward_kernel[(max(1, programs),)](
        gu_ptr=gu, dhu_ptr=dh_u, weight_ptr=weight, dgu_ptr=dgu, h_ptr=hw,
        dweight_ptr=d_weight, rows=0, rows_ptr=rows, F=f, stride_gu=gu.stride(0),
        stride_dhu=dh_u.stride(0), INTERLEAVED=True, GATE_UP=GATE_UP_BLOCK,
        ROWS_ON_DEVICE=True, SCALE_H=True, act=act_tile(activation), num_warps=NUM_WARPS)
