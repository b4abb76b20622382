"""Replica translation (comet.replicas): every pair lands on a replica of its own expert,
on the token's rank where one is there, spread over the replicas otherwise."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet.placement import PlacementConfig, plan_placement
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
