"""Fused kernels on one GPU (marker gpu): W=1 through FusedMoE, W=2/4 through the
virtual-rank driver (the same compiled role kernels, producers launched first)."""

import contextlib
import warnings

import pytest
import torch

from comet import reference
from comet.config import MoEConfig
from comet.runtime.errors import CometTimeoutError
from comet.weights import gate_up_first
from routings import KINDS, make_ids, make_tokens

pytestmark = pytest.mark.gpu

# The benchmark's configs scaled to test size: (E, k, H, F).
SCALED = {
    "mixtral": (8, 2, 512, 768),
    "qwen2-moe": (64, 4, 256, 176),
    "phi3.5-moe": (16, 2, 512, 400),
    "deepseek-v3-like": (32, 8, 448, 128),
}


def _weights(el, h, f, dtype, g):
    w13 = (torch.randn(el, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(dtype)
    w2 = (torch.randn(el, f, h, generator=g, device="cuda") * f ** -0.5).to(dtype)
    return w13, w2


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def _reduce_tile():
    """The default tiles with layer1 as GEMM, then the reduce role (not the scatter)."""
    import dataclasses
    from comet.config import TileConfig
    return TileConfig().with_fields(layer1_scatter=False)


def _fused(name, dtype, max_tokens=384, tile=None):
    from comet.runtime.layer import FusedMoE
    e, k, h, f = SCALED[name]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f, dtype=dtype,
                    max_tokens=max_tokens)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = _weights(e, h, f, dtype, g)
    return FusedMoE(cfg, w13, w2, tile=tile, check_errors="sync"), g


def _inputs(layer, kind, g, tokens=None):
    cfg = layer.cfg
    m = tokens if tokens is not None else make_tokens(kind, 1, cfg.max_tokens,
                                                      torch.Generator().manual_seed(1))[0]
    if kind == "zero_token_rank":
        m = 0
    ids = make_ids(kind if kind != "zero_token_rank" else "random", [m], cfg.num_experts,
                   cfg.top_k, torch.Generator().manual_seed(m))[0].cuda()
    x = torch.randn(m, cfg.hidden_size, generator=g, device="cuda").to(cfg.dtype)
    w = torch.rand(ids.shape, generator=g, device="cuda")
    return x, ids, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(SCALED))
def test_w1_fused_matches_reference_over_block_splits(name, dtype):
    layer, g = _fused(name, dtype)
    x, ids, w = _inputs(layer, "random", g, tokens=300)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=dtype)
    p = layer.programs
    for n_comm in sorted({0, 1, 7, p // 2, p - 1}):
        y = layer(x, ids, w, comm_blocks=n_comm)
        assert _rel_err(y, ref) < 1e-2, (name, dtype, n_comm)


def test_w1_scatter_epilogue_over_token_counts():
    """One rank scattering to itself, the fused kernels and graph replays: the combine
    must sum only this call's live slots (pair_out keeps older calls' rows)."""
    from comet.runtime.layer import FusedMoE
    e, k, h, f = SCALED["deepseek-v3-like"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.bfloat16, max_tokens=384)
    g = torch.Generator(device="cuda").manual_seed(5)
    w13, w2 = _weights(e, h, f, cfg.dtype, g)
    layer = FusedMoE(cfg, w13, w2)
    assert layer.tile.variant.layer1_scatter
    for kind, tokens, drop in (("random", 384, False), ("random", 200, True),
                               ("random", 7, False), ("one_expert", 300, False),
                               ("skewed", 384, True)):
        x, ids, w = _inputs(layer, kind, g, tokens=tokens)
        if drop:        # slots with no expert: their pair_out rows stay from older calls
            ids[::3, 0] = -1
        y = layer(x, ids, w, comm_blocks=(8, 8))
        assert layer.last_comm_blocks == (8, 0)
        ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2,
                                    round_to=cfg.dtype)
        assert _rel_err(y, ref) < 1e-2, (kind, tokens)
    layer.check_errors_now()


@pytest.mark.parametrize("name", ["qwen2-moe", "mixtral"])
def test_a_fused_call_never_synchronises_with_the_host(name):
    """Once compiled and captured (two warm-up calls per token count), a lazy-error call
    issues no host synchronisation at all -- through FusedMoE, and through CometMoE with
    the caller's routing (the expert ids are checked on the device, not read back) and
    with its router: ``torch.cuda.set_sync_debug_mode("error")`` raises on any. (Skipped
    on the CPU: the conftest's gpu marker.)"""
    from comet import CometMoE
    e, k, h, f = SCALED[name]
    layer, g = _fused(name, torch.bfloat16)
    layer.check_errors = "lazy"
    torch.manual_seed(0)
    moe = CometMoE(e, k, h, f, dtype=torch.bfloat16, max_tokens=384, device="cuda")
    calls = [_inputs(layer, "random", g, tokens=m) for m in (1, 16, 300, 0)]

    def run_all():
        outs = []
        for x, ids, w in calls:
            outs += [layer(x, ids, w), moe(x, ids, w), moe(x)]
        return outs

    with torch.inference_mode():
        for _ in range(2):
            want = run_all()
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = run_all()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    layer.check_errors_now()
    moe.fused_layer().check_errors_now()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_w1_routings(kind):
    layer, g = _fused("qwen2-moe", torch.bfloat16)
    x, ids, w = _inputs(layer, kind, g)
    y = layer(x, ids, w)
    if x.shape[0]:
        ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
        assert _rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("variant", ["reduce", "scatter"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCALED))
def test_virtual_ranks_bf16(world, name, variant):
    from comet.config import TileConfig
    from comet.runtime.virtual import VirtualEP
    e, k, h, f = SCALED[name]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.bfloat16, max_tokens=256)
    g = torch.Generator(device="cuda").manual_seed(world)
    shards = [_weights(e // world, h, f, torch.bfloat16, g) for _ in range(world)]
    tile = {"reduce": _reduce_tile(), "scatter": TileConfig()}[variant]
    ep = VirtualEP(cfg, [s[0] for s in shards], [s[1] for s in shards], tile)
    for kind in KINDS:
        cg = torch.Generator().manual_seed(len(kind))
        ids = [i.cuda() for i in make_ids(kind, make_tokens(kind, world, 256, cg), e, k, cg)]
        xs = [torch.randn(i.shape[0], h, generator=g, device="cuda").bfloat16() for i in ids]
        ws = [torch.rand(i.shape, generator=g, device="cuda") for i in ids]
        ys = ep.forward(xs, ids, ws, comm_programs=8, compute_programs=100)
        ref = reference.ep_forward(xs, ids, ws, [s[0] for s in shards], [s[1] for s in shards],
                                   round_to=torch.bfloat16)
        for y, r in zip(ys, ref):
            if r.numel():
                assert _rel_err(y, r) < 1e-2, (name, kind)


def test_no_host_sync_and_cuda_graph_replay():
    layer, g = _fused("mixtral", torch.bfloat16)
    x, ids, w = _inputs(layer, "random", g, tokens=256)
    layer(x, ids, w)                                   # compile outside the checks
    layer.check_errors = "lazy"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
    assert _rel_err(y, ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, ids, w)
        with torch.cuda.graph(graph, stream=stream):
            y_static = layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        x2, ids2, w2 = _inputs(layer, KINDS[seed], torch.Generator(device="cuda").manual_seed(seed),
                               tokens=256)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
        graph.replay()
        ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
        assert _rel_err(y_static, ref) < 1e-2, seed
    layer.check_errors_now()


def test_a_failed_graph_capture_falls_back_to_eager_calls():
    """A capture that fails (here: made to) warns once; that variant's calls then run
    eagerly and stay right, and the call that tried to capture is not lost."""
    from unittest import mock

    import comet.runtime.layer as layer_mod
    layer, g = _fused("mixtral", torch.bfloat16)

    class Broken(torch.cuda.CUDAGraph):
        def capture_begin(self, *args, **kwargs):
            raise RuntimeError("capture invalidated (test)")

    with mock.patch.object(layer_mod.torch.cuda, "CUDAGraph", Broken):
        for call in range(4):
            x, ids, w = _inputs(layer, "random", g, tokens=256)
            if call == 1:
                with pytest.warns(RuntimeWarning, match="capture .* failed"):
                    y = layer(x, ids, w)
            else:
                y = layer(x, ids, w)
            ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2,
                                        round_to=torch.bfloat16)
            assert _rel_err(y, ref) < 1e-2, call
    assert list(layer.graphs._graphs.values()) == [None]
    assert int(layer.ws.epoch) == 4
    layer.check_errors_now()


def _graph_in_a_reference_cycle():
    """Unreachable garbage that only the cyclic collector frees, holding a recorded graph
    (like an earlier layer that nothing refers to any more)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    buf = torch.zeros(16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        buf.add_(1)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    cycle = {"graph": graph, "buf": buf}
    cycle["self"] = cycle


@pytest.mark.parametrize("collector", ["off while recording", "left on"])
def test_garbage_collection_during_a_capture(collector):
    """A collection inside a capture that frees a graph from this thread invalidates the
    capture (destroying a graph is not permitted while capturing): seen at random in the
    GPU suite as a variant running without its graph. Here a collection falls due inside
    the recorded body (threshold 1, then allocations); the layer records with the
    collector off, and "left on" shows the failure that prevents -- after which the
    device's random ops must still work (the failed capture left the default generator
    in capture mode: every later ``torch.rand`` raised)."""
    import gc
    from unittest import mock

    import comet.runtime.forward as forward_mod
    layer, g = _fused("mixtral", torch.bfloat16)
    x, ids, w = _inputs(layer, "random", g, tokens=256)
    layer(x, ids, w)                                   # first call: eager
    plan = forward_mod.launch_layout

    def plan_then_collection_due(*args, **kwargs):
        gc.set_threshold(1)
        _ = [[] for _ in range(8)]                     # container allocations: gen0 is due
        return plan(*args, **kwargs)

    threshold = gc.get_threshold()
    gc.set_threshold(10**6)                            # no collection before the capture
    _graph_in_a_reference_cycle()
    try:
        with contextlib.ExitStack() as stack:
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            stack.enter_context(mock.patch.object(forward_mod, "launch_layout",
                                                  plan_then_collection_due))
            if collector == "left on":
                stack.enter_context(mock.patch.object(gc, "disable", lambda: None))
            y = layer(x, ids, w)                       # second call: captures
    finally:
        gc.set_threshold(*threshold)
    failed = [c for c in caught if "capture" in str(c.message)]
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2,
                                round_to=torch.bfloat16)
    assert _rel_err(y, ref) < 1e-2
    graphs = layer.graphs._graphs
    assert len(graphs) == 1
    if collector == "left on":
        assert failed and list(graphs.values()) == [None]
    else:
        assert not failed and None not in graphs.values()
    torch.rand(1, device="cuda")     # a failed capture must not leave the RNG capturing
    layer.check_errors_now()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph(mode):
    """A CometMoE compiled whole (inductor; with reduce-overhead, inside inductor's own
    CUDA graphs, where the layer records its launches into the user's capture) matches
    eager mode call after call; a compiled training step gives eager mode's gradients."""
    from comet import CometMoE
    e, k, h, f = SCALED["mixtral"]
    torch.manual_seed(0)
    moe = CometMoE(e, k, h, f, dtype=torch.bfloat16, max_tokens=256, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, mode=mode)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for tokens in (256, 256, 100, 256):
            x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
            want = moe(x)
            got = compiled(x).clone()
            assert _rel_err(got, want.float()) < 1e-2, tokens
    moe.fused_layer().check_errors_now()
    x = torch.randn(200, h, generator=g, device="cuda").to(torch.bfloat16)
    grads = []
    for step in (moe, compiled):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        step(xi).float().square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in moe.parameters()])
    for want, got in zip(*grads):
        assert _rel_err(got, want.float()) < 1e-2


def _spec_step(moe, x, dy):
    """Gradients of <dy, moe(x)> by autograd of the spec in fp32, with moe's weights and
    its routing: the logits carry the layer's bf16 values (so the same experts win every
    near tie) and fp32 gradients."""
    gate = moe.gate.weight.detach().float().requires_grad_()
    w13 = gate_up_first(moe.experts.w13.detach()).float().requires_grad_()
    w2 = moe.experts.w2.detach().float().requires_grad_()
    xf = x.detach().float().requires_grad_()
    exact = xf @ gate.t()
    logits = exact + ((x @ moe.gate.weight.detach().t()).float() - exact).detach()
    weights, ids = reference.route(logits, moe.cfg, None)
    y = reference.moe_forward(xf, ids, weights, w13, w2)
    (y * dy.float()).sum().backward()
    return xf.grad, gate.grad, w13.grad, w2.grad


def test_unfused_baseline_is_differentiable_on_the_gpu():
    """comet.baseline.ep_moe_forward runs its activation as one Triton pass on a GPU; where
    autograd records the expert rows (train_step.py's torch reference) it runs torch's
    ops instead, so every input gets the gradient autograd of the fp32 spec gives
    (within bf16); without autograd the Triton pass gives the spec's output."""
    from comet.baseline import ep_moe_forward
    e, k, h, f = SCALED["mixtral"]
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(64, h, generator=g, device="cuda")
    ids = torch.randint(0, e, (64, k), generator=g, device="cuda")
    wts = torch.rand(64, k, generator=g, device="cuda")
    w13 = torch.randn(e, h, 2 * f, generator=g, device="cuda") * h ** -0.5
    w2 = torch.randn(e, f, h, generator=g, device="cuda") * f ** -0.5
    dy = torch.randn(64, h, generator=g, device="cuda")
    inputs = [x.bfloat16(), wts, w13.bfloat16(), w2.bfloat16()]
    leaves = [t.clone().requires_grad_() for t in inputs]
    (ep_moe_forward(leaves[0], ids, *leaves[1:]).float() * dy).sum().backward()
    spec = [t.float().requires_grad_() for t in inputs]
    (reference.moe_forward(spec[0], ids, *spec[1:]) * dy).sum().backward()
    for got, want in zip(leaves, spec):
        assert got.grad is not None and _rel_err(got.grad, want.grad) < 2e-2
    with torch.no_grad():
        y = ep_moe_forward(*inputs[:1], ids, *inputs[1:])
    assert _rel_err(y, reference.moe_forward(*spec[:1], ids, *spec[1:])) < 1e-2


@pytest.mark.parametrize("name", list(SCALED))
def test_training_step_matches_autograd_of_the_spec(name):
    """A CometMoE on the GPU trains: the fused forward, then the backward, give x, the
    router and the experts the gradients autograd of the fp32 spec gives (within bf16);
    the next inference call is still right."""
    from comet import CometMoE
    e, k, h, f = SCALED[name]
    torch.manual_seed(0)
    moe = CometMoE(e, k, h, f, dtype=torch.bfloat16, max_tokens=512, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    for tokens in (512, 37, 0):
        moe.zero_grad()
        x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
        dy = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y.float() * dy.float()).sum().backward()
        if tokens == 0:
            assert xi.grad.shape == x.shape and not moe.experts.w2.grad.any()
            continue
        dx, dgate, d13, d2 = _spec_step(moe, x, dy)
        assert _rel_err(xi.grad, dx) < 2e-2, (name, tokens)
        assert _rel_err(moe.gate.weight.grad, dgate) < 3e-2, (name, tokens)
        assert _rel_err(gate_up_first(moe.experts.w13.grad), d13) < 2e-2, (name, tokens)
        assert _rel_err(moe.experts.w2.grad, d2) < 2e-2, (name, tokens)
    with torch.no_grad():
        x = torch.randn(300, h, generator=g, device="cuda").to(torch.bfloat16)
        logits, w, ids = moe.gate(x)
        ref = reference.moe_forward(x, ids, w, gate_up_first(moe.experts.w13), moe.experts.w2,
                                    round_to=torch.bfloat16)
        assert _rel_err(moe(x), ref) < 1e-2
    moe.fused_layer().check_errors_now()


def test_backward_graph_replays_keep_every_calls_gradients():
    """FusedMoE.backward back to back (W=1): the variant's device-only segments are
    captured on its second call and replayed after; every call's gradients -- taken
    after all calls ran, so a replay that wrote into an earlier call's tensors would
    show -- match autograd of the fp32 spec, for changing token counts."""
    layer, g = _fused("qwen2-moe", torch.bfloat16)
    w13, w2 = gate_up_first(layer.w13).float(), layer.w2.float()
    calls = []
    for tokens in (200, 384, 17, 0, 256, 1):
        x, ids, w = _inputs(layer, "random", g, tokens=tokens)
        dy = torch.randn(tokens, layer.cfg.hidden_size, generator=g, device="cuda").to(x.dtype)
        layer(x, ids, w)
        calls.append((x, ids, w, dy, layer.backward(dy, x, ids, w, comm_blocks=(1, 1))))
    layer.check_errors_now()
    assert isinstance(layer.graphs._graphs[("backward", True, True)], list)
    for x, ids, w, dy, got in calls:
        f13, f2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
        fx, fw = x.float().requires_grad_(), w.clone().requires_grad_()
        loss = (f13.sum() + f2.sum()) * 0      # a graph even with no tokens
        (loss + (reference.moe_forward(fx, ids, fw, f13, f2) * dy.float()).sum()).backward()
        dx, dw, d13, d2 = got
        m = x.shape[0]
        if m:
            assert _rel_err(dx, fx.grad) < 2e-2, m
            assert _rel_err(dw, fw.grad) < 2e-2, m
        assert dx.shape == x.shape and dw.shape == w.shape
        assert _rel_err(gate_up_first(d13), f13.grad) < 2e-2 if m else not d13.any()
        assert _rel_err(d2, f2.grad) < 2e-2 if m else not d2.any()


def test_thousand_back_to_back_calls():
    layer, g = _fused("phi3.5-moe", torch.bfloat16, max_tokens=128)
    layer.check_errors = "lazy"
    calls = []
    for i in range(1000):
        x, ids, w = _inputs(layer, KINDS[i % len(KINDS)], g, tokens=int(torch.randint(0, 129, ())))
        calls.append((x, ids, w, layer(x, ids, w)))
        if len(calls) > 50:      # check a window without draining the queue
            calls.pop(0)
    layer.check_errors_now()
    for x, ids, w, y in calls:
        if x.shape[0]:
            ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
            assert _rel_err(y, ref) < 1e-2
    assert int(layer.ws.epoch) == 1000


def test_scalar_staging_survives_a_full_ring():
    # The GPU sleeps while the host makes more calls than the pinned ring of staged
    # scalars holds: calls past the ring stage with device fills; every output, with its
    # own token count and input address, must still be right.
    layer, g = _fused("qwen2-moe", torch.bfloat16, max_tokens=128)
    x, ids, w = _inputs(layer, "random", g, tokens=64)
    layer(x, ids, w)
    torch.cuda.synchronize()
    inputs = [_inputs(layer, KINDS[i % len(KINDS)], g, tokens=1 + i % 128)
              for i in range(3 * layer._static.RING)]
    torch.cuda._sleep(1_000_000_000)
    outputs = [layer(*args) for args in inputs]
    layer.check_errors_now()
    for (x, ids, w), y in zip(inputs, outputs):
        ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
        assert _rel_err(y, ref) < 1e-2


def test_calls_on_alternating_streams_run_in_order():
    # A layer's calls share its workspace: a call made on another stream than the last
    # one waits for it (the staged scalars' ring does), so outputs stay right while the
    # GPU lags far behind the host (a sleep at the head of the first stream).
    layer, g = _fused("qwen2-moe", torch.bfloat16, max_tokens=128)
    x, ids, w = _inputs(layer, "random", g, tokens=64)
    layer(x, ids, w)
    layer(x, ids, w)                               # compiled and captured
    inputs = [_inputs(layer, KINDS[i % len(KINDS)], g, tokens=1 + (7 * i) % 128)
              for i in range(96)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outputs = []
    for i, args in enumerate(inputs):
        with torch.cuda.stream(streams[i % 2]):
            if i == 0:
                torch.cuda._sleep(200_000_000)
            outputs.append(layer(*args))
    torch.cuda.synchronize()
    layer.check_errors_now()
    for (x, ids, w), y in zip(inputs, outputs):
        ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2,
                                    round_to=torch.bfloat16)
        assert _rel_err(y, ref) < 1e-2


def test_bad_inputs_raise_before_launch_and_leave_the_layer_usable():
    layer, g = _fused("mixtral", torch.bfloat16, max_tokens=64)
    x, ids, w = _inputs(layer, "random", g, tokens=32)
    bad = [
        (x.float(), ids, w, TypeError),
        (x[:, :-16].contiguous(), ids, w, ValueError),
        (x.cpu(), ids, w, ValueError),
        (x.t().contiguous().t(), ids, w, ValueError),
        (torch.cat([x, x, x]), torch.cat([ids] * 3), torch.cat([w] * 3), ValueError),
        (x, ids[:, :1], w, ValueError),
    ]
    epoch = int(layer.ws.epoch)
    for args in bad:
        with pytest.raises(args[3]):
            layer(*args[:3])
    assert int(layer.ws.epoch) == epoch, "a rejected call must not touch the workspace"
    y = layer(x, ids, w)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.bfloat16)
    assert _rel_err(y, ref) < 1e-2


def test_missing_peer_times_out_quickly(monkeypatch):
    """Virtual rank 1 never runs: rank 0 raises within seconds instead of hanging."""
    import time
    from comet.config import TileConfig
    from comet.kernels import exchange
    from comet.kernels.plan import Routing, launch_counts
    from comet.runtime.errors import raise_if_failed
    from comet.runtime.virtual import VirtualEP
    monkeypatch.setenv("COMET_TIMEOUT_S", "1")
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.bfloat16, max_tokens=64)
    g = torch.Generator(device="cuda").manual_seed(0)
    shards = [_weights(4, h, f, torch.bfloat16, g) for _ in range(2)]
    ep = VirtualEP(cfg, [s[0] for s in shards], [s[1] for s in shards], TileConfig())
    ws = ep.ws[0]
    ws.begin_call()
    start = time.time()
    ids = torch.tensor([[0, 5]], device="cuda")
    launch_counts(ws.plan, Routing.of(ids, torch.ones(ids.shape, device="cuda")),
                  ws.input_word, ws.sync, ws.shape, ws.exchange(in_plan=False))
    exchange.launch_exchange(ws.plan.block_counts[-1], ws.exchange(in_plan=False),
                             ws.sync, ws.shape)
    torch.cuda.synchronize()
    with pytest.raises(CometTimeoutError, match="rank 1"):
        raise_if_failed(ws.fatal_word, 0)
    assert time.time() - start < 10


def test_timeline_records_both_roles():
    from comet.bench.trace import phase_budget, record_timeline
    layer, g = _fused("mixtral", torch.bfloat16, tile=_reduce_tile())
    x, ids, w = _inputs(layer, "random", g, tokens=256)
    layer(x, ids, w)
    records = record_timeline(layer, x, ids, w, comm_blocks=4)
    roles = {(r["layer"], r["role"]) for r in records}
    assert roles == {("layer0", "comm"), ("layer0", "compute"), ("layer1", "comm"),
                     ("layer1", "compute")}
    assert all(r["end_ns"] >= r["start_ns"] >= 0 for r in records)
    pushes = {r["block"] for r in records if (r["layer"], r["role"]) == ("layer0", "comm")}
    assert pushes <= set(range(4)), "only the comm blocks push"
    # layer1 with no comm block (the tables' usual choice) is traced as it runs: every
    # block's GEMM tiles come before its reduce items.
    records = record_timeline(layer, x, ids, w, comm_blocks=(4, 0))
    assert list(layer.last_comm_blocks) == [4, 0]
    for block in range(layer.programs):
        kinds = [r["role"] for r in records if r["layer"] == "layer1" and r["block"] == block]
        assert kinds == sorted(kinds, key=lambda k: k == "comm"), f"block {block}: {kinds}"
    assert {r["role"] for r in records if r["layer"] == "layer1"} == {"comm", "compute"}
    # The default layer1 scatters from its epilogue: no comm role at all. Timed, the
    # call's phases come back, each layer's no shorter than its units' stamped span.
    # Every program records its run, which holds its units.
    layer, g = _fused("mixtral", torch.bfloat16)
    phases, programs = {}, []
    records = record_timeline(layer, x, ids, w, comm_blocks=4, phases=phases,
                              programs=programs)
    assert {r["role"] for r in records if r["layer"] == "layer1"} == {"compute"}
    assert set(phases) == {"plan", "layer0", "layer1", "combine"}
    assert sorted((p["layer"], p["block"]) for p in programs) == sorted(
        (name, b) for name in ("layer0", "layer1") for b in range(layer.programs))
    run = {(p["layer"], p["block"]): p for p in programs}
    for r in records:
        p = run[r["layer"], r["block"]]
        assert p["start_ns"] <= r["start_ns"] <= r["end_ns"] <= p["end_ns"], (p, r)
    budget = phase_budget(phases, records, programs)
    for name in ("layer0", "layer1"):
        assert budget[f"{name}_units"] > 0 and budget[f"{name}_setup"] >= 0, budget
        assert budget[f"{name}_drain"] >= 0 and budget[f"{name}_outside"] > -2, budget


def test_blocks_change_role_at_full_size():
    """Full Mixtral layer, 2048 tokens, layer1 with the reduce role: the 16 comm blocks
    finish pushing long before the GEMM ends and take tiles from the queue; GEMM blocks
    out of tiles take reduce items;
    layer1's comm blocks run split 0's tiles with everyone, none of the later splits'."""
    from comet.bench.trace import record_timeline
    from comet.config import PRESETS
    from comet.runtime.layer import FusedMoE
    cfg = PRESETS["mixtral"].replace(max_tokens=2048)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = _weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, g)
    layer = FusedMoE(cfg, w13, w2, tile=_reduce_tile(), check_errors="sync")
    x, ids, w = _inputs(layer, "random", g, tokens=2048)
    records = record_timeline(layer, x, ids, w, comm_blocks=(16, 16))
    comm = set(range(16))
    tiles0 = {r["block"] for r in records if (r["layer"], r["role"]) == ("layer0", "compute")}
    assert tiles0 & comm, "no comm block joined the layer0 GEMM"
    reducers = {r["block"] for r in records if (r["layer"], r["role"]) == ("layer1", "comm")}
    assert reducers - comm, "no GEMM block joined the layer1 reduce"
    tiles1 = [r for r in records if (r["layer"], r["role"]) == ("layer1", "compute")]
    assert {r["block"] for r in tiles1 if r["what"] == "tile of split 0"} >= comm
    assert not [r for r in tiles1 if r["block"] in comm and r["what"] != "tile of split 0"]
    y = layer(x, ids, w)
    ref = reference.moe_forward(x, ids, w, w13, w2, round_to=cfg.dtype)
    assert _rel_err(y, ref) < 2e-2


def test_decode_tile_at_full_size_alternating_with_the_default():
    """One EP=4 rank of Mixtral (2 experts, full size) on one GPU: at 128 tokens layer1 has
    2 experts x 1 m-tile x 16 column blocks = 32 items, far fewer than SMs, and runs on
    the decode tile's 128-column blocks; at 2048 tokens on the default 256. Alternating
    them replays two graphs."""
    from comet.config import preset
    from comet.runtime.layer import FusedMoE
    cfg = preset("mixtral", num_experts=2, max_tokens=2048)
    g = torch.Generator(device="cuda").manual_seed(3)
    w13, w2 = _weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, g)
    layer = FusedMoE(cfg, w13, w2)
    small, large = (_inputs(layer, "random", g, tokens=t) for t in (128, 2048))
    refs = [reference.moe_forward(*inp, gate_up_first(layer.w13), layer.w2,
                                  round_to=cfg.dtype) for inp in (small, large)]
    for _ in range(3):
        for inp, ref, block_n1 in ((small, refs[0], 128), (large, refs[1], 256)):
            y = layer(*inp)
            assert layer.last_tile.gemm.block_n1 == block_n1
            assert _rel_err(y, ref) < 1e-2, block_n1
    layer.check_errors_now()


def test_tile_fields_change_the_order_not_the_result():
    """The per-call tile fields (layer0's group of m-tiles, the local head) reorder work
    only: calls alternating between them and the layer's own give the same output bit
    for bit, each variant replayed from its own graph. One EP=2 rank of Mixtral (4
    experts, 16 m-tiles each at 2048 tokens: more than one group of 8)."""
    from comet.config import preset
    from comet.runtime.layer import FusedMoE
    cfg = preset("mixtral", num_experts=4, max_tokens=2048)
    g = torch.Generator(device="cuda").manual_seed(7)
    w13, w2 = _weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, g)
    layer = FusedMoE(cfg, w13, w2)
    x, ids, w = _inputs(layer, "random", g, tokens=2048)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2,
                                round_to=cfg.dtype)
    y0 = layer(x, ids, w, tile_overrides={})
    assert _rel_err(y0, ref) < 1e-2
    for _ in range(3):
        for overrides in ({"group_m": 16}, {"local_head_tiles": 0},
                          {"group_m": 3, "local_head_tiles": 5}, {}):
            y = layer(x, ids, w, tile_overrides=overrides)
            assert layer.last_tile_overrides == overrides
            assert torch.equal(y, y0), overrides
    layer.check_errors_now()


def test_live_row_loads_give_the_same_output_bit_for_bit():
    """A gathered layer0 loading only its tiles' own A rows in small calls
    (``layer0_live_rows``: the other rows are zeros) computes what the unmasked loads
    do, bit for bit -- an output row depends on its own A row only -- over 200
    back-to-back calls of 0 to 512 tokens with no host sync between them (the masks in
    calls of up to 256 tokens, stream-K at 1; graph replays). Qwen2-MoE on one GPU at
    full size (64 experts, top-4: it gathers there), the first call checked against the
    reference. On one rank every row is its own, read in place from the input
    (``layer0_own_in_place``, the default) -- and the same bits again when the dispatch
    copies them (calls smaller than earlier ones leave index entries past their tokens)."""
    import dataclasses
    from comet.config import preset
    from comet.runtime.layer import FusedMoE
    cfg = preset("qwen2-moe", max_tokens=512)
    g = torch.Generator(device="cuda").manual_seed(13)
    w13, w2 = _weights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, g)
    live = FusedMoE(cfg, w13, w2)
    full = FusedMoE(cfg, w13, w2, tile=live.tile.with_fields(layer0_live_rows=False))
    copied = FusedMoE(cfg, w13, w2,
                      tile=live.tile.with_fields(layer0_own_in_place=False))
    assert live.tile.variant.layer0_gather and live.tile.variant.layer0_own_in_place
    assert live.selection.may_live_rows
    assert live.selection.tile_for(256).variant.layer0_live_rows
    assert not live.selection.tile_for(257).variant.layer0_live_rows
    assert not full.selection.tile_for(1).variant.layer0_live_rows
    live.check_errors = full.check_errors = copied.check_errors = "lazy"
    sizes = torch.randint(0, 513, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    sizes[:4] = [16, 1, 0, 512]
    outs = []
    for m in sizes:
        x, ids, w = _inputs(live, "random", g, tokens=m)
        outs.append((live(x, ids, w), full(x, ids, w), copied(x, ids, w)))
        if len(outs) == 1:
            ref = reference.moe_forward(x, ids, w, gate_up_first(live.w13), live.w2,
                                        round_to=cfg.dtype)
    for layer in (live, full, copied):
        layer.check_errors_now()
    assert _rel_err(outs[0][0], ref) < 1e-2
    for i, (a, b, c) in enumerate(outs):
        assert torch.equal(a, b) and torch.equal(a, c), (i, sizes[i])


def test_private_streams_are_never_shared_while_alive():
    """Live private streams are distinct, none is one of torch's pool, and work runs on
    them."""
    from comet.runtime.streams import PrivateStream
    device = torch.device("cuda", torch.cuda.current_device())
    pool = {torch.cuda.Stream().cuda_stream for _ in range(32)}
    live = [PrivateStream(device) for _ in range(40)]
    handles = [s.cuda_stream for s in live]
    assert len(set(handles)) == len(handles) and not set(handles) & pool
    x = torch.ones(1024, device=device)
    with torch.cuda.stream(live[-1]):
        y = x * 2
    torch.cuda.synchronize()
    assert y.sum().item() == 2048


def test_private_stream_is_destroyed_with_its_object(monkeypatch):
    """Dropping the last reference destroys the handle, once (a weak-reference finalizer
    never fired for torch's stream objects)."""
    import gc
    from comet.runtime import topology
    from comet.runtime.streams import PrivateStream
    rt = topology.cuda_runtime()
    destroyed, destroy = [], rt.cudaStreamDestroy
    monkeypatch.setattr(rt, "cudaStreamDestroy",
                        lambda h: (destroyed.append(int(h)), destroy(h))[1])
    s = PrivateStream(torch.device("cuda", torch.cuda.current_device()))
    handle = s.cuda_stream
    del s
    gc.collect()
    assert destroyed == [handle]


def test_private_stream_dropped_during_a_capture_is_destroyed_after_it(monkeypatch):
    """A stream dropped while a graph is being captured is not destroyed inside the
    capture (which it could invalidate) but at the next stream's creation."""
    from comet.runtime import topology
    from comet.runtime.streams import PrivateStream
    rt = topology.cuda_runtime()
    destroyed, destroy = [], rt.cudaStreamDestroy
    monkeypatch.setattr(rt, "cudaStreamDestroy",
                        lambda h: (destroyed.append(int(h)), destroy(h))[1])
    dev = torch.device("cuda", torch.cuda.current_device())
    doomed = PrivateStream(dev)
    handle = doomed.cuda_stream
    x = torch.ones(16, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        del doomed
    assert destroyed == []
    graph.replay()
    torch.cuda.synchronize()
    assert y.sum().item() == 32
    _kept = PrivateStream(dev)      # alive while asserting: its own drop would destroy it
    assert destroyed == [handle]


def test_a_pytest_process_that_made_private_streams_exits_cleanly(tmp_path):
    """A pytest process that made, used and dropped private streams (and keeps some alive
    to the end) exits 0: with a weakref.finalize on each stream it segfaulted at exit
    (benchmarks/results/2026-11-25/h100-exit-probe.log)."""
    import os
    import pathlib
    import subprocess
    import sys
    import textwrap
    (tmp_path / "test_streams_at_exit.py").write_text(textwrap.dedent("""
        import gc

        import torch

        from comet.runtime.streams import PrivateStream

        KEPT = []


        def test_make_use_and_drop():
            dev = torch.device("cuda", 0)
            live = [PrivateStream(dev) for _ in range(40)]
            with torch.cuda.stream(live[-1]):
                y = torch.ones(1024, device=dev) * 2
            torch.cuda.synchronize()
            assert y.sum().item() == 2048
            del live
            gc.collect()
            KEPT.extend(PrivateStream(dev) for _ in range(4))
    """))
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_streams_at_exit.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])


