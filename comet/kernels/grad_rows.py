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

import triton
import triton.language as tl

from comet.kernels.sync import wait_chunks

#: Wait site of the entry wait (comet.runtime.errors.SITES).
SITE_ROW_ENTRIES = tl.constexpr(7)
#: Chunk flags checked per vector load (as layer0's CHUNK_SCAN).
CHUNK_SCAN = tl.constexpr(32)

#: Entries per step of :func:`row_weights_kernel`.
ENTRY_BLOCK = 128
#: Rows x columns per step of :func:`copy_rows_kernel` (16-byte vectors per thread).
COPY_ROWS, COPY_COLS = 4, 1024
#: Elements per step of :func:`zero_empty_kernel`.
ZERO_BLOCK = 4096


@triton.jit
def row_weights_kernel(recv_rows, recv_weight, entries, w_row, max_tokens,
                       flag0, chunk_slots, chunks_total, epoch_ptr, err_table, rank,
                       timeout_ptr, WORLD: tl.constexpr, TOPK: tl.constexpr,
                       TOPK_P2: tl.constexpr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    """``w_row[rows[s, q, j]] = weight[s, q, j]`` for every held slot of every entry of
    source ``s = program_id(1)``, once its ``chunks_total[s]`` chunk flags (rows, then
    entries) reached the call's epoch; programs of axis 0 stride over its entries. A
    wait that gives up writes nothing (the error word reports it)."""
    s = tl.program_id(1)
    ok = wait_chunks(flag0 + s * chunk_slots, 0, tl.load(chunks_total + s), tl.load(epoch_ptr),
                     err_table, SITE_ROW_ENTRIES, s, rank, tl.load(timeout_ptr), "sys",
                     WORLD, CHUNK_SCAN, USE_ASM)
    n = tl.where(ok != 0, tl.load(entries + s), 0)
    j = tl.arange(0, TOPK_P2)
    for q0 in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        idx = (s * max_tokens + q[:, None]).to(tl.int64) * TOPK + j[None, :]
        live = (q[:, None] < n) & (j[None, :] < TOPK)
        row = tl.load(recv_rows + idx, mask=live, other=-1)
        wgt = tl.load(recv_weight + idx, mask=live, other=0.0)
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
