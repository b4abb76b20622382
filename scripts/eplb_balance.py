# usage: PYTHONPATH=. python scripts/eplb_balance.py [--cases all|check]
"""The balance of redundant experts (EPLB) on the CPU, at the device check's full sizes.

Where the rows of a routing fall depends only on the routing, the placement and the
translation (pure torch), so this computes ``scripts/device/eplb_check.py``'s balance
columns without running a GEMM: the same routings (its generator and seeds, so the
same ids as on the device), the same plans (R = E/8, from the routing's own load), and
for each case:

* ``r0``: rows max/mean per rank without replicas;
* ``planned``: the planner's predicted GPU load max/mean (each replica ``1 / c`` of its
  expert's pairs: ``Placement.gpu_loads``);
* ``own_first``: realized by the translation without dispatch shares (a replica on
  the token's rank first, else ``t mod c``: the rule before shares);
* ``spread``: realized by ``t mod c`` for every pair (``prefer_local=False``);
* ``uniform``: realized with dispatch shares from the summed load (``1 / c`` of each
  rank's pairs per replica);
* ``shares``: realized with dispatch shares from each rank's load (own replicas first
  up to their planned load): what the check, the bench and ``CometMoE.rebalance`` load;
* ``bound``: the heaviest replica's planned load over the mean rank load (no placement
  with these replica counts can go below it), and ``pairs_per_replica_on_two`` how many
  (rank, expert) hold two or more replicas of one expert;

each realized column with its local fraction (rows computed on the token's own rank).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comet.bench.eplb import balance_columns, destination_rows  # noqa: E402
from comet.bench.inputs import derive_seed, make_routing  # noqa: E402
from comet.placement import PlacementConfig, dispatch_shares, plan_placement  # noqa: E402
from comet.replicas import ReplicaTables, translate  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "eplb_check", os.path.join(os.path.dirname(os.path.abspath(__file__)), "device",
                               "eplb_check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

#: (model, EP, tokens per rank): the device check's three measured cases, then Qwen3 at 8.
CASES = [("deepseek-v3-like", 4, 4096), ("deepseek-v3-like", 8, 3072),
         ("qwen3-30b-a3b-like", 4, 4096), ("qwen3-30b-a3b-like", 8, 4096)]


def routing_ids(name: str, kind: str, world: int, tokens: int) -> list[torch.Tensor]:
    """Every rank's ``topk_ids`` as eplb_check.inputs draws them (the ids come first
    from each rank's generator, so the same ids without the activations)."""
    cfg = check.MODELS[name]
    ids = []
    for r in range(world):
        g = torch.Generator().manual_seed(derive_seed(check.SEED, kind, tokens, world, r))
        i, _ = (check.zipf_routing(tokens, cfg, g) if kind.startswith("zipf")
                else make_routing(tokens, cfg.num_experts, cfg.top_k, kind, g))
        ids.append(i)
    return ids


def realized(ids, plan, placement: PlacementConfig, shares=None, prefer_local=True):
    e, r, w = placement.num_experts, placement.redundant_experts, placement.num_gpus
    tables = ReplicaTables.empty(e, r, w)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0],
                 None if shares is None else shares[0])
    rows = torch.stack([destination_rows(translate(i, tables, rank, prefer_local),
                                         placement.slots_per_gpu, w)
                        for rank, i in enumerate(ids)])
    cols = balance_columns(rows)
    return round(cols["rows_max_over_mean"], 4), round(cols["rows_local_fraction"], 3)


def case(name: str, world: int, tokens: int, kind: str) -> dict:
    e = check.MODELS[name].num_experts
    placement = PlacementConfig(e, e // 8, world)
    ids = routing_ids(name, kind, world, tokens)
    rank_load = torch.stack([torch.bincount(i.flatten(), minlength=e) for i in ids])
    load = rank_load.sum(0)
    plan = plan_placement(None, placement, rank_load=rank_load)
    r0 = balance_columns(torch.stack([destination_rows(i, e // world, world) for i in ids]))
    gpu = plan.gpu_loads(load)[0]
    slot_rank = plan.log2phy[0] // placement.slots_per_gpu
    doubled = sum(int((torch.bincount(row[row >= 0]) > 1).sum())
                  for row in torch.where(plan.log2phy[0] >= 0, slot_rank, -1))
    return {"model": name, "ep": world, "tokens_per_rank": tokens, "routing": kind,
            "redundant_experts": e // 8, "max_replicas": int(plan.replicas.max()),
            "r0": round(r0["rows_max_over_mean"], 4),
            "r0_local": round(r0["rows_local_fraction"], 3),
            "planned": round(float(gpu.max() / gpu.mean()), 4),
            "own_first": realized(ids, plan, placement),
            "spread": realized(ids, plan, placement, prefer_local=False),
            "uniform": realized(ids, plan, placement, dispatch_shares(plan)),
            "shares": realized(ids, plan, placement, plan.shares),
            "bound": round(float((load.double() / plan.replicas[0]).max()
                                 / (load.sum() / world)), 4),
            "ranks_with_two_replicas_of_one_expert": doubled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for name, world, tokens in CASES:
        for kind in check.ROUTINGS:
            rows.append(case(name, world, tokens, kind))
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
