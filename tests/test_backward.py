"""Training through comet: the expert-parallel backward (comet.baseline_backward, and the
fused one of comet.runtime.backward) and the op's
registered autograd against autograd of the spec, on one rank and over gloo."""

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
from comet import CometMoE, reference
from comet.baseline_backward import routed_experts_backward
from comet.grouped import grouped_weight_grad
from comet.weights import interleave_gate_up

K, H = 2, 32


def _problem(tokens, experts, ffn, seed, drop=0, forbid=()):
    """Every rank's (x, ids, weights, dy) and the full W13 (gate-up) and W2, fp32."""
    g = torch.Generator().manual_seed(seed)
    per_rank = []
    for m in tokens:
        scores = torch.rand(m, experts, generator=g)
        if forbid:
            scores[:, list(forbid)] = -1.0
        ids = scores.topk(K, dim=1).indices
        if drop and m:
            ids[torch.randint(m, (drop,), generator=g), torch.randint(K, (drop,), generator=g)] = -1
        per_rank.append((torch.randn(m, H, generator=g), ids, torch.rand(m, K, generator=g),
                         torch.randn(m, H, generator=g)))
    w13 = torch.randn(experts, H, 2 * ffn, generator=g) * H ** -0.5
    w2 = torch.randn(experts, ffn, H, generator=g) * ffn ** -0.5
    return per_rank, w13, w2


def _spec_grads(per_rank, w13, w2):
    """Autograd of sum_r <dy_r, moe_forward(x_r)> with every expert on one process."""
    w13 = w13.clone().requires_grad_()
    w2 = w2.clone().requires_grad_()
    xs, ws = [], []
    loss = (w13.sum() + w2.sum()) * 0     # a graph even when no rank has tokens
    for x, ids, w, dy in per_rank:
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        xs.append(x), ws.append(w)
        loss = loss + (reference.moe_forward(x, ids, w, w13, w2) * dy).sum()
    loss.backward()
    grad = lambda t: torch.zeros_like(t) if t.grad is None else t.grad   # noqa: E731
    return [grad(x) for x in xs], [grad(w) for w in ws], w13.grad, w2.grad


CASES = [
    dict(tokens=[7, 12, 3, 9], experts=8, ffn=160, seed=1),              # 1 block + a tail
    dict(tokens=[0, 11, 5, 0], experts=8, ffn=48, seed=2),               # idle ranks; tail only
    dict(tokens=[9, 4, 6, 8], experts=8, ffn=256, seed=3, forbid=(1,)),  # an expert with no rows
    dict(tokens=[10, 3, 8, 5], experts=4, ffn=160, seed=5, drop=4),      # -1 ids
]


def _check(world, rank, group=None):
    for case in CASES:
        case = dict(case, tokens=case["tokens"][:world])
        per_rank, w13, w2 = _problem(**case)
        want_dx, want_dw, want_13, want_2 = _spec_grads(per_rank, w13, w2)
        el = w13.shape[0] // world
        mine = slice(rank * el, (rank + 1) * el)
        x, ids, w, dy = per_rank[rank]
        for layout in ("gate_up", "interleaved"):
            w13_mine = w13[mine] if layout == "gate_up" else interleave_gate_up(w13[mine])
            dx, dw, d13, d2 = routed_experts_backward(dy, x, ids, w, w13_mine, w2[mine],
                                                      group, layout=layout)
            want13 = want_13[mine] if layout == "gate_up" else interleave_gate_up(want_13[mine])
            msg = f"{case} {layout} rank {rank}"
            torch.testing.assert_close(dx, want_dx[rank], atol=1e-5, rtol=1e-5, msg=msg)
            torch.testing.assert_close(dw, want_dw[rank], atol=1e-5, rtol=1e-5, msg=msg)
            torch.testing.assert_close(d13, want13, atol=1e-5, rtol=1e-5, msg=msg)
            torch.testing.assert_close(d2, want_2[mine], atol=1e-5, rtol=1e-5, msg=msg)


def _module_check(world, rank, group):
    """A CometMoE over the group trained one step: every gradient as the full layer's."""
    alone = [dist.new_group([r]) for r in range(world)]     # collective: every rank makes all
    torch.manual_seed(0)
    full = CometMoE(8, K, H, 160, dtype=torch.float32, group=alone[rank])   # every expert
    torch.manual_seed(0)
    sharded = CometMoE(8, K, H, 160, dtype=torch.float32, group=group)
    el = sharded.local_experts
    with torch.no_grad():
        sharded.gate.weight.copy_(full.gate.weight)
        sharded.experts.w13.copy_(full.experts.w13[rank * el:(rank + 1) * el])
        sharded.experts.w2.copy_(full.experts.w2[rank * el:(rank + 1) * el])
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(m, H, generator=g) for m in (9, 14, 5, 7)[:world]]
    x = xs[rank].clone().requires_grad_()
    sharded(x).square().sum().backward()
    # Expert weights: every rank's tokens; the router and x: this rank's own.
    x_full = torch.cat(xs).requires_grad_()
    full(x_full).square().sum().backward()
    start = sum(m.shape[0] for m in xs[:rank])
    torch.testing.assert_close(x.grad, x_full.grad[start:start + xs[rank].shape[0]],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sharded.experts.w13.grad,
                               full.experts.w13.grad[rank * el:(rank + 1) * el],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sharded.experts.w2.grad,
                               full.experts.w2.grad[rank * el:(rank + 1) * el],
                               atol=1e-4, rtol=1e-4)
    router = full.gate.weight.grad.clone()
    full.zero_grad()
    full(xs[rank]).square().sum().backward()
    torch.testing.assert_close(sharded.gate.weight.grad, full.gate.weight.grad,
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(router, full.gate.weight.grad)   # the two references differ


def _check_over_gloo(world, rank):
    _check(world, rank, dist.group.WORLD)
    _module_check(world, rank, dist.group.WORLD)


def test_single_rank_matches_autograd_of_the_spec():
    _check(1, 0)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gloo_ranks_match_autograd_of_the_spec(world):
    gloo_ranks.spawn(_check_over_gloo, world)


def test_grouped_weight_grad_is_per_expert_a_transposed_b():
    g = torch.Generator().manual_seed(0)
    rows = [3, 0, 5, 1]
    a, b = torch.randn(9, 16, generator=g), torch.randn(9, 24, generator=g)
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    got = grouped_weight_grad(a, b, offs, rows)
    torch.testing.assert_close(grouped_weight_grad(a, b, offs), got)   # rows from offs
    starts = [0] + offs.tolist()
    for e in range(len(rows)):
        want = a[starts[e]:starts[e + 1]].t() @ b[starts[e]:starts[e + 1]]
        torch.testing.assert_close(got[e], want)
    assert not got[1].any()


def test_the_op_backward_is_the_layers_gradient():
    """The op's registered autograd (what the fused CUDA path runs) on a CPU layer, against
    autograd of the layer's reference path."""
    from comet import custom_op
    torch.manual_seed(0)
    layer = CometMoE(8, K, H, 160, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, H, generator=g)
    ids = torch.rand(11, 8, generator=g).topk(K, dim=1).indices
    w = torch.rand(11, K, generator=g)
    dy = torch.randn(11, H, generator=g)
    grads = []
    for through_op in (False, True):
        layer.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if through_op:
            y = custom_op.routed_experts(xi, ids, wi, layer.experts.w13, layer.experts.w2,
                                         layer._op_key)
        else:
            y = layer.experts_forward(xi, ids, wi)
        (y * dy).sum().backward()
        grads.append([xi.grad, wi.grad, layer.experts.w13.grad, layer.experts.w2.grad])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_layout_is_refused():
    per_rank, w13, w2 = _problem([4], 4, 48, 0)
    x, ids, w, dy = per_rank[0]
    with pytest.raises(ValueError, match="layout"):
        routed_experts_backward(dy, x, ids, w, w13, w2, layout="up_gate")


@pytest.mark.parametrize("layout,ffn", [("interleaved", 320), ("interleaved", 48),
                                        ("interleaved", 256), ("gate_up", 200)])
def test_the_activation_kernel_matches_its_torch_form(layout, ffn):
    """comet.kernels.act_backward (Triton; the interpreter on a CPU) against the torch
    ops it replaces, with ragged rows and a partial last gate/up block."""
    from comet.baseline_backward import act_backward_torch
    from comet.kernels.act_backward import act_backward
    g = torch.Generator().manual_seed(ffn)
    # On a GPU machine Triton is not interpreting: the kernel needs device tensors.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.float16):
        gu = torch.randn(21, 2 * ffn, generator=g).to(dev, dtype)
        dh_u = torch.randn(21, ffn, generator=g).to(dev, dtype)
        w = torch.rand(21, generator=g).to(dev)
        got = act_backward(gu, dh_u, w, interleaved=layout == "interleaved")
        want = act_backward_torch(gu, dh_u, w, layout)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)


def test_frozen_experts_skip_their_gradients():
    """Experts with requires_grad off: x and the router still get theirs (the same as
    with trainable experts), the experts none, and the weight GEMMs are not run."""
    from unittest import mock

    import comet.baseline_backward as bw
    torch.manual_seed(0)
    layer = CometMoE(8, K, H, 160, dtype=torch.float32)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    ids = torch.rand(9, 8, generator=torch.Generator().manual_seed(5)).topk(K, dim=1).indices
    w = torch.rand(9, K, generator=torch.Generator().manual_seed(6))
    from comet import custom_op
    grads = []
    for frozen in (False, True):
        layer.zero_grad(set_to_none=True)
        layer.experts.requires_grad_(not frozen)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with mock.patch.object(bw, "grouped_weight_grad", wraps=bw.grouped_weight_grad) as spy:
            custom_op.routed_experts(xi, ids, wi, layer.experts.w13, layer.experts.w2,
                                     layer._op_key).square().sum().backward()
        assert spy.call_count == (0 if frozen else 2)
        grads.append((xi.grad, wi.grad))
    assert layer.experts.w13.grad is None and layer.experts.w2.grad is None
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the fused backward
def _fused_config(experts, ffn, world_tokens):
    from comet.config import MoEConfig
    return MoEConfig(num_experts=experts, top_k=K, hidden_size=H, intermediate_size=ffn,
                     dtype=torch.float32, max_tokens=max(16, max(world_tokens)))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_backward_of_virtual_ranks_matches_the_spec(world):
    """comet.runtime.backward on the fused kernels (the Triton interpreter, every rank's
    phases in lockstep): dx, the routing weights' and every rank's expert weights'
    gradients as autograd of the spec -- idle ranks, an expert with no rows, -1 ids."""
    from comet.runtime.virtual import VirtualEP
    for case in CASES:
        case = dict(case, tokens=case["tokens"][:world])
        per_rank, w13, w2 = _problem(**case)
        want_dx, want_dw, want_13, want_2 = _spec_grads(per_rank, w13, w2)
        el = w13.shape[0] // world
        cfg = _fused_config(w13.shape[0], w2.shape[1], case["tokens"])
        ep = VirtualEP(cfg, [w13[r * el:(r + 1) * el] for r in range(world)],
                       [w2[r * el:(r + 1) * el] for r in range(world)])
        xs, ids, ws, dys = (list(t) for t in zip(*per_rank))
        ep.forward(xs, ids, ws)     # the backward reuses a workspace a forward left behind
        for r, (dx, dw, d13, d2) in enumerate(ep.backward(dys, xs, ids, ws)):
            mine = slice(r * el, (r + 1) * el)
            msg = f"{case} rank {r}"
            torch.testing.assert_close(dx, want_dx[r], atol=1e-4, rtol=1e-4, msg=msg)
            torch.testing.assert_close(dw, want_dw[r], atol=1e-4, rtol=1e-4, msg=msg)
            torch.testing.assert_close(d13, interleave_gate_up(want_13[mine]), atol=1e-4,
                                       rtol=1e-4, msg=msg)
            torch.testing.assert_close(d2, want_2[mine], atol=1e-4, rtol=1e-4, msg=msg)


def test_fused_backward_between_gathered_forwards_matches_the_spec():
    """A layer with ``layer0_gather`` (its forward's token rows live in a0's memory) runs
    the backward on rows placed per pair, as every layer does: the gradients match the
    spec, and a gathered forward after it gives the reference again (the backward's
    rows overwrote the token rows; the next forward sends them anew)."""
    import dataclasses

    from comet.config import TileConfig
    from comet.reference import ep_forward
    from comet.runtime.virtual import VirtualEP
    from comet.weights import GATE_UP_BLOCK
    world, case = 2, dict(CASES[2], tokens=CASES[2]["tokens"][:2])   # ffn 256: one-dot items
    per_rank, w13, w2 = _problem(**case)
    want_dx, want_dw, want_13, want_2 = _spec_grads(per_rank, w13, w2)
    el = w13.shape[0] // world
    cfg = _fused_config(w13.shape[0], w2.shape[1], case["tokens"])
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK, layer0_gather=True)
    shards13 = [w13[r * el:(r + 1) * el] for r in range(world)]
    shards2 = [w2[r * el:(r + 1) * el] for r in range(world)]
    ep = VirtualEP(cfg, shards13, shards2, tile)
    xs, ids, ws, dys = (list(t) for t in zip(*per_rank))
    expect = ep_forward(xs, ids, ws, shards13, shards2)
    for y, e in zip(ep.forward(xs, ids, ws), expect):
        torch.testing.assert_close(y, e, atol=1e-4, rtol=1e-4)
    for r, (dx, dw, d13, d2) in enumerate(ep.backward(dys, xs, ids, ws)):
        mine = slice(r * el, (r + 1) * el)
        torch.testing.assert_close(dx, want_dx[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dw, want_dw[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(d13, interleave_gate_up(want_13[mine]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(d2, want_2[mine], atol=1e-4, rtol=1e-4)
    for y, e in zip(ep.forward(xs, ids, ws), expect):
        torch.testing.assert_close(y, e, atol=1e-4, rtol=1e-4)


def test_fused_backward_frozen_experts_and_back_to_back_calls():
    """Without weight gradients only dx and d weights come back (and match); calls
    after it -- forward and backward -- are still right (epochs, staging, pair slots)."""
    from comet.runtime.virtual import VirtualEP
    case = dict(CASES[3], tokens=CASES[3]["tokens"][:2])
    per_rank, w13, w2 = _problem(**case)
    want_dx, want_dw, _, want_2 = _spec_grads(per_rank, w13, w2)
    cfg = _fused_config(w13.shape[0], w2.shape[1], case["tokens"])
    el = w13.shape[0] // 2
    ep = VirtualEP(cfg, [w13[:el], w13[el:]], [w2[:el], w2[el:]])
    xs, ids, ws, dys = (list(t) for t in zip(*per_rank))
    frozen = ep.backward(dys, xs, ids, ws, weight_grads=False)
    again = ep.backward(dys, xs, ids, ws)
    for r in range(2):
        assert frozen[r][2] is None and frozen[r][3] is None
        for got in (frozen[r], again[r]):
            torch.testing.assert_close(got[0], want_dx[r], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got[1], want_dw[r], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(again[r][3], want_2[r * el:(r + 1) * el], atol=1e-4,
                                   rtol=1e-4)
    assert all(int(ws_.epoch) == 4 for ws_ in ep.ws)


def test_fused_layer_backward_on_one_rank_stages_the_routing():
    """FusedMoE.backward (one rank, the interpreter): routing staged into the layer's
    max_tokens buffers, bad shapes refused before any kernel runs."""
    from comet.runtime.layer import FusedMoE
    per_rank, w13, w2 = _problem(tokens=[9], experts=8, ffn=48, seed=7)
    want_dx, want_dw, want_13, want_2 = _spec_grads(per_rank, w13, w2)
    x, ids, w, dy = per_rank[0]
    layer = FusedMoE(_fused_config(8, 48, [16]), w13, w2)
    with pytest.raises(ValueError, match="dy must be"):
        layer.backward(dy[:3], x, ids, w)
    epoch = int(layer.ws.epoch)
    assert epoch == 0
    dx, dw, d13, d2 = layer.backward(dy, x, ids, w)
    # The variant (reused by every call) keeps nothing of the call: a held weight
    # gradient is as large as the experts' weights.
    for call in layer._backward_calls.values():
        assert call.dx is call.dw13 is call.dw2 is call.d_weights is None
        assert call._inputs == ()
    torch.testing.assert_close(dx, want_dx[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw, want_dw[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d13, interleave_gate_up(want_13), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d2, want_2, atol=1e-4, rtol=1e-4)


def test_zero_empty_kernel_zeroes_only_experts_without_rows():
    from comet.kernels.grad_rows import zero_empty_kernel
    out = torch.randn(4, 3, 50)
    keep = out.clone()
    ends = torch.tensor([5, 5, 9, 9], dtype=torch.int32)     # experts 1 and 3 got no rows
    zero_empty_kernel[(3,)](out, ends, 150, LOCAL_EXPERTS=4, BLOCK=32)
    assert not out[1].any() and not out[3].any()
    torch.testing.assert_close(out[0], keep[0])
    torch.testing.assert_close(out[2], keep[2])


def test_row_weights_wait_for_the_calls_entries():
    """A row's weight is read only once its source's chunk flags (rows, then the return
    entries) reached the call's epoch: layer0's GEMM waits for rows only, and the entries
    still there may be another call's. A source whose flags lag is given up on -- the
    wait is recorded (site 7) and nothing of it is written."""
    from comet.kernels.grad_rows import launch_row_weights
    from comet.kernels.layer0 import Arrivals
    from comet.kernels.plan import EntryTables
    from comet.kernels.shape import Shape
    from comet.kernels.sync import Sync
    world, mx, slots, epoch = 2, 4, 3, 5
    rows = torch.full((world, mx, K), -1, dtype=torch.int32)
    rows[0, 0], rows[1, 0] = torch.tensor([0, 1]), torch.tensor([2, 3])
    weight = torch.arange(world * mx * K, dtype=torch.float32).view(world, mx, K) + 1
    flag0 = torch.zeros(world, slots, dtype=torch.int64)
    flag0[0, :2] = epoch            # source 0: both chunks landed; source 1: one of two
    flag0[1, 0] = epoch
    error = torch.zeros(world, 8, dtype=torch.int32)
    err_table = torch.tensor([error[r].data_ptr() for r in range(world)])
    w_row = torch.zeros(4)
    shape = Shape.of(world * 2, K, world)
    launch_row_weights(1, recv=EntryTables(None, rows, weight),
                       arrivals=Arrivals(flag0, slots, torch.tensor([2, 2], dtype=torch.int32),
                                         torch.ones(world, dtype=torch.int32)),
                       w_row=w_row, max_tokens=mx,
                       sync=Sync(torch.tensor([epoch]), err_table, 0, torch.tensor([10**9]),
                                 shape.WORLD), shape=shape)
    torch.testing.assert_close(w_row, torch.tensor([1.0, 2.0, 0.0, 0.0]))
    assert error[0, :4].tolist() == [1, 7, 1, 0]       # timeout, site, source, rank


def test_the_fused_backward_is_the_default():
    moe = CometMoE(num_experts=4, top_k=2, hidden_size=H, intermediate_size=16)
    assert moe.fused_backward is True
    assert CometMoE(num_experts=4, top_k=2, hidden_size=H, intermediate_size=16,
                    fused_backward=False).fused_backward is False
