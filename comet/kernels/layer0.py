"""layer0: dispatch -> GroupGEMM(W13) -> SiLU(gate) * up, in one persistent kernel.

The backward (comet.runtime.backward) runs the same kernel twice more, as plain GEMMs
with no activation: dispatch x and recompute ``gate/up = a0 @ W13``, then dispatch dy and
compute ``a0 @ W2^T``.

Shared tensor: ``a0 [rows, H]``, the token rows this rank receives, laid out by
:mod:`comet.routing` (expert, then source in ring order, then token). It is decomposed
along M: a GEMM tile needs only its own rows, so it can start as soon as the sources in
its wait set have delivered.

Roles (program ids below ``n_comm`` communicate, the rest compute):

* comm (:func:`dispatch_role`) -- *push*: this rank writes its token rows straight into
  every destination's ``a0`` (remote stores beat remote loads on NVLink), every
  destination abreast: chunk ``c`` of each destination before chunk ``c + 1`` of any, so
  each destination receives every source's rows in expert order, the order its
  expert-major tiles consume them (destinations in ring order ``r, r-1, ...`` inside a
  round, so that every rank feeds a different peer). With layer1's scatter epilogue each
  row also carries where its layer1 output goes (``row_home``, ``row_weight``). After a
  destination's rows go the *return entries* layer1's reduce will need. Each chunk has its
  own flag, ``flag0[r, c]`` on the destination, set to the call's epoch once chunk ``c``
  of rank ``r`` landed: chunks publish independently, no chunk waits for another.
* compute (:func:`layer0_compute_role`) -- the GroupGEMM over the tile table (a local
  head, then expert-major: comet.scheduler.plan);
  before a tile, wait for exactly the sources of its wait set, and of each for the
  chunks up to the one holding the tile's last row: local rows feed the GEMM as soon as
  they land.
  Tiles come from a device work queue in the table's order (strided lanes of a few
  items, :func:`comet.kernels.group_gemm.strided_take`), and a comm block that has
  pushed its chunks joins it: the split sets how many blocks *start* communicating, no
  SM is lost to communication for the rest of the call.

The count exchange that precedes the kernel (:func:`exchange_counts_kernel`) is where
every rank learns the layout of every destination's shared tensor.
"""

import triton
import triton.language as tl

from comet.kernels.address import pointer_at
from comet.kernels.roles import ROLE_COMM, ROLE_COMPUTE, assign_role
from comet.kernels.group_gemm import gemm_tile, grouped_work, lane_shape, strided_take
from comet.kernels.sync import (barrier, clock_ns, fence_async_proxy, healthy, release,
                                stamp, take, wait_at_least, wait_chunks)

# Wait sites, reported in the error word (comet.runtime.errors.SITES).
SITE_COUNTS = tl.constexpr(1)
SITE_DISPATCH = tl.constexpr(2)

# Chunk flags checked per vector load when a tile or the reduce waits for a run of chunks.
CHUNK_SCAN = tl.constexpr(32)


@triton.jit
def exchange_counts_kernel(totals, counts_table, count_flags_table, count_flags,
                           epoch_ptr, err_table, rank, timeout_ptr,
                           WORLD: tl.constexpr, LOCAL_EXPERTS: tl.constexpr,
                           COUNT_BUFFERS: tl.constexpr, BLOCK: tl.constexpr,
                           PUSH: tl.constexpr, WAIT: tl.constexpr, USE_ASM: tl.constexpr):
    """All-gather of the routing counts: row ``r`` of every peer's
    ``counts[epoch % COUNT_BUFFERS]`` (``[W, W*(El+1)]``) receives this rank's
    ``[W, El + 1]`` (pairs per destination
    expert, then distinct tokens per destination), built from ``totals`` (``[E + W]``:
    pairs per expert, tokens per rank); then ``count_flags[r] = epoch``. The wait is the
    handshake that opens a call: no peer writes anything else of this call into this
    rank before it (comet.runtime.workspace). ``PUSH``/``WAIT`` select the halves (the
    virtual-rank driver runs them apart)."""
    EL1: tl.constexpr = LOCAL_EXPERTS + 1
    ROW: tl.constexpr = WORLD * EL1
    epoch = tl.load(epoch_ptr)
    timeout = tl.load(timeout_ptr)
    if PUSH:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        d = offs // EL1
        c = offs % EL1
        src = tl.where(c < LOCAL_EXPERTS, d * LOCAL_EXPERTS + c, WORLD * LOCAL_EXPERTS + d)
        row = tl.load(totals + src, mask=mask)
        slot = (epoch % COUNT_BUFFERS) * WORLD * ROW + rank * ROW
        if healthy(err_table, rank, USE_ASM):    # a failed rank writes nothing into peers
            for p in range(WORLD):
                dst = pointer_at(counts_table, p, totals)
                tl.store(dst + slot + offs, row, mask=mask)
            barrier()
            for p in range(WORLD):
                release(pointer_at(count_flags_table, p, count_flags) + rank, epoch, "sys")
    if WAIT:
        for s in range(WORLD):
            wait_at_least(count_flags + s, epoch, err_table, SITE_COUNTS, s, rank, timeout,
                          "sys", WORLD, USE_ASM)


@triton.jit
def _push_rows(x_ptr, dst, send_pair, send_row, send_weight, dst_home, dst_weight,
               home_base, start, end, H, TOPK: tl.constexpr, COPY_ROWS: tl.constexpr,
               BLOCK_H: tl.constexpr, ROW_HOME: tl.constexpr):
    """Copy the token rows of pairs ``send_pair[start:end]`` of x into rows
    ``send_row[...]`` of dst, ``COPY_ROWS`` x ``BLOCK_H`` at a time. With ``ROW_HOME``,
    also tell the destination where each row's layer1 output goes and with what weight:
    ``dst_home[row] = home_base + pair`` (this rank's slot in every rank's ``pair_out``
    numbering) and ``dst_weight[row]`` -- a few bytes per row, published by the same
    chunk flag as the row itself."""
    for r0 in range(start, end, COPY_ROWS):
        i = r0 + tl.arange(0, COPY_ROWS)
        live = i < end
        pair = tl.load(send_pair + i, mask=live, other=0)
        tok = (pair // TOPK).to(tl.int64)
        row = tl.load(send_row + i, mask=live, other=0).to(tl.int64)
        if ROW_HOME:
            tl.store(dst_home + row, home_base + pair, mask=live)
            tl.store(dst_weight + row, tl.load(send_weight + i, mask=live), mask=live)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = live[:, None] & (cols[None, :] < H)
            v = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=mask)
            tl.store(dst + row[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _push_entries(src_token, src_rows, src_weight, dst_token, dst_rows, dst_weight,
                  start, end, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  ENTRY_TILE: tl.constexpr):
    """Copy return entries ``[start, end)`` (same indices on both sides)."""
    for q0 in range(start, end, ENTRY_TILE):
        q = q0 + tl.arange(0, ENTRY_TILE)
        live = q < end
        tl.store(dst_token + q, tl.load(src_token + q, mask=live), mask=live)
        j = tl.arange(0, TOPK_P2)
        idx = q[:, None] * TOPK + j[None, :]
        mask = live[:, None] & (j[None, :] < TOPK)
        tl.store(dst_rows + idx, tl.load(src_rows + idx, mask=mask), mask=mask)
        tl.store(dst_weight + idx, tl.load(src_weight + idx, mask=mask), mask=mask)


@triton.jit
def _chunks_to(d, send_off, ret_count, ROWS: tl.constexpr, ENTRIES: tl.constexpr):
    """``(row chunks, all chunks)`` this rank sends destination ``d``: its rows, then
    its return entries."""
    rows = tl.cdiv(tl.load(send_off + d + 1) - tl.load(send_off + d), ROWS)
    return rows, rows + tl.cdiv(tl.load(ret_count + d), ENTRIES)


@triton.jit
def dispatch_role(queue, x_ptr, H, send_pair, send_row, send_weight, send_off,
                  ret_token, ret_rows, ret_weight, ret_count,
                  a0_table, ret_token_table, ret_rows_table, ret_weight_table, flag0_table,
                  home_table, home_weight_table, a0_ptr, recv_token, recv_rows, recv_weight,
                  row_home, row_weight, flag0, chunk_slots,
                  epoch, err_table, rank, max_tokens, timeout, trace_ptr, events,
                  WORLD: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  ROWS: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                  ENTRIES: tl.constexpr, ENTRY_TILE: tl.constexpr, ROW_HOME: tl.constexpr,
                  TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr):
    """Push this rank's rows, then its return entries, to every destination, in chunks
    the comm programs take from the dispatch queue ``queue``: take ``g`` is chunk
    ``g // W`` of the destination at ring offset ``g % W`` (all destinations abreast,
    see the module doc; a queue rather than a fixed stride, so that when destinations
    have unequal chunk counts every program still shares the work of the longest);
    after copying chunk ``c`` a program sets the destination's
    ``flag0[rank, c] = epoch``. No chunk waits for another to publish: an
    in-order chain (each chunk published after the previous one) cost one system-scope
    release round trip per chunk in series, which capped dispatch at ~7 us per chunk
    whatever the number of comm blocks. Returns the trace events recorded so far."""
    # This rank's region in a destination's return-entry tables.
    region = rank * max_tokens
    rounds = 0
    for d in range(WORLD):
        rounds = tl.maximum(rounds, _chunks_to(d, send_off, ret_count, ROWS, ENTRIES)[1])
    g = take(queue)
    while g < rounds * WORLD:
        c = g // WORLD
        d = (rank - g % WORLD + WORLD) % WORLD
        lo = tl.load(send_off + d)
        hi = tl.load(send_off + d + 1)
        n_ent = tl.load(ret_count + d)
        row_chunks, chunks = _chunks_to(d, send_off, ret_count, ROWS, ENTRIES)
        if c < chunks:
            a0 = pointer_at(a0_table, d, a0_ptr)
            dst_tok = pointer_at(ret_token_table, d, recv_token) + region
            dst_rows = pointer_at(ret_rows_table, d, recv_rows) + region * TOPK
            dst_w = pointer_at(ret_weight_table, d, recv_weight) + region * TOPK
            src = d * max_tokens
            flags = pointer_at(flag0_table, d, flag0) + rank * chunk_slots
            if TRACE:
                start = clock_ns(USE_ASM)
            if healthy(err_table, rank, USE_ASM):
                if c < row_chunks:
                    home, home_weight = row_home, row_weight
                    if ROW_HOME:
                        home = pointer_at(home_table, d, row_home)
                        home_weight = pointer_at(home_weight_table, d, row_weight)
                    _push_rows(x_ptr, a0, send_pair, send_row, send_weight, home,
                               home_weight, rank * max_tokens * TOPK, lo + c * ROWS,
                               tl.minimum(lo + (c + 1) * ROWS, hi), H, TOPK, COPY_ROWS,
                               BLOCK_H, ROW_HOME)
                else:
                    e0 = (c - row_chunks) * ENTRIES
                    _push_entries(ret_token + src, ret_rows + src * TOPK,
                                  ret_weight + src * TOPK, dst_tok, dst_rows, dst_w,
                                  e0, tl.minimum(e0 + ENTRIES, n_ent), TOPK, TOPK_P2,
                                  ENTRY_TILE)
                # Never publish after a failure: a chunk skipped because the group failed
                # must not look delivered. (The vote is also the barrier the release needs.)
                if healthy(err_table, rank, USE_ASM):
                    release(flags + c, epoch, "sys")
                if TRACE:
                    events = stamp(trace_ptr, events, d, c, start, MAX_EVENTS, USE_ASM)
        g = take(queue)
    return events


@triton.jit
def _rows_from(s, rank, seg_rows, pre, WORLD: tl.constexpr, LOCAL_EXPERTS: tl.constexpr):
    """Rows source ``s`` sends this rank (the plan's offsets of its last expert plus its
    rows there): known from the count exchange, before any row arrives."""
    last = (s - rank + WORLD) % WORLD * LOCAL_EXPERTS + LOCAL_EXPERTS - 1
    return (tl.load(pre + s * LOCAL_EXPERTS + LOCAL_EXPERTS - 1)
            + tl.load(seg_rows + last))


@triton.jit
def place_role(queue, x_ptr, H, send_pair, send_row, send_weight, send_off,
               x_recv, sent_pair, sent_row, sent_weight, sent_off, copy_flags, seg_rows,
               pre, a0_ptr, row_home, row_weight, flag0, chunk_slots,
               epoch, err_table, rank, max_tokens, timeout, trace_ptr, events,
               WORLD: tl.constexpr, LOCAL_EXPERTS: tl.constexpr, TOPK: tl.constexpr,
               ROWS: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
               TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr):
    """The dispatch by copy engines, receiving side (``TileConfig.copy_dispatch``): every
    peer's host has copied its input rows and its send list here (``x_recv[s]``,
    ``sent_*[s]``) and then set ``copy_flags[s]`` to the call's epoch; the comm programs
    copy each pair's row into the shared tensor ``a0`` -- from this rank's own input,
    or from a copy that landed -- with its layer1 home and weight, chunk by chunk, and
    set ``flag0[s, c]`` as a pushing source would: the GEMM side waits exactly as for
    the push. Chunks come from the dispatch queue: this rank's own rows first (the
    GEMM's local head needs them while the copies are in flight), then the peers'
    abreast (chunk ``c`` of every peer before ``c + 1``). A local HBM-to-HBM copy, so
    the comm blocks are soon done and join the GEMM."""
    local_chunks = tl.cdiv(_rows_from(rank, rank, seg_rows, pre, WORLD, LOCAL_EXPERTS), ROWS)
    rounds = 0
    for o in range(1, WORLD):
        rows = _rows_from((rank + o) % WORLD, rank, seg_rows, pre, WORLD, LOCAL_EXPERTS)
        rounds = tl.maximum(rounds, tl.cdiv(rows, ROWS))
    g = take(queue)
    while g < local_chunks + rounds * (WORLD - 1):
        o = 0
        c = g
        if g >= local_chunks:
            o = 1 + (g - local_chunks) % (WORLD - 1)
            c = (g - local_chunks) // (WORLD - 1)
        s = (rank + o) % WORLD
        rows = _rows_from(s, rank, seg_rows, pre, WORLD, LOCAL_EXPERTS)
        if c * ROWS < rows:
            if TRACE:
                start = clock_ns(USE_ASM)
            src, pairs, dst_rows, weights, lo = x_ptr, send_pair, send_row, send_weight, 0
            landed = 1
            if o == 0:
                lo = tl.load(send_off + rank)
            else:
                landed = wait_at_least(copy_flags + s, epoch, err_table, SITE_DISPATCH, s,
                                       rank, timeout, "sys", WORLD, USE_ASM)
                src = x_recv + s.to(tl.int64) * max_tokens * H
                pairs = sent_pair + s * max_tokens * TOPK
                dst_rows = sent_row + s * max_tokens * TOPK
                weights = sent_weight + s * max_tokens * TOPK
                lo = tl.load(sent_off + s * (WORLD + 1) + rank)
            if landed != 0:
                if healthy(err_table, rank, USE_ASM):
                    _push_rows(src, a0_ptr, pairs, dst_rows, weights, row_home, row_weight,
                               s * max_tokens * TOPK, lo + c * ROWS,
                               lo + tl.minimum((c + 1) * ROWS, rows), H, TOPK, COPY_ROWS,
                               BLOCK_H, True)
                    # Never publish after a failure (the vote is the barrier the release
                    # needs).
                    if healthy(err_table, rank, USE_ASM):
                        release(flag0 + s * chunk_slots + c, epoch, "gpu")
            if TRACE:
                events = stamp(trace_ptr, events, s, c, start, MAX_EVENTS, USE_ASM)
        g = take(queue)
    return events


@triton.jit
def _await_rows(flag0, chunk_slots, seg_start, seg_rows, pre, wait, expert, r0, r1, seen,
                epoch, err_table, rank, timeout, WORLD: tl.constexpr, W_P2: tl.constexpr,
                LOCAL_EXPERTS: tl.constexpr, ROWS: tl.constexpr, USE_ASM: tl.constexpr):
    """Wait until every source in ``wait`` has published its chunks up to the one holding
    its last row in ``[r0, r1)``; returns ``(seen, ok)``. ``seen[s]`` caches how many
    leading chunks of ``s`` are known published, so most tiles cost no flag load at all
    (waiting for the whole prefix rather than the tile's own chunks keeps that cache a
    single number; chunks land roughly in order anyway). It only ever holds waited-for
    counts, never a raw flag value: every warp must agree on it, or warps would disagree
    on which tiles wait (see comet.kernels.sync on uniform control flow). ``ok`` is 0
    once a wait gave up."""
    ranks = tl.arange(0, W_P2)
    ok = tl.full([], 1, tl.int32)
    for s in range(WORLD):
        if ((wait >> s) & 1) != 0:
            o = (s - rank + WORLD) % WORLD
            seg0 = tl.load(seg_start + o * LOCAL_EXPERTS + expert)
            seg1 = seg0 + tl.load(seg_rows + o * LOCAL_EXPERTS + expert)
            last = tl.minimum(r1, seg1) - 1 - seg0
            need = (tl.load(pre + s * LOCAL_EXPERTS + expert) + last) // ROWS + 1
            have = tl.sum(tl.where(ranks == s, seen, 0), axis=0)
            if need > have:
                got = wait_chunks(flag0 + s * chunk_slots, have, need, epoch, err_table,
                                  SITE_DISPATCH, s, rank, timeout, "sys", WORLD, CHUNK_SCAN,
                                  USE_ASM)
                ok = ok & got
                seen = tl.where((ranks == s) & (got != 0), need, seen)
    return seen, ok


#: Work items per take of layer0's queue (one lane of :func:`strided_take`) once the call
#: has at least one full round of them (``programs * LANE_ITEMS`` items; below that, one
#: item per take balances the few items there are). A lane of several items runs as one
#: flattened loop, its tiles' epilogues under the next tile's loads. 4: within 3% of a
#: static flattened loop, 2 and 8 lower (H100, ``h100-gemm-strided.json``).
LANE_ITEMS = tl.constexpr(4)


@triton.jit
def layer0_compute_role(queue, a_desc, a_ptr, a_index, w_desc, c_ptr, K, N,
                        tile_expert, tile_row_start, tile_row_end, tile_wait, num_tiles_ptr,
                        seg_start, seg_rows, pre,
                        flag0, chunk_slots, epoch, err_table, rank, timeout, trace_ptr, events,
                        WAIT: tl.constexpr, GATED: tl.constexpr, TRANS_B: tl.constexpr,
                        GATE_UP: tl.constexpr, ONE_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        GROUP_M: tl.constexpr, HEAD_ROUNDS: tl.constexpr,
                        TAIL_ROUNDS: tl.constexpr, WORLD: tl.constexpr, W_P2: tl.constexpr,
                        LOCAL_EXPERTS: tl.constexpr,
                        ROWS: tl.constexpr, TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr,
                        USE_ASM: tl.constexpr, A_GATHER: tl.constexpr):
    """GroupGEMM ``c = silu(a0 @ W13_gate) * (a0 @ W13_up)`` (``GATED``; ``N`` = F) -- or,
    for the backward, a plain ``c = a0 @ W`` or ``a0 @ W^T`` (``TRANS_B``) with ``N``
    output columns -- over the tiles in the table's order (comet.scheduler.plan),
    taken from the work queue ``queue`` (a counter every GEMM block of this rank bumps) a
    lane at a time (:func:`strided_take`; ``HEAD_ROUNDS`` and ``TAIL_ROUNDS`` rounds of
    single items at its ends, :func:`comet.kernels.group_gemm.lane_shape`): blocks take work in the scheduler's order
    whenever they are free, so a block that joins late (a comm block done dispatching)
    takes the next lane, not a fixed share. A lane's rows are all waited for before its
    flattened loop starts: the pipeliner issues a tile's loads while the previous tile
    still runs, so no wait may sit between them."""
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(N, BLOCK_N)
    total = num_tiles * n_blocks
    programs = tl.num_programs(0)
    items, head, lanes_end = lane_shape(total, programs, LANE_ITEMS, HEAD_ROUNDS,
                                        TAIL_ROUNDS)
    seen = tl.zeros([W_P2], dtype=tl.int32)
    first, end = strided_take(queue, programs, items, head, lanes_end)
    while first < total:
        end = tl.minimum(end, total)
        ready = 1
        if WAIT:
            for w in range(first, end, programs):
                t, nb = grouped_work(w, num_tiles, n_blocks, GROUP_M)
                seen, ok = _await_rows(flag0, chunk_slots, seg_start, seg_rows, pre,
                                       tl.load(tile_wait + t), tl.load(tile_expert + t),
                                       tl.load(tile_row_start + t), tl.load(tile_row_end + t),
                                       seen, epoch, err_table, rank, timeout, WORLD, W_P2,
                                       LOCAL_EXPERTS, ROWS, USE_ASM)
                ready = ready & ok
            fence_async_proxy(USE_ASM)
        if ready:   # after a failure the call's output is void: skip the GEMMs
            for w in tl.range(first, end, programs, flatten=True):
                if TRACE:
                    start = clock_ns(USE_ASM)
                t, nb = grouped_work(w, num_tiles, n_blocks, GROUP_M)
                expert = tl.load(tile_expert + t)
                gemm_tile(a_desc, w_desc, c_ptr, N, expert, tl.load(tile_row_start + t),
                          tl.load(tile_row_end + t), nb * BLOCK_N, K, N, GATED, GATE_UP,
                          ONE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TRANS_B,
                          a_ptr, a_index, A_GATHER)
                if TRACE:
                    events = stamp(trace_ptr, events, WORLD + expert, t, start, MAX_EVENTS,
                                   USE_ASM)
        first, end = strided_take(queue, programs, items, head, lanes_end)


@triton.jit
def layer0_kernel(
    # dispatch (comm role); the input's address is read on the device (graph replays)
    x_addr, send_pair, send_row, send_weight, send_off, ret_token, ret_rows, ret_weight,
    ret_count, a0_table, ret_token_table, ret_rows_table, ret_weight_table, flag0_table,
    home_table, home_weight_table, recv_token, recv_rows, recv_weight, row_home, row_weight,
    chunk_slots, max_tokens,
    # the same, placed from the copies peers' hosts made (COPY_DISPATCH)
    x_recv, sent_pair, sent_row, sent_weight, sent_off, copy_flags,
    # GroupGEMM (compute role): K = H, N output columns (F when GATED)
    a0_ptr, a_desc, a_index, w_desc, c_ptr, K, N,
    tile_expert, tile_row_start, tile_row_end, tile_wait, num_tiles_ptr,
    seg_start, seg_rows, pre, queue, dispatch_queue,
    # both; n_comm is read on the device so one captured launch serves every split
    flag0, epoch_ptr, err_table, rank, split_ptr, timeout_ptr, trace_ptr,
    ROLE: tl.constexpr, WAIT: tl.constexpr, WORLD: tl.constexpr, W_P2: tl.constexpr,
    LOCAL_EXPERTS: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    COMM_ROWS: tl.constexpr, COMM_COPY_ROWS: tl.constexpr, COMM_BLOCK_H: tl.constexpr,
    COMM_ENTRIES: tl.constexpr, COMM_ENTRY_TILE: tl.constexpr, ROW_HOME: tl.constexpr,
    GATED: tl.constexpr, TRANS_B: tl.constexpr, GATE_UP: tl.constexpr, ONE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr, HEAD_ROUNDS: tl.constexpr,
    TAIL_ROUNDS: tl.constexpr, TRACE: tl.constexpr, MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr,
    A_GATHER: tl.constexpr = False, COPY_DISPATCH: tl.constexpr = False,
):
    epoch = tl.load(epoch_ptr)
    timeout = tl.load(timeout_ptr)
    trace_ptr += tl.program_id(0) * MAX_EVENTS * 4
    x_ptr = pointer_at(x_addr, 0, a0_ptr)
    comm, _, _ = assign_role(split_ptr, ROLE)
    events = tl.full([], 0, tl.int32)
    if ROLE != ROLE_COMPUTE:
        if comm and COPY_DISPATCH:
            events = place_role(dispatch_queue, x_ptr, K, send_pair, send_row, send_weight,
                                send_off, x_recv, sent_pair, sent_row, sent_weight, sent_off,
                                copy_flags, seg_rows, pre, a0_ptr, row_home, row_weight,
                                flag0, chunk_slots, epoch, err_table, rank, max_tokens,
                                timeout, trace_ptr, events, WORLD, LOCAL_EXPERTS, TOPK,
                                COMM_ROWS, COMM_COPY_ROWS, COMM_BLOCK_H, TRACE, MAX_EVENTS,
                                USE_ASM)
        elif comm:
            events = dispatch_role(dispatch_queue, x_ptr, K, send_pair, send_row,
                                   send_weight, send_off, ret_token, ret_rows, ret_weight,
                                   ret_count, a0_table, ret_token_table, ret_rows_table,
                                   ret_weight_table, flag0_table, home_table,
                                   home_weight_table, a0_ptr, recv_token, recv_rows,
                                   recv_weight, row_home, row_weight, flag0, chunk_slots,
                                   epoch, err_table, rank, max_tokens, timeout, trace_ptr,
                                   events, WORLD, TOPK, TOPK_P2, COMM_ROWS, COMM_COPY_ROWS,
                                   COMM_BLOCK_H, COMM_ENTRIES, COMM_ENTRY_TILE, ROW_HOME,
                                   TRACE, MAX_EVENTS, USE_ASM)
    # Fused: a comm block that has pushed its chunks joins the GEMM (no SM idles for the
    # rest of the call); it never holds a tile while a peer waits on its pushes.
    if ROLE != ROLE_COMM:
        layer0_compute_role(queue, a_desc, a0_ptr, a_index, w_desc, c_ptr, K, N,
                            tile_expert, tile_row_start, tile_row_end, tile_wait,
                            num_tiles_ptr, seg_start, seg_rows, pre, flag0, chunk_slots,
                            epoch, err_table, rank, timeout, trace_ptr, events, WAIT, GATED,
                            TRANS_B, GATE_UP, ONE_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
                            DOT_PRECISION, GROUP_M, HEAD_ROUNDS, TAIL_ROUNDS, WORLD, W_P2,
                            LOCAL_EXPERTS, COMM_ROWS, TRACE, MAX_EVENTS, USE_ASM, A_GATHER)
