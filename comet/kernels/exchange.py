"""The count exchange: every rank learns every peer's routing counts, and the call opens.

Each rank all-gathers its totals (pairs per destination expert, distinct tokens per
destination) into every peer's symmetric ``counts``, then sets its flag on every peer; a
rank that has seen every peer's flag knows the layout of every destination's shared
tensor. The wait is the handshake that opens a call: no peer writes anything else of this
call into this rank before it (comet.runtime.workspace).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comet.constants import COUNT_BUFFERS, SITE_COUNTS
from comet.kernels.address import PeerBuffer, peer
from comet.kernels.shape import Shape, next_pow2
from comet.kernels.sync import Sync, barrier, healthy, release, wait_at_least

#: Halves of the exchange (the virtual-rank driver runs them apart: pushes of every
#: rank, then waits).
PUSH, WAIT, BOTH = 1, 2, 3


def launch_exchange(totals: torch.Tensor, counts: PeerBuffer, flags: PeerBuffer,
                    sync: Sync, shape: Shape, halves: int = BOTH) -> None:
    """Push ``totals`` (``[E + W]``: this rank's pairs per expert, then tokens per rank;
    the plan's last block-count row) into every peer's ``counts`` and set this rank's
    ``flags`` entry there; then wait for every peer's (``halves``: PUSH, WAIT or BOTH)."""
    exchange_counts_kernel[(1,)](
        totals=totals, counts=counts, flags=flags, sync=sync, shape=shape,
        BLOCK=next_pow2(shape.WORLD * (shape.LOCAL_EXPERTS + 1)),
        PUSH=bool(halves & PUSH), WAIT=bool(halves & WAIT), num_warps=1)


@triton.jit
def exchange_counts_kernel(totals, counts, flags, sync, shape, BLOCK: tl.constexpr,
                           PUSH: tl.constexpr, WAIT: tl.constexpr):
    """All-gather of the routing counts: row ``r`` of every peer's
    ``counts[epoch % COUNT_BUFFERS]`` (``[W, W*(El+1)]``) receives this rank's
    ``[W, El + 1]`` (pairs per destination expert, then distinct tokens per destination),
    built from ``totals`` (``[E + W]``: pairs per expert, tokens per rank); then
    ``flags[r] = epoch`` on every peer."""
    WORLD: tl.constexpr = shape.WORLD
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    EL1: tl.constexpr = LOCAL_EXPERTS + 1
    ROW: tl.constexpr = WORLD * EL1
    rank = sync.rank
    epoch = tl.load(sync.epoch)
    if PUSH:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        d = offs // EL1
        c = offs % EL1
        src = tl.where(c < LOCAL_EXPERTS, d * LOCAL_EXPERTS + c, WORLD * LOCAL_EXPERTS + d)
        row = tl.load(totals + src, mask=mask)
        slot = (epoch % COUNT_BUFFERS) * WORLD * ROW + rank * ROW
        if healthy(sync):    # a failed rank writes nothing into peers
            for p in range(WORLD):
                tl.store(peer(counts, p) + slot + offs, row, mask=mask)
            barrier()
            for p in range(WORLD):
                release(peer(flags, p) + rank, epoch, "sys")
    if WAIT:
        for s in range(WORLD):
            wait_at_least(flags.local + s, epoch, sync, SITE_COUNTS, s, "sys")
