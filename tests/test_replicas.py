"""Replica translation (comet.replicas): every pair lands on a replica of its own expert,
on the token's rank where one is there, spread over the replicas otherwise."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet.placement import PlacementConfig, dispatch_shares, plan_placement
from comet.replicas import ReplicaTables, count_load, translate


def _tables(cfg: PlacementConfig, load: torch.Tensor) -> ReplicaTables:
    plan = plan_placement(load, cfg)
    tables = ReplicaTables.empty(cfg.num_experts, cfg.redundant_experts, cfg.num_gpus)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0])
    return tables


@st.composite
def cases(draw):
    gpus = draw(st.sampled_from([1, 2, 4]))
    experts = gpus * draw(st.integers(1, 4))
    redundant = gpus * draw(st.integers(0, 2))
    cfg = PlacementConfig(experts, redundant, gpus)
    load = torch.tensor(draw(st.lists(st.integers(0, 100), min_size=experts,
                                      max_size=experts)), dtype=torch.float64)
    tokens, k = draw(st.integers(0, 40)), draw(st.integers(1, min(4, experts)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) \
        if tokens else torch.empty(0, k, dtype=torch.int64)
    drop = torch.rand(tokens, k, generator=gen) < 0.1
    ids = torch.where(drop, torch.full_like(ids, -1), ids)
    rank = draw(st.integers(0, gpus - 1))
    return cfg, load, ids, rank


@settings(max_examples=80, deadline=None)
@given(cases(), st.booleans())
def test_every_pair_goes_to_a_replica_of_its_expert(case, prefer_local):
    cfg, load, ids, rank = case
    tables = _tables(cfg, load)
    phys = translate(ids, tables, rank, prefer_local)
    assert phys.shape == ids.shape and phys.dtype == torch.int64
    assert torch.equal(phys < 0, ids < 0)
    live = ids >= 0
    assert torch.equal(tables.phy2log[phys[live]], ids[live])
    assert torch.equal(phys, translate(ids, tables, rank, prefer_local))   # deterministic


@settings(max_examples=80, deadline=None)
@given(cases())
def test_a_replica_on_the_tokens_rank_is_preferred(case):
    cfg, load, ids, rank = case
    tables = _tables(cfg, load)
    phys = translate(ids, tables, rank)
    on_rank = range(rank * cfg.slots_per_gpu, (rank + 1) * cfg.slots_per_gpu)
    experts_here = set(tables.phy2log[list(on_rank)].tolist())
    for i, j in (ids >= 0).nonzero().tolist():
        local = int(phys[i, j]) in on_rank
        assert local == (int(ids[i, j]) in experts_here)


def test_remote_pairs_take_turns_over_the_replicas():
    tables = ReplicaTables.empty(4, 4, 4)
    # expert 0 on slots 1, 3 and 5 (ranks 0, 1, 2); the others once; rank 3 has none of 0
    phy2log = torch.tensor([1, 0, 2, 0, 3, 0, 1, 2])
    log2phy = torch.tensor([[1, 3, 5], [0, 6, -1], [2, 7, -1], [4, -1, -1]])
    tables.load_(phy2log, log2phy, torch.tensor([3, 2, 2, 1]))
    ids = torch.zeros(9, 1, dtype=torch.int64)
    phys = translate(ids, tables, rank=3)
    assert phys[:, 0].tolist() == [1, 3, 5] * 3
    assert translate(ids, tables, rank=1)[:, 0].tolist() == [3] * 9
    assert translate(ids, tables, rank=1, prefer_local=False)[:, 0].tolist() == [1, 3, 5] * 3


def test_ids_outside_the_experts_give_no_expert():
    tables = ReplicaTables.empty(4, 0, 2)
    tables.load_(torch.arange(4), torch.arange(4)[:, None], torch.ones(4, dtype=torch.int64))
    ids = torch.tensor([[-1, 4], [3, -7]])
    assert translate(ids, tables, 0).tolist() == [[-1, -1], [3, -1]]


def test_loading_a_placement_that_does_not_fit_is_a_value_error():
    tables = ReplicaTables.empty(4, 2, 2)
    with pytest.raises(ValueError, match="placement of 4 experts"):
        tables.load_(torch.arange(5), torch.zeros(4, 1, dtype=torch.int64),
                     torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="at most 3 replicas"):
        tables.load_(torch.arange(6) % 4, torch.zeros(4, 4, dtype=torch.int64),
                     torch.ones(4, dtype=torch.int64))


def test_load_counts_pairs_per_logical_expert_and_keeps_its_tensor():
    load = torch.zeros(6, dtype=torch.int64)
    before = load.data_ptr()
    ids = torch.tensor([[0, 3], [3, -1], [4, 9]])
    count_load(load, ids)
    count_load(load, ids[:1])
    assert load.tolist() == [2, 2, 0, 0, 3, 1]      # [none, e0, e1, e2, e3, e4]
    assert load.data_ptr() == before


# ----------------------------------------------------------------- dispatch shares
def _zipf_ranks(experts, k, tokens, world, seed, s=1.2):
    """Each rank's ``topk_ids`` with Zipf(s) popularity over its own random order of the
    experts (as scripts/device/eplb_check.py draws them: hot experts differ by rank)."""
    ids = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        order = torch.randperm(experts, generator=g)
        probs = torch.empty(experts)
        probs[order] = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32) ** s
        ids.append(torch.multinomial(probs.expand(tokens, experts), k, generator=g))
    return ids


def _rank_rows(ids, tables, cfg, shares=True):
    rows = torch.zeros(cfg.num_gpus, dtype=torch.int64)
    for rank, i in enumerate(ids):
        phys = translate(i, tables, rank)
        rows += torch.bincount(phys.flatten() // cfg.slots_per_gpu, minlength=cfg.num_gpus)
    return rows.double()


@pytest.mark.parametrize("experts,world,tokens", [(256, 8, 3072), (256, 4, 4096),
                                                  (128, 4, 4096)])
def test_zipf_routing_balances_to_the_plan_with_dispatch_shares(experts, world, tokens):
    """The issue's target, rows max/mean per rank <= 1.10 with R = E/8 at Zipf 1.2
    (DeepSeek-V3-like E=256 at EP 8 and 4, Qwen3-30B-A3B-like E=128 at EP 4): the plan
    promises ~1.00, and the translation with shares delivers it. The rule without
    shares (own rank first) missed it: 1.136 / 1.093 / 1.157 on the device check's
    routings (docs/eplb.md), because one rank's hot expert is another's cold one."""
    cfg = PlacementConfig(experts, experts // 8, world)
    ids = _zipf_ranks(experts, 8, tokens, world, seed=experts + world)
    rank_load = torch.stack([torch.bincount(i.flatten(), minlength=experts) for i in ids])
    plan = plan_placement(None, cfg, rank_load=rank_load)
    planned = plan.gpu_loads(rank_load.sum(0))[0]
    tables = ReplicaTables.empty(experts, cfg.redundant_experts, world)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], plan.shares[0])
    rows = _rank_rows(ids, tables, cfg)
    assert rows.sum() == rank_load.sum()
    assert float(rows.max() / rows.mean()) <= 1.10
    # realized = planned, up to one pair per (rank, expert, replica)
    assert (rows - planned).abs().max() <= world * experts
    assert float(rows.max() / rows.mean()) <= float(planned.max() / planned.mean()) + 0.005
    # uniform shares (from the summed load only) balance as well
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0],
                 dispatch_shares(plan)[0])
    assert float(_rank_rows(ids, tables, cfg).max() / rows.mean()) <= 1.10


def test_the_rule_without_shares_misses_the_target_on_zipf_routing():
    """Why shares: the same case through the own-rank-first rule overloads the rank
    that holds a replica of its own hottest expert."""
    cfg = PlacementConfig(256, 32, 8)
    ids = _zipf_ranks(256, 8, 3072, 8, seed=256 + 8)
    rank_load = torch.stack([torch.bincount(i.flatten(), minlength=256) for i in ids])
    plan = plan_placement(None, cfg, rank_load=rank_load)
    tables = ReplicaTables.empty(256, 32, 8)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0])        # no shares
    rows = _rank_rows(ids, tables, cfg)
    assert float(rows.max() / rows.mean()) > 1.10


@st.composite
def share_cases(draw):
    cfg, load, ids, rank = draw(cases())
    world = cfg.num_gpus
    rank_load = torch.tensor(draw(st.lists(st.integers(0, 60), min_size=world * cfg.num_experts,
                                           max_size=world * cfg.num_experts)),
                             dtype=torch.float64).view(world, cfg.num_experts)
    return cfg, rank_load, ids, rank


@settings(max_examples=80, deadline=None)
@given(share_cases())
def test_dispatch_shares_give_every_replica_its_planned_load(case):
    cfg, rank_load, _, _ = case
    plan = plan_placement(None, cfg, rank_load=rank_load)
    shares = plan.shares[0]                                         # [W, E, X]
    log2phy = plan.log2phy[0]
    valid = log2phy >= 0
    assert torch.allclose(shares.sum(-1), torch.ones(cfg.num_gpus, cfg.num_experts,
                                                     dtype=torch.float64))
    assert (shares >= 0).all() and (shares[:, ~valid] == 0).all()
    # rows per rank: what the planner packed (each replica 1 / c of its expert)
    owner = torch.where(valid, log2phy // cfg.slots_per_gpu, 0)
    flow = rank_load[..., None] * shares                            # [W, E, X]
    per_rank = torch.zeros(cfg.num_gpus, dtype=torch.float64)
    per_rank.index_add_(0, owner[valid], flow.sum(0)[valid])
    assert torch.allclose(per_rank, plan.gpu_loads(rank_load.sum(0))[0], atol=1e-6)
    # as many pairs as possible stay on their own rank
    total = rank_load.sum(0)
    for r in range(cfg.num_gpus):
        mine = (valid & (owner == r)).sum(-1).double()
        want = torch.minimum(rank_load[r], mine * total / plan.replicas[0])
        assert torch.allclose((flow[r] * (valid & (owner == r))).sum(-1), want, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(share_cases())
def test_the_translation_realizes_the_shares_to_one_pair(case):
    cfg, rank_load, ids, rank = case
    plan = plan_placement(None, cfg, rank_load=rank_load)
    tables = ReplicaTables.empty(cfg.num_experts, cfg.redundant_experts, cfg.num_gpus)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], plan.shares[0])
    phys = translate(ids, tables, rank)
    live = ids >= 0
    assert torch.equal(phys < 0, ids < 0)
    assert torch.equal(tables.phy2log[phys[live]], ids[live])
    assert torch.equal(phys, translate(ids, tables, rank))          # deterministic
    got = torch.bincount(phys[live], minlength=cfg.physical_experts).double()
    n = torch.bincount(ids[live], minlength=cfg.num_experts).double()
    log2phy = plan.log2phy[0]
    want = torch.zeros(cfg.physical_experts, dtype=torch.float64)
    valid = log2phy >= 0
    want[log2phy[valid]] = (n[:, None] * plan.shares[0][rank])[valid]
    assert (got - want).abs().max() <= 1.0 + 1e-9


def test_a_ranks_replicas_of_one_expert_take_its_pairs_on_one_slot():
    """At one rank every replica is local: the layer computes the rows it computed
    without replicas, on the expert's lowest slot."""
    cfg = PlacementConfig(4, 4, 1)
    plan = plan_placement(torch.tensor([40.0, 1.0, 1.0, 1.0]), cfg)
    assert plan.replicas[0, 0] > 1
    assert torch.equal(plan.shares[0, 0, :, 0], torch.ones(4))
    tables = ReplicaTables.empty(4, 4, 1)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], plan.shares[0])
    ids = torch.tensor([[0, 1], [0, 2], [3, 0]])
    assert torch.equal(translate(ids, tables, 0), plan.log2phy[0][ids, 0])
