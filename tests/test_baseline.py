"""The unfused and chunked EP baselines against the spec, on one rank and over gloo."""


import pytest
import torch

import gloo_ranks
from comet import reference
from comet.baseline import (chunked_ep_moe_forward, ep_moe_forward, grouped_mm,
                            plan_dispatch)
from comet.bench.timing import PhaseClock

E, K, H, F = 8, 2, 32, 48


def _routing(m, g, forbid=(), drop=0):
    """Distinct experts per token avoiding ``forbid``; ``drop`` slots set to -1."""
    scores = torch.rand(m, E, generator=g)
    if forbid:
        scores[:, list(forbid)] = -1.0
    ids = scores.topk(K, dim=1).indices
    if drop and m:
        ids[torch.randint(m, (drop,), generator=g), torch.randint(K, (drop,), generator=g)] = -1
    return ids, torch.rand(m, K, generator=g)


def _world_inputs(world, tokens, seed, forbid=(), drop=0, dtype=torch.float32):
    """Every rank's inputs and weights, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for m in tokens:
        i, w = _routing(m, g, forbid, drop)
        xs.append(torch.randn(m, H, generator=g).to(dtype))
        ids.append(i)
        ws.append(w)
    el = E // world
    w13 = (torch.randn(E, H, 2 * F, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, F, H, generator=g) * F ** -0.5).to(dtype)
    shards13 = [w13[r * el:(r + 1) * el] for r in range(world)]
    shards2 = [w2[r * el:(r + 1) * el] for r in range(world)]
    return xs, ids, ws, shards13, shards2


def _check_all(world, rank, group=None):
    cases = [
        dict(tokens=[7, 12, 3, 9][:world], seed=1),
        dict(tokens=[0, 11, 5, 0][:world] if world > 1 else [0], seed=2),     # idle ranks
        dict(tokens=[9, 4, 6, 8][:world], seed=3, forbid=(1,)),               # empty expert
        # every expert of the last rank idle: it receives no rows at all
        dict(tokens=[6, 6, 6, 6][:world], seed=4, forbid=tuple(range(E - E // world, E))
             if world > 1 else (6, 7)),
        dict(tokens=[10, 3, 8, 5][:world], seed=5, drop=4),                    # -1 ids
    ]
    for case in cases:
        xs, ids, ws, s13, s2 = _world_inputs(world, **case)
        want = reference.ep_forward(xs, ids, ws, s13, s2)[rank]
        got = ep_moe_forward(xs[rank], ids[rank], ws[rank], s13[rank], s2[rank], group)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{case}")
        for chunks in (1, 2, 3, 16):
            got = chunked_ep_moe_forward(xs[rank], ids[rank], ws[rank], s13[rank], s2[rank],
                                         group, chunks=chunks)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} chunks={chunks}")
    xs, ids, ws, s13, s2 = _world_inputs(world, [9, 14, 5, 7][:world], 6, dtype=torch.bfloat16)
    want = reference.ep_forward(xs, ids, ws, s13, s2, round_to=torch.bfloat16)[rank]
    got = ep_moe_forward(xs[rank], ids[rank], ws[rank], s13[rank], s2[rank], group)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_single_rank_matches_reference():
    _check_all(1, 0)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gloo_ranks_match_reference(world):
    gloo_ranks.spawn(_check_all, world)


def test_grouped_mm_loop_matches_per_expert_matmul():
    g = torch.Generator().manual_seed(0)
    rows = [3, 0, 5, 1]
    a = torch.randn(sum(rows), 16, generator=g)
    b = torch.randn(len(rows), 16, 24, generator=g)
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    got = grouped_mm(a, b, rows, offs)
    starts = [0] + offs.tolist()
    want = torch.cat([a[starts[e]:starts[e + 1]] @ b[e] for e in range(len(rows))])
    torch.testing.assert_close(got, want)


def test_plan_groups_rows_by_expert():
    ids = torch.tensor([[3, 0], [0, -1], [2, 3], [3, 2]])
    plan = plan_dispatch(ids, local_experts=4)
    assert plan.send_splits == [7] and plan.recv_splits == [7]
    assert plan.expert_rows == [2, 0, 2, 3]
    assert plan.offs.tolist() == [2, 2, 4, 7]
    # pairs in expert order, (token, slot) ascending inside an expert; the -1 slot dropped
    assert plan.order.tolist() == [1, 2, 4, 7, 0, 5, 6]


def test_topk_sum_drops_the_rows_never_computed():
    """The TP pipeline's grouped GEMMs leave the rows of pairs of no expert (sorted last)
    unwritten: whatever they hold -- NaN here -- must not reach a token's sum."""
    from comet.baseline import _topk_reduce
    g = torch.Generator().manual_seed(3)
    m, k = 5, 3
    weights = torch.rand(m, k, generator=g)
    order = torch.randperm(m * k, generator=g)
    computed = 11                                  # the last 4 pairs have no expert
    back = torch.randn(m * k, H, generator=g)
    back[computed:] = float("nan")
    want = torch.zeros(m, H)
    for i, pair in enumerate(order[:computed].tolist()):
        want[pair // k] += weights[pair // k, pair % k] * back[i]
    got = _topk_reduce(back, order, weights, computed=torch.tensor(computed))
    torch.testing.assert_close(got, want)


def test_phase_timer_sees_every_phase():
    xs, ids, ws, s13, s2 = _world_inputs(1, [6], 7)
    clock = PhaseClock(torch.device("cpu"))
    ep_moe_forward(xs[0], ids[0], ws[0], s13[0], s2[0], timer=clock)
    assert set(clock.elapsed_us()) == {"route", "counts", "gather", "dispatch", "permute",
                                       "gemm0", "act", "gemm1", "unpermute", "combine",
                                       "reduce"}
    assert all(v >= 0 for v in clock.elapsed_us().values())


def test_chunks_must_be_positive():
    xs, ids, ws, s13, s2 = _world_inputs(1, [4], 8)
    with pytest.raises(ValueError, match="chunks"):
        chunked_ep_moe_forward(xs[0], ids[0], ws[0], s13[0], s2[0], chunks=0)


def _check_mesh(world, rank):
    """The unfused (tp, ep) pipelines against comet.reference.mesh_forward, both input
    conventions, GPT-OSS's activation and expert biases, uneven token counts."""
    from comet.activation import GatedActivation
    from comet.baseline import MeshGroups, mesh_moe_forward
    from comet.mesh import MeshLayout
    act = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)
    layouts = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}[world]
    for tp, ep in layouts:
        mesh = MeshLayout(tp=tp, ep=ep)
        groups = MeshGroups.new(mesh)
        for convention in ("sequence", "replicated"):
            xs, ids, ws, _, _ = _world_inputs(world, [7, 12, 0, 9][:world], seed=tp * 10 + ep,
                                              drop=2)
            if convention == "replicated":
                for r in range(world):
                    first = mesh.tp_group(r)[0]
                    xs[r], ids[r], ws[r] = xs[first], ids[first], ws[first]
            g = torch.Generator().manual_seed(7)
            f = 64                     # F / tp must be a multiple of 16
            w13 = torch.randn(E, H, 2 * f, generator=g) * H ** -0.5
            w2 = torch.randn(E, f, H, generator=g) * f ** -0.5
            b13, b2 = torch.randn(E, 2 * f, generator=g), torch.randn(E, H, generator=g)
            want = reference.mesh_forward(xs, ids, ws, w13, w2, mesh, convention,
                                          activation=act, b13=b13, b2=b2)[rank]
            got = mesh_moe_forward(xs[rank], ids[rank], ws[rank],
                                   mesh.shard(rank, w13, w2, b13, b2), groups, convention,
                                   activation=act)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=f"tp={tp} ep={ep} {convention}")


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_and_hybrid_baselines_over_gloo(world):
    gloo_ranks.spawn(_check_mesh, world)
