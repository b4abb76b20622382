"""The routing plan in torch: the specification of the plan kernels (comet.kernels.plan),
which compute the same tables on the device with no host synchronisation. (The router
itself is :func:`comet.reference.route`.)

The forward path never asks the host how many tokens went where: every table here has a
fixed capacity derived from ``max_tokens`` and the live counts stay on the device, where
the kernels read them. That is what makes the layer CUDA-graph capturable.

Row layout of the layer0 shared tensor on a destination rank ``d`` (the contract between
the sender, the receiver and the kernels; :func:`comet.reference.ep_receive_order` is its
specification): rows grouped by local expert ``el``; inside an expert by source rank in
ring order ``d, d+1, ...`` (own rank first, so local tiles can start at once); inside a
source by ``(token, slot)`` ascending, which keeps the order deterministic.

Steps of one call on rank ``r``:

1. :func:`local_counts` -- ``[W, El + 1]``: pairs this rank sends to each destination's
   experts, and (last column) the distinct tokens it sends to each destination.
2. exchange (runtime, through symmetric memory) -- every rank gets ``counts_all
   [W_src, W_dst, El + 1]``.
3. :func:`build_send_plan` -- this rank as a source: the rows to push and where they land,
   and the *return entries* (per destination, one per token, naming the rows that hold
   its expert outputs and their routing weights) that the destination uses in layer1 to
   pre-sum a token's experts before sending one row back.
4. :func:`build_recv_layout` -- this rank as a destination: expert and segment offsets of
   its shared tensor, from which :mod:`comet.scheduler.plan` builds the tile tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["local_counts", "SendPlan", "RecvLayout", "build_send_plan", "build_recv_layout",
           "recv_capacity"]


def recv_capacity(world_size: int, max_tokens: int, top_k: int) -> int:
    """Rows a rank's layer0 shared tensor must hold in the worst case (every token of every
    rank routes all ``top_k`` slots to this rank)."""
    return world_size * max_tokens * top_k


def _valid_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flattened ids with "no expert" (negative or out of range) mapped to ``num_experts``,
    a dump bin that sorts after every real expert."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids, torch.full_like(ids, num_experts))


def _exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def local_counts(topk_ids: torch.Tensor, world_size: int, local_experts: int) -> torch.Tensor:
    """``[W, El + 1]`` int32: column ``el`` counts the (token, slot) pairs this rank routes
    to expert ``d * El + el`` of destination ``d``; the last column counts distinct tokens
    sent to ``d`` (the return entries ``d`` will send back)."""
    num_experts = world_size * local_experts
    m, k = topk_ids.shape
    e = _valid_expert_ids(topk_ids, num_experts)
    pairs = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    pairs.scatter_add_(0, e, torch.ones_like(e, dtype=torch.int32))
    mask = _dest_mask(e.view(m, k), world_size, local_experts)
    tokens = mask.sum(dim=0, dtype=torch.int32)
    return torch.cat([pairs[:num_experts].view(world_size, local_experts),
                      tokens.view(world_size, 1)], dim=1)


def _dest_mask(e: torch.Tensor, world_size: int, local_experts: int) -> torch.Tensor:
    """``[M, W]`` int32: 1 where a token sends at least one slot to destination ``d``."""
    m = e.shape[0]
    dest = torch.div(e, local_experts, rounding_mode="floor")  # dump bin -> W
    hit = torch.zeros(m, world_size + 1, dtype=torch.int32, device=e.device)
    hit.scatter_(1, dest, 1)
    return hit[:, :world_size]


@dataclass
class RecvLayout:
    """Where rows land in each destination's layer0 shared tensor (computed identically on
    every rank from ``counts_all``). Leading dim: destination rank ``d``.

    expert_rows: ``[W, El]`` rows of each local expert.
    expert_off:  ``[W, El + 1]`` first row of each expert (last: total rows).
    seg_rows:    ``[W, W, El]`` rows from the source at ring offset ``o`` (source
                 ``(d + o) % W``) for expert ``el``.
    seg_off:     ``[W, W, El]`` first row of that segment.
    entries:     ``[W, W]`` return entries ``d`` receives from source ``s`` (by source rank).
    """

    expert_rows: torch.Tensor
    expert_off: torch.Tensor
    seg_rows: torch.Tensor
    seg_off: torch.Tensor
    entries: torch.Tensor


def build_recv_layout(counts_all: torch.Tensor) -> RecvLayout:
    """The layout of every destination's shared tensor from ``counts_all [W, W, El + 1]``
    (source, destination, expert or distinct-token column)."""
    world = counts_all.shape[0]
    dev = counts_all.device
    pairs = counts_all[:, :, :-1].to(torch.int32)             # [s, d, el]
    d = torch.arange(world, device=dev).view(world, 1)
    o = torch.arange(world, device=dev).view(1, world)
    src = (d + o) % world                                     # [d, o] -> source rank
    seg_rows = pairs.permute(1, 0, 2)[d, src]                 # [d, o, el]
    expert_rows = seg_rows.sum(dim=1, dtype=torch.int32)      # [d, el]
    ex_off = _exclusive_cumsum(expert_rows, dim=1)
    expert_off = torch.cat([ex_off, expert_rows.sum(dim=1, keepdim=True, dtype=torch.int32)],
                           dim=1).to(torch.int32)
    seg_off = (ex_off.unsqueeze(1) + _exclusive_cumsum(seg_rows, dim=1)).to(torch.int32)
    entries = counts_all[:, :, -1].t().contiguous().to(torch.int32)  # [d, s]
    return RecvLayout(expert_rows, expert_off, seg_rows, seg_off, entries)


@dataclass
class SendPlan:
    """This rank as a source. Capacities: ``P = max_tokens * top_k`` pairs, ``Mx =
    max_tokens`` tokens; entries past the live counts are padding.

    send_pair:   ``[P]`` pair ``t * k + j`` (token ``t``, slot ``j``) of the i-th row
                 pushed, rows ordered by (dest, expert, token, slot).
    send_row:    ``[P]`` row it lands on in the destination's shared tensor.
    send_weight: ``[P]`` fp32 routing weight of that pair (0 where not finite).
    send_off:    ``[W + 1]`` rows for destination ``d`` are ``send_off[d]:send_off[d+1]``.
    send_first:  ``[P]`` int32, 1 where the i-th pair is the first of its token's pairs to
                 its destination in this order (a gathered dispatch sends the token's
                 row with it, once per destination).
    entry_token: ``[W, Mx]`` return entry ``q`` for destination ``d``: the token.
    entry_rows:  ``[W, Mx, k]`` rows of the destination's shared tensor holding that
                 token's slots (``-1``: slot not on ``d``).
    entry_weight: ``[W, Mx, k]`` fp32 routing weights of those slots (0 where ``-1``).
    entry_count: ``[W]`` live return entries per destination.
    dest_mask:   ``[Mx, W]`` int32, 1 where token ``t`` was sent to ``d``; the final combine
                 sums exactly these partial results, in rank order.
    pair_live:   ``[Mx, k]`` int32, 1 where ``(t, j)`` is a real pair; with layer1's scatter
                 epilogue the final combine sums exactly these rows, in slot order.
    """

    send_pair: torch.Tensor
    send_row: torch.Tensor
    send_weight: torch.Tensor
    send_off: torch.Tensor
    send_first: torch.Tensor
    entry_token: torch.Tensor
    entry_rows: torch.Tensor
    entry_weight: torch.Tensor
    entry_count: torch.Tensor
    dest_mask: torch.Tensor
    pair_live: torch.Tensor


def build_send_plan(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    counts_all: torch.Tensor,
    layout: RecvLayout,
    rank: int,
    max_tokens: int,
) -> SendPlan:
    """Plan the pushes of this rank (a source) for one call.

    Args:
        topk_ids: ``[M, k]`` global expert ids of this rank's tokens (``-1`` = none).
        topk_weights: ``[M, k]`` routing weights.
        counts_all: ``[W, W, El + 1]`` from the exchange.
        layout: :func:`build_recv_layout` of ``counts_all``.
        rank: this rank.
        max_tokens: table capacity (``M <= max_tokens``).
    """
    world = counts_all.shape[0]
    el_count = counts_all.shape[2] - 1
    num_experts = world * el_count
    m, k = topk_ids.shape
    dev = topk_ids.device
    cap_pairs = max_tokens * k

    e = _valid_expert_ids(topk_ids, num_experts)                 # [M*k]
    sorted_e, perm = torch.sort(e, stable=True)                  # order (dest, el, token, slot)
    pair_counts = counts_all[rank, :, :-1].reshape(-1).to(torch.int64)      # [E]
    start = torch.cat([_exclusive_cumsum(pair_counts),
                       pair_counts.sum().view(1)])               # [E + 1], dump bin at the end
    pos_sorted = torch.arange(m * k, device=dev) - start[sorted_e]

    # Row in the destination's shared tensor: segment of (dest, ring offset of this rank, el).
    dest = torch.div(sorted_e, el_count, rounding_mode="floor").clamp(max=world - 1)
    el = sorted_e - dest * el_count
    ring_off = (rank - dest) % world
    base = layout.seg_off[dest, ring_off, el.clamp(max=el_count - 1)]
    valid_sorted = sorted_e < num_experts
    row_sorted = torch.where(valid_sorted, base + pos_sorted, torch.full_like(pos_sorted, -1))

    send_pair = torch.zeros(cap_pairs, dtype=torch.int32, device=dev)
    send_row = torch.full((cap_pairs,), -1, dtype=torch.int32, device=dev)
    send_weight = torch.zeros(cap_pairs, dtype=torch.float32, device=dev)
    send_pair[: m * k] = perm.to(torch.int32)
    send_row[: m * k] = row_sorted.to(torch.int32)
    w_flat = topk_weights.float().reshape(-1)
    send_weight[: m * k] = torch.where(torch.isfinite(w_flat), w_flat, 0.0)[perm]
    # First pair of each (destination, token) in send order.
    key = dest * m + torch.div(perm, k, rounding_mode="floor")
    order = torch.arange(m * k, device=dev)
    first_of_key = torch.full((world * m,), m * k, dtype=torch.int64, device=dev)
    first_of_key.scatter_reduce_(0, key, order, "amin")
    send_first = torch.zeros(cap_pairs, dtype=torch.int32, device=dev)
    send_first[: m * k] = (valid_sorted & (first_of_key[key] == order)).to(torch.int32)
    per_dest = pair_counts.view(world, el_count).sum(dim=1)
    send_off = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                          torch.cumsum(per_dest, 0)]).to(torch.int32)

    # Row of every (token, slot) pair, in the input's order.
    row_of_pair = torch.empty(m * k, dtype=torch.int64, device=dev)
    row_of_pair[perm] = row_sorted
    row_of_pair = row_of_pair.view(m, k)
    e2 = e.view(m, k)
    pair_dest = torch.div(e2, el_count, rounding_mode="floor")  # dump bin -> W

    # Return entries: for each destination, its tokens in ascending order.
    mask = _dest_mask(e2, world, el_count)                      # [M, W]
    q = torch.cumsum(mask, dim=0) - 1                           # entry index per (t, d)
    slot_idx = torch.where(mask.bool(), q, torch.full_like(q, max_tokens))  # trash slot
    d_ids = torch.arange(world, device=dev).view(1, world, 1)
    on_d = pair_dest.unsqueeze(1) == d_ids                      # [M, W, k]
    rows_tdk = torch.where(on_d, row_of_pair.unsqueeze(1), torch.full_like(row_of_pair.unsqueeze(1), -1))
    w_tdk = torch.where(on_d, topk_weights.float().unsqueeze(1), torch.zeros((), device=dev))

    flat = (torch.arange(world, device=dev).view(1, world) * (max_tokens + 1) + slot_idx).reshape(-1)
    entry_token = torch.zeros(world * (max_tokens + 1), dtype=torch.int32, device=dev)
    entry_token.scatter_(0, flat, torch.arange(m, device=dev, dtype=torch.int32)
                       .view(m, 1).expand(m, world).reshape(-1))
    entry_rows = torch.full((world * (max_tokens + 1), k), -1, dtype=torch.int32, device=dev)
    entry_rows.index_copy_(0, flat, rows_tdk.reshape(-1, k).to(torch.int32))
    entry_weight = torch.zeros(world * (max_tokens + 1), k, dtype=torch.float32, device=dev)
    entry_weight.index_copy_(0, flat, w_tdk.reshape(-1, k))

    dest_mask = torch.zeros(max_tokens, world, dtype=torch.int32, device=dev)
    dest_mask[:m] = mask
    pair_live = torch.zeros(max_tokens, k, dtype=torch.int32, device=dev)
    pair_live[:m] = (e2 < num_experts).to(torch.int32)
    return SendPlan(
        send_pair=send_pair,
        send_row=send_row,
        send_weight=send_weight,
        send_off=send_off,
        send_first=send_first,
        entry_token=entry_token.view(world, max_tokens + 1)[:, :max_tokens].contiguous(),
        entry_rows=entry_rows.view(world, max_tokens + 1, k)[:, :max_tokens].contiguous(),
        entry_weight=entry_weight.view(world, max_tokens + 1, k)[:, :max_tokens].contiguous(),
        entry_count=mask.sum(dim=0, dtype=torch.int32),
        dest_mask=dest_mask,
        pair_live=pair_live,
    )
