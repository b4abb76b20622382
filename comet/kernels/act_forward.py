"""``h = SiLU(gate) * up`` (or another gated activation, :mod:`comet.activation`) of a
GEMM's ``[R, 2F]`` output in one pass: the unfused baseline's activation (:mod:`comet.baseline`).

The fused layer applies the activation in layer0's epilogue and never stores ``gate/up``;
the unfused pipelines keep the torch user's shape -- grouped GEMM, activation, grouped GEMM
-- and this is that activation as a careful torch user writes it on a GPU: each element of
``gate/up`` read once and ``h`` written once, in fp32 registers (eager torch's
``silu(gate) * up`` makes two passes and a ``[R, F]`` temporary; a variant, more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comet.activation import SILU, GatedActivation
from comet.kernels.activation import act_tile, gated

#: One program's tile: rows x columns of ``h``. Columns as wide as a 16-byte vector per
#: thread over a warp and a half keeps every load a contiguous run.
BLOCK_ROWS = 8
BLOCK_COLS = 256
NUM_WARPS = 4


@triton.jit
def gated_rows_kernel(gu_ptr, h_ptr, rows, F, stride_gu, stride_h,
                      BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, act):
    """Program ``(i, j)``: rows ``[i*BLOCK_R, ...)``, columns ``[j*BLOCK_F, ...)`` of ``h``;
    gates are columns ``[0, F)`` of ``gu``, ups ``[F, 2F)``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = (r < rows)[:, None] & (c < F)[None, :]
    at = r.to(tl.int64)[:, None] * stride_gu + c[None, :]
    g = tl.load(gu_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + at + F, mask=ok, other=0.0).to(tl.float32)
    h = gated(g, u, act)
    tl.store(h_ptr + r.to(tl.int64)[:, None] * stride_h + c[None, :],
             h.to(h_ptr.dtype.element_ty), mask=ok)


def gated_rows(gu: torch.Tensor, activation: GatedActivation = SILU) -> torch.Tensor:
    """``gu [R, 2F]`` (gate columns, then up; unit stride along columns) ->
    ``h [R, F]`` in ``gu``'s dtype, computed in fp32 (:func:`comet.activation.gated`)."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(1) != 1:
        raise ValueError(f"gated_rows takes [R, 2F] with unit column stride, got "
                         f"{list(gu.shape)} with strides {gu.stride()}")
    rows, f = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(rows, f, dtype=gu.dtype, device=gu.device)
    if rows and f:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(f, BLOCK_COLS))
        gated_rows_kernel[grid](gu_ptr=gu, h_ptr=h, rows=rows, F=f, stride_gu=gu.stride(0),
                                stride_h=h.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_F=BLOCK_COLS,
                                act=act_tile(activation), num_warps=NUM_WARPS)
    return h
