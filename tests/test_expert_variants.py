"""Expert variants: the gated activations of comet.activation and expert biases, in the
spec, the unfused baselines and the fused kernels (virtual ranks under the interpreter;
the GPU suite runs the same at full size).
"""


import pytest
import torch
import torch.nn.functional as F

from comet import reference
from comet.activation import SILU, GatedActivation, gated, gated_grad
from comet.config import MoEConfig, TileConfig
from comet.constants import interpreting
from routings import make_ids, make_tokens

GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)
CLAMPED_SILU = GatedActivation(limit=7.0)
GELU_TANH = GatedActivation(kind="gelu_tanh")
VARIANTS = {"silu": SILU, "gpt-oss": GPT_OSS, "clamped-silu": CLAMPED_SILU,
            "gelu-tanh": GELU_TANH}

interpreter = pytest.mark.skipif(not interpreting(), reason="interpreter tests (CPU); the "
                                 "GPU suite runs these kernels compiled")


def _halves(rows=64, f=24, scale=6.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, f, generator=g) * scale, torch.randn(rows, f, generator=g) * scale)


# --------------------------------------------------------------------------- the spec
def test_gated_is_what_the_families_compute():
    """Against the formulas as the model families write them (GPT-OSS's _apply_gate,
    DeepSeek-V4's clamped SiLU, Gemma's gelu_pytorch_tanh)."""
    gate, up = _halves()
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(gated(gate, up, GPT_OSS), (u + 1) * g * torch.sigmoid(1.702 * g))
    torch.testing.assert_close(gated(gate, up, CLAMPED_SILU), F.silu(g) * u)
    torch.testing.assert_close(gated(gate, up, GELU_TANH),
                               F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gated(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gated_grad_is_autograd_of_gated(name):
    act = VARIANTS[name]
    gate, up = (t.requires_grad_() for t in _halves(seed=1))
    dh = torch.randn(gate.shape, generator=torch.Generator().manual_seed(2))
    gated(gate, up, act).backward(dh)
    dg, du = gated_grad(gate.detach(), up.detach(), dh, act)
    torch.testing.assert_close(dg, gate.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(du, up.grad, rtol=1e-5, atol=1e-5)


def test_bad_activations_are_refused():
    with pytest.raises(ValueError, match="kind"):
        GatedActivation(kind="relu")
    with pytest.raises(ValueError, match="limit"):
        GatedActivation(limit=0.0)
    with pytest.raises(ValueError, match="alpha"):
        GatedActivation(kind="gelu_tanh", alpha=2.0)
    with pytest.raises(ValueError, match="activation"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=16,
                  activation="silu")


# --------------------------------------------------------------------------- fused kernels
def _problem(world, act, bias, dtype, f=48, seed=0):
    e, k, h = 8, 2, 32
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f, dtype=dtype,
                    max_tokens=12, activation=act, expert_bias=bias)
    g = torch.Generator().manual_seed(seed)
    el = e // world
    ids = make_ids("uniform", make_tokens("uniform", world, cfg.max_tokens, g), e, k, g)
    # Scaled so the gate/up values reach the clamp (|x| > 7) in a share of the entries.
    xs = [(torch.randn(i.shape[0], h, generator=g) * 4).to(dtype) for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    w13 = [(torch.randn(el, h, 2 * f, generator=g) * h ** -0.5 * 2).to(dtype)
           for _ in range(world)]
    w2 = [(torch.randn(el, f, h, generator=g) * f ** -0.5).to(dtype) for _ in range(world)]
    b13 = [(torch.randn(el, 2 * f, generator=g)).to(dtype) for _ in range(world)] if bias else None
    b2 = [(torch.randn(el, h, generator=g)).to(dtype) for _ in range(world)] if bias else None
    return cfg, xs, ids, wts, w13, w2, b13, b2


@interpreter
@pytest.mark.parametrize("scatter", [False, True], ids=["reduce", "scatter"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ["gpt-oss", "clamped-silu", "gelu-tanh"])
def test_fused_forward_of_a_variant_matches_the_spec(name, bias, scatter):
    """Virtual ranks (W=2) through both layer1 algorithms, fp32; the clamp is reached."""
    from comet.runtime.virtual import VirtualEP
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(2, VARIANTS[name], bias, torch.float32)
    tile = TileConfig.small().with_fields(layer1_scatter=scatter)
    ep = VirtualEP(cfg, w13, w2, tile, b13_shards=b13, b2_shards=b2)
    ys = ep.forward(xs, ids, wts)
    want = reference.ep_forward(xs, ids, wts, w13, w2, activation=VARIANTS[name],
                                b13_shards=b13, b2_shards=b2)
    for y, w in zip(ys, want):
        torch.testing.assert_close(y.float(), w, rtol=1e-4, atol=1e-4)
    plain = reference.ep_forward(xs, ids, wts, w13, w2)
    assert not torch.allclose(plain[0], want[0], atol=1e-2), "the variant must matter"


@interpreter
def test_fused_forward_one_dot_epilogue_with_biases():
    """The one-dot epilogue (a tile is a whole 128-column interleave block: the bias is
    added to both halves of the box), two blocks of F, fp16."""
    from comet.runtime.virtual import VirtualEP
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(2, GPT_OSS, True, torch.float16, f=256)
    tile = TileConfig.small().with_fields(block_n0=128)
    ep = VirtualEP(cfg, w13, w2, tile, b13_shards=b13, b2_shards=b2)
    want = reference.ep_forward(xs, ids, wts, w13, w2, round_to=torch.float16,
                                activation=GPT_OSS, b13_shards=b13, b2_shards=b2)
    for y, w in zip(ep.forward(xs, ids, wts), want):
        torch.testing.assert_close(y.float(), w, rtol=2e-2, atol=5e-2)


@interpreter
@pytest.mark.parametrize("name,bias,f", [("silu", False, 192), ("gpt-oss", True, 320)])
def test_fused_forward_half_tail_epilogue(name, bias, f):
    """F ending in half an interleave block (F % 128 == 64, as F = 704 or GPT-OSS's 2880):
    one dot per tile still, the last item's box ``[gate/2 | up/2 | zeros]`` unpacked by the
    half-tail epilogue (comet.kernels.group_gemm), fp16, with and without biases."""
    from comet.kernels.layer0 import layer0_gemm
    from comet.runtime.virtual import VirtualEP
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(2, VARIANTS[name], bias, torch.float16,
                                                   f=f, seed=f)
    tile = TileConfig.small().with_fields(block_n0=128)
    item = layer0_gemm(torch.zeros(16, 32, dtype=torch.float16), w13[0],
                       torch.zeros(16, f, dtype=torch.float16), tile, gated=True)[1]
    assert item.ONE_DOT and item.HALF_TAIL      # the path under test
    ep = VirtualEP(cfg, w13, w2, tile, b13_shards=b13, b2_shards=b2)
    want = reference.ep_forward(xs, ids, wts, w13, w2, round_to=torch.float16,
                                activation=VARIANTS[name], b13_shards=b13, b2_shards=b2)
    for y, w in zip(ep.forward(xs, ids, wts), want):
        torch.testing.assert_close(y.float(), w, rtol=2e-2, atol=5e-2)


@interpreter
@pytest.mark.parametrize("name", ["gpt-oss", "gelu-tanh"])
def test_act_backward_kernel_of_a_variant_matches_torch(name):
    from comet.baseline_backward import act_backward_torch
    from comet.kernels.act_backward import act_backward
    g = torch.Generator().manual_seed(3)
    rows, f = 20, 160          # one full interleave block and a partial one
    gu = torch.randn(rows, 2 * f, generator=g) * 6
    dhu = torch.randn(rows, f, generator=g)
    w = torch.rand(rows, generator=g)
    for layout in ("interleaved", "gate_up"):
        got = act_backward(gu, dhu, w, interleaved=layout == "interleaved",
                           activation=VARIANTS[name])
        want = act_backward_torch(gu, dhu, w, layout, VARIANTS[name])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_baseline_activation_kernel_of_a_variant_matches_the_spec(name):
    """comet.kernels.act_forward (the unfused baselines' fused activation; the interpreter
    on a CPU) against comet.activation.gated, with rows and F not multiples of its tile."""
    from comet.kernels.act_forward import gated_rows
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    rows, f = 19, 300
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        gu = (torch.randn(rows, 2 * f, generator=g) * 6).to(dev, dtype)
        want = gated(gu[:, :f].float(), gu[:, f:].float(), VARIANTS[name]).to(dtype)
        got = gated_rows(gu, VARIANTS[name])
        assert got.dtype == dtype and got.shape == (rows, f)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="unit column stride"):
        gated_rows(gu.t())
    assert gated_rows(gu[:0]).shape == (0, f)


@interpreter
def test_fused_backward_of_a_variant_matches_autograd_of_the_spec():
    """W=2 virtual ranks, GPT-OSS's clamped SwiGLU: dx, d weights, dW13, dW2."""
    from comet.runtime.virtual import VirtualEP
    from comet.weights import interleave_gate_up
    cfg, xs, ids, wts, w13, w2, _, _ = _problem(2, GPT_OSS, False, torch.float32)
    g = torch.Generator().manual_seed(5)
    dys = [torch.randn(x.shape, generator=g) for x in xs]
    leaves = [t.clone().requires_grad_() for t in xs + wts + w13 + w2]
    lx, lw, l13, l2 = leaves[:2], leaves[2:4], leaves[4:6], leaves[6:]
    outs = reference.ep_forward(lx, ids, lw, l13, l2, activation=GPT_OSS)
    sum((o * d).sum() for o, d in zip(outs, dys)).backward()
    ep = VirtualEP(cfg, w13, w2)
    for r, (dx, dw, d13, d2) in enumerate(ep.backward(dys, xs, ids, wts)):
        torch.testing.assert_close(dx, lx[r].grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dw, lw[r].grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(d13, interleave_gate_up(l13[r].grad), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(d2, l2[r].grad, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- the module
def _moe_with_biases(seed):
    """A CPU CometMoE (8 experts, H=32, F=48) with GPT-OSS's activation and random biases."""
    from comet.moe import CometMoE
    torch.manual_seed(seed)
    moe = CometMoE(8, 2, 32, 48, dtype=torch.float32, activation=GPT_OSS, expert_bias=True)
    with torch.no_grad():
        moe.experts.b13.normal_()
        moe.experts.b2.normal_()
    return moe


def test_comet_moe_with_biases_and_a_variant_on_one_cpu_rank():
    """CometMoE's CPU path: biases (in the kernels' interleaved layout) and the
    activation reach the reference; training there is plain autograd."""
    from comet.weights import gate_up_first
    moe = _moe_with_biases(seed=0)
    x = torch.randn(10, 32)
    y = moe(x)
    logits, wts, ids = moe.gate(x)
    want = reference.moe_forward(x, ids, wts, gate_up_first(moe.experts.w13), moe.experts.w2,
                                 activation=GPT_OSS, b13=gate_up_first(moe.experts.b13),
                                 b2=moe.experts.b2)
    torch.testing.assert_close(y, want)
    y.sum().backward()
    assert moe.experts.b2.grad is not None and moe.experts.b2.grad.abs().sum() > 0


def test_the_unfused_baseline_runs_variants_and_biases():
    from comet.baseline import ep_moe_forward
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(1, GPT_OSS, True, torch.float32)
    got = ep_moe_forward(xs[0], ids[0], wts[0], w13[0], w2[0], activation=GPT_OSS,
                         b13=b13[0], b2=b2[0])
    want = reference.moe_forward(xs[0], ids[0], wts[0], w13[0], w2[0], activation=GPT_OSS,
                                 b13=b13[0], b2=b2[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
def test_fused_layer_with_biases_checks_them_and_trains_them():
    """FusedMoE (one rank, the interpreter) with biases: wrong biases refused at
    construction; forward and backward (dx, d weights, dW13, dW2, db13, db2) as the
    spec's autograd."""
    from comet.runtime.layer import FusedMoE
    from comet.weights import gate_up_first
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(1, GPT_OSS, True, torch.float32)
    with pytest.raises(ValueError, match="b13"):
        FusedMoE(cfg, w13[0], w2[0], tile=TileConfig.small(), b13=b13[0][:, :8], b2=b2[0])
    with pytest.raises(ValueError, match="expert_bias"):
        FusedMoE(cfg, w13[0], w2[0], tile=TileConfig.small())
    layer = FusedMoE(cfg, w13[0], w2[0], tile=TileConfig.small(), b13=b13[0], b2=b2[0])
    y = layer(xs[0], ids[0], wts[0])
    leaves = [t.clone().requires_grad_() for t in (xs[0], wts[0], w13[0], w2[0], b13[0], b2[0])]
    want = reference.moe_forward(leaves[0], ids[0], leaves[1], leaves[2], leaves[3],
                                 activation=GPT_OSS, b13=leaves[4], b2=leaves[5])
    torch.testing.assert_close(y.float(), want.detach(), rtol=1e-4, atol=1e-4)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    (want * dy).sum().backward()
    got = layer.backward(dy, xs[0], ids[0], wts[0])
    assert len(got) == 6
    dx, dw, d13, d2, db13, db2 = got
    for name, a, b in (("dx", dx, leaves[0].grad), ("dw", dw, leaves[1].grad),
                       ("dW13", gate_up_first(d13), leaves[2].grad), ("dW2", d2, leaves[3].grad),
                       ("db13", gate_up_first(db13), leaves[4].grad), ("db2", db2, leaves[5].grad)):
        torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-4, msg=name)


@interpreter
def test_fused_backward_with_biases_on_virtual_ranks():
    """W=2 virtual ranks with biases: every rank's six gradients as the spec's autograd
    (the biases' routing-weight term crosses ranks with the d weights)."""
    from comet.runtime.virtual import VirtualEP
    from comet.weights import gate_up_first
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(2, GELU_TANH, True, torch.float32, seed=4)
    g = torch.Generator().manual_seed(6)
    dys = [torch.randn(x.shape, generator=g) for x in xs]
    leaves = [t.clone().requires_grad_() for t in xs + wts + w13 + w2 + b13 + b2]
    lx, lw, l13, l2, lb13, lb2 = (leaves[i:i + 2] for i in range(0, 12, 2))
    outs = reference.ep_forward(lx, ids, lw, l13, l2, activation=GELU_TANH, b13_shards=lb13,
                                b2_shards=lb2)
    sum((o * d).sum() for o, d in zip(outs, dys)).backward()
    ep = VirtualEP(cfg, w13, w2, b13_shards=b13, b2_shards=b2)
    for r, (dx, dw, d13, d2, db13, db2) in enumerate(ep.backward(dys, xs, ids, wts)):
        for a, b in ((dx, lx[r].grad), (dw, lw[r].grad), (gate_up_first(d13), l13[r].grad),
                     (d2, l2[r].grad), (gate_up_first(db13), lb13[r].grad), (db2, lb2[r].grad)):
            torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-4)


def test_unfused_backward_with_biases_matches_autograd():
    """comet.baseline_backward with biases (one CPU rank, both W13 layouts)."""
    from comet.baseline_backward import routed_experts_backward
    from comet.weights import interleave_gate_up
    cfg, xs, ids, wts, w13, w2, b13, b2 = _problem(1, CLAMPED_SILU, True, torch.float32, seed=8)
    leaves = [t.clone().requires_grad_() for t in (xs[0], wts[0], w13[0], w2[0], b13[0], b2[0])]
    y = reference.moe_forward(leaves[0], ids[0], leaves[1], leaves[2], leaves[3],
                              activation=CLAMPED_SILU, b13=leaves[4], b2=leaves[5])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * dy).sum().backward()
    want = [t.grad for t in leaves]
    for layout, fix in (("gate_up", lambda t: t), ("interleaved", interleave_gate_up)):
        got = routed_experts_backward(dy, xs[0], ids[0], wts[0], fix(w13[0]), w2[0],
                                      layout=layout, activation=CLAMPED_SILU,
                                      biases=(fix(b13[0]), b2[0]))
        for a, b in zip(got, [want[0], want[1], fix(want[2]), want[3], fix(want[4]), want[5]]):
            torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-4)


def test_training_through_the_op_with_biases():
    """CometMoE's autograd op (what the GPU and multi-rank paths use) gives the biases
    their gradients, as autograd of the reference does."""
    from comet import custom_op
    moe = _moe_with_biases(seed=3)
    x = torch.randn(10, 32)
    _, wts, ids = moe.gate(x)
    wts = wts.detach()
    e = moe.experts
    y = custom_op.routed_experts(x, ids, wts, e.w13, e.w2, moe._op_key, e.b13, e.b2)
    y.sum().backward()
    got = [t.grad.clone() for t in (e.w13, e.w2, e.b13, e.b2)]
    for t in (e.w13, e.w2, e.b13, e.b2):
        t.grad = None
    moe.experts_forward(x, ids, wts).sum().backward()      # one CPU rank: the reference
    for a, t in zip(got, (e.w13, e.w2, e.b13, e.b2)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-4)
