"""Row-wise helpers of the fused backward (comet.runtime.backward), on the destination's
rows of the layer0 shared tensor, bounded by the row count on the device (the buffers
have the worst-case capacity; the call's rows are known only to the device).

* :func:`row_weights_kernel` -- each row's routing weight, from the return entries the
  dispatch delivered (one entry per source token names its rows here and their weights):
  the backward needs it per row, the forward only per entry. The entries travel after
  the rows, and layer0's GEMM waits for rows only: a source's entries are read once all
  its chunk flags say they landed (else the previous call's entries, another batch's
  routing under a pipeline schedule, would be read).
* :func:`copy_rows_kernel` -- keep the dispatched ``x`` rows (for ``dW13``) before the
  dispatch of ``dy`` reuses the shared tensor.
* :func:`zero_empty_kernel` -- zero the weight gradients of experts that got no rows
  (``torch._grouped_mm`` does not write an empty group in every torch version), without
  asking the host which ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comet.constants import CHUNK_SCAN, SITE_ROW_ENTRIES
from comet.kernels.layer0 import Arrivals
from comet.kernels.plan import EntryTables
from comet.kernels.shape import Shape, next_pow2
from comet.kernels.sync import Sync, wait_chunks

#: Entries per step of :func:`row_weights_kernel`.
ENTRY_BLOCK = 128
#: Rows x columns per step of :func:`copy_rows_kernel` (16-byte vectors per thread).
COPY_ROWS, COPY_COLS = 4, 1024
#: Elements per step of :func:`zero_empty_kernel`.
ZERO_BLOCK = 4096


def launch_row_weights(programs: int, *, recv: EntryTables, arrivals: Arrivals,
                       w_row: torch.Tensor, max_tokens: int, sync: Sync, shape: Shape) -> None:
    """Each received row's routing weight into ``w_row`` (``programs`` per source)."""
    row_weights_kernel[(max(1, programs), int(shape.WORLD))](
        recv=recv, arrivals=arrivals, w_row=w_row, max_tokens=max_tokens, sync=sync,
        shape=shape, BLOCK=ENTRY_BLOCK, num_warps=4)


def launch_copy_rows(programs: int, src: torch.Tensor, dst: torch.Tensor,
                     rows: torch.Tensor) -> None:
    """``dst[:rows[0]] = src[:rows[0]]`` for ``[cap, H]`` buffers."""
    copy_rows_kernel[(programs,)](src=src, dst=dst, rows_ptr=rows, H=src.shape[1],
                                  ROWS=COPY_ROWS, COLS=min(COPY_COLS, next_pow2(src.shape[1])),
                                  num_warps=4)


def launch_zero_empty(programs: int, out: torch.Tensor, ends: torch.Tensor) -> None:
    """Zero ``out[e]`` (``[El, ...]``) for every expert ``e`` with no rows (``ends``)."""
    zero_empty_kernel[(programs,)](out_ptr=out, ends=ends, per_expert=out[0].numel(),
                                   LOCAL_EXPERTS=out.shape[0], BLOCK=ZERO_BLOCK, num_warps=4)


@triton.jit
def row_weights_kernel(recv, arrivals, w_row, max_tokens, sync, shape, BLOCK: tl.constexpr):
    """``w_row[rows[s, q, j]] = weight[s, q, j]`` for every held slot of every received
    entry (:class:`~comet.kernels.plan.EntryTables` ``recv``) of source ``s =
    program_id(1)``, once its chunk flags (rows, then entries) reached the call's epoch;
    programs of axis 0 stride over its entries. A wait that gives up writes nothing (the
    error word reports it)."""
    TOPK: tl.constexpr = shape.TOPK
    s = tl.program_id(1)
    ok = wait_chunks(arrivals.flags + s * arrivals.slots, 0, tl.load(arrivals.chunks + s),
                     tl.load(sync.epoch), sync, SITE_ROW_ENTRIES, s, "sys", CHUNK_SCAN)
    n = tl.where(ok != 0, tl.load(arrivals.entries + s), 0)
    j = tl.arange(0, shape.TOPK_P2)
    for q0 in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        idx = (s * max_tokens + q[:, None]).to(tl.int64) * TOPK + j[None, :]
        live = (q[:, None] < n) & (j[None, :] < TOPK)
        row = tl.load(recv.rows + idx, mask=live, other=-1)
        wgt = tl.load(recv.weight + idx, mask=live, other=0.0)
        tl.store(w_row + row.to(tl.int64), wgt, mask=row >= 0)


@triton.jit
def copy_rows_kernel(src, dst, rows_ptr, H, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``dst[:rows] = src[:rows]`` (``[cap, H]``, contiguous), ``rows = rows_ptr[0]``."""
    rows = tl.load(rows_ptr)
    for r0 in range(tl.program_id(0) * ROWS, rows, tl.num_programs(0) * ROWS):
        r = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        for c0 in range(0, H, COLS):
            c = c0 + tl.arange(0, COLS)
            mask = (r[:, None] < rows) & (c[None, :] < H)
            at = r[:, None] * H + c[None, :]
            tl.store(dst + at, tl.load(src + at, mask=mask), mask=mask)


@triton.jit
def zero_empty_kernel(out_ptr, ends, per_expert, LOCAL_EXPERTS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Zero ``out[e]`` (``per_expert`` elements each) for every local expert ``e`` with no
    rows (``ends[e] == ends[e - 1]``); programs stride over the blocks of those experts
    only, so a call where every expert got rows costs one load per expert per program."""
    prev = 0
    for e in range(LOCAL_EXPERTS):
        end = tl.load(ends + e)
        if end == prev:
            base = out_ptr + (tl.zeros([], tl.int64) + e) * per_expert   # > 2**31 elements
            for b0 in range(tl.program_id(0) * BLOCK, per_expert, tl.num_programs(0) * BLOCK):
                offs = b0 + tl.arange(0, BLOCK)
                tl.store(base + offs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty),
                         mask=offs < per_expert)
        prev = end
