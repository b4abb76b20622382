"""The block-scaled FP8 GroupGEMM of large calls as a warp-specialized Gluon kernel.

Why a second kernel: in :mod:`comet.kernels.fp8_gemm`'s ``tl`` K loop each step's product
must be complete before it is scaled into the fp32 accumulator (a dot whose result another
op uses is made synchronous), so the tensor core idles while the CUDA cores promote. Here
a one-warp producer partition streams the boxes through ``STAGES`` slots of shared memory
with TMA, and the consumer warpgroups promote each wgmma's product while the next one
runs, so neither unit waits for the other (docs/precision.md). By default it promotes
every step's sum (128 K); ``promotion_k=32`` every 32 K (four wgmmas on slices of a
step's boxes), slower: a promotion per 32 K costs the CUDA cores what the wgmma costs the
tensor cores (docs/notebook.md, "GEMMs").

A work item is one m-tile of the plan's table (``BLOCK_M`` = 64 rows of one expert) times
two boxes of B, each ``BLOCK_N`` rows (K-major, the checkpoint's ``[E, N, K]``), on two
consumer partitions of one warpgroup each that share the A box:

* layer0 (``GATED``): box 0 the gate rows ``n0:+BLOCK_N``, box 1 the up rows ``N + n0:``;
  the epilogue is split by columns between the two partitions, each handing the other
  half of its fp32 tile over in shared memory (gate keeps the left half, up the right):
  each applies the gated activation to its ``BLOCK_N / 2`` columns, the two trade their
  rows' partial amax, and each quantizes its half of the row's one group of the recipe
  (:func:`comet.kernels.fp8_gemm.quantize_groups`) and stores it in FP8. Half the
  epilogue each, not all of it on one partition while the other stalls a ring's depth
  into the next item: with K = 2048 (16 steps) the epilogue is a large part of an item;
* layer1: boxes 0 and 1 the columns ``n0:+BLOCK_N`` and ``n0 + BLOCK_N:``, each partition
  storing its own tile -- into a bf16 ``out`` (``EPILOGUE_STORE``), or, weighted, into its
  rows' token slots (``EPILOGUE_SCATTER``, :func:`comet.kernels.layer1.scatter_home`'s
  epilogue).

Or, ``PAIRED``, an item is a 128-row m-tile times one box at a time, each consumer on a row
half of the A box (a fifth fewer bytes a K step for the same FLOPs: the K loop is bound by
moving the boxes from L2, docs/precision.md): layer1 over its column block, layer0 over
its gate box, then its up box, the gate tile parked in shared memory, each consumer then
holding whole rows of the h group (no trade).

The kernel waits for no peer: it runs where every row it reads is in place when it starts
(a rank with no peers, after its dispatch launch: ``Variant.fp8_ws_min_rows``). Its
scales are one per step for A (a row's 128-value group) and for B (``SCALE_N x SCALE_K``
blocks that are multiples of the boxes: :func:`fits`); other scale layouts run the ``tl``
kernels. Gluon has no interpreter: the kernel is checked by compiling it for sm_90
(tests/sm90_compile.py) and on a GPU (tests/test_gpu_fp8_ws.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from comet.activation import GatedActivation
from comet.constants import ADDRESS_ALIGN, constexpr
from comet.kernels.activation import Act, act_tile, gated
from comet.kernels.fp8_gemm import (AMAX_EPS, E4M3_MAX, SCALE_PER_AMAX, Fp8Gather, Fp8GemmConfig,
                                    MTiles, bf16_out, check_group_gemm, check_m_tiles,
                                    imprecise_acc)
from comet.kernels.group_gemm import grouped_work
from comet.quant import E4M3, GROUP, Fp8Rows, Fp8Weight

#: Rows of a work item: the FP8 plan's m-tile (comet.runtime.layer.FP8_BLOCK_M), one
#: warpgroup's wgmma rows.
BLOCK_M = 64
#: Rows of each B box: one activation group (layer0 quantizes a tile's h row as one group).
BLOCK_N = GROUP
#: Rows of a paired item (``ws_gemm``'s ``paired``): a row half per consumer.
PAIRED_ROWS = 2 * BLOCK_M
#: K per step: one scale of A and of B per step.
BLOCK_K = GROUP
#: Shared-memory slots of the ring: 40 KiB each (A box and two B boxes).
STAGES = 4
#: Registers of the producer warp (it only issues TMA copies) and of the second consumer.
PRODUCER_REGS = constexpr(40)
CONSUMER_REGS = constexpr(232)
#: Most K steps per drained group of :func:`_steps`: a wgmma's register tile never
#: crosses a loop edge (a copy of one in flight made ptxas serialize every wgmma, C7514).
MAX_UNROLL = 2

#: TMA box load: ``async_load`` from Triton 3.7 on, which removed 3.6's name for it.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: cp.async of a pointer tile into shared memory (the same rename).
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: A's shared-memory box, TMA's or the gather's (128-byte rows of e4m3, swizzled as wgmma
#: reads them).
A_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                           rank=2))
#: The gathering producer's view of an A box: a lane copies 64 bytes (four cp.async) of
#: each of its 4 rows, whole 32-byte sectors; 16 rows per instruction of the warp. Few rows
#: a lane: their addresses are registers, and the producer warp has PRODUCER_REGS
#: (setmaxnreg counts it as a warpgroup beside the two consumers).
GATHER = gl.constexpr(gl.BlockedLayout([1, 64], [16, 2], [1, 1], [1, 0]))
#: Lanes of the producer warp: with ``A_GATHER`` each arrives on a slot's ``ready`` once its
#: copies landed.
PRODUCER_LANES = gl.constexpr(32)

EPILOGUE_STORE = constexpr(0)
EPILOGUE_SCATTER = constexpr(1)


class WsTile(NamedTuple):
    """Constexpr shape and choices of the kernel."""

    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    GROUP_M: gl.constexpr      # m-tiles sweeping the column blocks together (L2 reuse)
    STAGES: gl.constexpr
    UNROLL: gl.constexpr       # K steps per drained group (divides the step count)
    A_GROUP: gl.constexpr      # K values per A scale
    SCALE_N: gl.constexpr      # B's scale block
    SCALE_K: gl.constexpr
    GATED: gl.constexpr        # box 1 is the up half: act(gate) * up, requantized
    ACT: Act
    EPILOGUE: gl.constexpr     # without GATED: EPILOGUE_STORE or EPILOGUE_SCATTER
    MMA_K: gl.constexpr        # K values a wgmma sums before fp32 promotion
    A_GATHER: gl.constexpr     # A's rows read through an index (Fp8Gather), not TMA boxes
    #: An item is an m-tile of 2 * BLOCK_M rows, the consumers on its row halves, times
    #: one B box (GATED: the gate box, then the up box; see :func:`ws_gemm`'s ``paired``)
    PAIRED: gl.constexpr = constexpr(False)


class WsOperands(NamedTuple):
    """Run-time operands besides the TMA descriptors and the epilogue's group."""

    tiles: MTiles
    a_scale: torch.Tensor | None  # fp32 [rows, ceil(K / A_GROUP)] (strides below); None
                                  # with A_GATHER (each packed row's scales follow it)
    sa_row: int
    sa_group: int
    rows: int                  # rows of A: scale loads stop there
    b_scale: torch.Tensor      # fp32 [E, SN, SK]
    SN: int                    # scale rows per expert
    up_scale_row: int          # GATED: scale row of the first up row (else unused)
    NB: int                    # B rows per expert
    N: int                     # output columns (GATED: F)
    K: int


class WsH(NamedTuple):
    """layer0's output: h in FP8 groups (``GATED``)."""

    out: torch.Tensor          # e4m3 [rows, N]
    out_scale: torch.Tensor    # fp32 [rows, ceil(N / BLOCK_N)]


class WsOut(NamedTuple):
    """A plain GEMM's output (``EPILOGUE_STORE``)."""

    out: torch.Tensor          # bf16 [rows, N]


# ------------------------------------------------------------------------ producer
@gluon.jit
def _item(w, tiles, n_blocks, t):
    """``(expert, row_start, row_end, n0)`` of work item ``w`` in the grouped order."""
    tile, nb = grouped_work(w, gl.load(tiles.num), n_blocks, t.GROUP_M)
    return (gl.load(tiles.expert + tile), gl.load(tiles.row_start + tile),
            gl.load(tiles.row_end + tile), nb * _item_cols(t))


@gluon.jit
def _item_cols(t):
    """Output columns of one item: ``BLOCK_N`` (GATED: both boxes give one h tile;
    PAIRED: one box, both consumers) or two boxes' worth."""
    if t.GATED or t.PAIRED:
        return t.BLOCK_N
    else:
        return 2 * t.BLOCK_N


@gluon.jit
def _second_box(op, t):
    """B rows from box 0 to box 1: the up half (GATED) or the next column block."""
    if t.GATED:
        off = op.N
    else:
        off = t.BLOCK_N
    return off


@gluon.jit
def gathered_rows(gather, rows, row_end):
    """``(base, read)`` (``A_GATHER``): byte pointers to the packed rows (K e4m3 values, then
    their fp32 group scales) that A's rows ``rows`` read, ``gather.tokens`` at ``src[row]
    * row_bytes``, and which rows are the item's (the others read nothing)."""
    read = rows < row_end
    src = gl.load(gather.src + rows, mask=read, other=0).to(gl.int64)
    return gather.tokens + src * gather.row_bytes, read


@gluon.jit
def _gather_a(slot, bar, gather, row_start, row_end, k, t):
    """K step ``k`` of the item's rows ``row_start:+BLOCK_M``, read through the index
    (:func:`gathered_rows`), into the A box ``slot`` by cp.async, each lane's copies
    landing on ``bar`` (rows not the item's land as zeros)."""
    rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, GATHER))
    base, read = gathered_rows(gather, rows, row_end)
    cols = k + gl.arange(0, t.BLOCK_K, layout=gl.SliceLayout(0, GATHER))
    ptrs = (base[:, None] + cols[None, :]).to(gl.pointer_type(gl.float8e4nv))
    cp_async(slot, ptrs, mask=read[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def producer(a_desc, b_desc, a_bufs, b_bufs, c_bufs, ready, empty, op, gather, t):
    """Every item of this program, every K step: the A box and both B boxes into the
    next free slot (``empty``), landing on ``ready`` -- B by TMA, A by TMA too, or with
    ``A_GATHER`` by each lane's cp.async of its rows (``ready`` counts the lanes). PAIRED:
    the A box and one B box a step, over K once, or with GATED twice (the gate box, then
    the up box)."""
    n_blocks = gl.cdiv(op.N, _item_cols(t))
    k_steps = gl.cdiv(op.K, t.BLOCK_K)
    if t.A_GATHER:
        nbytes: gl.constexpr = 2 * b_desc.block_type.nbytes
    elif t.PAIRED:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    PASSES: gl.constexpr = 2 if t.PAIRED and t.GATED else 1
    it = 0
    for w in range(gl.program_id(0), gl.load(op.tiles.num) * n_blocks, gl.num_programs(0)):
        expert, row_start, row_end, n0 = _item(w, op.tiles, n_blocks, t)
        for p in gl.static_range(PASSES):
            b_row = expert * op.NB + n0 + p * _second_box(op, t)
            for kk in range(k_steps):
                s = it % t.STAGES
                mbarrier.wait(empty.index(s), ((it // t.STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                k = kk * t.BLOCK_K
                if t.A_GATHER:
                    _gather_a(a_bufs.index(s), ready.index(s), gather, row_start, row_end, k,
                              t)
                else:
                    tma_load(a_desc, [row_start, k], ready.index(s), a_bufs.index(s))
                tma_load(b_desc, [b_row, k], ready.index(s), b_bufs.index(s))
                if not t.PAIRED:
                    tma_load(b_desc, [b_row + _second_box(op, t), k], ready.index(s),
                             c_bufs.index(s))
                it += 1


# ------------------------------------------------------------------------ consumers
#: A consumer warpgroup's accumulator: wgmma's register layout, four warps of 16 rows.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, BLOCK_N, 32]))
#: h's FP8 half tile as layer0 stores it: 16 bytes of a row per thread.
ROW_STORE = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
#: A bf16 tile as layer1 stores it: 16 bytes of a row per thread, a warp two whole rows of
#: ``BLOCK_N``. The accumulator's layout gives a thread two adjacent values of a row: a
#: warp's store then writes 16 bytes of each of 8 rows, half a sector each, in four times
#: the instructions.
BF16_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
#: A half tile handed over in shared memory, written and read in the accumulator's
#: layout: a warp's access is 8 rows x 4 pairs of columns, and rows of 64 fp32 lie on the
#: same banks; XOR-ing 32-byte blocks by the row spreads the 8 rows over every bank (an
#: unswizzled buffer serializes them 8-way).
XBUF = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
#: The rows' partial amax traded between the two halves.
ABUF = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _step_scale(sa_ptr, live, sb_ptr, sb_ok, op, t, k):
    """fp32 ``[BLOCK_M]``: A's row scales times B's block scale for K step ``k``."""
    sa = gl.load(sa_ptr + (k // t.A_GROUP) * op.sa_group, mask=live, other=0.0)
    return sa * gl.load(sb_ptr + k // t.SCALE_K, mask=sb_ok, other=0.0)


@gluon.jit
def _wgmma(a_bufs, x_bufs, ready, step, J: gl.constexpr, into, t, HALF: gl.constexpr):
    """K slice ``J`` (``MMA_K`` values) of ring step ``step``: its exact product ``A @
    B^T`` into the registers of ``into``, async; a step's first slice waits for its slot
    to land. ``HALF``: with PAIRED, the A box's row half this consumer multiplies."""
    s = step % t.STAGES
    if J == 0:
        mbarrier.wait(ready.index(s), (step // t.STAGES) & 1)
        if t.A_GATHER:
            # cp.async wrote the A box through the generic proxy; wgmma reads it
            # through the async one.
            fence_async_shared()
    a = a_bufs.index(s)
    if t.PAIRED:
        a = a.slice(HALF * t.BLOCK_M, t.BLOCK_M, 0)
    if t.MMA_K == t.BLOCK_K:
        b = x_bufs.index(s)
    else:
        a = a.slice(J * t.MMA_K, t.MMA_K, 1)
        b = x_bufs.index(s).slice(J * t.MMA_K, t.MMA_K, 1)
    return warpgroup_mma(a, b.permute((1, 0)), into, use_acc=False, is_async=True)


@gluon.jit
def _promoted(acc, d, sc, empty, step, J: gl.constexpr, t):
    """``acc + d * sc`` for slice ``J`` of ring step ``step``; a step's last slice frees
    its slot for the producer."""
    acc += d * sc[:, None]
    if J == t.BLOCK_K // t.MMA_K - 1:
        mbarrier.arrive(empty.index(step % t.STAGES), count=1)
    return acc


@gluon.jit
def _steps(a_bufs, x_bufs, ready, empty, spare0, spare1, acc, it, kk, sa_ptr, live, sb_ptr,
           sb_ok, op, t, HALF: gl.constexpr):
    """K steps ``kk .. kk + UNROLL - 1`` (ring positions from ``it``), each in
    ``BLOCK_K // MMA_K`` wgmmas of ``MMA_K`` values: each wgmma's exact product is
    promoted into fp32, ``acc += d * sa * sb`` (the step's scales), while the next one
    runs; the last one drained. With ``MMA_K`` = ``BLOCK_K`` (the default) that is
    a whole step's sum, and with 32 (``promotion_k=32``) every instruction's, as
    ``max_num_imprecise_acc=32`` asks -- whose lowering takes another register tile and
    spilled here. A wgmma writes into a tile already promoted (``spare``: the operand
    of a ``use_acc=False`` wgmma is only its registers), so the accumulator and two
    product tiles are all the registers it takes. Returns the accumulator and two spares.
    ``HALF``: as :func:`_wgmma`'s."""
    SLICES: gl.constexpr = t.BLOCK_K // t.MMA_K
    tok = _wgmma(a_bufs, x_bufs, ready, it, 0, spare0, t, HALF)
    sc = _step_scale(sa_ptr, live, sb_ptr, sb_ok, op, t, kk * t.BLOCK_K)
    spare = spare1
    for j in gl.static_range(1, t.UNROLL * SLICES):
        nxt = _wgmma(a_bufs, x_bufs, ready, it + j // SLICES, j % SLICES, spare, t, HALF)
        if j % SLICES == 0:
            sc_next = _step_scale(sa_ptr, live, sb_ptr, sb_ok, op, t,
                                  (kk + j // SLICES) * t.BLOCK_K)
        else:
            sc_next = sc
        d = warpgroup_mma_wait(num_outstanding=1, deps=(tok, ))
        acc = _promoted(acc, d, sc, empty, it + (j - 1) // SLICES, (j - 1) % SLICES, t)
        spare = d
        tok = nxt
        sc = sc_next
    d = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
    acc = _promoted(acc, d, sc, empty, it + t.UNROLL - 1, SLICES - 1, t)
    return acc, spare, d


@gluon.jit
def _scale_row(n0, op, t, BOX: gl.constexpr):
    """B's scale row of box ``BOX`` of the item at columns ``n0``, as :func:`producer`
    loads the boxes: the gate rows, the up rows (GATED) or the next column block."""
    if BOX == 0:
        row = n0 // t.SCALE_N
    elif t.GATED:
        row = op.up_scale_row + n0 // t.SCALE_N
    else:
        row = (n0 + t.BLOCK_N) // t.SCALE_N
    return row


@gluon.jit
def _tile_acc(a_bufs, x_bufs, ready, empty, it, expert, row_start, row_end, scale_row, op,
              gather, t, HALF: gl.constexpr):
    """The fp32 tile of rows ``row_start:+BLOCK_M`` times the ring's B box of scale row
    ``scale_row`` (:func:`_scale_row`) over all of K, from the ring (positions from
    ``it``); returns it and the next position. PAIRED: the rows are the A box's row half
    ``HALF``, whose first row ``row_start`` is. A's scales: its rows', or with
    ``A_GATHER`` those after each gathered row's values (the item's rows only)."""
    rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, MMA))
    if t.A_GATHER:
        base, live = gathered_rows(gather, rows, row_end)
        sa_ptr = (base + op.K).to(gl.pointer_type(gl.float32))
    else:
        live = rows < op.rows
        sa_ptr = op.a_scale + rows.to(gl.int64) * op.sa_row
    sk = gl.cdiv(op.K, t.SCALE_K)
    sb_ok = scale_row < op.SN      # box 1 of a layer's last column block may lie past N
    sb_ptr = op.b_scale + (expert.to(gl.int64) * op.SN + scale_row) * sk
    zero = gl.full([t.BLOCK_M, t.BLOCK_N], 0.0, gl.float32, MMA)
    acc = zero
    spare0 = zero
    spare1 = zero
    k_steps = gl.cdiv(op.K, t.BLOCK_K)
    for kk in range(0, k_steps, t.UNROLL):
        acc, spare0, spare1 = _steps(a_bufs, x_bufs, ready, empty, spare0, spare1, acc,
                                     it + kk, kk, sa_ptr, live, sb_ptr, sb_ok, op, t, HALF)
    return acc, it + k_steps


@gluon.jit
def _as_rows(value, row_start, n0, t):
    """``(value, rows, cols)``: a tile of the item's rows ``row_start:`` and columns
    ``n0:``, from the accumulator's layout into :data:`BF16_ROWS` (whole rows a warp),
    with its rows' and columns' indices in that layout."""
    value = gl.convert_layout(value, BF16_ROWS)
    rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, BF16_ROWS))
    cols = n0 + gl.arange(0, t.BLOCK_N, layout=gl.SliceLayout(0, BF16_ROWS))
    return value, rows, cols


@gluon.jit
def _store(acc, epi, op, t, row_start, row_end, n0):
    """``EPILOGUE_STORE``: the tile into ``out`` in its dtype, whole rows a warp."""
    value, rows, cols = _as_rows(acc.to(epi.out.dtype.element_ty), row_start, n0, t)
    mask = (rows[:, None] < row_end) & (cols[None, :] < op.N)
    gl.store(epi.out + rows[:, None].to(gl.int64) * op.N + cols[None, :], value, mask=mask)


@gluon.jit
def _scatter(acc, homes, op, t, row_start, row_end, n0):
    """``EPILOGUE_SCATTER``: row ``r`` of the tile, times its routing weight, into its
    token's slot ``pair_out[home[r]]`` on the token's rank (and the rest of its group of
    ``FANOUT``): :func:`comet.kernels.layer1.scatter_home` on this kernel's layout."""
    rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, MMA))
    weight = gl.load(homes.weight + rows, mask=rows < row_end, other=0.0)
    # Weighted in the accumulator's layout (two rows a thread), stored whole rows a warp
    # (BF16_ROWS: eight rows a thread, whose destinations are loaded in that layout).
    value, rows, cols = _as_rows(
        (acc * weight[:, None]).to(homes.pair_out.local.dtype.element_ty), row_start, n0, t)
    live = rows < row_end
    home = gl.load(homes.home + rows, mask=live, other=0)
    mask = live[:, None] & (cols[None, :] < op.N)
    rank = home // homes.slots
    offset = (home % homes.slots).to(gl.int64) * op.N
    for q in gl.static_range(homes.FANOUT):
        base = gl.load(homes.pair_out.peers + (rank - rank % homes.FANOUT + q), mask=live,
                       other=0)
        # Symmetric buffers are ADDRESS_ALIGN-aligned (comet.kernels.address): said so,
        # a thread's two adjacent values are one store, not two 2-byte ones.
        ptr = gl.multiple_of(base.to(gl.pointer_type(homes.pair_out.local.dtype.element_ty)),
                             ADDRESS_ALIGN) + offset
        gl.store(ptr[:, None] + cols[None, :], value, mask=mask)


@gluon.jit
def _epilogue(acc, epi, op, t, row_start, row_end, n0):
    if t.EPILOGUE == EPILOGUE_SCATTER:
        _scatter(acc, epi, op, t, row_start, row_end, n0)
    else:
        _store(acc, epi, op, t, row_start, row_end, n0)


@gluon.jit
def _halves(acc):
    """The column halves ``(acc[:, :n/2], acc[:, n/2:])`` of a tile, each thread keeping
    its own registers."""
    m: gl.constexpr = acc.shape[0]
    n: gl.constexpr = acc.shape[1]
    return acc.reshape([m, 2, n // 2]).permute(0, 2, 1).split()


@gluon.jit
def _trade(mine, bufs, full, free, j, BOX: gl.constexpr):
    """Hands ``mine`` to the other partition through ``bufs[BOX]`` and returns what it
    handed over in ``bufs[1 - BOX]`` (same shape and layout), for the item counted ``j``;
    each buffer is written again once its reader freed it."""
    mbarrier.wait(free.index(BOX), (j & 1) ^ 1)
    bufs.index(BOX).store(mine)
    mbarrier.arrive(full.index(BOX), count=1)
    mbarrier.wait(full.index(1 - BOX), j & 1)
    theirs = bufs.index(1 - BOX).load(mine.type.layout)
    mbarrier.arrive(free.index(1 - BOX), count=1)
    return theirs


@gluon.jit
def _over_scale(x, scale):
    """``x / scale[:, None]`` rounded as one IEEE division (the recipe's, torch's) each:
    the row's reciprocal once, then each quotient ``q0 = x r`` corrected once by its
    residual, ``q = q0 + (x - q0 scale) r`` (two fma, the residual exact) -- the sequence of
    the division's own fast path, less the per-value reciprocal and its range check (the
    slow path's branch). The check guards subnormal and huge operands: a scale is at least
    ``AMAX_EPS / 448``, and a subnormal value of h, whose quotient the correction might
    round otherwise, is zero in e4m3 either way. A division per value made this the gated
    epilogue's largest cost (a MUFU and a branch each, 32 a thread)."""
    r = gl.broadcast(gl.div_rn(gl.full_like(scale, 1.0), scale)[:, None], x)[0]
    s = gl.broadcast(scale[:, None], x)[0]
    q0 = x * r
    return gl.fma(gl.fma(-q0, s, x), r, q0)


@gluon.jit
def _h_amax(h, c0, op):
    """``(h, amax)``: ``h`` (columns from ``c0``) with its columns past N zeroed, and each
    row's amax over them."""
    cols = c0 + gl.arange(0, h.shape[1], layout=gl.SliceLayout(0, h.type.layout))
    h = gl.where(cols[None, :] < op.N, h, 0.0)
    return h, gl.max(gl.abs(h), axis=1)


@gluon.jit
def _store_h(h, amax, epi, op, t, row_start, row_end, n0, c0: gl.constexpr,
             SCALE: gl.constexpr):
    """Columns ``n0 + c0:`` of the rows' h group at ``n0``, quantized with the group's
    ``amax`` as the recipe does (:func:`comet.kernels.fp8_gemm.quantize_groups`), stored
    in FP8 -- and with ``SCALE`` the group's scales."""
    scale = gl.maximum(amax, AMAX_EPS) * SCALE_PER_AMAX
    q = gl.minimum(gl.maximum(_over_scale(h, scale), -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
    if SCALE:
        rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, h.type.layout))
        gl.store(epi.out_scale + rows.to(gl.int64) * gl.cdiv(op.N, t.BLOCK_N)
                 + n0 // t.BLOCK_N, scale, mask=rows < row_end)
    # A thread of the accumulator holds two adjacent values (2-byte stores): 16 a thread.
    q = gl.convert_layout(q, ROW_STORE)
    rows = row_start + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(1, ROW_STORE))
    cols = n0 + c0 + gl.arange(0, h.shape[1], layout=gl.SliceLayout(0, ROW_STORE))
    gl.store(epi.out + rows[:, None].to(gl.int64) * op.N + cols[None, :], q,
             mask=(rows[:, None] < row_end) & (cols[None, :] < op.N))


@gluon.jit
def _gated_half(acc, xbufs, x_full, x_free, abufs, a_full, a_free, epi, op, t, j,
                row_start, row_end, n0, BOX: gl.constexpr):
    """``GATED``: this partition's half of the item's h tile (the gate partition the left
    columns, the up one the right), from its own fp32 tile (gate or up) and the other's
    half handed over; quantized per row as one group of ``BLOCK_N`` columns with the
    other half's amax, its e4m3 values stored (and by the gate partition the scale)."""
    HALF: gl.constexpr = t.BLOCK_N // 2
    lo, hi = _halves(acc)
    if BOX == 0:
        gate = lo
        up = _trade(hi, xbufs, x_full, x_free, j, BOX)
    else:
        up = hi
        gate = _trade(lo, xbufs, x_full, x_free, j, BOX)
    h, amax = _h_amax(gated(gate, up, t.ACT), n0 + BOX * HALF, op)
    amax = gl.maximum(amax, _trade(amax, abufs, a_full, a_free, j, BOX))
    _store_h(h, amax, epi, op, t, row_start, row_end, n0, BOX * HALF, BOX == 0)


@gluon.jit
def _paired_gated(a_bufs, x_bufs, ready, empty, park, it, expert, row_start, row_end, n0, epi,
                  op, gather, t, HALF: gl.constexpr):
    """``GATED`` and ``PAIRED``: the h tile of row half ``HALF`` of the item, all of its
    ``BLOCK_N`` columns (the row's whole group, no trade with the other partition): the
    gate tile over K, parked in shared memory ``park`` while the up tile runs over K (the
    two and the product tiles would not fit the registers), then the activation and the
    requantization. Returns the next ring position."""
    gate, it = _tile_acc(a_bufs, x_bufs, ready, empty, it, expert, row_start, row_end,
                         _scale_row(n0, op, t, 0), op, gather, t, HALF)
    park.store(gate)
    up, it = _tile_acc(a_bufs, x_bufs, ready, empty, it, expert, row_start, row_end,
                       _scale_row(n0, op, t, 1), op, gather, t, HALF)
    # Each thread reads back only what it stored: no barrier.
    h, amax = _h_amax(gated(park.load(MMA), up, t.ACT), n0, op)
    _store_h(h, amax, epi, op, t, row_start, row_end, n0, 0, True)
    return it


@gluon.jit
def consumer(a_bufs, x_bufs, ready, empty, xbufs, x_full, x_free, abufs, a_full, a_free,
             park, epi, op, gather, t, BOX: gl.constexpr):
    """Box ``BOX`` of every item: its columns get the layer's epilogue, or with ``GATED``
    half of layer0's (:func:`_gated_half`: box 0 the gate tile, box 1 the up tile); with
    ``PAIRED``, row half ``BOX`` of the item times its one box, or with ``GATED`` its gate
    then its up box (:func:`_paired_gated`; a half past the item's rows multiplies rows it
    then does not store)."""
    n_blocks = gl.cdiv(op.N, _item_cols(t))
    it = 0
    j = 0
    for w in range(gl.program_id(0), gl.load(op.tiles.num) * n_blocks, gl.num_programs(0)):
        expert, row_start, row_end, n0 = _item(w, op.tiles, n_blocks, t)
        if t.PAIRED:
            row_start += BOX * t.BLOCK_M
            if t.GATED:
                it = _paired_gated(a_bufs, x_bufs, ready, empty, park.index(BOX), it, expert,
                                   row_start, row_end, n0, epi, op, gather, t, BOX)
            else:
                acc, it = _tile_acc(a_bufs, x_bufs, ready, empty, it, expert, row_start,
                                    row_end, _scale_row(n0, op, t, 0), op, gather, t, BOX)
                _epilogue(acc, epi, op, t, row_start, row_end, n0)
        else:
            acc, it = _tile_acc(a_bufs, x_bufs, ready, empty, it, expert, row_start, row_end,
                                _scale_row(n0, op, t, BOX), op, gather, t, 0)
            if t.GATED:
                _gated_half(acc, xbufs, x_full, x_free, abufs, a_full, a_free, epi, op, t, j,
                            row_start, row_end, n0, BOX)
            else:
                _epilogue(acc, epi, op, t, row_start, row_end, n0 + BOX * t.BLOCK_N)
        j += 1


# ------------------------------------------------------------------------ kernel
@gluon.jit
def fp8_ws_gemm_kernel(a_desc, b_desc, op, epi, gather, t):
    """Persistent programs striding over the work items (m-tile x column block, in
    layer0's grouped order, comet.kernels.group_gemm.grouped_work): the producer warp
    and the two consumer warpgroups of :mod:`this module <comet.kernels.fp8_ws>`.

    a_desc, b_desc: TMA descriptors of A (FP8 rows, box ``[BLOCK_M, BLOCK_K]``; None with
    ``A_GATHER``) and B (``[E * NB, K]``, box ``[BLOCK_N, BLOCK_K]``); op:
    :class:`WsOperands`; epi: :class:`WsH` (``GATED``), :class:`WsOut` or
    :class:`comet.kernels.layer1.Homes`; gather: with ``A_GATHER`` the
    :class:`comet.kernels.fp8_gemm.Fp8Gather` A's rows are read through (else None);
    t: :class:`WsTile`."""
    A_ROWS: gl.constexpr = 2 * t.BLOCK_M if t.PAIRED else t.BLOCK_M
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [t.STAGES, A_ROWS, t.BLOCK_K], A_SMEM)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [t.STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    if t.PAIRED:    # both consumers read the one box
        c_bufs = b_bufs
    else:
        c_bufs = gl.allocate_shared_memory(b_desc.dtype, [t.STAGES] + b_desc.block_type.shape,
                                           b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [t.STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [t.STAGES, 1], mbarrier.MBarrierLayout())
    # GATED: each partition's half tile and rows' amax on their way to the other, or
    # with PAIRED each one's parked gate tile (one element each, unused, else).
    if t.GATED and not t.PAIRED:
        xbufs = gl.allocate_shared_memory(gl.float32, [2, t.BLOCK_M, t.BLOCK_N // 2], XBUF)
        abufs = gl.allocate_shared_memory(gl.float32, [2, t.BLOCK_M], ABUF)
    else:
        xbufs = gl.allocate_shared_memory(gl.float32, [2, 1, 1], XBUF)
        abufs = gl.allocate_shared_memory(gl.float32, [2, 1], ABUF)
    if t.GATED and t.PAIRED:
        park = gl.allocate_shared_memory(gl.float32, [2, t.BLOCK_M, t.BLOCK_N], XBUF)
    else:
        park = gl.allocate_shared_memory(gl.float32, [2, 1, 1], XBUF)
    x_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(t.STAGES):
        # The TMA bytes' expect; with A_GATHER also each producer lane's cp.async arrive.
        if t.A_GATHER:
            mbarrier.init(ready.index(i), count=1 + PRODUCER_LANES)
        else:
            mbarrier.init(ready.index(i), count=1)
        # Both consumers read every slot; an arrive is one per partition.
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(x_full.index(i), count=1)
        mbarrier.init(x_free.index(i), count=1)
        mbarrier.init(a_full.index(i), count=1)
        mbarrier.init(a_free.index(i), count=1)
    gl.warp_specialize([
        (consumer, (a_bufs, b_bufs, ready, empty, xbufs, x_full, x_free, abufs, a_full,
                    a_free, park, epi, op, gather, t, 0)),
        (consumer, (a_bufs, c_bufs, ready, empty, xbufs, x_full, x_free, abufs, a_full,
                    a_free, park, epi, op, gather, t, 1)),
        (producer, (a_desc, b_desc, a_bufs, b_bufs, c_bufs, ready, empty, op, gather, t)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------- host
def fits(w: Fp8Weight, gated: bool) -> bool:
    """Whether this kernel runs GEMMs on ``w``: one B scale per box and step (scale
    blocks of whole boxes, and the up half on a block boundary), K rows 16-byte aligned."""
    bn, bk = w.block_shape()
    up_aligned = not gated or w.parts == 2 or (w.n // 2) % bn == 0
    return bn % BLOCK_N == 0 and bk % BLOCK_K == 0 and up_aligned and w.k % 16 == 0


def unroll(k: int, promotion_k: int) -> int:
    """K steps per drained group: the most, up to :data:`MAX_UNROLL`, dividing the steps
    -- one where ``promotion_k`` splits a step into a chain of wgmmas (two steps of four
    spilled layer0's kernel 1.7 KB at 168 registers)."""
    if promotion_k < BLOCK_K:
        return 1
    steps = triton.cdiv(k, BLOCK_K)
    return next(u for u in range(MAX_UNROLL, 0, -1) if steps % u == 0)


class WsLaunch(NamedTuple):
    """One launch of :func:`fp8_ws_gemm_kernel`, its arguments built once (the same
    launch serves every call of a layer: its buffers are at fixed addresses)."""

    a: TensorDescriptor | None
    b: TensorDescriptor
    op: WsOperands
    epi: tuple
    gather: Fp8Gather | None
    tile: WsTile

    def __call__(self, programs: int) -> None:
        fp8_ws_gemm_kernel[(programs, )](a_desc=self.a, b_desc=self.b, op=self.op,
                                         epi=self.epi, gather=self.gather, t=self.tile,
                                         num_warps=4)


def ws_gemm(a: torch.Tensor | Fp8Gather, a_scale: torch.Tensor | None, w: Fp8Weight,
            tiles: MTiles, epi: tuple, *, activation: GatedActivation | None = None,
            scatter: bool = False, group_m: int = 8, promotion_k: int = BLOCK_K,
            paired: bool = False, stages: int = STAGES) -> WsLaunch:
    """The launch of ``a`` (e4m3 rows ``[rows, K]``, any 16-byte row stride; fp32
    ``a_scale [rows, ceil(K / GROUP)]``, any strides; or A's rows read through an index,
    :class:`comet.kernels.fp8_gemm.Fp8Gather`, with ``a_scale`` None and K a multiple of
    :data:`BLOCK_K`) times ``w``, over ``tiles`` (m-tiles of at most :data:`BLOCK_M`
    rows): with ``activation`` (``w = [gate | up]``), h into ``epi`` (:class:`WsH`); else
    ``epi`` a :class:`WsOut` or (``scatter``) the scatter epilogue's
    :class:`comet.kernels.layer1.Homes`. ``w`` must :func:`fit`. ``promotion_k``: as
    :class:`comet.quant.Fp8`. ``paired`` (placed rows only): ``tiles`` of up to 2 x
    :data:`BLOCK_M` rows, an item one such m-tile, the two consumers on its row halves,
    times one B box -- a K step moves 32 KiB (an A box of 128 rows, one B box) where the
    default's moves 40 (64 rows, two B boxes) for the same FLOPs; with ``activation`` an
    item runs its gate box over K, then its up box, each consumer parking its gate tile in
    shared memory (32 KiB) meanwhile. ``stages``: slots of the ring."""
    gated_ = activation is not None
    if paired and isinstance(a, Fp8Gather):
        raise ValueError("paired m-tiles read placed rows only (no gather)")
    if not fits(w, gated_):
        raise ValueError(f"the warp-specialized FP8 GEMM needs scale blocks of whole "
                         f"{BLOCK_N}x{BLOCK_K} boxes, got {w.block_shape()}")
    gather = a if isinstance(a, Fp8Gather) else None
    if gather is not None:
        if a_scale is not None:
            raise ValueError("a gathered A carries its scales in its packed rows: a_scale "
                             "must be None")
        if w.k % BLOCK_K:
            raise ValueError(f"a gathered A is read in whole steps of {BLOCK_K} values; "
                             f"K = {w.k}")
        if gather.own is not None:
            raise ValueError("the warp-specialized GEMM runs on one rank: a gather's rows "
                             "are all in its tokens (pass the home rows there), no own "
                             "rows beside them")
        rows, k = gather.src.shape[0], w.k
        op_a = (None, 0, 1, rows)     # scales follow each packed row's values
    else:
        rows, k = a.shape
        op_a = (a_scale, a_scale.stride(0), a_scale.stride(1), rows)
    nb = w.n
    n = nb // 2 if gated_ else nb
    bn, bk = w.block_shape()
    sn = w.scale_grid()[0]
    up_row = (sn // w.parts if w.parts == 2 else n // bn) if gated_ else 0
    op = WsOperands(tiles, *op_a, w.scale_inv, sn, up_row, nb, n, k)
    tile = WsTile(*(constexpr(v) for v in (BLOCK_M, BLOCK_N, BLOCK_K, group_m,
                                           stages, unroll(k, promotion_k), GROUP,
                                           bn, bk, gated_)),
                  act_tile(activation) if gated_ else act_tile(),
                  EPILOGUE_SCATTER if scatter else EPILOGUE_STORE,
                  constexpr(imprecise_acc(promotion_k, BLOCK_K)), constexpr(gather is not None),
                  constexpr(paired))
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    a_rows = PAIRED_ROWS if paired else BLOCK_M
    a_desc = (None if gather is not None else
              TensorDescriptor.from_tensor(a, [a_rows, BLOCK_K], A_SMEM.value))
    return WsLaunch(a_desc, TensorDescriptor.from_tensor(w.weight.view(w.experts * nb, k),
                                                         [BLOCK_N, BLOCK_K], b_layout),
                    op, epi, gather, tile)


def ws_group_gemm(a: Fp8Rows | Fp8Gather, w: Fp8Weight, tiles: MTiles, *,
                  activation: GatedActivation | None = None, programs: int | None = None,
                  promotion_k: int = BLOCK_K, out: torch.Tensor | None = None,
                  paired: bool = False, stages: int = STAGES) -> torch.Tensor | Fp8Rows:
    """:func:`comet.kernels.fp8_gemm.fp8_group_gemm` on this kernel (``tiles`` of at most
    :data:`BLOCK_M` rows): bf16 ``[rows, N]``, or with ``activation`` h as
    :class:`comet.quant.Fp8Rows` (``requant`` there). ``a``: A's rows, or an
    :class:`comet.kernels.fp8_gemm.Fp8Gather` whose index reads packed rows
    (:func:`comet.kernels.fp8_roles.pack_rows`; rows = the index's length).
    ``programs``: persistent programs (default: one per work item). ``out``: the bf16
    output to write (not with ``activation``). ``paired``, ``stages``: as
    :func:`ws_gemm`'s (``tiles`` then of up to 2 x :data:`BLOCK_M` rows)."""
    if isinstance(a, Fp8Gather):
        _check_gather(a, w)
        check_m_tiles(tiles, BLOCK_M)
        a_rows, a_scale, device = a, None, a.src.device
        rows = a.src.shape[0]
    else:
        check_group_gemm(a, w, tiles, activation, activation is not None,
                         Fp8GemmConfig(PAIRED_ROWS if paired else BLOCK_M, BLOCK_N, BLOCK_K))
        if a.group != GROUP:
            raise ValueError(f"rows quantized in groups of {a.group}; this kernel reads "
                             f"{GROUP}")
        a_rows, a_scale, device = a.data, a.scale, a.data.device
        rows = a.data.shape[0]
    n = w.n // 2 if activation is not None else w.n
    if activation is not None:
        epi = WsH(torch.empty(rows, n, dtype=E4M3, device=device),
                  torch.empty(rows, triton.cdiv(n, GROUP), dtype=torch.float32,
                              device=device))
        cols = BLOCK_N
    else:
        epi = WsOut(bf16_out(out, rows, n, device))
        cols = (1 if paired else 2) * BLOCK_N
    launch = ws_gemm(a_rows, a_scale, w, tiles, epi, activation=activation,
                     promotion_k=promotion_k, paired=paired, stages=stages)
    items = tiles.expert.shape[0] * triton.cdiv(n, cols)
    if items:
        launch(max(1, min(items, programs or items)))
    return Fp8Rows(epi.out, epi.out_scale, GROUP) if activation is not None else epi.out


def _check_gather(g: Fp8Gather, w: Fp8Weight) -> None:
    """What a gathered A must be, as a ValueError before the launch."""
    if not (isinstance(g.src, torch.Tensor) and g.src.dtype == torch.int32
            and g.src.dim() == 1):
        raise ValueError("a gather's index is int32 [rows]")
    t = g.tokens
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 2
            and t.is_contiguous() and t.shape[1] == g.row_bytes):
        raise ValueError(f"a gather reads contiguous packed rows, uint8 [tokens, "
                         f"{g.row_bytes}]")
    if g.row_bytes % 16 or g.row_bytes < w.k + 4 * (w.k // GROUP):
        raise ValueError(f"a packed row of K = {w.k} needs at least {w.k + 4 * (w.k // GROUP)}"
                         f" bytes, 16-byte aligned; got {g.row_bytes}")
    if t.device != w.weight.device or g.src.device != w.weight.device:
        raise ValueError("the gather's rows, index and the weight must be on one device")
