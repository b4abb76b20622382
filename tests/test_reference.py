import torch
import torch.nn.functional as F

from comet import reference
from comet.config import MoEConfig


def _cfg(**kw):
    base = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    base.update(kw)
    return MoEConfig(**base)


def test_softmax_router_renormalises():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 8, generator=g)
    w, ids = reference.route(logits, _cfg())
    assert torch.equal(ids.sort(1).values, logits.topk(2, dim=1).indices.sort(1).values)
    torch.testing.assert_close(w.sum(1), torch.ones(50))
    w_raw, _ = reference.route(logits, _cfg(renormalize=False))
    torch.testing.assert_close(w_raw, logits.softmax(1).gather(1, ids))


def test_sigmoid_router_bias_selects_but_does_not_weigh():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 8, generator=g)
    bias = torch.zeros(8)
    bias[5] = 10.0
    cfg = _cfg(router="sigmoid", renormalize=False, score_correction_bias=True)
    w, ids = reference.route(logits, cfg, bias)
    assert (ids == 5).any(dim=1).all()
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids))


def test_grouped_topk_stays_in_chosen_groups():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 16, generator=g)
    cfg = _cfg(num_experts=16, top_k=4, router="sigmoid", n_group=4, topk_group=2,
               routed_scaling_factor=2.5)
    w, ids = reference.route(logits, cfg)
    groups = ids // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    best_groups = logits.sigmoid().view(64, 4, 4).max(-1).values.topk(2, dim=1).indices
    for row, keep in zip(groups, best_groups):
        assert set(row.tolist()) <= set(keep.tolist())
    torch.testing.assert_close(w.sum(1), torch.full((64,), 2.5))


def test_moe_forward_is_the_weighted_sum_of_experts():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 32, generator=g)
    w13 = torch.randn(8, 32, 32, generator=g)
    w2 = torch.randn(8, 16, 32, generator=g)
    ids = torch.randint(0, 8, (10, 2), generator=g)
    ids[3, 1] = -1
    wts = torch.rand(10, 2, generator=g)
    y = reference.moe_forward(x, ids, wts, w13, w2)
    for t in range(10):
        expect = torch.zeros(32)
        for j in range(2):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = x[t] @ w13[e]
            expect += wts[t, j] * ((F.silu(gu[:16]) * gu[16:]) @ w2[e])
        torch.testing.assert_close(y[t], expect, rtol=1e-5, atol=1e-4)


def test_ep_forward_equals_single_rank():
    g = torch.Generator().manual_seed(4)
    el = 2
    xs = [torch.randn(m, 32, generator=g) for m in (5, 0, 3, 7)]
    ids = [torch.randint(0, 8, (x.shape[0], 2), generator=g) for x in xs]
    wts = [torch.rand(x.shape[0], 2, generator=g) for x in xs]
    w13 = torch.randn(8, 32, 32, generator=g)
    w2 = torch.randn(8, 16, 32, generator=g)
    ys = reference.ep_forward(xs, ids, wts, list(w13.split(el)), list(w2.split(el)))
    for x, i, w, y in zip(xs, ids, wts, ys):
        torch.testing.assert_close(y, reference.moe_forward(x, i, w, w13, w2))


def test_receive_order_is_expert_then_ring_then_token():
    ids = [torch.tensor([[0, 3], [2, 1]]), torch.tensor([[1, 0]]), torch.tensor([[0, 2]])]
    got = reference.ep_receive_order(ids, rank=1, local_experts=2)   # experts 2, 3 on rank 1
    # expert 2: sources in ring order 1, 2, 0 -> rank 2 token 0, then rank 0 token 1
    # expert 3: rank 0 token 0
    assert got.expert.tolist() == [0, 0, 1]
    assert got.source.tolist() == [2, 0, 0]
    assert got.token.tolist() == [0, 1, 0]
    assert got.slot.tolist() == [1, 0, 1]
