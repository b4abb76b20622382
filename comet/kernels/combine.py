"""The combine: each token's output, summed on its home rank from the parts layer1 sent.

The parts are the ranks' partial rows (``comb [W, Mx, H]``, after layer1's reduce) or the
slots' weighted rows (``pair_out [Mx, k, H]``, after its scatter epilogue); a token's live
parts are summed in fp32 in a fixed order (rank order, or slot order), so the result does
not depend on timing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.config import TileConfig
from comet.constants import ADDRESS_ALIGN, SITE_COMBINE, constexpr
from comet.kernels.address import pointer_at
from comet.kernels.shape import next_pow2
from comet.kernels.sync import Sync, wait_at_least

#: Combine programs per SM on a GPU of its own: loads in flight, not threads, bound a
#: stream, and one program per SM left HBM two-thirds idle (docs/notebook.md). (Virtual
#: ranks sharing a GPU launch fewer: a combine spins on its peers' flags, which a peer
#: can only raise on the SMs left to it.)
COMBINE_PROGRAMS_PER_SM = 4


class Parts(NamedTuple):
    """What a token's output is summed from: part ``i`` of token ``t`` is row
    ``i * part_stride + t * token_stride`` of ``rows``, present when ``live[t, i]`` --
    or, with ``fanout > 1`` (a replicated TP layout, comet.mesh), when ``live[t, i']``
    for ``i'`` the part of this rank's TP index in ``i``'s group of ``fanout``: the
    rank's own plan only knows its own shard's slots (and ranks), and the TP peers'
    parts of the same group are live exactly when its own is."""

    rows: torch.Tensor       # [*, H]
    live: torch.Tensor       # int32 [Mx, count]
    part_stride: int
    token_stride: int
    count: int               # parts per token
    fanout: int = 1


class Combine(NamedTuple):
    """The combine as its kernels take it: :class:`Parts` summed into the output whose
    address is in ``y_addr`` (``[M, H]``, ``M`` in the device scalar ``num_tokens``),
    in items of ``ROWS`` tokens x ``BLOCK_H`` columns. Flat, every constexpr a field of
    its own: a group nested in a kernel argument read its constexprs as None after a
    run-time ``if`` of a kernel (Triton 3.6; docs/design.md, "Kernel arguments")."""

    rows: torch.Tensor       # [*, H]
    live: torch.Tensor       # int32 [Mx, COUNT]
    y_addr: torch.Tensor     # int64 [1]
    num_tokens: torch.Tensor  # int64 [1]
    PART_STRIDE: tl.constexpr
    TOKEN_STRIDE: tl.constexpr
    COUNT: tl.constexpr
    FANOUT: tl.constexpr
    H: tl.constexpr
    ROWS: tl.constexpr
    BLOCK_H: tl.constexpr


def combine_of(parts: Parts, y_addr: torch.Tensor, num_tokens: torch.Tensor,
               tile: TileConfig) -> Combine:
    """The :class:`Combine` of ``parts`` into ``y_addr`` on ``tile``'s combine tile."""
    hidden = parts.rows.shape[-1]
    block_h = min(tile.comm.combine_block_h, next_pow2(hidden))
    rows = tile.comm.combine_rows
    return Combine(parts.rows, parts.live, y_addr, num_tokens,
                   *(constexpr(int(v)) for v in (
                       parts.part_stride, parts.token_stride, parts.count, parts.fanout,
                       hidden, rows, block_h)))


def _vector_warp(rows: torch.Tensor) -> int:
    """Elements of ``rows`` a warp holds with one 16-byte vector per thread."""
    return 32 * (int(ADDRESS_ALIGN) // rows.dtype.itemsize)


def launch_combine(grid: int, *, combine: Combine, flag1: torch.Tensor, max_tokens: int,
                   sync: Sync, tile: TileConfig, wait: bool = True) -> None:
    """Sum ``combine``'s parts into its output (:func:`combine_of`) on at most ``grid``
    programs, once every rank's ``flag1`` says its parts landed (``wait``)."""
    # Even with no tokens every program waits for every rank's flag1: the wait closes
    # the call (see comet.runtime.workspace).
    rows, block_h = int(combine.ROWS), int(combine.BLOCK_H)
    grid = max(1, min(grid, triton.cdiv(max_tokens, rows) * triton.cdiv(int(combine.H), block_h)))
    # At least one 16-byte vector per thread, or narrow rows would compile to 2-byte copies.
    warps = max(1, min(tile.comm.combine_warps, rows * block_h // _vector_warp(combine.rows)))
    combine_kernel[(grid,)](combine=combine, flag1=flag1, sync=sync, WAIT=wait,
                            num_warps=warps)


@triton.jit
def combine_kernel(combine, flag1, sync, WAIT: tl.constexpr):
    """``y[t] = sum_{i < COUNT, live[t, i]} rows[i * PART_STRIDE + t * TOKEN_STRIDE]``
    in fp32, in the fixed order of ``i`` (:class:`Combine`). Persistent:
    a fixed grid loops over the items -- several programs per SM on a GPU of its own (a
    stream needs many loads in flight), few when W virtual ranks share one GPU (spinning
    programs must not fill it). The token count and the output's address are read on the
    device, so one captured launch serves every call."""
    epoch = tl.load(sync.epoch)
    ready = tl.full([], 1, tl.int32)
    if WAIT:
        ready = await_parts(flag1, epoch, sync)
    if ready:
        combine_items(combine, sync.rank, tl.program_id(0), tl.num_programs(0))


@triton.jit
def await_parts(flag1, epoch, sync):
    """Wait until every rank's ``flag1`` (on this rank) says its parts of call ``epoch``
    landed; 1 in every thread when they did, 0 when the group gave up."""
    ready = tl.full([], 1, tl.int32)
    for d in range(sync.WORLD):
        ready = ready & wait_at_least(flag1 + d, epoch, sync, SITE_COMBINE, d, "sys")
    return ready


@triton.jit
def combine_items(combine, rank, pid, n_prog):
    """The combine's items ``pid, pid + n_prog, ...``: each sums the live parts of
    ``ROWS`` tokens over ``BLOCK_H`` columns and stores them into the output."""
    rows_ptr = combine.rows
    y_ptr = pointer_at(combine.y_addr, 0, rows_ptr)
    n_tokens = tl.load(combine.num_tokens)
    H = combine.H
    # Items of (token block, column block): a small call's few tokens still spread over
    # as many programs as their row has column blocks; the parts of an item are loaded in
    # one unrolled run, so their HBM round trips overlap (a 1-token DeepSeek-V3-like row,
    # 2 blocks x 8 parts, was 16 round trips one after another).
    h_blocks = tl.cdiv(H, combine.BLOCK_H)
    for item in range(pid, tl.cdiv(n_tokens, combine.ROWS) * h_blocks, n_prog):
        b = item // h_blocks
        h0 = (item % h_blocks) * combine.BLOCK_H
        rows = b * combine.ROWS + tl.arange(0, combine.ROWS)
        live = rows < n_tokens
        cols = h0 + tl.arange(0, combine.BLOCK_H)
        cmask = live[:, None] & (cols[None, :] < H)
        acc = tl.zeros((combine.ROWS, combine.BLOCK_H), dtype=tl.float32)
        for i in tl.static_range(combine.COUNT):
            known = i
            if combine.FANOUT > 1:
                known = i - i % combine.FANOUT + rank % combine.FANOUT
            sent = tl.load(combine.live + rows * combine.COUNT + known, mask=live,
                           other=0) != 0
            part = (i * combine.PART_STRIDE + rows[:, None] * combine.TOKEN_STRIDE).to(tl.int64)
            v = tl.load(rows_ptr + part * H + cols[None, :], mask=cmask & sent[:, None],
                        other=0.0)
            acc += v.to(tl.float32)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=cmask)
