"""layer1: GroupGEMM(W2) -> weighted top-k reduce -> combine, in one persistent kernel,
followed by the final combine on each token's home rank.

Shared tensor: ``out1 [rows, H]``, the expert outputs of this rank's received rows. The
top-k reduce gathers many rows into one token, so it is *not* independent along M; it is
along N. The GroupGEMM therefore runs column-wise: column split ``s`` (``BLOCKS_PER_SPLIT``
column blocks) of every expert's tiles before split ``s + 1``, and the compute blocks count
finished tiles per split.

Roles (without ``SCATTER``):

* compute (:func:`layer1_compute_role`) -- the GroupGEMM, each block striding over the
  work items, counting tiles per split; a compute block out of tiles joins the reduce.
  Every block of the grid, comm blocks included, runs split 0 (nothing can be reduced
  before it is complete); the later splits run on the compute blocks alone.
* comm (:func:`reduce_send_role`) -- reduce items from a device queue (a counter zeroed
  when a call opens) in split order; an item of split ``s``
  waits until all of split ``s``'s tiles are counted, then for each of its *return
  entries* (one token of one source rank, naming the rows of its experts on this rank and
  their weights) sums ``weight * out1[row]`` in fp32 -- pre-summing the experts a token
  has on this rank, so one row per (token, rank) crosses the link -- and stores it into the
  source rank's ``comb[this rank, token]``. Inside a split, sources go in ring order from
  this rank, so at each step every rank writes to a different peer. The last block to
  finish releases ``flag1[this rank] = epoch`` on every source rank.

The comm blocks reduce the early splits while the GEMM of the later ones runs; the reduce
of the last split runs on every block. With no comm block the kernel is "GEMM, then
reduce on the whole GPU" in one launch.

``SCATTER`` (the forward's default, ``TileConfig.layer1_scatter``) moves the top-k sum
past the communication: ``out1`` is never stored; every block runs the GroupGEMM and its
epilogue (:func:`scatter_home`) writes each row, weighted, into ``pair_out[t, j]`` on
the token's rank, which makes the shared tensor independent along M as well
(docs/shared_tensor.md). No comm role, no reduce, no wait inside the kernel; the last
block to finish releases ``flag1`` as above.

The backward (comet.runtime.backward) runs the same kernel on ``d(gate, up) @ W13^T``
(``TRANS_B``): the reduce then sums a token's rows unweighted (the routing weights are
already in ``d(gate, up)``) and, with ``PAIRS``, also returns each (token, slot)'s
routing-weight gradient, one fp32 per row, into the source's ``pair_grad``.

:func:`combine_kernel` then sums, on each token's home rank, the partial rows of the ranks
that token was sent to, always in rank order 0..W-1 (after a scatter: the token's real
slots in slot order): the result does not depend on timing.
"""

import triton
import triton.language as tl

from comet.kernels.address import pointer_at
from comet.kernels.roles import ROLE_COMM, ROLE_COMPUTE, assign_role
from comet.kernels.group_gemm import column_work, gemm_acc, gemm_tile
from comet.kernels.layer0 import CHUNK_SCAN
from comet.kernels.sync import (arrive, clock_ns, healthy, release, stamp, take, wait_at_least,
                                wait_chunks)

SITE_SPLIT = tl.constexpr(3)
SITE_COMBINE = tl.constexpr(4)
SITE_ENTRIES = tl.constexpr(6)

# Trace kinds: a GEMM work item stamps its split, a reduce item TRACE_REDUCE + its split.
TRACE_REDUCE = tl.constexpr(1 << 16)


@triton.jit
def layer1_compute_role(comm, role_pid, n_role, h_desc, w2_desc, out1_ptr, F, H,
                        tile_expert, tile_row_start, tile_row_end, num_tiles_ptr, split_done,
                        row_home, row_weight, pair_table, pair_out, slots,
                        trace_ptr, events, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                        N_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        TRANS_B: tl.constexpr, SCATTER: tl.constexpr, TRACE: tl.constexpr,
                        MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr):
    """The column-wise GroupGEMM in split order; returns the trace events recorded so far.
    Split 0 runs on every block of the grid (work item ``pid + i * programs``): no reduce
    item can start before it is complete, so a comm block (``comm``) that only waited
    for it would idle for the first split's whole GEMM -- which cost layer1 its SM share
    over the whole call (one GPU, Mixtral at EP=2 rank shapes, 16384 tokens: 4 comm
    blocks +169 us, 16 +574, ``h200-kernel-times-ep2-fused-splits.json``). Later splits
    run on the compute blocks (``role_pid + i * n_role``) while the comm blocks reduce.

    A static stride, not a queue: the rows are all in place when the kernel starts and
    which blocks run a split is fixed, so nothing needs handing out at run time -- and a
    static loop can be flattened, which lets Triton's pipeliner load the next tile's
    operands under this tile's epilogue (layer1 5-13% faster than the queue loop for
    qwen2-moe and deepseek-v3-like at 4096-16384 tokens, H100, ``h100-gemm-strided.json``).

    ``SCATTER``: each tile goes straight to its tokens' homes (:func:`scatter_home`)
    instead of into ``out1``.
    """
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(H, BLOCK_N)
    total = num_tiles * n_blocks
    per_split = num_tiles * BLOCKS_PER_SPLIT
    # Unrolled over the splits: a flattened loop nested in a run-time loop is not
    # flattened by Triton (one pipeline per tile again).
    for split in tl.static_range(N_SPLITS):
        if split == 0:
            me = tl.program_id(0)
            stride = tl.num_programs(0)
        else:
            me = role_pid
            stride = n_role
        if (split == 0) or (comm == 0):
            lo = split * per_split
            hi = tl.minimum(lo + per_split, total)
            first = lo + (me - lo % stride + stride) % stride
            for w in tl.range(first, hi, stride, flatten=True):
                if TRACE:
                    start = clock_ns(USE_ASM)
                t, nb, _ = column_work(w, num_tiles, n_blocks, BLOCKS_PER_SPLIT)
                expert = tl.load(tile_expert + t)
                row_start = tl.load(tile_row_start + t)
                row_end = tl.load(tile_row_end + t)
                if SCATTER:
                    acc = gemm_acc(h_desc, w2_desc, expert, row_start, nb * BLOCK_N, F, H,
                                   False, 0, False, BLOCK_M, BLOCK_N, BLOCK_K,
                                   DOT_PRECISION)
                    scatter_home(acc, row_home, row_weight, pair_table, pair_out, slots,
                                 row_start, row_end, nb * BLOCK_N, H, BLOCK_M, BLOCK_N)
                else:
                    gemm_tile(h_desc, w2_desc, out1_ptr, H, expert, row_start, row_end,
                              nb * BLOCK_N, F, H, False, 0, False, BLOCK_M, BLOCK_N, BLOCK_K,
                              DOT_PRECISION, TRANS_B)
                if TRACE:
                    events = stamp(trace_ptr, events, split, t, start, MAX_EVENTS, USE_ASM)
            # Counted once per split, not per tile: an atomic inside the loop keeps Triton
            # from pipelining it (one stage of shared memory instead of three).
            arrive(split_done + split, "gpu", tl.maximum(tl.cdiv(hi - first, stride), 0))
    return events


@triton.jit
def scatter_home(acc, row_home, row_weight, pair_table, pair_out, slots, row_start, row_end,
                 n0, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scatter epilogue: row ``r`` of the fp32 tile ``acc`` (rows ``row_start..``,
    columns ``n0..``), times its routing weight, into its token's home --
    ``pair_out[t, j]`` on rank ``s``, where ``row_home[r] = s * slots + t * TOPK + j``
    (pushed with the row by the dispatch). Stores to a peer's memory are posted: the
    tile's data crosses the link while the GEMM goes on, with no reduce pass and no
    block waiting for a column split."""
    rows = row_start + tl.arange(0, BLOCK_M)
    live = rows < row_end
    home = tl.load(row_home + rows, mask=live, other=0)
    weight = tl.load(row_weight + rows, mask=live, other=0.0)
    row_ptr = pointer_at(pair_table, home // slots, pair_out) + (home % slots).to(tl.int64) * H
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(row_ptr[:, None] + cols[None, :],
             (acc * weight[:, None]).to(pair_out.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < H))


@triton.jit
def _release_sources(done_counter, flag1_table, flag1, epoch, err_table, rank,
                     WORLD: tl.constexpr, USE_ASM: tl.constexpr):
    """The last block of the launch to get here tells every source its rows of this
    call are there (``flag1[this rank] = epoch`` on each) -- unless the group failed
    meanwhile: rows skipped after a failure must not look sent."""
    if arrive(done_counter, "sys") == tl.num_programs(0) - 1:
        if healthy(err_table, rank, USE_ASM):
            for s in range(WORLD):
                flag = pointer_at(flag1_table, s, flag1)
                release(flag + rank, epoch, "sys")


@triton.jit
def _return_pairs(pair_src, pair_dst, recv_rows, q, live, tok, TOPK: tl.constexpr):
    """``pair_dst[token, j] = pair_src[row_j]`` for the slots of entries ``q`` held here."""
    for j in tl.static_range(TOPK):
        row = tl.load(recv_rows + q * TOPK + j, mask=live, other=-1)
        held = row >= 0
        v = tl.load(pair_src + row.to(tl.int64), mask=held, other=0.0)
        tl.store(pair_dst + tok * TOPK + j, v, mask=held)


@triton.jit
def _reduce_entries(out1_ptr, H, dst, recv_token, recv_rows, recv_weight, start, end,
                    col0, col1, pair_src, pair_dst, TOPK: tl.constexpr,
                    ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr, WEIGHTED: tl.constexpr,
                    PAIRS: tl.constexpr):
    """``dst[token] = sum_j weight_j * out1[row_j]`` (``WEIGHTED``, else the plain sum)
    over columns ``[col0, col1)`` for entries ``[start, end)``, ``ENTRIES`` at a time;
    rows of ``-1`` are slots that live on other ranks. With ``PAIRS``, the items of the
    first columns also return each held slot's scalar (:func:`_return_pairs`)."""
    for e0 in range(start, end, ENTRIES):
        q = e0 + tl.arange(0, ENTRIES)
        live = q < end
        tok = tl.load(recv_token + q, mask=live, other=0).to(tl.int64)
        if PAIRS:
            if col0 == 0:
                _return_pairs(pair_src, pair_dst, recv_rows, q, live, tok, TOPK)
        for c0 in range(col0, col1, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            cmask = cols[None, :] < col1
            acc = tl.zeros((ENTRIES, BLOCK_C), dtype=tl.float32)
            for j in tl.static_range(TOPK):
                row = tl.load(recv_rows + q * TOPK + j, mask=live, other=-1).to(tl.int64)
                v = tl.load(out1_ptr + row[:, None] * H + cols[None, :],
                            mask=(row[:, None] >= 0) & cmask, other=0.0)
                if WEIGHTED:
                    wgt = tl.load(recv_weight + q * TOPK + j, mask=live, other=0.0)
                    acc += v.to(tl.float32) * wgt[:, None]
                else:
                    acc += v.to(tl.float32)
            tl.store(dst + tok[:, None] * H + cols[None, :], acc.to(dst.dtype.element_ty),
                     mask=live[:, None] & cmask)


@triton.jit
def _reduce_item(i, rank, entries, WORLD: tl.constexpr, ITEM: tl.constexpr):
    """Reduce-queue item ``i`` -> ``(split, source, first entry)``. Items run split by
    split, inside a split source by source in ring order from this rank (so at each step
    every rank sends to a different peer), ``ITEM`` entries each."""
    per_split = 0
    for o in range(WORLD):
        per_split += tl.cdiv(tl.load(entries + (rank + o) % WORLD), ITEM)
    split = i // tl.maximum(per_split, 1)
    rest = i % tl.maximum(per_split, 1)
    source = rank
    first = 0
    for o in range(WORLD):
        s = (rank + o) % WORLD
        n = tl.cdiv(tl.load(entries + s), ITEM)
        here = (rest >= 0) & (rest < n)
        source = tl.where(here, s, source)
        first = tl.where(here, rest * ITEM, first)
        rest -= n
    return split, source, first, per_split


@triton.jit
def reduce_send_role(queue, out1_ptr, H, recv_token, recv_rows, recv_weight, entries,
                     flag0, chunk_slots, chunks_total, comb_table, comb_ptr, flag1_table,
                     flag1, split_done, done_counter, num_tiles_ptr, epoch, err_table, rank,
                     max_tokens, timeout, pair_src, pair_table, pair_ptr, trace_ptr, events,
                     WAIT: tl.constexpr, WORLD: tl.constexpr, TOPK: tl.constexpr,
                     ENTRIES: tl.constexpr, ITEM: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     WEIGHTED: tl.constexpr, PAIRS: tl.constexpr,
                     TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr):
    """Reduce the top-k rows of every return entry into the sources' ``comb`` buffers
    (see module doc), items from the reduce queue ``queue``; an item of split ``s`` waits
    until all of split ``s``'s tiles are counted. A source's return entries travel after
    its rows in layer0: all ``chunks_total`` of its chunk flags set say they landed. Every
    block of the launch runs this, and the last one to finish releases ``flag1``."""
    for s in range(WORLD):
        wait_chunks(flag0 + s * chunk_slots, 0, tl.load(chunks_total + s), epoch, err_table,
                    SITE_ENTRIES, s, rank, timeout, "sys", WORLD, CHUNK_SCAN, USE_ASM)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(H, BLOCK_N)
    split_cols = BLOCKS_PER_SPLIT * BLOCK_N
    n_splits = tl.cdiv(n_blocks, BLOCKS_PER_SPLIT)
    # A block takes items in increasing order, so it waits for each split at most once.
    ready_split = tl.full([], -1, tl.int32)
    ready = healthy(err_table, rank, USE_ASM)
    i = take(queue)
    split, source, first, per_split = _reduce_item(i, rank, entries, WORLD, ITEM)
    while i < n_splits * per_split:
        if TRACE:
            start = clock_ns(USE_ASM)
        if split > ready_split:
            if WAIT:
                blocks = tl.minimum(n_blocks - split * BLOCKS_PER_SPLIT, BLOCKS_PER_SPLIT)
                ready = wait_at_least(split_done + split, num_tiles * blocks, err_table,
                                      SITE_SPLIT, split, rank, timeout, "gpu", WORLD, USE_ASM)
            else:
                ready = healthy(err_table, rank, USE_ASM)
            ready_split = split
        if ready:
            col0 = split * split_cols
            dst = pointer_at(comb_table, source, comb_ptr)
            region = source * max_tokens
            _reduce_entries(out1_ptr, H, dst + rank * max_tokens * H, recv_token + region,
                            recv_rows + region * TOPK, recv_weight + region * TOPK, first,
                            tl.minimum(first + ITEM, tl.load(entries + source)), col0,
                            tl.minimum(col0 + split_cols, H), pair_src,
                            pointer_at(pair_table, source, pair_ptr), TOPK, ENTRIES,
                            BLOCK_C, WEIGHTED, PAIRS)
        if TRACE:
            events = stamp(trace_ptr, events, split + TRACE_REDUCE, source, start,
                           MAX_EVENTS, USE_ASM)
        i = take(queue)
        split, source, first, per_split = _reduce_item(i, rank, entries, WORLD, ITEM)
    _release_sources(done_counter, flag1_table, flag1, epoch, err_table, rank, WORLD,
                     USE_ASM)


@triton.jit
def layer1_kernel(
    h_desc, w2_desc, out1_ptr, F, H,
    tile_expert, tile_row_start, tile_row_end, num_tiles_ptr, split_done,
    recv_token, recv_rows, recv_weight, entries, flag0, chunk_slots, chunks_total,
    comb_table, comb_ptr, flag1_table, flag1,
    done_counter, reduce_queue, epoch_ptr, err_table, rank, max_tokens,
    split_ptr, timeout_ptr, pair_src, pair_table, pair_ptr,
    row_home, row_weight, out_table, pair_out, trace_ptr,
    ROLE: tl.constexpr, WAIT: tl.constexpr, SCATTER: tl.constexpr,
    WORLD: tl.constexpr, TOPK: tl.constexpr,
    COMM_ENTRIES: tl.constexpr, COMM_ITEM: tl.constexpr, COMM_BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr, N_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TRANS_B: tl.constexpr, WEIGHTED: tl.constexpr, PAIRS: tl.constexpr,
    TRACE: tl.constexpr,
    MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr,
):
    epoch = tl.load(epoch_ptr)
    timeout = tl.load(timeout_ptr)
    trace_ptr += tl.program_id(0) * MAX_EVENTS * 4
    events = tl.full([], 0, tl.int32)
    if SCATTER:
        # No comm role: the epilogue sends, every block runs the GEMM.
        events = layer1_compute_role(0, tl.program_id(0), tl.num_programs(0), h_desc,
                                     w2_desc, out1_ptr, F, H, tile_expert, tile_row_start,
                                     tile_row_end, num_tiles_ptr, split_done, row_home,
                                     row_weight, out_table, pair_out, max_tokens * TOPK,
                                     trace_ptr, events, BLOCK_M, BLOCK_N, BLOCK_K,
                                     BLOCKS_PER_SPLIT, N_SPLITS, DOT_PRECISION, False, True,
                                     TRACE, MAX_EVENTS, USE_ASM)
        _release_sources(done_counter, flag1_table, flag1, epoch, err_table, rank, WORLD,
                         USE_ASM)
    else:
        comm, n_role, role_pid = assign_role(split_ptr, ROLE)
        if ROLE != ROLE_COMM:
            events = layer1_compute_role(comm, role_pid, n_role, h_desc, w2_desc, out1_ptr,
                                         F, H, tile_expert, tile_row_start, tile_row_end,
                                         num_tiles_ptr, split_done, row_home, row_weight,
                                         out_table, pair_out, 0, trace_ptr, events, BLOCK_M,
                                         BLOCK_N, BLOCK_K, BLOCKS_PER_SPLIT, N_SPLITS,
                                         DOT_PRECISION, TRANS_B, False, TRACE, MAX_EVENTS,
                                         USE_ASM)
        # Fused: a comm block goes from split 0's GEMM to the reduce; a compute block out
        # of tiles joins it, so the reduce of the last split runs on the whole GPU.
        if ROLE != ROLE_COMPUTE:
            reduce_send_role(reduce_queue, out1_ptr, H, recv_token, recv_rows, recv_weight,
                             entries, flag0, chunk_slots, chunks_total, comb_table, comb_ptr,
                             flag1_table, flag1, split_done, done_counter, num_tiles_ptr,
                             epoch, err_table, rank, max_tokens, timeout, pair_src,
                             pair_table, pair_ptr, trace_ptr, events, WAIT, WORLD, TOPK,
                             COMM_ENTRIES, COMM_ITEM, COMM_BLOCK_C, BLOCK_N,
                             BLOCKS_PER_SPLIT, WEIGHTED, PAIRS, TRACE, MAX_EVENTS, USE_ASM)


@triton.jit
def combine_kernel(parts_ptr, flag1, part_live, y_addr, num_tokens_ptr, H, part_stride,
                   token_stride, epoch_ptr, err_table, rank, timeout_ptr,
                   WAIT: tl.constexpr, WORLD: tl.constexpr, PARTS: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_H: tl.constexpr, USE_ASM: tl.constexpr):
    """``y[t] = sum_{i < PARTS, part_live[t, i]} parts[i * part_stride + t * token_stride]``
    in fp32, in the fixed order of ``i``: the result does not depend on timing. The parts
    are the ranks' partial rows (``comb [W, Mx, H]``, after the reduce) or the slots'
    weighted rows (``pair_out [Mx, k, H]``, after the scatter epilogue).
    Persistent: a fixed grid loops over blocks of ``ROWS`` tokens -- several programs per
    SM on a GPU of its own (a stream needs many loads in flight), few when W virtual ranks
    share one GPU (spinning programs must not fill it). The token count and the output's
    address are read on the device, so one captured launch serves every call."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    y_ptr = pointer_at(y_addr, 0, parts_ptr)
    epoch = tl.load(epoch_ptr)
    timeout = tl.load(timeout_ptr)
    num_tokens = tl.load(num_tokens_ptr)
    ready = tl.full([], 1, tl.int32)
    if WAIT:
        for d in range(WORLD):
            ready = ready & wait_at_least(flag1 + d, epoch, err_table, SITE_COMBINE, d, rank,
                                          timeout, "sys", WORLD, USE_ASM)
    if ready:
        for b in range(pid, tl.cdiv(num_tokens, ROWS), n_prog):
            rows = b * ROWS + tl.arange(0, ROWS)
            live = rows < num_tokens
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = live[:, None] & (cols[None, :] < H)
                acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
                for i in range(PARTS):
                    sent = tl.load(part_live + rows * PARTS + i, mask=live, other=0) != 0
                    part = (i * part_stride + rows[:, None] * token_stride).to(tl.int64)
                    v = tl.load(parts_ptr + part * H + cols[None, :],
                                mask=cmask & sent[:, None], other=0.0)
                    acc += v.to(tl.float32)
                tl.store(y_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                         acc.to(y_ptr.dtype.element_ty), mask=cmask)
