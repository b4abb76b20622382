"""The count exchange: every rank learns every peer's routing counts, and the call opens.

Each rank all-gathers its totals (pairs per destination expert, distinct tokens per
destination) into every peer's symmetric ``counts``, then sets its flag on every peer; a
rank that has seen every peer's flag knows the layout of every destination's shared
tensor. The wait is the handshake that opens a call: no peer writes anything else of this
call into this rank before it (comet.runtime.workspace).

A forward call runs both halves inside the plan's kernels (:class:`Exchange`): the push
at the end of the scan that computes the totals (its last program), the wait at the start
of the layout kernel that reads the counts -- two launches fewer than a kernel of its own,
which the backward (same routing, no new plan) still launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.constants import COUNT_BUFFERS, SITE_COUNTS, constexpr
from comet.kernels.address import PeerBuffer, peer
from comet.kernels.shape import Shape, next_pow2
from comet.kernels.sync import Sync, barrier, healthy, release, wait_at_least

#: Halves of the exchange (the virtual-rank driver runs them apart: pushes of every
#: rank, then waits).
PUSH, WAIT, BOTH = 1, 2, 3


class Exchange(NamedTuple):
    """The count exchange as the plan's kernels run it (``IN_PLAN``): the scan's last
    program pushes, every layout program waits. Without ``IN_PLAN`` the plan kernels
    leave it to :func:`launch_exchange`."""

    counts: PeerBuffer          # int32 [COUNT_BUFFERS, W, W * (El + 1)] on every rank
    flags: PeerBuffer           # int64 [W]: flags[s] = the epoch whose counts s pushed here
    scanned: torch.Tensor | None = None   # int32 [1]: scan programs done (zeroed per call)
    BLOCK: tl.constexpr = constexpr(1)     # >= W * (El + 1), a power of two
    IN_PLAN: tl.constexpr = constexpr(False)


def exchange_block(shape: Shape) -> int:
    """The push's vector width: one row of ``counts``, ``W * (El + 1)``, rounded up."""
    return next_pow2(shape.WORLD * (shape.LOCAL_EXPERTS + 1))


def launch_exchange(totals: torch.Tensor, exchange: Exchange, sync: Sync, shape: Shape,
                    halves: int = BOTH) -> None:
    """Push ``totals`` (``[E + W]``: this rank's pairs per expert, then tokens per rank;
    the plan's last block-count row) into every peer's ``exchange.counts`` and set this
    rank's ``exchange.flags`` entry there; then wait for every peer's (``halves``: PUSH,
    WAIT or BOTH)."""
    exchange_counts_kernel[(1,)](
        totals=totals, counts=exchange.counts, flags=exchange.flags, sync=sync, shape=shape,
        BLOCK=exchange.BLOCK, PUSH=bool(halves & PUSH), WAIT=bool(halves & WAIT),
        num_warps=1)


@triton.jit
def push_counts(totals, counts, flags, sync, shape, BLOCK: tl.constexpr):
    """Row ``r`` of every peer's ``counts[epoch % COUNT_BUFFERS]`` (``[W, W*(El+1)]``)
    receives this rank's ``[W, El + 1]`` (pairs per destination expert, then distinct
    tokens per destination), built from ``totals`` (``[E + W]``: pairs per expert, tokens
    per rank); then ``flags[r] = epoch`` on every peer."""
    WORLD: tl.constexpr = shape.WORLD
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    EL1: tl.constexpr = LOCAL_EXPERTS + 1
    ROW: tl.constexpr = WORLD * EL1
    rank = sync.rank
    epoch = tl.load(sync.epoch)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    d = offs // EL1
    c = offs % EL1
    src = tl.where(c < LOCAL_EXPERTS, d * LOCAL_EXPERTS + c, WORLD * LOCAL_EXPERTS + d)
    # Through L2 (".cg"): in the plan scan, other programs stored these totals just
    # before this program's arrival, and a line of them may sit in this SM's L1 from its
    # own part of the scan.
    row = tl.load(totals + src, mask=mask, cache_modifier=".cg")
    slot = (epoch % COUNT_BUFFERS) * WORLD * ROW + rank * ROW
    if healthy(sync):    # a failed rank writes nothing into peers
        for p in range(WORLD):
            tl.store(peer(counts, p) + slot + offs, row, mask=mask)
        barrier()
        for p in range(WORLD):
            release(peer(flags, p) + rank, epoch, "sys")


@triton.jit
def wait_counts(flags, sync, shape):
    """Wait (bounded) until every peer has pushed this call's counts here."""
    epoch = tl.load(sync.epoch)
    for s in range(shape.WORLD):
        wait_at_least(flags.local + s, epoch, sync, SITE_COUNTS, s, "sys")


@triton.jit
def exchange_counts_kernel(totals, counts, flags, sync, shape, BLOCK: tl.constexpr,
                           PUSH: tl.constexpr, WAIT: tl.constexpr):
    """All-gather of the routing counts (:func:`push_counts`), then the wait for every
    peer's (:func:`wait_counts`), as halves ``PUSH`` and ``WAIT`` say."""
    if PUSH:
        push_counts(totals, counts, flags, sync, shape, BLOCK)
    if WAIT:
        wait_counts(flags, sync, shape)
