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
    or, with ``FANOUT > 1`` (a replicated TP layout, comet.mesh), when ``live[t, i']``
    for ``i'`` the part of this rank's TP index in ``i``'s group of ``FANOUT``: the
    rank's own plan only knows its own shard's slots (and ranks), and the TP peers'
    parts of the same group are live exactly when its own is."""

    rows: torch.Tensor       # [*, H]
    live: torch.Tensor       # int32 [Mx, COUNT]
    part_stride: int
    token_stride: int
    COUNT: tl.constexpr      # parts per token
    FANOUT: tl.constexpr = constexpr(1)


def launch_combine(grid: int, *, parts: Parts, flag1: torch.Tensor, y_addr: torch.Tensor,
                   num_tokens: torch.Tensor, hidden: int, max_tokens: int, sync: Sync,
                   tile: TileConfig, wait: bool = True) -> None:
    """Sum the parts into the output whose address is in ``y_addr`` (``[M, H]``, ``M`` in
    the device scalar ``num_tokens``), on at most ``grid`` programs, once every rank's
    ``flag1`` says its parts landed (``wait``)."""
    # Even with no tokens every program waits for every rank's flag1: the wait closes
    # the call (see comet.runtime.workspace).
    block_h = min(tile.combine_block_h, next_pow2(hidden))
    grid = max(1, min(grid, triton.cdiv(max_tokens, tile.combine_rows)
                      * triton.cdiv(hidden, block_h)))
    # At least one 16-byte vector per thread, or narrow rows would compile to 2-byte copies.
    per_warp = 32 * (int(ADDRESS_ALIGN) // parts.rows.dtype.itemsize)
    warps = max(1, min(tile.combine_warps, tile.combine_rows * block_h // per_warp))
    combine_kernel[(grid,)](
        parts=parts, flag1=flag1, y_addr=y_addr, num_tokens=num_tokens, H=hidden, sync=sync,
        WAIT=wait, ROWS=tile.combine_rows, BLOCK_H=block_h, num_warps=warps)


@triton.jit
def combine_kernel(parts, flag1, y_addr, num_tokens, H, sync, WAIT: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``y[t] = sum_{i < COUNT, live[t, i]} parts.rows[i * part_stride + t *
    token_stride]`` in fp32, in the fixed order of ``i``. Persistent: a fixed grid loops
    over items of ``ROWS`` tokens x ``BLOCK_H`` columns -- several programs per SM on a
    GPU of its own (a stream needs many loads in flight), few when W virtual ranks share
    one GPU (spinning programs must not fill it). The token count and the output's
    address are read on the device, so one captured launch serves every call."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    parts_ptr = parts.rows
    y_ptr = pointer_at(y_addr, 0, parts_ptr)
    epoch = tl.load(sync.epoch)
    n_tokens = tl.load(num_tokens)
    ready = tl.full([], 1, tl.int32)
    if WAIT:
        for d in range(sync.WORLD):
            ready = ready & wait_at_least(flag1 + d, epoch, sync, SITE_COMBINE, d, "sys")
    if ready:
        # Items of (token block, column block): a small call's few tokens still spread
        # over as many programs as their row has column blocks; the parts of an item
        # are loaded in one unrolled run, so their HBM round trips overlap (a 1-token
        # DeepSeek-V3-like row, 2 blocks x 8 parts, was 16 round trips one after another).
        h_blocks = tl.cdiv(H, BLOCK_H)
        for item in range(pid, tl.cdiv(n_tokens, ROWS) * h_blocks, n_prog):
            b = item // h_blocks
            h0 = (item % h_blocks) * BLOCK_H
            rows = b * ROWS + tl.arange(0, ROWS)
            live = rows < n_tokens
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = live[:, None] & (cols[None, :] < H)
            acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
            for i in tl.static_range(parts.COUNT):
                known = i
                if parts.FANOUT > 1:
                    known = i - i % parts.FANOUT + sync.rank % parts.FANOUT
                sent = tl.load(parts.live + rows * parts.COUNT + known, mask=live,
                               other=0) != 0
                part = (i * parts.part_stride + rows[:, None] * parts.token_stride).to(tl.int64)
                v = tl.load(parts_ptr + part * H + cols[None, :],
                            mask=cmask & sent[:, None], other=0.0)
                acc += v.to(tl.float32)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=cmask)
