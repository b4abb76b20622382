"""A (tp, ep) layout's routing as the expert-parallel kernels take it.

The fused kernels run a tensor- or hybrid-parallel layer as expert parallelism over shard
experts (:mod:`comet.mesh`): each of a token's ``k`` choices becomes ``tp`` slots, one
per F shard. :func:`launch_shard_routing` writes those slots from the caller's routing
on the device, as the first launch of a call, so the staged routing stays ``[Mx, k]`` and
a call's host work does not grow with the layout. Its torch spec is
:meth:`comet.mesh.MeshLayout.shard_routing`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.constants import constexpr
from comet.kernels.shape import next_pow2

#: Tokens per program.
TOKENS_PER_PROGRAM = 64


class ShardRouting(NamedTuple):
    """The caller's routing in, the kernels' out, and the layout as constexprs."""

    ids: torch.Tensor            # int64 [Mx, TOPK]: global expert ids (or -1)
    weights: torch.Tensor        # fp32 [Mx, TOPK]
    num_tokens: torch.Tensor     # int64 [1]: tokens of the call
    shard_ids: torch.Tensor      # int64 [Mx, TOPK * TP]: shard-expert ids (or -1)
    shard_weights: torch.Tensor  # fp32 [Mx, TOPK * TP]
    kept: int                    # the shard slot this rank keeps ("replicated"), or -1: all
    NUM_EXPERTS: tl.constexpr    # E, global experts
    LOCAL_EXPERTS: tl.constexpr  # El = E / ep
    TOPK: tl.constexpr
    TP: tl.constexpr


def shard_routing(ids: torch.Tensor, weights: torch.Tensor, num_tokens: torch.Tensor,
                  shard_ids: torch.Tensor, shard_weights: torch.Tensor, *, num_experts: int,
                  ep: int, tp: int, kept: int) -> ShardRouting:
    """The argument group of one rank (``kept``: its TP index under ``"replicated"``,
    -1 under ``"sequence"``)."""
    return ShardRouting(ids, weights, num_tokens, shard_ids, shard_weights, kept,
                        constexpr(num_experts), constexpr(num_experts // ep),
                        constexpr(ids.shape[1]), constexpr(tp))


def launch_shard_routing(routing: ShardRouting) -> None:
    """Write ``shard_ids`` / ``shard_weights`` for the call's tokens (a fixed grid for
    ``Mx`` tokens; programs past the device-held token count return at once)."""
    rows = routing.ids.shape[0]
    grid = triton.cdiv(rows, TOKENS_PER_PROGRAM)
    slots = int(routing.TOPK) * int(routing.TP)
    shard_routing_kernel[(grid,)](routing=routing, SLOTS_P2=next_pow2(slots),
                                  BLOCK_T=TOKENS_PER_PROGRAM, num_warps=4)


@triton.jit
def shard_routing_kernel(routing, SLOTS_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    """Slot ``i = j * TP + t`` of token ``n``: shard ``t`` of choice ``j`` -- its
    shard-expert id ``(e // El * TP + t) * El + e % El``, or -1 for "no expert" and for
    the slots a replicated rank leaves to its TP peers; an invalid id stays invalid
    (``E * TP``) in the first kept slot, for the plan kernels to report."""
    TOPK: tl.constexpr = routing.TOPK
    TP: tl.constexpr = routing.TP
    EL: tl.constexpr = routing.LOCAL_EXPERTS
    E: tl.constexpr = routing.NUM_EXPERTS
    SLOTS: tl.constexpr = TOPK * TP
    n_tokens = tl.load(routing.num_tokens)
    t0 = tl.program_id(0) * BLOCK_T
    if t0 < n_tokens:
        tok = t0 + tl.arange(0, BLOCK_T)
        i = tl.arange(0, SLOTS_P2)
        j = i // TP
        shard = i % TP
        inside = (tok[:, None] < n_tokens) & (i[None, :] < SLOTS)
        src = tok[:, None].to(tl.int64) * TOPK + j[None, :]
        e = tl.load(routing.ids + src, mask=inside, other=-1)
        w = tl.load(routing.weights + src, mask=inside, other=0.0)
        valid = (e >= 0) & (e < E)
        e_safe = tl.where(valid, e, 0)
        out = (e_safe // EL * TP + shard[None, :]) * EL + e_safe % EL
        kept = routing.kept
        mine = (shard[None, :] == kept) | (kept < 0)
        out = tl.where(valid & mine, out, -1)
        first_kept = shard[None, :] == tl.maximum(kept, 0)
        out = tl.where(~valid & (e != -1) & first_kept, E * TP, out)
        dst = tok[:, None].to(tl.int64) * SLOTS + i[None, :]
        tl.store(routing.shard_ids + dst, out, mask=inside)
        tl.store(routing.shard_weights + dst, w, mask=inside)
