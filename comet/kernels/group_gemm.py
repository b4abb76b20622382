"""The compute role: a persistent GroupGEMM over the scheduler's m-tile table.

One *work item* is one output tile: ``BLOCK_M`` rows of one local expert (an m-tile of
:class:`comet.scheduler.plan.TileTable`) times ``BLOCK_N`` columns. Operands come in
through TMA tensor descriptors (A: the rows, ``[rows, K]``; B: all local experts' weights
viewed as ``[El * K, N]``, so expert ``e``'s block starts at row ``e * K``); accumulation
is fp32; the tile is written with ``tl.store`` so that a release can publish it (a TMA
store would still be in flight).

The layer0 epilogue fuses the activation: with ``GATED``, each work item multiplies A by
the gate columns ``[n, n + BLOCK_N)`` and the up columns ``[F + n, F + n + BLOCK_N)`` of
W13 and stores ``silu(gate) * up`` -- the activation never makes its own pass over memory.

The same ``gemm_tile`` runs in both fused layer kernels (and in
scripts/device/gemm_variants.py, which times it under other tile loops); only the loop
around it and the waits differ.
"""

import triton
import triton.language as tl

# Work-item orders (comet.scheduler.plan documents them for the simulator).
GROUP_M = tl.constexpr(8)    # m-tiles that share a column block while it sits in L2


@triton.jit
def gemm_tile(a_desc, b_desc, c_ptr, stride_cm, expert, row_start, row_end, n0, K, N,
              GATED: tl.constexpr, UP_OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``C[row_start:row_end, n0:n0+BLOCK_N] = A[rows] @ B[expert][:, cols]`` (+ SiLU*up)."""
    b_row = expert * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row_start, k])
        b = b_desc.load([b_row + k, n0])
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = b_desc.load([b_row + k, UP_OFFSET + n0])
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < row_end) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_work(w, num_tiles, n_blocks):
    """layer0 order: groups of ``GROUP_M`` consecutive m-tiles sweep the column blocks
    together (so a weight block is read once per group from L2), groups in table order
    (which is the scheduler's local-first order). Returns (tile, column block)."""
    per_group = GROUP_M * n_blocks
    first = (w // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    within = w % per_group
    return first + within % size, within // size


@triton.jit
def column_work(w, num_tiles, n_blocks, BLOCKS_PER_SPLIT: tl.constexpr):
    """layer1 order: column split major (all experts' tiles of split ``s`` before split
    ``s + 1``), inside a split m-tile major. Returns (tile, column block, split)."""
    per_split = num_tiles * BLOCKS_PER_SPLIT
    split = w // per_split
    within = w % per_split
    first_block = split * BLOCKS_PER_SPLIT
    blocks = tl.minimum(n_blocks - first_block, BLOCKS_PER_SPLIT)
    return within // blocks, first_block + within % blocks, split
