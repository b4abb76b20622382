"""The placement planner (comet.placement): structural properties of every plan, the
guarantee against the layout without replicas, and DeepSeek's published example."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet.placement import (Placement, PlacementConfig, balanced_packing, home_placement,
                             plan_placement, replicate)


@st.composite
def configs_and_loads(draw, hierarchical=None):
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from([n for n in (1, 2, 4) if gpus % n == 0]))
    per_gpu = draw(st.integers(1, 4))
    experts = gpus * per_gpu
    redundant = gpus * draw(st.integers(0, 3))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if experts % g == 0]))
    cfg = PlacementConfig(experts, redundant, gpus, num_nodes=nodes, num_groups=groups)
    layers = draw(st.integers(1, 3))
    skew = draw(st.sampled_from(["uniform", "zipf", "sparse"]))
    loads = draw(st.lists(st.integers(0, 1000), min_size=layers * experts,
                          max_size=layers * experts))
    load = torch.tensor(loads, dtype=torch.float64).view(layers, experts)
    if skew == "zipf":
        load = load + 1e4 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    elif skew == "sparse":
        load = load * (torch.arange(experts) % 3 == 0)
    return cfg, load


def _check_structure(plan: Placement, cfg: PlacementConfig, layers: int) -> None:
    e, p = cfg.num_experts, cfg.physical_experts
    assert plan.phy2log.shape == (layers, p)
    assert plan.replicas.shape == (layers, e)
    assert (plan.replicas >= 1).all()
    assert (plan.replicas.sum(1) == p).all()
    assert plan.log2phy.shape == (layers, e, int(plan.replicas.max()))
    for layer in range(layers):
        for expert in range(e):
            slots = plan.log2phy[layer, expert]
            live = slots[slots >= 0]
            assert len(live) == plan.replicas[layer, expert]
            assert (slots[len(live):] == -1).all()          # padding only at the end
            assert (plan.phy2log[layer, live] == expert).all()
            assert torch.equal(live, live.sort().values)
    # every GPU the same number of slots (P / W, slot s on GPU s // (P / W)), and the
    # GPUs' loads account for every expert's load exactly once
    assert plan.slots_per_gpu * cfg.num_gpus == p


@settings(max_examples=60, deadline=None)
@given(configs_and_loads())
def test_every_plan_is_a_valid_layout(case):
    cfg, load = case
    plan = plan_placement(load, cfg)
    _check_structure(plan, cfg, load.shape[0])
    gpus = plan.gpu_loads(load)
    assert gpus.shape == (load.shape[0], cfg.num_gpus)
    assert torch.allclose(gpus.sum(1), load.sum(1))


@settings(max_examples=60, deadline=None)
@given(configs_and_loads())
def test_the_busiest_gpu_is_never_busier_than_without_replicas(case):
    cfg, load = case
    plan = plan_placement(load, cfg)
    per_gpu = load.view(load.shape[0], cfg.num_gpus, -1).sum(-1)   # contiguous, no replica
    assert (plan.gpu_loads(load).amax(1) <= per_gpu.amax(1) * (1 + 1e-9)).all()


@settings(max_examples=40, deadline=None)
@given(configs_and_loads())
def test_hierarchical_plans_keep_groups_and_replicas_on_one_node(case):
    cfg, load = case
    if not cfg.hierarchical:
        return
    plan = plan_placement(load, cfg)
    home = home_placement(cfg, load)
    node_of_slot = torch.arange(cfg.physical_experts) // (cfg.physical_experts // cfg.num_nodes)
    group_size = cfg.num_experts // cfg.num_groups
    for layer in range(load.shape[0]):
        if torch.equal(plan.phy2log[layer], home.phy2log[layer]):
            continue                                   # the fallback: no node structure
        nodes_of_group = {}
        for slot, expert in enumerate(plan.phy2log[layer].tolist()):
            nodes_of_group.setdefault(expert // group_size, set()).add(int(node_of_slot[slot]))
        assert all(len(n) == 1 for n in nodes_of_group.values())
        per_node = [0] * cfg.num_nodes
        for group in nodes_of_group:
            per_node[next(iter(nodes_of_group[group]))] += 1
        assert per_node == [cfg.num_groups // cfg.num_nodes] * cfg.num_nodes


def test_deepseek_worked_example_2_nodes_of_4_gpus():
    # The example of DeepSeek's EPLB README: 2 layers of 12 experts, 4 redundant,
    # 4 groups, 2 nodes of 4 GPUs. Ties are broken by the lowest index, as there.
    load = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                         [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    cfg = PlacementConfig(12, 4, 8, num_nodes=2, num_groups=4)
    assert cfg.hierarchical
    plan = plan_placement(load, cfg)
    assert plan.phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    gpus = plan.gpu_loads(load)
    # balanced: each layer's four heaviest experts are split in two, so every GPU
    # carries less than the heaviest expert alone, and none more than 1.25x the mean
    assert (plan.replicas[0, [1, 4, 5, 10]] == 2).all()
    assert (plan.replicas[1, [1, 5, 6, 8]] == 2).all()
    assert (gpus.amax(1) < load.double().amax(1)).all()
    assert (gpus.amax(1) / gpus.mean(1) < 1.25).all()


def test_replicate_gives_slots_to_the_highest_load_per_replica():
    phy2log, nth, counts = replicate(torch.tensor([[10.0, 1.0, 4.0]]), 6)
    # 10 -> 5 (second), 5 vs 4 -> 10 again (3.33), then 4
    assert phy2log.tolist() == [[0, 1, 2, 0, 0, 2]]
    assert nth.tolist() == [[0, 0, 0, 1, 2, 1]]
    assert counts.tolist() == [[3, 1, 2]]


def test_balanced_packing_fills_every_pack_equally_heaviest_first():
    pack, pos = balanced_packing(torch.tensor([[9.0, 1.0, 8.0, 2.0, 5.0, 5.0]]), 2)
    # 9 -> 0, 8 -> 1, 5 -> 1 (13), 5 -> 0 (14), 2 -> 1 (15, full), 1 -> 0 (15)
    assert pack.tolist() == [[0, 0, 1, 1, 1, 0]]
    assert torch.bincount(pack[0]).tolist() == [3, 3]
    assert sorted(pos[0, pack[0] == 0].tolist()) == [0, 1, 2]


def test_greedy_packing_that_loses_falls_back_to_the_home_layout():
    # Greedy packs 9, 5, 4 | 8, 7, 1 = 18 / 16; the contiguous layout is 17 / 17.
    load = torch.tensor([[5.0, 8.0, 4.0, 1.0, 9.0, 7.0]])
    pack, _ = balanced_packing(load, 2)
    greedy = max(load[0, pack[0] == p].sum() for p in range(2))
    assert greedy == 18
    plan = plan_placement(load, PlacementConfig(6, 0, 2))
    assert plan.phy2log.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert plan.gpu_loads(load).amax() == 17


def test_home_placement_copies_a_gpus_own_experts_and_moves_no_load():
    cfg = PlacementConfig(8, 4, 4)
    load = torch.tensor([1.0, 9.0, 3.0, 2.0, 5.0, 5.0, 0.0, 7.0])
    home = home_placement(cfg, load)
    assert home.phy2log.tolist() == [[0, 1, 1, 2, 3, 2, 4, 5, 4, 6, 7, 7]]
    per_gpu = load.view(4, 2).sum(-1)
    assert torch.allclose(home.gpu_loads(load)[0], per_gpu.double())


def test_from_phy2log_rejects_layouts_that_lose_an_expert():
    with pytest.raises(ValueError, match="has no physical slot"):
        Placement.from_phy2log(torch.tensor([0, 0, 1, 1]), 3, 2)
    with pytest.raises(ValueError, match="outside"):
        Placement.from_phy2log(torch.tensor([0, 1, 2, 3]), 3, 2)
    with pytest.raises(ValueError, match="do not split"):
        Placement.from_phy2log(torch.tensor([0, 1, 2]), 3, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=8, redundant_experts=-1, num_gpus=2), "redundant_experts"),
    (dict(num_experts=8, redundant_experts=1, num_gpus=2), "divisible by num_gpus"),
    (dict(num_experts=8, redundant_experts=0, num_gpus=4, num_nodes=3), "num_nodes"),
    (dict(num_experts=8, redundant_experts=0, num_gpus=4, num_groups=3), "num_groups"),
])
def test_bad_configs_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlacementConfig(**kwargs)


def test_bad_loads_are_value_errors():
    cfg = PlacementConfig(4, 0, 2)
    with pytest.raises(ValueError, match="must be"):
        plan_placement(torch.ones(5), cfg)
    with pytest.raises(ValueError, match="non-negative"):
        plan_placement(torch.tensor([1.0, -1.0, 0.0, 0.0]), cfg)
    with pytest.raises(TypeError):
        PlacementConfig(4.0, 0, 2)
