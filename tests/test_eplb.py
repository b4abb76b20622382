"""CometMoE with redundant experts (comet.eplb): the same function as without replicas,
before and after rebalancing, on one rank, over gloo ranks (experts sent point to point
between ranks) and on the fused kernels' physical layout under the interpreter."""

import pytest
import torch
import torch.distributed as dist

import comet.eplb
import gloo_ranks
from comet import CometMoE, reference
from comet.config import MoEConfig
from comet.constants import interpreting
from comet.eplb import physical_config, senders
from comet.mesh import MeshLayout
from comet.moe import redundant_placement
from comet.placement import Placement, PlacementConfig, plan_placement
from comet.replicas import ReplicaTables, translate
from comet.runtime.virtual import VirtualEP

E, K, H, F = 8, 2, 32, 32


def _pair(redundant=4, rebalance_interval=None, rebalance_window=None, **kwargs):
    """A layer with ``redundant`` replicas (rebalancing itself as told) and the same layer
    without, same weights."""
    torch.manual_seed(0)
    plain = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64, **kwargs)
    replicated = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64,
                          redundant_experts=redundant, rebalance_interval=rebalance_interval,
                          rebalance_window=rebalance_window, **kwargs)
    replicated.load_state_dict(plain.state_dict())
    return plain, replicated


def _skewed_ids(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, E, generator=g)
    scores[:, 3] += 0.8                               # expert 3 takes most first choices
    ids = scores.topk(K, dim=1).indices
    ids[::5, 1] = -1                                  # dropped slots stay dropped
    return ids, torch.rand(tokens, K, generator=g)


@torch.no_grad()
def test_replicas_give_the_layers_output_before_and_after_rebalancing():
    plain, replicated = _pair()
    x = torch.randn(40, H)
    assert torch.equal(plain(x), replicated(x))       # the router's own routing
    ids, w = _skewed_ids(40)
    assert torch.equal(plain(x, ids, w), replicated(x, ids, w))
    plan = replicated.rebalance()
    assert plan.replicas[0, 3] > 1                    # the hot expert got replicas
    assert not torch.equal(replicated.replicas.phy2log, torch.tensor([*range(8), 0, 1, 2, 3]))
    assert torch.equal(plain(x, ids, w), replicated(x, ids, w))
    assert torch.equal(plain(x), replicated(x))


@torch.no_grad()
def test_expert_load_counts_logical_pairs_on_the_device_until_rebalanced():
    _, layer = _pair()
    ids, w = _skewed_ids(30)
    x = torch.randn(30, H)
    layer(x, ids, w)
    layer(x[:7], ids[:7], w[:7])
    live = torch.cat([ids, ids[:7]]).flatten()
    expect = torch.bincount(live[live >= 0], minlength=E)
    assert torch.equal(layer.expert_load(), expect)
    assert layer.expert_load().device == layer.experts.w13.device
    layer.rebalance()
    assert layer.expert_load().sum() == 0
    layer(x, ids, w)
    layer.reset_expert_load()
    assert layer.expert_load().sum() == 0


@torch.no_grad()
def test_rebalancing_writes_in_place():
    plain, layer = _pair()
    r, xs = layer.replicas, layer.experts
    held = (xs.w13, xs.w2, r.log2phy, r.replicas, r.phy2log, r.load)
    before = [t.data_ptr() for t in held]
    ids, w = _skewed_ids(30)
    layer(torch.randn(30, H), ids, w)
    layer.rebalance()
    assert [t.data_ptr() for t in held] == before
    assert xs.w13 is held[0] and xs.w2 is held[1]
    # every slot holds its logical expert's weights
    for slot, e in enumerate(r.phy2log.tolist()):
        assert torch.equal(xs.w13[slot], plain.experts.w13[e])
        assert torch.equal(xs.w2[slot], plain.experts.w2[e])


@torch.no_grad()
def test_a_given_plan_is_followed_and_checked():
    _, layer = _pair()
    phy2log = torch.tensor([7, 7, 7, 6, 5, 4, 3, 2, 1, 0, 6, 6])
    plan = layer.rebalance(Placement.from_phy2log(phy2log, E, 1))
    assert layer.replicas.phy2log.tolist() == phy2log.tolist()
    assert layer.replicas.replicas[7] == 3 and plan.replicas[0, 6] == 3
    with pytest.raises(ValueError, match="this layer has 8 on 12"):
        layer.rebalance(Placement.from_phy2log(torch.arange(8), E, 1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got dict"):
        layer.rebalance(plan, optimizer={})
    assert layer.replicas.phy2log.tolist() == phy2log.tolist()


def test_state_dict_keeps_the_logical_keys_and_loading_refills_the_replicas():
    plain, replicated = _pair(expert_bias=True)
    assert set(plain.state_dict()) == set(replicated.state_dict())
    assert replicated.state_dict()["experts.w13"].shape == (E, H, 2 * F)
    assert replicated.experts.w13.shape == (E + 4, H, 2 * F)     # the slots only
    with torch.no_grad():
        replicated.rebalance(Placement.from_phy2log(torch.arange(12) % 8, E, 1))
        for p in plain.parameters():
            p.add_(0.25)
    replicated.load_state_dict(plain.state_dict())
    x = torch.randn(20, H)
    with torch.no_grad():
        assert torch.equal(plain(x), replicated(x))
    assert torch.equal(replicated.experts.b13[9], plain.experts.b13[1])
    for key, value in plain.state_dict().items():
        assert torch.equal(replicated.state_dict()[key], value), key


def _train_step(layer, x, ids, w, lr=0.05):
    """One SGD step on ``x`` (routing given, or the router's when ``ids`` is None);
    returns the output and every gradient by name."""
    x = x.clone().requires_grad_(True)
    y = layer(x) if ids is None else layer(x, ids, w)
    (y.float().square().sum()).backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()
                             if p.grad is not None and not n.startswith("experts.")},
             **{f"experts.{n}": g for n, g in layer.logical_experts(grad=True).items()}}
    if layer.replicas is not None:
        _check_only_owners_have_gradients(layer)
    with torch.no_grad():
        for p in layer.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None
    return y.detach(), grads


def _check_only_owners_have_gradients(layer):
    owners = {rows[0] for rows in layer.replicas.owners().values()}
    rank = layer.par.rank
    for p in layer._slots().values():
        for row in range(p.shape[0]):
            if (rank, row) not in owners:
                assert not p.grad[row].any()


def _close_grads(got: dict, want: dict) -> None:
    """Equal up to fp32 summation order, relative to each gradient's scale."""
    assert set(got) == set(want)
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                   msg=name)


@pytest.mark.parametrize("bias", [False, True])
def test_training_sums_the_replicas_gradients_into_their_logical_experts(bias):
    plain, layer = _pair(expert_bias=bias)
    ids, w = _skewed_ids(24)
    x = torch.randn(24, H)
    with torch.no_grad():
        layer(x, ids, w)
    plan = layer.rebalance()
    assert plan.replicas[0, 3] > 1                    # the hot expert has replicas
    for step in range(2):                             # the second after an optimizer step
        y0, g0 = _train_step(plain, x, ids, w.clone().requires_grad_(True))
        y1, g1 = _train_step(layer, x, ids, w.clone().requires_grad_(True))
        # equal up to summation order (replicas reorder rows), grown by the step between
        torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
        assert set(g0) == set(g1)
        _close_grads(g1, g0)
        assert g1["experts.w13"][3].abs().sum() > 0
    # the copies are stale after a step until the next call refreshes them
    assert layer.replicas.stale(layer._slots())
    with torch.no_grad():
        layer(x, ids, w)
    owners = layer.replicas.owners()
    for slot, e in enumerate(layer.replicas.phy2log.tolist()):
        assert torch.equal(layer.experts.w13[slot], layer.experts.w13[owners[e][0][1]])
        torch.testing.assert_close(layer.experts.w13[slot], plain.experts.w13[e])


def test_training_steps_reuse_the_layouts_indices(monkeypatch):
    """Refresh and fold run once per training step: their row indices are made once per
    layout (on a GPU a fresh index is a pageable copy that waits for the device)."""
    plain, layer = _pair()
    ids, w = _skewed_ids(24)
    x = torch.randn(24, H)
    with torch.no_grad():
        layer(x, ids, w)
    layer.rebalance()
    for _ in range(2):          # the first backward folds, the second call refreshes
        _train_step(layer, x, ids, w)
        _train_step(plain, x, ids, w)
    made = []
    real = comet.eplb.host_index
    monkeypatch.setattr(comet.eplb, "host_index", lambda *a: made.append(a) or real(*a))
    for _ in range(2):
        y1, _ = _train_step(layer, x, ids, w)
        y0, _ = _train_step(plain, x, ids, w)
        # summation order apart, grown by four steps
        torch.testing.assert_close(y1, y0, rtol=2e-3, atol=1e-3 * float(y0.abs().max()))
    assert made == []
    layer.rebalance()                                 # a new layout makes its own
    _train_step(layer, x, ids, w)
    assert made


def test_training_through_the_router_reaches_the_gate():
    plain, layer = _pair()
    with torch.no_grad():
        layer.rebalance(Placement.from_phy2log(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 3,
                                                             5, 0]), E, 1))
    x = torch.randn(16, H)
    _, g0 = _train_step(plain, x, None, None)
    _, g1 = _train_step(layer, x, None, None)
    _close_grads(g1, g0)


def test_a_layer_without_replicas_has_no_load_to_report():
    plain, _ = _pair()
    assert plain.replicas is None
    with pytest.raises(ValueError, match="no redundant experts"):
        plain.expert_load()
    with pytest.raises(ValueError, match="no redundant experts"):
        plain.rebalance()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(redundant_experts=-2), ValueError, "must be >= 0"),
    (dict(redundant_experts=2.0), TypeError, "redundant_experts must be an int"),
    (dict(redundant_experts=4, placement_nodes=3), ValueError, "num_nodes"),
])
def test_bad_redundant_experts_are_refused_before_anything_is_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        CometMoE(E, K, H, F, dtype=torch.float32, **kwargs)


def test_replicas_must_split_over_the_ranks_of_an_expert_parallel_layout():
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F)
    with pytest.raises(ValueError, match=r"8 \+ 2 must be divisible by the group's 4"):
        redundant_placement(cfg.num_experts, 4, MeshLayout(tp=1, ep=4), 2, 1, cfg.n_group)
    with pytest.raises(ValueError, match="expert-parallel layout"):
        redundant_placement(cfg.num_experts, 4, MeshLayout(tp=2, ep=2), 4, 1, cfg.n_group)
    assert redundant_placement(cfg.num_experts, 4, MeshLayout(tp=1, ep=4), 0, 1, cfg.n_group) is None
    assert redundant_placement(cfg.num_experts, 4, MeshLayout(tp=1, ep=4), 4, 1, cfg.n_group) \
        .slots_per_gpu == 3


# ----------------------------------------------------------------- gloo ranks
def _check_gloo_rebalance(world, rank):
    torch.manual_seed(rank)
    plain = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64)
    layer = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64,
                     redundant_experts=2 * world)
    layer.load_state_dict(plain.state_dict())
    ids, w = _skewed_ids(24, seed=rank)
    x = torch.randn(24, H)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5, atol=1e-5)
        plan = layer.rebalance()
        # the hot expert 3 lives on rank 1 of 2 (or 4): a replica must cross ranks
        slots = plan.log2phy[0, 3][plan.log2phy[0, 3] >= 0]
        assert len(slots) > 1 and len(set((slots // layer.replicas.placement_config.slots_per_gpu)
                                          .tolist())) > 1
        r = layer.replicas
        every = [torch.empty_like(plain.experts.w13) for _ in range(world)]
        dist.all_gather(every, plain.experts.w13.contiguous())
        for i, e in enumerate(r.phy2log[rank * (E // world + 2):][:E // world + 2].tolist()):
            assert torch.equal(layer.experts.w13[i], torch.cat(every)[e])
        torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5, atol=1e-5)
    # training: replicas on other ranks send their gradients to the owner (fold's reduce)
    for _ in range(2):
        y0, g0 = _train_step(plain, x, ids, w.clone().requires_grad_(True))
        y1, g1 = _train_step(layer, x, ids, w.clone().requires_grad_(True))
        torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
        _close_grads(g1, g0)


@pytest.mark.parametrize("world", [2])
def test_gloo_ranks_rebalance_and_train_across_ranks(world):
    gloo_ranks.spawn(_check_gloo_rebalance, world)


def _check_gloo_point_to_point(world, rank):
    """Rebalancing sends each moved expert once, from one rank holding it to one that
    needs it (no broadcast); the state dict is gathered from owners on other ranks and
    loading fills every rank's slots."""
    torch.manual_seed(rank)
    kw = dict(dtype=torch.float32, max_tokens=64, expert_bias=True)
    plain = CometMoE(E, K, H, F, **kw)
    layer = CometMoE(E, K, H, F, redundant_experts=2 * world, **kw)
    slots = (E + 2 * world) // world
    assert layer.experts.w13.shape[0] == slots
    layer.load_state_dict(plain.state_dict())

    def refuse(*args, **kwargs):
        raise AssertionError("a collective over the whole group moved experts")

    sent, real = [], dist.batch_isend_irecv

    def spy(ops):
        sent.extend(op.tensor.shape[0] for op in ops
                    if op.op is dist.isend and op.tensor.shape[1:] == (H, 2 * F))
        return real(ops)

    dist.broadcast = dist.reduce = dist.all_gather = refuse
    dist.batch_isend_irecv = spy
    # every rank's slots go to the next rank down: every expert crosses ranks once
    # per rank that needs it, and every owner lies on another rank than its home
    home = layer.replicas.phy2log.clone()
    layer.rebalance(Placement.from_phy2log(torch.roll(home, -slots), E, world))
    needed = torch.zeros(1, dtype=torch.int64)
    needed[0] = len(set(layer.replicas.phy2log[rank * slots:(rank + 1) * slots].tolist()))
    total_sent = torch.tensor([sum(sent)])
    dist.all_reduce(needed)
    dist.all_reduce(total_sent)
    assert total_sent.item() == needed.item()
    x = torch.randn(24, H)
    ids, w = _skewed_ids(24, seed=rank)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5, atol=1e-5)
    state, want = layer.state_dict(), plain.state_dict()
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value), key
    for _ in range(2):                   # owners on other ranks than the experts' homes
        y0, g0 = _train_step(plain, x, ids, w.clone().requires_grad_(True))
        y1, g1 = _train_step(layer, x, ids, w.clone().requires_grad_(True))
        torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
        _close_grads(g1, g0)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    layer.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5, atol=1e-5)
        layer.rebalance()
        torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_move_experts_point_to_point(world):
    gloo_ranks.spawn(_check_gloo_point_to_point, world)


def test_senders_send_each_wanted_expert_once_from_its_holders_in_turn():
    sources = {0: [(0, 0), (1, 2)], 1: [(1, 0)], 2: [(2, 1)]}
    targets = [(2, 0, 0), (2, 3, 0), (3, 0, 0), (0, 1, 1), (0, 2, 1), (1, 5, 1), (0, 4, 2)]
    moves = senders(sources, targets)
    # expert 0 held on ranks 0 and 1: ranks 2 and 3 get it from each in turn, rank 2 once
    assert moves == {(0, 2): [0], (1, 3): [0], (1, 0): [1], (2, 0): [2]}
    assert senders(sources, list(reversed(targets))) == moves        # order-free
    with pytest.raises(ValueError, match="expert 5 is wanted on rank 1"):
        senders(sources, [(1, 0, 5)])


def _expert_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in layer.experts.parameters())


def _layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size()
               for t in (*layer.parameters(), *layer.buffers()))


@pytest.mark.parametrize("bias", [False, True])
def test_a_rank_holds_its_slots_only(bias):
    """Parameters and buffers of a layer with R replicas: (E + R) / E of the experts of
    the layer without, plus the placement tables -- not a logical copy beside them."""
    e, r, h, f = 16, 4, 256, 128
    kw = dict(dtype=torch.bfloat16, max_tokens=64, expert_bias=bias)
    plain = CometMoE(e, K, h, f, **kw)
    layer = CometMoE(e, K, h, f, redundant_experts=r, **kw)
    assert _expert_bytes(layer) * e == _expert_bytes(plain) * (e + r)
    extra = _layer_bytes(layer) - _layer_bytes(plain)
    assert extra - _expert_bytes(plain) * r // e < 0.01 * _expert_bytes(plain)
    layer.rebalance()                    # a re-placement allocates nothing that stays
    assert _layer_bytes(layer) - _layer_bytes(plain) == extra


def test_pending_gradients_move_with_their_owners():
    """A backward, a rebalance that moves every owner, a second backward: the gradients
    accumulate into the same logical experts as without replicas."""
    plain, layer = _pair(expert_bias=True)
    x = torch.randn(24, H)
    ids, w = _skewed_ids(24)
    for m in (plain, layer):
        m(x, ids, w).square().sum().backward()
    with torch.no_grad():
        layer.rebalance(Placement.from_phy2log(torch.tensor([3, 7, 6, 5, 4, 3, 2, 1, 0, 3,
                                                             7, 0]), E, 1))
    assert layer.replicas.owners()[0] == [(0, 8)]
    for m in (plain, layer):
        m(x, ids, w).square().sum().backward()
    got = layer.logical_experts(grad=True)
    _close_grads({n: got[n] for n in got},
                 {n: g for n, g in plain.logical_experts(grad=True).items()})
    _check_only_owners_have_gradients(layer)


def test_an_optimizers_state_follows_the_owners():
    """Adam on the slots, owners moved between steps: with the optimizer passed to
    rebalance the layer trains as the layer without replicas; without it each moved
    owner steps with another expert's moments."""
    plain, layer = _pair(expert_bias=True)
    _, stranded = _pair(expert_bias=True)
    layers = (plain, layer, stranded)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in layers]
    x = torch.randn(24, H)
    ids, w = _skewed_ids(24)
    for phy2log in ([3, 7, 6, 5, 4, 3, 2, 1, 0, 3, 7, 0], [0, 1, 2, 3, 4, 5, 6, 7, 3, 3, 5, 0],
                    [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4]):
        for m, opt in zip(layers, opts):
            opt.zero_grad()
            m(x, ids, w).square().sum().backward()
            opt.step()
        plan = Placement.from_phy2log(torch.tensor(phy2log), E, 1)
        with torch.no_grad():
            layer.rebalance(plan, optimizer=opts[1])
            stranded.rebalance(plan)
    for m, opt in zip(layers, opts):
        opt.zero_grad()
        m(x, ids, w).square().sum().backward()
        opt.step()
    want = plain.logical_experts()
    got, off = layer.logical_experts(), stranded.logical_experts()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(off["w13"], want["w13"], rtol=1e-4, atol=1e-5)


def test_automatic_rebalances_move_the_tracked_optimizers_state(recwarn):
    """rebalance_interval in training: with the optimizer tracked, the layer trains as the
    layer without replicas while its experts move every two steps; untracked, it warns
    once and drifts (moved slots step with other experts' moments)."""
    plain, layer = _pair(rebalance_interval=2)
    _, untracked = _pair(rebalance_interval=2)
    layers = (plain, layer, untracked)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in layers]
    layer.track_optimizer(opts[1])
    x = torch.randn(24, H)
    for step in range(6):
        ids, w = _skewed_ids(24, seed=step)
        ids[:, 0] = (3 + 2 * step) % E          # the hot expert moves: so do the owners
        for m, opt in zip(layers, opts):
            opt.zero_grad()
            m(x, ids, w).square().sum().backward()
            opt.step()
    assert [type(wn.message) for wn in recwarn.list
            if "no optimizer is tracked" in str(wn.message)] == [UserWarning]
    want = plain.logical_experts()
    got, off = layer.logical_experts(), untracked.logical_experts()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(off["w13"], want["w13"], rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        layer.track_optimizer(object())


# ----------------------------------------------------------------- rebalance_interval
def _spy_rebalances(layer, monkeypatch) -> list[tuple[int, torch.Tensor]]:
    """Record ``(calls so far, the load planned from)`` at each rebalance of ``layer``."""
    seen, calls, real = [], [0], layer.rebalance

    def spy(plan=None, optimizer=None):
        seen.append((calls[0], layer.expert_load()))
        return real(plan, optimizer)

    monkeypatch.setattr(layer, "rebalance", spy)
    original_forward = layer.experts_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(layer, "experts_forward", counted)
    return seen


def _load_of(*ids: torch.Tensor) -> torch.Tensor:
    live = torch.cat([i.flatten() for i in ids])
    return torch.bincount(live[live >= 0], minlength=E)


@torch.no_grad()
def test_rebalance_interval_replans_every_n_calls_from_their_load(monkeypatch):
    _, layer = _pair(rebalance_interval=3)
    seen = _spy_rebalances(layer, monkeypatch)
    routing = [_skewed_ids(5 + c, seed=c) for c in range(7)]
    for c, (ids, w) in enumerate(routing):
        layer(torch.randn(len(ids), H), ids, w)
    assert [c for c, _ in seen] == [3, 6]
    assert torch.equal(seen[0][1], _load_of(*(i for i, _ in routing[0:3])))
    assert torch.equal(seen[1][1], _load_of(*(i for i, _ in routing[3:6])))
    assert torch.equal(layer.expert_load(), _load_of(routing[6][0]))   # counting again
    assert layer.replicas.replicas[3] > 1                              # the hot expert


@torch.no_grad()
def test_rebalance_window_plans_from_the_last_calls_only(monkeypatch):
    _, layer = _pair(rebalance_interval=4, rebalance_window=2)
    seen = _spy_rebalances(layer, monkeypatch)
    routing = [_skewed_ids(6, seed=c) for c in range(4)]
    for ids, w in routing:
        layer(torch.randn(6, H), ids, w)
    [(calls, load)] = seen
    assert calls == 4 and torch.equal(load, _load_of(routing[2][0], routing[3][0]))


@torch.no_grad()
def test_a_manual_rebalance_restarts_the_count(monkeypatch):
    _, layer = _pair(rebalance_interval=2)
    seen = _spy_rebalances(layer, monkeypatch)
    ids, w = _skewed_ids(6)
    layer(torch.randn(6, H), ids, w)
    layer.rebalance()                                 # the count restarts here
    layer(torch.randn(6, H), ids, w)
    assert len(seen) == 1
    layer(torch.randn(6, H), ids, w)
    assert len(seen) == 2


@torch.no_grad()
def test_outputs_do_not_change_across_automatic_rebalances():
    plain, layer = _pair(rebalance_interval=1)
    home = layer.replicas.phy2log.clone()
    x = torch.randn(30, H)
    for seed in range(3):
        ids, w = _skewed_ids(30, seed=seed)
        assert torch.equal(layer(x, ids, w), plain(x, ids, w))
    assert not torch.equal(layer.replicas.phy2log, home)     # it was re-placed
    assert torch.equal(layer(x), plain(x))


def test_a_backward_after_the_rebalance_keeps_the_gradients():
    """With an interval of 1 every forward re-places the experts before its backward
    runs: the backward translates with the new placement, on the same weights."""
    plain, layer = _pair(expert_bias=True, rebalance_interval=1)
    x = torch.randn(24, H)
    ids, w = _skewed_ids(24)
    for step in range(2):
        before = layer.replicas.phy2log.clone()
        y0, g0 = _train_step(plain, x, ids, w.clone().requires_grad_(True))
        y1, g1 = _train_step(layer, x, ids, w.clone().requires_grad_(True))
        if step == 0:
            assert not torch.equal(layer.replicas.phy2log, before)
        torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
        _close_grads(g1, g0)


@torch.no_grad()
def test_compiled_calls_are_not_counted():
    _, layer = _pair(rebalance_interval=2)
    ids, w = _skewed_ids(16)
    x = torch.randn(16, H)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, i, g: layer(a, i, g), fullgraph=True, backend="eager")
    for _ in range(3):
        compiled(x, ids, w)
    assert layer._rebalance_calls == 0                        # no rebalance either:
    assert torch.equal(layer.expert_load(), 3 * _load_of(ids))  # the load is all there
    layer(x, ids, w)
    layer(x, ids, w)                                          # two eager calls: rebalanced
    assert layer.expert_load().sum() == 0


@pytest.mark.parametrize("interval", [None, 0])
def test_no_interval_means_no_automatic_rebalance(interval, monkeypatch):
    _, layer = _pair(rebalance_interval=interval)
    assert layer.rebalance_interval is None
    seen = _spy_rebalances(layer, monkeypatch)
    ids, w = _skewed_ids(8)
    with torch.no_grad():
        for _ in range(4):
            layer(torch.randn(8, H), ids, w)
    assert seen == [] and torch.equal(layer.expert_load(), 4 * _load_of(ids))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rebalance_interval=-1), ValueError, "positive number of calls"),
    (dict(rebalance_interval=2.0), TypeError, "rebalance_interval must be an int"),
    (dict(rebalance_interval=True), TypeError, "rebalance_interval must be an int"),
    (dict(rebalance_interval=4, redundant_experts=0), ValueError,
     "needs redundant_experts > 0"),
    (dict(rebalance_interval=4, rebalance_window=0), ValueError, r"in \[1, "),
    (dict(rebalance_interval=4, rebalance_window=5), ValueError, r"in \[1, "),
    (dict(rebalance_window=2), ValueError, "needs rebalance_interval"),
])
def test_bad_rebalance_knobs_are_refused(kwargs, error, match):
    kwargs = {"redundant_experts": 4, **kwargs}
    with pytest.raises(error, match=match):
        CometMoE(E, K, H, F, dtype=torch.float32, **kwargs)


def _check_gloo_interval(world, rank):
    """Ranks routing different token counts rebalance at the same calls (host counts),
    and the layer keeps the plain layer's outputs across the collective rebalances."""
    torch.manual_seed(0)
    plain = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64)
    layer = CometMoE(E, K, H, F, dtype=torch.float32, max_tokens=64,
                     redundant_experts=2 * world, rebalance_interval=2)
    layer.load_state_dict(plain.state_dict())
    home = layer.replicas.phy2log.clone()
    with torch.no_grad():
        for call in range(5):
            ids, w = _skewed_ids(8 + 7 * rank + call, seed=10 * rank + call)
            x = torch.randn(len(ids), H)
            torch.testing.assert_close(layer(x, ids, w), plain(x, ids, w), rtol=1e-5,
                                       atol=1e-5)
            assert layer._rebalance_calls == (call + 1) % 2
    assert not torch.equal(layer.replicas.phy2log, home)
    every = [torch.empty_like(home) for _ in range(world)]
    dist.all_gather(every, layer.replicas.phy2log)
    assert all(torch.equal(p, every[0]) for p in every)       # one plan on every rank


def test_gloo_ranks_rebalance_at_the_same_calls():
    gloo_ranks.spawn(_check_gloo_interval, 2)


# ----------------------------------------------------------------- fused kernels (interpreter)
@pytest.mark.skipif(not interpreting(), reason="interpreter test (CPU)")
@pytest.mark.parametrize("world,redundant", [(2, 2), (4, 4)])
def test_fused_kernels_on_a_physical_layout_give_the_logical_layers_output(world, redundant):
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F,
                    dtype=torch.float32, max_tokens=12)
    g = torch.Generator().manual_seed(world)
    w13 = torch.randn(E, H, 2 * F, generator=g) * H ** -0.5      # gate columns first
    w2 = torch.randn(E, F, H, generator=g) * F ** -0.5
    tokens = [12, 5, 9, 0][:world]
    routing = [_skewed_ids(m, seed=r) for r, m in enumerate(tokens)]
    xs = [torch.randn(m, H, generator=g) for m in tokens]
    placement = PlacementConfig(E, redundant, world)
    load = torch.bincount(torch.cat([i.flatten() for i, _ in routing]).clamp(min=0),
                          minlength=E)
    plan = plan_placement(load, placement)
    assert (plan.replicas[0] > 1).any()
    tables = ReplicaTables.empty(E, redundant, world)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0])
    slots = plan.phy2log[0].view(world, -1)
    ep = VirtualEP(physical_config(cfg, redundant), [w13[s] for s in slots],
                   [w2[s] for s in slots])
    phys = [translate(i, tables, r) for r, (i, _) in enumerate(routing)]
    ys = ep.forward(xs, phys, [w for _, w in routing])
    for r in range(world):
        expect = reference.moe_forward(xs[r], routing[r][0], routing[r][1], w13, w2)
        torch.testing.assert_close(ys[r].float(), expect.float(), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_compiled_inference_translates_and_counts_inside_the_op():
    plain, layer = _pair()
    ids, w = _skewed_ids(16)
    x = torch.randn(16, H)
    layer.rebalance(plan_placement(torch.bincount(ids.flatten().clamp(min=0), minlength=E),
                                   PlacementConfig(E, 4, 1)))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, i, g: layer(a, i, g), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, ids, w), plain(x, ids, w))
    live = ids.flatten()
    assert torch.equal(layer.expert_load(), torch.bincount(live[live >= 0], minlength=E))


# ----------------------------------------------------------------- comet bench --redundant-experts
def test_balance_columns_count_rows_per_rank_and_the_local_share():
    from comet.bench.eplb import balance_columns, destination_rows
    ids = torch.tensor([[0, 5], [1, -1], [7, 2]])               # 2 slots per rank, 4 ranks
    assert destination_rows(ids, 2, 4).tolist() == [2, 1, 1, 1]
    rows = torch.tensor([[2, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 4]])
    cols = balance_columns(rows)
    assert cols["rows_max_over_mean"] == pytest.approx(4 / 2)
    assert cols["rows_local_fraction"] == pytest.approx(6 / 8)
    assert balance_columns(torch.zeros(2, 2)) == {"rows_max_over_mean": None,
                                                  "rows_local_fraction": None}


def test_physical_weights_follow_the_plan_from_the_owners_seeds():
    from comet.bench.eplb import physical_weights
    from comet.bench.inputs import make_expert_weights
    from comet.weights import gate_up_first
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F,
                    dtype=torch.float32)
    plan = Placement.from_phy2log(torch.tensor([7, 0, 3, 3, 1, 2, 4, 5, 6, 7, 0, 3]), E, 2)
    w13, w2 = physical_weights(cfg, plan, 1, 2, "tiny", 0, "cpu")
    owners = [make_expert_weights(cfg, 4, "tiny", r, 0, "cpu") for r in range(2)]
    for i, e in enumerate([4, 5, 6, 7, 0, 3]):
        assert torch.equal(gate_up_first(w13[i]), owners[e // 4][0][e % 4])
        assert torch.equal(w2[i], owners[e // 4][1][e % 4])


def test_bench_with_redundant_experts_adds_the_balance_table(tmp_path, capsys):
    import glob
    from comet.bench import records as rec
    from comet.cli import bench
    argv = ["--tokens", "16", "--iters", "1", "--warmup", "0", "--input-sets", "2",
            "--routing", "skewed", "--layers", "moe", "--redundant-experts", "4",
            "--no-plot", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    assert "rows max/mean" in capsys.readouterr().out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    [moe] = rec.read_json(path)
    assert moe["redundant_experts"] == 4
    assert "--redundant-experts 4" in moe["command"]
    assert {"commit", "kernels", "torch", "triton", "device"} <= set(moe)
    # one rank computes every row: even and local, with or without replicas
    assert moe["rows_max_over_mean"] == moe["rows_max_over_mean_r0"] == 1.0
    assert moe["rows_local_fraction"] == moe["rows_local_fraction_r0"] == 1.0
    assert "## Redundant experts" in open(path[:-5] + ".md").read()


@pytest.mark.parametrize("extra", [["--redundant-experts", "-1"],
                                   ["--redundant-experts", "2", "--timeline"]])
def test_bench_refuses_bad_redundant_experts(extra, capsys):
    from comet.cli import bench
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "8"] + extra)
    assert "--redundant-experts takes R >= 0" in capsys.readouterr().err


# ----------------------------------------------------------------- one GPU (marker gpu)
def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


@pytest.mark.gpu
def test_gpu_translation_and_load_count_never_sync_the_host():
    tables = ReplicaTables.empty(E, 4, 2, "cuda")
    plan = plan_placement(torch.arange(E, dtype=torch.float64), PlacementConfig(E, 4, 2))
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0])
    ids = torch.randint(-1, E, (512, K), device="cuda")
    load = torch.zeros(E + 1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        from comet.replicas import count_load
        phys = translate(ids, tables, 1)
        count_load(load, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tables.phy2log[phys[ids >= 0]], ids[ids >= 0])


@pytest.mark.gpu
def test_gpu_refresh_and_fold_of_a_training_step_never_sync_the_host():
    """What a training step adds with replicas -- the owners copied into their replicas,
    the replicas' gradients folded into their owners -- runs on the device alone once its
    layout's indices exist."""
    layer = CometMoE(E, K, 256, 256, dtype=torch.bfloat16, max_tokens=64, device="cuda",
                     redundant_experts=4)
    layer.rebalance(Placement.from_phy2log(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 3, 5, 0]),
                                           E, 1))
    slots = layer._slots()
    grads = {n: torch.randn_like(p) for n, p in slots.items() if p is not None}
    for _ in range(2):                                # the second runs on the cached indices
        with torch.no_grad():
            for p in slots.values():
                if p is not None:
                    p.add_(1.0)                       # an optimizer step: the copies are stale
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if _ else "default")
        try:
            layer.replicas.refresh(slots)
            folded = layer.replicas.fold(grads)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    owners = layer.replicas.owners()
    w13 = slots["w13"]
    for slot, e in enumerate(layer.replicas.phy2log.tolist()):
        assert torch.equal(w13[slot], w13[owners[e][0][1]])
    want = torch.zeros(E, *grads["w13"].shape[1:], device="cuda")
    want.index_add_(0, layer.replicas.phy2log.long(), grads["w13"].float())
    got = folded["w13"].float()[[rows[0][1] for _, rows in sorted(owners.items())]]
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_gpu_translation_with_dispatch_shares_never_syncs_the_host():
    """The split by dispatch shares (a stable sort, an index_add_, a scatter) on the
    device: no host sync, and the same ids as on the CPU."""
    world = 4
    cfg = PlacementConfig(E, 4, world)
    g = torch.Generator().manual_seed(3)
    rank_load = torch.randint(0, 50, (world, E), generator=g).double()
    rank_load[:, 3] *= 8
    plan = plan_placement(None, cfg, rank_load=rank_load)
    tables = ReplicaTables.empty(E, 4, world, "cuda")
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], plan.shares[0])
    cpu = ReplicaTables.empty(E, 4, world)
    cpu.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], plan.shares[0])
    ids = torch.randint(-1, E, (512, K), generator=g)
    dev = ids.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        phys = translate(dev, tables, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(phys.cpu(), translate(ids, cpu, 2))


@pytest.mark.gpu
def test_gpu_fused_layer_with_replicas_matches_and_trains():
    """A Qwen3-30B-A3B-sized layer at EP=1 on the fused kernels: the same outputs as
    without replicas, after a rebalance from its own device count (graph replays on the
    re-placed weights), and a training step's gradients through the fused backward."""
    e, k, h, f, m = 128, 8, 2048, 768, 512
    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, max_tokens=m, device="cuda")
    plain = CometMoE(e, k, h, f, **kw)
    layer = CometMoE(e, k, h, f, redundant_experts=16, **kw)
    layer.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(m, e, generator=g)
    scores[:, 5] += 0.7
    ids = scores.topk(k, dim=1).indices.cuda()
    w = torch.rand(m, k, generator=g).softmax(1).cuda()
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = plain(x, ids, w)
        assert _rel(layer(x, ids, w), want) < 2e-2
        plan = layer.rebalance()
        assert plan.replicas[0, 5] > 1
        for _ in range(3):
            assert _rel(layer(x, ids, w), want) < 2e-2
    grads = []
    for mod in (plain, layer):
        xg = x.clone().requires_grad_(True)
        mod(xg, ids, w).float().square().mean().backward()
        logical = mod.logical_experts(grad=True)
        grads.append((xg.grad, logical["w13"], logical["w2"]))
    for got, ref in zip(grads[1], grads[0]):
        assert _rel(got, ref) < 2e-2


# ----------------------------------------------------------------- FP8 experts
def _fp8_pair(redundant=4):
    """An FP8 layer with ``redundant`` replicas and the same layer without (H and F whole
    128-blocks)."""
    from comet.quant import Fp8
    torch.manual_seed(0)
    plain = CometMoE(E, K, 256, 256, max_tokens=64, fp8=Fp8())
    replicated = CometMoE(E, K, 256, 256, max_tokens=64, fp8=Fp8(),
                          redundant_experts=redundant)
    replicated.load_state_dict(plain.state_dict())
    return plain, replicated


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@torch.no_grad()
def test_fp8_experts_with_replicas_are_the_layer_without():
    """FP8 slots (e4m3 weights and their scales) hold, copy and move as bf16 ones: the
    layer's output before and after rebalancing is the layer's without replicas, its
    state dict the logical FP8 experts; a bf16 block's state dict loads quantized, and
    quantize_experts turns a replicated bf16 layer into the same FP8 one."""
    from comet.moe import Fp8LocalExperts, quantize_experts
    plain, replicated = _fp8_pair()
    assert isinstance(replicated.experts, Fp8LocalExperts)
    assert replicated.experts.w13.shape[0] == E + 4 and replicated.experts.w13_scale_inv.shape[0] == E + 4
    x = torch.randn(40, 256).bfloat16()
    ids, w = _skewed_ids(40)
    assert torch.equal(plain(x, ids, w), replicated(x, ids, w))
    plan = replicated.rebalance()
    assert plan.replicas[0, 3] > 1
    assert torch.equal(plain(x, ids, w), replicated(x, ids, w))
    assert torch.equal(plain(x), replicated(x))
    state = replicated.state_dict()
    assert state.keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(_bytes_of(state[key]), _bytes_of(value)), key
    # a bf16 block's state dict: quantized on load, into the logical experts, every slot
    torch.manual_seed(3)
    source = CometMoE(E, K, 256, 256, max_tokens=64, redundant_experts=4)
    replicated.load_state_dict(source.state_dict())
    plain.load_state_dict(source.state_dict())
    assert torch.equal(plain(x, ids, w), replicated(x, ids, w))
    quantize_experts(source)
    assert torch.equal(source(x, ids, w), plain(x, ids, w))
    source.rebalance()
    assert torch.equal(source(x, ids, w), plain(x, ids, w))


def _check_gloo_fp8_rebalance(world, rank):
    """FP8 slots cross ranks on a rebalance, each rank's slots then the logical experts
    they name (byte for byte); the state dict gathers them back."""
    from comet.quant import Fp8
    torch.manual_seed(0)
    kw = dict(max_tokens=64, fp8=Fp8())
    plain = CometMoE(E, K, 256, 256, **kw)
    layer = CometMoE(E, K, 256, 256, redundant_experts=2 * world, **kw)
    layer.load_state_dict(plain.state_dict())
    slots = (E + 2 * world) // world
    with torch.no_grad():
        home = layer.replicas.phy2log.clone()
        layer.rebalance(Placement.from_phy2log(torch.roll(home, -slots), E, world))
    mine = layer.replicas.phy2log[rank * slots:(rank + 1) * slots].tolist()
    every = {}
    for name, t in plain.experts.named_parameters():
        parts = [torch.empty_like(_bytes_of(t)) for _ in range(world)]
        dist.all_gather(parts, _bytes_of(t).contiguous())
        every[name] = torch.cat(parts)
    for name, t in layer.experts.named_parameters():
        for i, e in enumerate(mine):
            assert torch.equal(_bytes_of(t)[i], every[name][e]), (name, i, e)
    state, want = layer.state_dict(), plain.state_dict()
    for key, value in want.items():
        assert torch.equal(_bytes_of(state[key]), _bytes_of(value)), key


def test_gloo_ranks_move_fp8_experts():
    gloo_ranks.spawn(_check_gloo_fp8_rebalance, 2)
