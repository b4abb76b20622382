"""Replica translation on the device: a rank's top-k logical expert ids -> physical expert
ids of a placement (:mod:`comet.placement`), and the per-logical-expert load count the
next placement is planned from.

Everything here is a fixed-shape torch op on device tensors: no host synchronisation, no
shape that depends on data, so a call stays CUDA-graph capturable, and a new placement is
written into the same tensors (:meth:`ReplicaTables.load_`) without invalidating a graph
that read them.

Which replica a (token, slot) pair goes to, deterministically, where the tables hold a
placement's dispatch shares (:func:`comet.placement.dispatch_shares`, loaded by
:meth:`ReplicaTables.load_`; what every layer, the bench and the device check load):

* the ``n`` pairs of this call that this rank routes to expert ``e``, in token order,
  are cut into consecutive runs, one per replica, of ``n`` times the replica's share
  for this rank (rounded at the run ends): pair number ``i`` (0-based) goes to the
  replica whose cumulative share interval holds ``(i + 1/2) / n``. The planner's load
  per replica is then met call by call (up to one pair per replica and rank), whatever
  each rank routes; with per-rank loads the shares keep pairs on their own rank where
  that still leaves every replica its planned load.

Without shares (tables loaded with ``shares=None``), the earlier rule:

1. a replica on the token's own rank, if the expert has one there (the lowest such
   slot): the row is then computed where it lives and never crosses ranks;
2. else replica ``t mod c`` of the expert's ``c`` replicas (``t`` the token's index on
   its rank): consecutive tokens take turns, so each replica gets about ``1 / c`` of the
   expert's remote pairs.

Rule 1 is a bet that ranks route alike: a replica on a rank with many of the expert's
tokens takes all of them, more than its ``1 / c`` (with Zipf 1.2 routing whose hot
experts differ between ranks, 1.136 rows max/mean at E=256, W=8, R=32 where the plan
promised 1.0005; docs/eplb.md). ``prefer_local=False`` spreads every pair by rule 2,
shares or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReplicaTables", "translate", "count_load", "SHARE_UNIT"]

#: Dispatch shares are stored as integers in units of 1 / SHARE_UNIT.
SHARE_UNIT = 1 << 20


@dataclass
class ReplicaTables:
    """A placement of ``E`` logical experts on ``P`` physical slots of ``W`` ranks, as
    device tensors of fixed shape (the widest placement ``R`` redundant experts allow).

    Attributes:
        log2phy: ``[E, R + 1]`` int64, the slots of each logical expert, ``-1`` padded.
        replicas: ``[E]`` int64, replica counts (``>= 1``).
        phy2log: ``[P]`` int64, the logical expert of each slot.
        slots_per_rank: ``P / W``; rank ``r`` holds slots ``[r * P/W, (r + 1) * P/W)``.
        split: ``[W, E, R + 1]`` int64 or None: per source rank and expert, the
            cumulative dispatch shares of the replica columns in units of
            :data:`SHARE_UNIT` (the last valid column ``SHARE_UNIT``, padding too);
            ``-1`` where no shares are loaded (the rule without shares).
    """

    log2phy: torch.Tensor
    replicas: torch.Tensor
    phy2log: torch.Tensor
    slots_per_rank: int
    split: torch.Tensor | None = None

    @classmethod
    def empty(cls, num_experts: int, redundant_experts: int, world: int,
              device=None) -> "ReplicaTables":
        """Tables of the right shapes, holding no placement yet (fill with :meth:`load_`)."""
        physical = num_experts + redundant_experts
        return cls(torch.full((num_experts, redundant_experts + 1), -1, dtype=torch.int64,
                              device=device),
                   torch.ones(num_experts, dtype=torch.int64, device=device),
                   torch.zeros(physical, dtype=torch.int64, device=device),
                   physical // world,
                   torch.full((world, num_experts, redundant_experts + 1), -1,
                              dtype=torch.int64, device=device))

    def load_(self, phy2log: torch.Tensor, log2phy: torch.Tensor,
              replicas: torch.Tensor, shares: torch.Tensor | None = None) -> None:
        """Write one layer's placement (``[P]``, ``[E, X]`` with ``X <= R + 1``, ``[E]``)
        and its dispatch ``shares [W, E, X]`` (:attr:`comet.placement.Placement.shares`
        of one layer; None: the rule without shares) into the tables in place.
        ValueError for shapes that do not fit."""
        e, width = self.log2phy.shape
        if (tuple(phy2log.shape) != tuple(self.phy2log.shape) or log2phy.dim() != 2
                or log2phy.shape[0] != e or log2phy.shape[1] > width
                or tuple(replicas.shape) != (e,)):
            raise ValueError(f"a placement of {e} experts on {self.phy2log.shape[0]} slots "
                             f"(at most {width} replicas each) expected, got phy2log "
                             f"{list(phy2log.shape)}, log2phy {list(log2phy.shape)}, "
                             f"replicas {list(replicas.shape)}")
        padded = torch.full_like(self.log2phy, -1, device="cpu")
        padded[:, :log2phy.shape[1]] = log2phy
        if shares is not None and self.split is None:
            raise ValueError("these tables hold no dispatch shares (ReplicaTables.empty "
                             "makes tables that do)")
        if self.split is not None:
            self.split.copy_(self._split(shares, padded, replicas.cpu()))
        self.log2phy.copy_(padded)
        self.replicas.copy_(replicas)
        self.phy2log.copy_(phy2log)

    def _split(self, shares, log2phy: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
        """Cumulative integer shares ``[W, E, R + 1]`` (``-1``: none)."""
        world, e, width = self.split.shape
        if shares is None:
            return torch.full((world, e, width), -1, dtype=torch.int64)
        shares = torch.as_tensor(shares).detach().cpu().double()
        if (shares.dim() != 3 or shares.shape[0] != world or shares.shape[1] != e
                or shares.shape[2] > width):
            raise ValueError(f"shares must be [{world}, {e}, <= {width}], got "
                             f"{list(shares.shape)}")
        padded = torch.zeros(world, e, width, dtype=torch.float64)
        padded[..., :shares.shape[2]] = shares
        valid = (torch.arange(width) < replicas[:, None])[None]
        if not torch.isfinite(padded).all() or (padded < 0).any() or \
                (padded * ~valid).abs().sum() > 0:
            raise ValueError("shares must be finite, non-negative and zero past an "
                             "expert's replicas")
        total = padded.sum(-1, keepdim=True)
        # A row of zeros (no pairs planned): 1 / c each.
        padded = torch.where(total > 0, padded / total.clamp(min=1e-300),
                             valid / replicas[None, :, None].double())
        cum = torch.round(padded.cumsum(-1) * SHARE_UNIT).to(torch.int64)
        return torch.where(valid, cum.clamp(max=SHARE_UNIT), torch.full_like(cum, SHARE_UNIT))


def translate(topk_ids: torch.Tensor, tables: ReplicaTables, rank: int,
              prefer_local: bool = True) -> torch.Tensor:
    """Physical ids ``[M, k]`` int64 for this rank's logical ``topk_ids [M, k]`` (see the
    module doc for which replica). Ids outside ``[0, E)`` (``-1``: no expert) give
    ``-1``. On the ids' device, no host synchronisation."""
    e, width = tables.log2phy.shape
    ids = topk_ids.to(torch.int64)
    live = (ids >= 0) & (ids < e)
    safe = torch.where(live, ids, torch.zeros_like(ids))
    slots = tables.log2phy[safe]                                   # [M, k, X]
    count = tables.replicas[safe]                                  # [M, k]
    token = torch.arange(ids.shape[0], device=ids.device)[:, None]
    choice = token % count
    if prefer_local:
        nth = torch.arange(width, device=ids.device)
        local = (nth < count[..., None]) & (slots // tables.slots_per_rank == rank)
        # argmax of a bool row: its first True (ties resolve to the first index).
        choice = torch.where(local.any(-1), local.to(torch.uint8).argmax(-1), choice)
    if prefer_local and tables.split is not None:
        # (Pairs with no expert get a column past the end: clamped, then masked.)
        split = _split_choice(ids, live, safe, tables.split[rank][safe], e)
        choice = torch.where(tables.split[rank][safe][..., 0] >= 0,
                             torch.minimum(split, count - 1), choice)
    physical = slots.gather(-1, choice[..., None]).squeeze(-1)
    return torch.where(live, physical, torch.full_like(physical, -1))


def _split_choice(ids: torch.Tensor, live: torch.Tensor, safe: torch.Tensor,
                  cum: torch.Tensor, e: int) -> torch.Tensor:
    """The replica column of each pair under cumulative shares ``cum [M, k, X]``: pair
    number ``i`` of the ``n`` pairs of its expert (in token order, on this rank) takes
    the column whose interval holds ``(i + 1/2) / n``. Fixed shapes (a stable sort, an
    ``index_add_``, a scatter): no host synchronisation."""
    flat = torch.where(live, ids, torch.full_like(ids, e)).reshape(-1)
    size = flat.numel()
    order = torch.sort(flat, stable=True).indices
    per = torch.zeros(e + 1, dtype=torch.int64, device=ids.device)
    per.index_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(per, 0) - per
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(size, device=ids.device) - starts[flat[order]]
    nth = nth.view_as(ids)
    total = per[safe]                                              # [M, k]
    # (nth + 1/2) / total >= cum / SHARE_UNIT, in integers.
    key = (2 * nth + 1) * SHARE_UNIT
    return ((2 * cum * total[..., None]) <= key[..., None]).sum(-1)


def count_load(load: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Add the pairs of ``topk_ids [M, k]`` to ``load [E + 1]`` in place: entry ``e + 1``
    counts logical expert ``e``, entry 0 the slots with no expert (ids outside
    ``[0, E)``). A fixed-size ``index_add_``: no host synchronisation."""
    e = load.shape[0] - 1
    ids = topk_ids.reshape(-1).to(torch.int64)
    bins = torch.where((ids >= 0) & (ids < e), ids + 1, torch.zeros_like(ids))
    load.index_add_(0, bins, torch.ones_like(bins, dtype=load.dtype))
