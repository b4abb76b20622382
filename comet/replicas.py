"""Replica translation on the device: a rank's top-k logical expert ids -> physical expert
ids of a placement (:mod:`comet.placement`), and the per-logical-expert load count the
next placement is planned from.

Everything here is a fixed-shape torch op on device tensors: no host synchronisation, no
shape that depends on data, so a call stays CUDA-graph capturable, and a new placement is
written into the same tensors (:meth:`ReplicaTables.load_`) without invalidating a graph
that read them.

Which replica a (token, slot) pair goes to, deterministically:

1. a replica on the token's own rank, if the expert has one there (the lowest such
   slot): the row is then computed where it lives and never crosses ranks;
2. else replica ``t mod c`` of the expert's ``c`` replicas (``t`` the token's index on
   its rank): consecutive tokens take turns, so each replica gets about ``1 / c`` of the
   expert's remote pairs.

Rule 1 is a bet that the planner's load per replica is met on average: a replica on a
rank with many of the expert's tokens takes more than ``1 / c``. ``prefer_local=False``
spreads every pair by rule 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReplicaTables", "translate", "count_load"]


@dataclass
class ReplicaTables:
    """A placement of ``E`` logical experts on ``P`` physical slots of ``W`` ranks, as
    device tensors of fixed shape (the widest placement ``R`` redundant experts allow).

    Attributes:
        log2phy: ``[E, R + 1]`` int64, the slots of each logical expert, ``-1`` padded.
        replicas: ``[E]`` int64, replica counts (``>= 1``).
        phy2log: ``[P]`` int64, the logical expert of each slot.
        slots_per_rank: ``P / W``; rank ``r`` holds slots ``[r * P/W, (r + 1) * P/W)``.
    """

    log2phy: torch.Tensor
    replicas: torch.Tensor
    phy2log: torch.Tensor
    slots_per_rank: int

    @classmethod
    def empty(cls, num_experts: int, redundant_experts: int, world: int,
              device=None) -> "ReplicaTables":
        """Tables of the right shapes, holding no placement yet (fill with :meth:`load_`)."""
        physical = num_experts + redundant_experts
        return cls(torch.full((num_experts, redundant_experts + 1), -1, dtype=torch.int64,
                              device=device),
                   torch.ones(num_experts, dtype=torch.int64, device=device),
                   torch.zeros(physical, dtype=torch.int64, device=device),
                   physical // world)

    def load_(self, phy2log: torch.Tensor, log2phy: torch.Tensor,
              replicas: torch.Tensor) -> None:
        """Write one layer's placement (``[P]``, ``[E, X]`` with ``X <= R + 1``, ``[E]``)
        into the tables in place. ValueError for shapes that do not fit."""
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
        self.log2phy.copy_(padded)
        self.replicas.copy_(replicas)
        self.phy2log.copy_(phy2log)


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
    physical = slots.gather(-1, choice[..., None]).squeeze(-1)
    return torch.where(live, physical, torch.full_like(physical, -1))


def count_load(load: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Add the pairs of ``topk_ids [M, k]`` to ``load [E + 1]`` in place: entry ``e + 1``
    counts logical expert ``e``, entry 0 the slots with no expert (ids outside
    ``[0, E)``). A fixed-size ``index_add_``: no host synchronisation."""
    e = load.shape[0] - 1
    ids = topk_ids.reshape(-1).to(torch.int64)
    bins = torch.where((ids >= 0) & (ids < e), ids + 1, torch.zeros_like(ids))
    load.index_add_(0, bins, torch.ones_like(bins, dtype=load.dtype))
