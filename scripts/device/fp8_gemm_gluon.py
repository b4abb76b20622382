"""Gluon prototype of the block-scaled FP8 GEMM role (device only: Gluon has no interpreter).

The same operands, tile table and work order as comet.kernels.fp8_gemm (one work item:
an m-tile of one expert times ``BLOCK_N`` columns of ``B[e]^T``, B K-major, one fp32
scale per row and 128 K for A, per ``SCALE_N x SCALE_K`` block for B), written where
Triton's ``tl`` cannot reach: the promotion of a K step's product into the fp32
accumulator overlaps the next step's wgmma.

``tl.dot(a, b) * s`` makes the pipeliner wait for every wgmma before the multiply (a
dot whose result any other op uses is made synchronous), so the tensor core idles while
the CUDA cores scale. Here the loop is written out:

    issue wgmma(step i) into a fresh register tile       (async)
    wait until one wgmma is left in flight              -> step i - 1's product is ready
    acc += product(i - 1) * sa * sb                      (under step i's wgmma)
    free step i - 1's shared-memory slot

with a one-warp producer partition (``gl.warp_specialize``) streaming the A and B boxes
through ``STAGES`` slots of shared memory with TMA, and the consumer warpgroups (64 rows
each) doing the above. ``OVERLAP=False`` waits for every wgmma at once (the ``tl``
schedule, for the comparison). Persistent programs stride over the work items in the
grouped order of comet.kernels.group_gemm.grouped_work.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _work(w, num_tiles, n_blocks, GROUP_M: gl.constexpr):
    per_group = GROUP_M * n_blocks
    first = (w // per_group) * GROUP_M
    size = gl.minimum(num_tiles - first, GROUP_M)
    within = w % per_group
    return first + within % size, within // size


#: Largest number of K steps per drained group of :func:`_overlapped_steps`.
MAX_UNROLL = 2


def _unroll(k: int, block_k: int) -> int:
    """K steps per drained group (dividing the step count)."""
    steps = triton.cdiv(k, block_k)
    return next(u for u in (8, 4, 2, 1) if steps % u == 0 and u <= MAX_UNROLL)


@gluon.jit
def _boxes(a_bufs, b_bufs, ready, i, STAGES: gl.constexpr):
    """K step ``i``'s A and B^T boxes, once they have landed."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return a_bufs.index(s), b_bufs.index(s).permute((1, 0))


@gluon.jit
def _scale(sa_ptr, sb_ptr, live, k, A_GROUP: gl.constexpr, SCALE_K: gl.constexpr):
    return gl.load(sa_ptr + k // A_GROUP, mask=live, other=0.0) * gl.load(sb_ptr + k // SCALE_K)


@gluon.jit
def _release(empty, a_desc, b_desc, a_bufs, b_bufs, ready, i, k_steps, row_start, b_row,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WS: gl.constexpr):
    """Step ``i``'s slot is read: hand it to the producer (WS), or (no WS) load step
    ``i + STAGES - 1`` into it once every warp is done with it."""
    if WS:
        mbarrier.arrive(empty.index(i % STAGES), count=1)
    else:
        gl.thread_barrier()
        _issue(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES, k_steps, row_start, b_row,
               BLOCK_K, STAGES)


@gluon.jit
def _overlapped_steps(a_bufs, b_bufs, ready, empty, spare0, spare1, acc, it, kk, sa_ptr,
                      sb_ptr, live, a_desc, b_desc, k_steps, row_start, b_row,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_GROUP: gl.constexpr,
                      SCALE_K: gl.constexpr, UNROLL: gl.constexpr, WS: gl.constexpr):
    """K steps ``kk .. kk + UNROLL - 1`` (ring positions from ``it``): each step's product
    is promoted while the next step's wgmma runs; all drained at the end, so no register
    tile of a wgmma in flight crosses a loop edge (its copy would make ptxas serialize
    every wgmma: C7514). A wgmma writes into a tile already promoted (``spare``: the
    operand of a ``use_acc=False`` wgmma is only its registers), so the accumulator and two
    product tiles are all the registers it takes. Returns the accumulator and two spares."""
    tok = warpgroup_mma(*_boxes(a_bufs, b_bufs, ready, it, STAGES), spare0, use_acc=False,
                        is_async=True)
    sc = _scale(sa_ptr, sb_ptr, live, kk * BLOCK_K, A_GROUP, SCALE_K)
    spare = spare1
    for j in gl.static_range(1, UNROLL):
        nxt = warpgroup_mma(*_boxes(a_bufs, b_bufs, ready, it + j, STAGES), spare,
                            use_acc=False, is_async=True)
        sc_n = _scale(sa_ptr, sb_ptr, live, (kk + j) * BLOCK_K, A_GROUP, SCALE_K)
        d = warpgroup_mma_wait(num_outstanding=1, deps=(tok, ))
        acc += d * sc[:, None]
        _release(empty, a_desc, b_desc, a_bufs, b_bufs, ready, it + j - 1, k_steps,
                 row_start, b_row, BLOCK_K, STAGES, WS)
        spare = d
        tok = nxt
        sc = sc_n
    d = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
    acc += d * sc[:, None]
    _release(empty, a_desc, b_desc, a_bufs, b_bufs, ready, it + UNROLL - 1, k_steps,
             row_start, b_row, BLOCK_K, STAGES, WS)
    return acc, spare, d


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, t_expert, t_start, t_num,
              NB, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    num_tiles = gl.load(t_num)
    n_blocks = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    it = 0
    for w in range(gl.program_id(0), num_tiles * n_blocks, gl.num_programs(0)):
        tile, nb = _work(w, num_tiles, n_blocks, GROUP_M)
        row_start = gl.load(t_start + tile)
        b_row = gl.load(t_expert + tile) * NB + nb * BLOCK_N
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row_start, kk * BLOCK_K], ready.index(s),
                                            a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [b_row, kk * BLOCK_K], ready.index(s),
                                            b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, t_expert, t_start, t_end, t_num, a_scale, sa_row,
              rows_total, b_scale, SN, NB, N, K, out,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_GROUP: gl.constexpr,
              SCALE_N: gl.constexpr, SCALE_K: gl.constexpr, OVERLAP: gl.constexpr,
              UNROLL: gl.constexpr, WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.full((BLOCK_M, BLOCK_N), 0.0, gl.float32, mma)
    num_tiles = gl.load(t_num)
    n_blocks = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    SK = gl.cdiv(K, SCALE_K)
    it = 0
    for w in range(gl.program_id(0), num_tiles * n_blocks, gl.num_programs(0)):
        tile, nb = _work(w, num_tiles, n_blocks, GROUP_M)
        expert = gl.load(t_expert + tile)
        row_start = gl.load(t_start + tile)
        row_end = gl.load(t_end + tile)
        n0 = nb * BLOCK_N
        rows = row_start + gl.arange(0, BLOCK_M, layout=row_l)
        sa_ptr = a_scale + rows.to(gl.int64) * sa_row
        live = rows < rows_total
        sb_ptr = b_scale + expert.to(gl.int64) * SN * SK + (n0 // SCALE_N) * SK
        acc = zero
        if OVERLAP:
            spare0 = zero
            spare1 = zero
            for kk in range(0, k_steps, UNROLL):
                acc, spare0, spare1 = _overlapped_steps(
                    a_bufs, b_bufs, ready, empty, spare0, spare1, acc, it, kk, sa_ptr, sb_ptr,
                    live, 0, 0, 0, 0, 0, BLOCK_K, STAGES, A_GROUP, SCALE_K, UNROLL, True)
                it += UNROLL
        else:
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                tok = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero,
                                    use_acc=False, is_async=True)
                k = kk * BLOCK_K
                sa = gl.load(sa_ptr + k // A_GROUP, mask=live, other=0.0)
                sb = gl.load(sb_ptr + k // SCALE_K)
                d = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc += d * (sa * sb)[:, None]
                it += 1
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
        mask = (rows[:, None] < row_end) & (cols[None, :] < N)
        gl.store(out + rows[:, None].to(gl.int64) * N + cols[None, :], acc.to(gl.bfloat16),
                 mask=mask)


@gluon.jit
def fp8_gemm_ws_kernel(a_desc, b_desc, t_expert, t_start, t_end, t_num, a_scale, sa_row,
                       rows_total, b_scale, SN, NB, N, K, out,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_GROUP: gl.constexpr,
                       SCALE_N: gl.constexpr, SCALE_K: gl.constexpr, OVERLAP: gl.constexpr,
                       UNROLL: gl.constexpr, CONSUMER_ARRIVALS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    WARPS: gl.constexpr = gl.num_warps()
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMER_ARRIVALS)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, t_expert, t_start, t_end, t_num, a_scale,
                     sa_row, rows_total, b_scale, SN, NB, N, K, out, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, STAGES, A_GROUP, SCALE_N, SCALE_K, OVERLAP, UNROLL,
                     WARPS)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, t_expert, t_start, t_num,
                     NB, N, K, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
    ], [1], [PRODUCER_REGS])


def fp8_gemm_gluon(a_data, a_scale, w_data, w_scale, tiles, scale_block, *, block_m=128,
                   block_n=128, block_k=128, stages=4, group_m=8, programs=None,
                   overlap=True, consumer_arrivals=None, producer_regs=40, maxnreg=None,
                   out=None):
    """Warp-specialized: a one-warp TMA producer and the consumer warpgroups. Not yet
    measured: at ``23ca182`` it hung on an H200 (``2026-12-03/fp8-gemm-probe-r1.log``) --
    its ``empty`` barriers counted one arrival per consumer warpgroup, but Gluon 3.6's
    ``mbarrier.arrive`` is one arrival per partition (a ``bar.sync`` of the partition's
    warps, then one thread), so the producer waited forever; ``consumer_arrivals`` is 1
    now.

    ``out [rows, N] bf16`` of FP8 rows ``a_data [rows, K]`` (scales ``a_scale [rows,
    K/128]``, row-major) times ``w_data [E, N, K]`` (scales ``w_scale [E, SN, SK]`` in
    ``scale_block`` blocks); ``tiles`` as comet.kernels.fp8_gemm.MTiles. Requires
    ``block_n`` to divide the scale block's rows (one B scale per step)."""
    rows, k = a_data.shape
    e, n, _ = w_data.shape
    bn, bk = scale_block
    assert bn % block_n == 0 and bk % block_k == 0 and 128 % block_k == 0
    warps = block_m // 16
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a_data, [block_m, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(w_data.view(e * n, k), [block_n, block_k], b_layout)
    if out is None:
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=a_data.device)
    items = tiles.expert.shape[0] * triton.cdiv(n, block_n)
    grid = (max(1, min(items, programs or items)), )
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    fp8_gemm_ws_kernel[grid](
        a_desc, b_desc, tiles.expert, tiles.row_start, tiles.row_end, tiles.num, a_scale,
        a_scale.stride(0), rows, w_scale, w_scale.shape[1], n, n, k, out,
        block_m, block_n, block_k, group_m, stages, 128, bn, bk, overlap, _unroll(k, block_k),
        consumer_arrivals or 1, producer_regs, num_warps=warps, **kw)
    return out


@gluon.jit
def _issue(a_desc, b_desc, a_bufs, b_bufs, ready, i, k_steps, row_start, b_row,
           BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of K step ``i`` (if there is one) into its slot."""
    s = i % STAGES
    go = i < k_steps
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes,
                    pred=go)
    tma.async_copy_global_to_shared(a_desc, [row_start, i * BLOCK_K], ready.index(s),
                                    a_bufs.index(s), pred=go)
    tma.async_copy_global_to_shared(b_desc, [b_row, i * BLOCK_K], ready.index(s),
                                    b_bufs.index(s), pred=go)


@gluon.jit
def fp8_gemm_sw_kernel(a_desc, b_desc, t_expert, t_start, t_end, t_num, a_scale, sa_row,
                       rows_total, b_scale, SN, NB, N, K, out,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_GROUP: gl.constexpr,
                       SCALE_N: gl.constexpr, SCALE_K: gl.constexpr, UNROLL: gl.constexpr):
    """One work item per program, no warp specialization: the warps issue their own TMA
    loads ``STAGES`` steps ahead, and step ``i``'s product is promoted under step
    ``i + 1``'s wgmma (registers A and B alternating, as in ``_consumer``)."""
    WARPS: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    num_tiles = gl.load(t_num)
    tile, nb = _work(gl.program_id(0), num_tiles, gl.cdiv(N, BLOCK_N), GROUP_M)
    expert = gl.load(t_expert + tile)
    row_start = gl.load(t_start + tile)
    row_end = gl.load(t_end + tile)
    n0 = nb * BLOCK_N
    b_row = expert * NB + n0
    k_steps = gl.cdiv(K, BLOCK_K)
    for i in gl.static_range(STAGES):
        _issue(a_desc, b_desc, a_bufs, b_bufs, ready, i, k_steps, row_start, b_row, BLOCK_K,
               STAGES)
    rows = row_start + gl.arange(0, BLOCK_M, layout=row_l)
    sa_ptr = a_scale + rows.to(gl.int64) * sa_row
    live = rows < rows_total
    sb_ptr = b_scale + expert.to(gl.int64) * SN * gl.cdiv(K, SCALE_K) + \
        (n0 // SCALE_N) * gl.cdiv(K, SCALE_K)
    zero = gl.full((BLOCK_M, BLOCK_N), 0.0, gl.float32, mma)
    acc = zero
    spare0 = zero
    spare1 = zero
    for kk in range(0, k_steps, UNROLL):
        acc, spare0, spare1 = _overlapped_steps(
            a_bufs, b_bufs, ready, ready, spare0, spare1, acc, kk, kk, sa_ptr, sb_ptr, live,
            a_desc, b_desc, k_steps, row_start, b_row, BLOCK_K, STAGES, A_GROUP, SCALE_K,
            UNROLL, False)
    cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
    mask = (rows[:, None] < row_end) & (cols[None, :] < N)
    gl.store(out + rows[:, None].to(gl.int64) * N + cols[None, :], acc.to(gl.bfloat16),
             mask=mask)


def fp8_gemm_gluon_sw(a_data, a_scale, w_data, w_scale, tiles, scale_block, *, block_m=128,
                      block_n=128, block_k=128, stages=4, group_m=8, out=None):
    """:func:`fp8_gemm_gluon` without warp specialization (one work item per program)."""
    rows, k = a_data.shape
    e, n, _ = w_data.shape
    bn, bk = scale_block
    assert bn % block_n == 0 and bk % block_k == 0 and 128 % block_k == 0
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a_data, [block_m, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(w_data.view(e * n, k), [block_n, block_k], b_layout)
    if out is None:
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=a_data.device)
    items = tiles.expert.shape[0] * triton.cdiv(n, block_n)
    if items:
        fp8_gemm_sw_kernel[(items, )](
            a_desc, b_desc, tiles.expert, tiles.row_start, tiles.row_end, tiles.num, a_scale,
            a_scale.stride(0), rows, w_scale, w_scale.shape[1], n, n, k, out,
            block_m, block_n, block_k, group_m, stages, 128, bn, bk, _unroll(k, block_k),
            num_warps=block_m // 16)
    return out
