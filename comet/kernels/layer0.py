"""layer0: dispatch -> GroupGEMM(W13) -> SiLU(gate) * up, in one persistent kernel.

Shared tensor: ``a0 [rows, H]``, the token rows this rank receives, laid out by
:mod:`comet.routing` (expert, then source in ring order, then token). It is decomposed
along M: a GEMM tile needs only its own rows, so it can start as soon as the sources in
its wait set have delivered.

Roles (program ids below ``n_comm`` communicate, the rest compute):

* comm (:func:`dispatch_role`) -- *push*: this rank writes its token rows straight into
  every destination's ``a0`` (remote stores beat remote loads on NVLink), destinations in
  the order ``r, r-1, r-2, ...`` so that, at each step, every rank feeds a different peer
  and each destination receives its sources in the order it consumes them (own rank
  first). With the rows go the *return entries* layer1 will need. The last chunk to a
  destination releases that destination's ``flag0[r] = epoch``.
* compute (:func:`layer0_compute_role`) -- the GroupGEMM over the local-first tile table;
  before a tile, wait for the flags of exactly its wait set (sources already seen are
  remembered, so each is awaited once per block).

The count exchange that precedes the kernel (:func:`exchange_counts_kernel`) is where
every rank learns the layout of every destination's shared tensor.
"""

import triton
import triton.language as tl

from comet.kernels.group_gemm import gemm_tile, grouped_work
from comet.kernels.sync import arrive, barrier, fence_async_proxy, healthy, wait_at_least

# Roles of a launch (constexpr ROLE).
ROLE_FUSED = tl.constexpr(0)
ROLE_COMM = tl.constexpr(1)
ROLE_COMPUTE = tl.constexpr(2)

# Wait sites, reported in the error word (comet.runtime.errors.SITES).
SITE_COUNTS = tl.constexpr(1)
SITE_DISPATCH = tl.constexpr(2)


@triton.jit
def _peer(table, rank, like_ptr):
    """Typed pointer to ``rank``'s copy of a symmetric buffer."""
    return tl.load(table + rank).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def exchange_counts_kernel(my_counts, counts_table, count_flags_table, count_flags,
                           epoch_ptr, err_ptr, rank, timeout,
                           WORLD: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                           PUSH: tl.constexpr, WAIT: tl.constexpr, USE_ASM: tl.constexpr):
    """All-gather of the ``[W, El + 1]`` routing counts: row ``r`` of every peer's
    ``counts`` buffer receives this rank's counts, then ``count_flags[r] = epoch``.
    ``PUSH`` and ``WAIT`` select the halves (the virtual-rank driver runs them apart)."""
    epoch = tl.load(epoch_ptr)
    if PUSH:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        row = tl.load(my_counts + offs, mask=mask)
        for p in range(WORLD):
            dst = _peer(counts_table, p, my_counts)
            tl.store(dst + rank * ROW + offs, row, mask=mask)
        barrier()
        for p in range(WORLD):
            flag = _peer(count_flags_table, p, count_flags)
            tl.atomic_xchg(flag + rank, epoch, sem="release", scope="sys")
    if WAIT:
        for s in range(WORLD):
            wait_at_least(count_flags + s, epoch, err_ptr, SITE_COUNTS, s, rank, timeout,
                          "sys", USE_ASM)


@triton.jit
def _push_rows(x_ptr, dst, send_token, send_row, start, end, H,
               ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Copy token rows ``send_token[start:end]`` of x into rows ``send_row[...]`` of dst."""
    i = start + tl.arange(0, ROWS)
    live = i < end
    tok = tl.load(send_token + i, mask=live, other=0).to(tl.int64)
    row = tl.load(send_row + i, mask=live, other=0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = live[:, None] & (cols[None, :] < H)
        v = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=mask)
        tl.store(dst + row[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _push_entries(src_token, src_rows, src_weight, dst_token, dst_rows, dst_weight,
                  start, end, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  ENTRIES: tl.constexpr):
    """Copy return entries ``[start, end)`` (same indices on both sides)."""
    q = start + tl.arange(0, ENTRIES)
    live = q < end
    tl.store(dst_token + q, tl.load(src_token + q, mask=live), mask=live)
    j = tl.arange(0, TOPK_P2)
    idx = q[:, None] * TOPK + j[None, :]
    mask = live[:, None] & (j[None, :] < TOPK)
    tl.store(dst_rows + idx, tl.load(src_rows + idx, mask=mask), mask=mask)
    tl.store(dst_weight + idx, tl.load(src_weight + idx, mask=mask), mask=mask)


@triton.jit
def dispatch_role(pid, n_prog, x_ptr, H, send_token, send_row, send_off,
                  ret_token, ret_rows, ret_weight, ret_count,
                  a0_table, ret_token_table, ret_rows_table, ret_weight_table, flag0_table,
                  a0_ptr, recv_token, recv_rows, recv_weight, flag0,
                  counters, epoch, err_ptr, rank, max_tokens,
                  WORLD: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ENTRIES: tl.constexpr):
    """Push this rank's rows and return entries to every destination (see module doc).
    ``a0_ptr``, ``recv_*`` and ``flag0`` are this rank's own buffers, used as types."""
    for o in range(WORLD):
        d = (rank - o + WORLD) % WORLD
        lo = tl.load(send_off + d)
        hi = tl.load(send_off + d + 1)
        n_ent = tl.load(ret_count + d)
        row_chunks = tl.cdiv(hi - lo, ROWS)
        total = row_chunks + tl.cdiv(n_ent, ENTRIES)
        a0 = _peer(a0_table, d, a0_ptr)
        # This rank's region in the destination's return-entry tables.
        region = rank * max_tokens
        dst_tok = _peer(ret_token_table, d, recv_token) + region
        dst_rows = _peer(ret_rows_table, d, recv_rows) + region * TOPK
        dst_w = _peer(ret_weight_table, d, recv_weight) + region * TOPK
        src = d * max_tokens
        for c in range(pid, total, n_prog):
            if healthy(err_ptr):
                if c < row_chunks:
                    _push_rows(x_ptr, a0, send_token, send_row, lo + c * ROWS, hi, H,
                               ROWS, BLOCK_H)
                else:
                    e0 = (c - row_chunks) * ENTRIES
                    _push_entries(ret_token + src, ret_rows + src * TOPK,
                                  ret_weight + src * TOPK, dst_tok, dst_rows, dst_w,
                                  e0, n_ent, TOPK, TOPK_P2, ENTRIES)
            if arrive(counters + d, "sys") == total - 1:
                flag = _peer(flag0_table, d, flag0)
                tl.atomic_xchg(flag + rank, epoch, sem="release", scope="sys")
        if (total == 0) & (pid == 0):
            flag = _peer(flag0_table, d, flag0)
            tl.atomic_xchg(flag + rank, epoch, sem="release", scope="sys")


@triton.jit
def layer0_compute_role(pid, n_prog, a_desc, w13_desc, h_ptr, H, F,
                        tile_expert, tile_row_start, tile_row_end, tile_wait, num_tiles_ptr,
                        flag0, epoch, err_ptr, rank, timeout,
                        WAIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        WORLD: tl.constexpr, USE_ASM: tl.constexpr):
    """GroupGEMM ``h = silu(a0 @ W13_gate) * (a0 @ W13_up)`` over the local-first tiles."""
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(F, BLOCK_N)
    ready = tl.full([], 0, tl.int64)
    for w in range(pid, num_tiles * n_blocks, n_prog):
        t, nb = grouped_work(w, num_tiles, n_blocks)
        if WAIT:
            need = tl.load(tile_wait + t) & ~ready
            if need != 0:
                for s in range(WORLD):
                    if ((need >> s) & 1) != 0:
                        wait_at_least(flag0 + s, epoch, err_ptr, SITE_DISPATCH, s, rank,
                                      timeout, "sys", USE_ASM)
                ready = ready | need
                fence_async_proxy(USE_ASM)
        gemm_tile(a_desc, w13_desc, h_ptr, F, tl.load(tile_expert + t),
                  tl.load(tile_row_start + t), tl.load(tile_row_end + t), nb * BLOCK_N, H, F,
                  True, F, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)


@triton.jit
def layer0_kernel(
    # dispatch (comm role)
    x_ptr, send_token, send_row, send_off, ret_token, ret_rows, ret_weight, ret_count,
    a0_table, ret_token_table, ret_rows_table, ret_weight_table, flag0_table,
    recv_token, recv_rows, recv_weight, counters, max_tokens,
    # GroupGEMM (compute role)
    a0_ptr, a_desc, w13_desc, h_ptr, H, F,
    tile_expert, tile_row_start, tile_row_end, tile_wait, num_tiles_ptr,
    # both
    flag0, epoch_ptr, err_ptr, rank, n_comm, timeout,
    ROLE: tl.constexpr, WAIT: tl.constexpr, WORLD: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, COMM_ROWS: tl.constexpr, COMM_BLOCK_H: tl.constexpr,
    COMM_ENTRIES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    if ROLE == ROLE_FUSED:
        comm = pid < n_comm
        n_role = tl.where(comm, n_comm, programs - n_comm)
        role_pid = tl.where(comm, pid, pid - n_comm)
    else:
        comm = ROLE == ROLE_COMM
        n_role = programs
        role_pid = pid
    if comm:
        dispatch_role(role_pid, n_role, x_ptr, H, send_token, send_row, send_off,
                      ret_token, ret_rows, ret_weight, ret_count,
                      a0_table, ret_token_table, ret_rows_table, ret_weight_table,
                      flag0_table, a0_ptr, recv_token, recv_rows, recv_weight, flag0,
                      counters, epoch, err_ptr, rank, max_tokens,
                      WORLD, TOPK, TOPK_P2, COMM_ROWS, COMM_BLOCK_H, COMM_ENTRIES)
    else:
        layer0_compute_role(role_pid, n_role, a_desc, w13_desc, h_ptr, H, F,
                            tile_expert, tile_row_start, tile_row_end, tile_wait,
                            num_tiles_ptr, flag0, epoch, err_ptr, rank, timeout,
                            WAIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, WORLD, USE_ASM)
