"""Redundant experts in the benchmark (``comet bench --redundant-experts R``, and
``scripts/device/eplb_check.py``): the fused layer on a physical layout, and how evenly
a routing's rows fall on the ranks.

Two numbers per case, from the ids the kernels see (physical with replicas, logical
without):

* ``rows_max_over_mean``: the most (token, expert) rows any rank's experts compute over
  the mean per rank -- the GEMM imbalance a replica placement is for (1.0: even);
* ``rows_local_fraction``: the share of rows computed on the token's own rank, which
  never cross a link (``1 - rows_local_fraction`` cross ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from comet.bench.inputs import make_expert_weights
from comet.config import MoEConfig
from comet.placement import Placement, PlacementConfig, dispatch_shares, plan_placement
from comet.replicas import ReplicaTables, translate
from comet.weights import interleave_gate_up

__all__ = ["destination_rows", "balance_columns", "ReplicatedLayer",
           "rank_load", "physical_weights"]


def destination_rows(ids: torch.Tensor, slots_per_rank: int, world: int) -> torch.Tensor:
    """``[W]`` int64: rows of ``ids [M, k]`` (expert ids of a layout with
    ``slots_per_rank`` experts per rank; ``-1``: none) computed on each rank. On the
    ids' device, fixed size."""
    ids = ids.reshape(-1).to(torch.int64)
    live = (ids >= 0) & (ids < slots_per_rank * world)
    dest = torch.where(live, ids // slots_per_rank, torch.full_like(ids, world))
    return torch.bincount(dest, minlength=world + 1)[:world]


def balance_columns(rows: torch.Tensor) -> dict[str, float | None]:
    """``rows [W_src, W_dst]`` (rows each source rank sends each rank's experts,
    itself included) -> ``rows_max_over_mean`` and ``rows_local_fraction`` (None for a
    case with no rows)."""
    rows = rows.double().cpu()
    per_rank, total = rows.sum(0), rows.sum()
    if total == 0:
        return {"rows_max_over_mean": None, "rows_local_fraction": None}
    return {"rows_max_over_mean": float(per_rank.max() / per_rank.mean()),
            "rows_local_fraction": float(rows.diagonal().sum() / total)}


def gathered_rows(ids: Sequence[torch.Tensor], slots_per_rank: int, world: int, rank: int,
                  group=None) -> torch.Tensor:
    """``[W_src, W_dst]`` rows of every rank, summed over this rank's input sets ``ids``
    (all-reduced over ``group`` when torch.distributed runs several ranks)."""
    rows = torch.zeros(world, world, dtype=torch.int64, device=ids[0].device)
    for i in ids:
        rows[rank] += destination_rows(i, slots_per_rank, world)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(rows, group=group)
    return rows


class ReplicatedLayer:
    """A fused layer on physical experts, called with logical ids: each call translates
    them (:func:`comet.replicas.translate`, on the device, inside the timed call) and
    runs ``layer``. Other attributes are ``layer``'s (the runner reads
    ``last_comm_blocks``, ``tile``, ``programs``...)."""

    def __init__(self, layer, placement: PlacementConfig, rank: int, device):
        self.layer, self.placement, self.rank = layer, placement, rank
        self.tables = ReplicaTables.empty(placement.num_experts, placement.redundant_experts,
                                          placement.num_gpus, device)

    def load_plan(self, plan: Placement) -> None:
        shares = plan.shares if plan.shares is not None else dispatch_shares(plan)
        self.tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], shares[0])

    def translate(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return translate(topk_ids, self.tables, self.rank)

    def __call__(self, x, topk_ids, topk_weights, **kwargs):
        return self.layer(x, self.translate(topk_ids), topk_weights, **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def physical_weights(cfg: MoEConfig, plan: Placement, rank: int, world: int,
                     config_name: str, seed: int, device, out: tuple | None = None,
                     interleaved: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's physical ``(w13 [P/W, H, 2F], w2 [P/W, F, H])`` under ``plan``: the
    logical experts of :func:`comet.bench.inputs.make_expert_weights` (regenerated from
    their owner rank's seed, one owner at a time, so nothing crosses ranks), written into
    ``out`` when given (in place: a built layer keeps its addresses). ``w13`` in the
    kernels' interleaved columns (``w13_layout="interleaved"``: a layer that kept a
    copy of its own would not see the refill), or gate-first."""
    el = cfg.num_experts // world
    slots = plan.phy2log.shape[-1] // world
    mine = plan.phy2log[0, rank * slots:(rank + 1) * slots].tolist()
    if out is None:
        h, f = cfg.hidden_size, cfg.intermediate_size
        out = (torch.empty(slots, h, 2 * f, dtype=cfg.dtype, device=device),
               torch.empty(slots, f, h, dtype=cfg.dtype, device=device))
    for owner in sorted({e // el for e in mine}):
        w13, w2 = make_expert_weights(cfg, el, config_name, owner, seed, device)
        for i, e in enumerate(mine):
            if e // el == owner:
                w = w13[e - owner * el]
                out[0][i].copy_(interleave_gate_up(w) if interleaved else w)
                out[1][i].copy_(w2[e - owner * el])
        del w13, w2
    return out


def rank_load(ids: Sequence[torch.Tensor], num_experts: int, world: int, rank: int,
              group=None) -> torch.Tensor:
    """``[W, E]`` pairs per logical expert of each rank over its input sets ``ids``
    (this rank's row filled here, all-reduced over ``group`` when it has several
    ranks)."""
    load = torch.zeros(world, num_experts, dtype=torch.int64, device=ids[0].device)
    for i in ids:
        flat = i.reshape(-1).to(torch.int64)
        load[rank] += torch.bincount(flat[(flat >= 0) & (flat < num_experts)],
                                     minlength=num_experts)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    return load


def plan_for(ids: Sequence[torch.Tensor], placement: PlacementConfig, group=None
             ) -> Placement:
    """The plan of every rank's routing ``ids`` (an oracle window: the load of the very
    calls to be timed), with dispatch shares from each rank's load."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    return plan_placement(None, placement, rank_load=rank_load(
        ids, placement.num_experts, placement.num_gpus, rank, group).cpu())
