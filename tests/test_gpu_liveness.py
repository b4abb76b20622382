"""Liveness on one GPU (marker gpu): W virtual ranks' *fused* calls run concurrently, one
stream per rank, so a fast rank's call N + 1 overlaps a slow rank's call N the way it does
on W GPUs -- at full model sizes, with random device-side delays -- and failures (a rank
that stalls, skips a call, or passes bad routing) become exceptions, never hangs.

The virtual-rank driver of test_gpu.py runs ranks phase by phase and cannot show any of
this; scripts/device/stress.sh does the same on real GPUs.
"""

import random
import time

import pytest
import torch

from comet import reference
from comet.activation import SILU, GatedActivation
from comet.config import PRESETS, MoEConfig
from comet.runtime.errors import CometError, CometInputError, CometTimeoutError
from routings import make_ids

pytestmark = pytest.mark.gpu

#: Drift: spins of up to this many SM cycles (~0.5 ms) before some calls of some ranks.
MAX_DELAY_CYCLES = 1_000_000


def _group(name, world, max_tokens, **kwargs):
    from comet.runtime.virtual import virtual_group
    cfg = (PRESETS.get(name) or VARIANT_MODELS[name]).replace(max_tokens=max_tokens)
    g = torch.Generator(device="cuda").manual_seed(world)
    el = cfg.num_experts // world
    h, f = cfg.hidden_size, cfg.intermediate_size
    w13 = [(torch.randn(el, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(cfg.dtype)
           for _ in range(world)]
    w2 = [(torch.randn(el, f, h, generator=g, device="cuda") * f ** -0.5).to(cfg.dtype)
          for _ in range(world)]
    if cfg.expert_bias:
        kwargs["b13_shards"] = [torch.randn(el, 2 * f, generator=g, device="cuda").to(cfg.dtype)
                                for _ in range(world)]
        kwargs["b2_shards"] = [(torch.randn(el, h, generator=g, device="cuda") * 0.1).to(
            cfg.dtype) for _ in range(world)]
    layers = virtual_group(cfg, w13, w2, **kwargs)
    return cfg, layers, w13, w2


def _inputs(cfg, world, kind, tokens, seed):
    cg = torch.Generator().manual_seed(seed)
    ids = [i.cuda() for i in make_ids(kind, tokens, cfg.num_experts, cfg.top_k, cg)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(m, cfg.hidden_size, generator=g, device="cuda").to(cfg.dtype)
          for m in tokens]
    ws = [torch.softmax(torch.randn(m, cfg.top_k, generator=g, device="cuda"), -1)
          for m in tokens]
    return xs, ids, ws


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item() if ref.numel() else 0.0


def _streams(world):
    return [torch.cuda.Stream() for _ in range(world)]


#: Full-size layers of the expert variants (comet.activation, expert biases): GPT-OSS-20B
#: (clamped SwiGLU, biases; F = 2880 is not a multiple of the 128-column interleave
#: block), a Phi-3.5-MoE-sized layer with Gemma's GELU-tanh, a GLM-4.5-Air-sized one with
#: DeepSeek-V4's clamped SiLU.
VARIANT_MODELS = {
    "gpt-oss-20b": MoEConfig(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880,
                             activation=GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0),
                             expert_bias=True),
    "phi3.5-size-gelu": PRESETS["phi3.5-moe"].replace(
        activation=GatedActivation(kind="gelu_tanh")),
    "glm-4.5-air-size-clamped": MoEConfig(num_experts=128, top_k=8, hidden_size=4096,
                                          intermediate_size=1408,
                                          activation=GatedActivation(limit=7.0)),
}
VARIANT_MODELS["gpt-oss-20b-no-bias"] = VARIANT_MODELS["gpt-oss-20b"].replace(expert_bias=False)


def _biases(layers, world):
    """The gate-up-first (b13, b2) shards of a group built with expert biases."""
    from comet.weights import gate_up_first
    if layers[0].b13 is None:
        return {}
    return {"b13_shards": [gate_up_first(lay.b13) for lay in layers],
            "b2_shards": [lay.b2 for lay in layers]}


@pytest.mark.parametrize("name, variant", [
    ("gpt-oss-20b", "scatter"), ("gpt-oss-20b", "reduce"), ("phi3.5-size-gelu", "scatter"),
    ("glm-4.5-air-size-clamped", "scatter")])
def test_drift_expert_variants_full_size(name, variant):
    """The expert variants' epilogues at full layer sizes and thousands of tokens per rank:
    W=2 virtual ranks, 40 back-to-back calls drifting apart, every output checked against
    the spec with the same activation and biases."""
    import dataclasses
    from comet.config import TileConfig
    from comet.runtime.virtual import concurrent_forward
    world, max_tokens = 2, 4096
    cfg, layers, w13, w2 = _group(name, world, max_tokens,
                                  tile=TileConfig().with_fields(**VARIANTS[variant]))
    p = layers[0].programs
    splits = [None, (2, max(1, p // 10)), (min(16, p - 1),) * 2]
    kinds = ["random", "skewed", "one_expert"]
    rng = random.Random(7)
    streams = _streams(world)
    worst = 0.0
    t0 = time.time()
    for i in range(40):
        tokens = [rng.choice([rng.randint(0, 64), rng.randint(2048, max_tokens)])
                  for _ in range(world)]
        xs, ids, ws = _inputs(cfg, world, kinds[i % len(kinds)], tokens, seed=i)
        torch.cuda.synchronize()
        delays = [rng.choice([0, rng.randint(1, MAX_DELAY_CYCLES)]) for _ in range(world)]
        ys = concurrent_forward(layers, xs, ids, ws, streams,
                                comm_blocks=splits[i % len(splits)], delay_cycles=delays)
        torch.cuda.synchronize()
        ref = reference.ep_forward(xs, ids, ws, w13, w2, round_to=cfg.dtype,
                                   activation=cfg.activation, **_biases(layers, world))
        worst = max([worst] + [_rel_err(y, r) for y, r in zip(ys, ref)])
    for layer in layers:
        layer.check_errors_now()
    print(f"{name} {variant} W={world}: 40 concurrent calls of up to {max_tokens} tokens in "
          f"{time.time() - t0:.1f}s, worst rel err {worst:.2e}")
    assert worst < 2e-2


@pytest.mark.parametrize("name", ["gpt-oss-20b-no-bias", "gpt-oss-20b"])
def test_backward_of_a_variant_full_size(name):
    """Training rounds of GPT-OSS-20B's layer (its clamped SwiGLU, and its biases, through
    the fused backward), W=2 virtual ranks drifting apart, against fp32 autograd."""
    from comet.runtime.virtual import concurrent_backward, concurrent_forward
    from comet.weights import gate_up_first
    world, max_tokens = 2, 2048
    cfg, layers, w13, w2 = _group(name, world, max_tokens, backward=True)
    biases = _biases(layers, world)
    spec_biases = (biases["b13_shards"], biases["b2_shards"]) if biases else None
    rng = random.Random(3)
    streams = _streams(world)
    worst = {"dx": 0.0, "dw": 0.0, "dw13": 0.0, "dw2": 0.0}
    for i in range(6):
        tokens = [rng.randint(0, max_tokens) for _ in range(world)]
        xs, ids, ws = _inputs(cfg, world, "random", tokens, seed=i)
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        dys = [torch.randn(m, cfg.hidden_size, generator=g, device="cuda").to(cfg.dtype)
               for m in tokens]
        torch.cuda.synchronize()
        delays = [rng.choice([0, rng.randint(1, MAX_DELAY_CYCLES)]) for _ in range(world)]
        concurrent_forward(layers, xs, ids, ws, streams, delay_cycles=delays)
        grads = concurrent_backward(layers, dys, xs, ids, ws, streams, delay_cycles=delays[::-1])
        torch.cuda.synchronize()
        want = _spec_grads(xs, ids, ws, dys, w13, w2, cfg.activation, spec_biases)
        for r, got in enumerate(grads):
            for j, key in enumerate(("dx", "dw", "dw13", "dw2", "db13", "db2")[:len(got)]):
                g = gate_up_first(got[j]) if key in ("dw13", "db13") else got[j]
                worst[key] = max(worst.get(key, 0.0), _rel_err(g, want[j][r]))
    for layer in layers:
        layer.check_errors_now()
    print(f"{name} W={world}: 6 training rounds, worst rel err {worst}")
    assert max(worst.values()) < 2e-2, worst


#: Tile variants of the drift test: the default (layer1's scatter epilogue), layer1's
#: reduce role.
VARIANTS = {"scatter": {}, "reduce": {"layer1_scatter": False}}


@pytest.mark.parametrize("name, world, variant", [
    ("mixtral", 4, "scatter"), ("mixtral", 2, "scatter"), ("qwen2-moe", 4, "scatter"),
    ("phi3.5-moe", 4, "scatter"), ("deepseek-v3-like", 4, "scatter"),
    ("mixtral", 2, "reduce"), ("qwen2-moe", 4, "reduce"), ("deepseek-v3-like", 4, "reduce")])
def test_drift_concurrent_virtual_ranks_full_size(name, world, variant):
    """220 back-to-back calls, full hidden sizes, ranks drifting apart; every output checked.
    ``scatter`` (the default): layer1's epilogue writes into peers' pair_out while a fast
    peer may already be in its next call; ``reduce``: layer1's reduce role, whose comm
    blocks write into peers' comb."""
    import dataclasses
    from comet.config import TileConfig
    from comet.runtime.virtual import concurrent_forward
    max_tokens = 384
    cfg, layers, w13, w2 = _group(name, world, max_tokens,
                                  tile=TileConfig().with_fields(**VARIANTS[variant]))
    p = layers[0].programs
    splits = [None, (1, 1), (2, max(1, p // 10)), (min(16, p - 1),) * 2, (p // 2, p // 2)]
    kinds = ["random", "skewed", "one_expert"]
    rng = random.Random(world)
    calls = []
    for i in range(220):
        tokens = [rng.randint(0, max_tokens) for _ in range(world)]
        calls.append(_inputs(cfg, world, kinds[i % len(kinds)], tokens, seed=i))
    torch.cuda.synchronize()
    streams = _streams(world)
    outputs = []
    t0 = time.time()
    for i, (xs, ids, ws) in enumerate(calls):
        delays = [rng.choice([0, 0, rng.randint(1, MAX_DELAY_CYCLES)]) for _ in range(world)]
        outputs.append(concurrent_forward(layers, xs, ids, ws, streams,
                                          comm_blocks=splits[i % len(splits)],
                                          delay_cycles=delays))
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    for layer in layers:
        layer.check_errors_now()
    worst = 0.0
    for (xs, ids, ws), ys in zip(calls, outputs):
        ref = reference.ep_forward(xs, ids, ws, w13, w2, round_to=cfg.dtype)
        for y, r in zip(ys, ref):
            worst = max(worst, _rel_err(y, r))
    print(f"{name} W={world} {variant}: 220 concurrent calls in {elapsed:.1f}s, "
          f"worst rel err {worst:.2e}")
    assert worst < 2e-2
    assert all(int(layer.ws.epoch) == 220 for layer in layers)


@pytest.mark.parametrize("name, split_k", [("mixtral", 2), ("phi3.5-moe", 4),
                                           ("qwen2-moe", 2)])
def test_split_k_small_calls_full_size(name, split_k):
    """``layer1_split_k`` on one rank with the whole GPU (virtual ranks share its SMs, too
    few for K splits at full size): 200 back-to-back calls of 0-4 tokens at full size,
    different routings, every output checked; a 1-token call runs layer1 in K splits."""
    import dataclasses
    from comet.config import TileConfig
    from comet.runtime.layer import FusedMoE
    cfg = PRESETS[name].replace(max_tokens=8)
    g = torch.Generator(device="cuda").manual_seed(split_k)
    h, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    w13 = (torch.randn(e, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(cfg.dtype)
    w2 = (torch.randn(e, f, h, generator=g, device="cuda") * f ** -0.5).to(cfg.dtype)
    layer = FusedMoE(cfg, w13, w2, tile=TileConfig().with_fields(layer1_split_k=split_k))
    rng = random.Random(split_k)
    kinds = ["random", "skewed", "one_expert"]
    calls = [_inputs(cfg, 1, kinds[i % 3], [rng.randint(0, 4)], seed=i) for i in range(200)]
    outputs = [layer(xs[0], ids[0], ws[0]) for xs, ids, ws in calls]
    layer.check_errors_now()
    worst = max(_rel_err(y, reference.moe_forward(xs[0], ids[0], ws[0], w13, w2,
                                                  round_to=cfg.dtype))
                for (xs, ids, ws), y in zip(calls, outputs))
    xs, ids, ws = _inputs(cfg, 1, "random", [1], seed=1000)
    y = layer(xs[0], ids[0], ws[0])
    torch.cuda.synchronize()
    splits = int(layer.ws.count.arrived.max())
    print(f"{name} split_k={split_k}: 200 calls, worst rel err {worst:.2e}; a 1-token "
          f"call ran layer1 in {splits} K splits")
    assert worst < 2e-2 and 2 <= splits <= split_k
    assert _rel_err(y, reference.moe_forward(xs[0], ids[0], ws[0], w13, w2,
                                             round_to=cfg.dtype)) < 2e-2


@pytest.mark.parametrize("name, tp, ep, convention, variant", [
    ("mixtral", 4, 1, "sequence", "scatter"), ("mixtral", 4, 1, "replicated", "scatter"),
    ("phi3.5-moe", 2, 2, "sequence", "scatter"), ("qwen2-moe", 2, 2, "replicated", "scatter"),
    ("qwen2-moe", 2, 2, "sequence", "reduce"), ("mixtral", 2, 2, "replicated", "reduce")],
    ids=lambda v: str(v))
def test_tensor_parallel_and_hybrid_drift_concurrent_virtual_ranks_full_size(
        name, tp, ep, convention, variant):
    """(tp, ep) layouts on W = tp * ep virtual ranks at full preset sizes: 200
    back-to-back calls, ranks drifting apart (random device delays), up to 4096 tokens per
    rank, every output checked against comet.reference.mesh_forward. ``replicated``:
    layer1 writes each partial row into every rank of the token's TP group (scatter) or
    its reduce role sends each sum there (reduce), while a fast peer may be a call
    ahead."""
    import dataclasses
    from comet.config import TileConfig
    from comet.mesh import MeshLayout
    from comet.runtime.virtual import concurrent_forward, virtual_group
    mesh, max_tokens, world = MeshLayout(tp=tp, ep=ep), 4096, tp * ep
    cfg = PRESETS[name].replace(max_tokens=max_tokens)
    g = torch.Generator(device="cuda").manual_seed(world)
    h, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    w13 = (torch.randn(e, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(cfg.dtype)
    w2 = (torch.randn(e, f, h, generator=g, device="cuda") * f ** -0.5).to(cfg.dtype)
    shards = [mesh.shard(r, w13, w2) for r in range(world)]
    layers = virtual_group(
        cfg, [s["w13"] for s in shards], [s["w2"] for s in shards], mesh=mesh,
        convention=convention, tile=TileConfig().with_fields(**VARIANTS[variant]))
    del shards
    p = layers[0].programs
    splits = [None, (1, 1), (2, max(1, p // 10)), (min(16, p - 1),) * 2]
    kinds = ["random", "skewed", "one_expert"]
    rng = random.Random(tp * 10 + ep)
    streams = _streams(world)
    worst, t0 = 0.0, time.time()
    # Bursts of back-to-back calls (ranks drift apart inside a burst), then every output
    # of the burst is checked: 200 calls' outputs at 4096 tokens would not fit at once.
    burst = 8
    for first_call in range(0, 200, burst):
        calls = []
        for i in range(first_call, first_call + burst):
            tokens = [rng.choice([rng.randint(0, 64), rng.randint(1024, max_tokens)])
                      for _ in range(world)]
            xs, ids, ws = _inputs(cfg, world, kinds[i % len(kinds)], tokens, seed=i)
            if convention == "replicated":
                for r in range(world):
                    lead = mesh.tp_group(r)[0]
                    xs[r], ids[r], ws[r] = xs[lead], ids[lead], ws[lead]
            calls.append((xs, ids, ws))
        torch.cuda.synchronize()
        outputs = []
        for i, (xs, ids, ws) in enumerate(calls, start=first_call):
            delays = [rng.choice([0, 0, rng.randint(1, MAX_DELAY_CYCLES)])
                      for _ in range(world)]
            outputs.append(concurrent_forward(layers, xs, ids, ws, streams,
                                              comm_blocks=splits[i % len(splits)],
                                              delay_cycles=delays))
        torch.cuda.synchronize()
        for (xs, ids, ws), ys in zip(calls, outputs):
            ref = reference.mesh_forward(xs, ids, ws, w13, w2, mesh, convention,
                                         round_to=cfg.dtype)
            worst = max([worst] + [_rel_err(y, r) for y, r in zip(ys, ref)])
    for layer in layers:
        layer.check_errors_now()
    print(f"{name} {mesh} {convention} {variant}: 200 concurrent calls in "
          f"{time.time() - t0:.1f}s, worst rel err {worst:.2e}")
    assert worst < 2e-2
    assert all(int(layer.ws.epoch) == 200 for layer in layers)


def _one_call(layers, cfg, world, seed, streams, **kwargs):
    from comet.runtime.virtual import concurrent_forward
    xs, ids, ws = _inputs(cfg, world, "random", [64] * world, seed)
    torch.cuda.synchronize()
    return xs, ids, ws, concurrent_forward(layers, xs, ids, ws, streams, **kwargs)


def _expect_timeout_everywhere(layers, started, budget_s):
    for layer in layers:
        with pytest.raises(CometTimeoutError):
            layer.check_errors_now()
    elapsed = time.time() - started
    assert elapsed < budget_s, elapsed
    for layer in layers:   # the failure is remembered: no call until reset()
        with pytest.raises(CometError, match="reset"):
            layer(torch.zeros(1, layer.cfg.hidden_size, dtype=layer.cfg.dtype, device="cuda"),
                  torch.zeros(1, layer.cfg.top_k, dtype=torch.int64, device="cuda"),
                  torch.ones(1, layer.cfg.top_k, device="cuda"))


def _reset_and_check(layers, cfg, w13, w2, world, streams):
    for layer in layers:
        layer.reset()
    xs, ids, ws, ys = _one_call(layers, cfg, world, 99, streams)
    for layer in layers:
        layer.check_errors_now()
    ref = reference.ep_forward(xs, ids, ws, w13, w2, round_to=cfg.dtype)
    assert max(_rel_err(y, r) for y, r in zip(ys, ref)) < 2e-2


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("COMET_TIMEOUT_S", "1")
    return 1.0


@pytest.mark.parametrize("variant", ["scatter"])
def test_injected_stall_mid_call_is_an_error_on_every_rank(short_timeout, monkeypatch,
                                                            variant):
    """Rank 1 sleeps for 3x the timeout between its layer0 and layer1 kernels."""
    import dataclasses
    from comet.config import TileConfig
    from comet.runtime.forward import ForwardCall
    world = 2
    cfg, layers, w13, w2 = _group("mixtral", world, 128, use_graphs=False,
                                  tile=TileConfig().with_fields(**VARIANTS[variant]))
    streams = _streams(world)
    real = ForwardCall.launch_layer1

    def stalled(call, *args, **kwargs):
        if call.ws.rank == 1:
            torch.cuda._sleep(int(3 * short_timeout * 2e9))        # ~2 GHz SM clock
        return real(call, *args, **kwargs)

    monkeypatch.setattr(ForwardCall, "launch_layer1", stalled)
    started = time.time()
    _one_call(layers, cfg, world, 2, streams)
    _expect_timeout_everywhere(layers, started, budget_s=3 * short_timeout + 2 + 5)
    monkeypatch.setattr(ForwardCall, "launch_layer1", real)
    _reset_and_check(layers, cfg, w13, w2, world, streams)


def test_skipped_call_is_an_error_on_every_rank(short_timeout):
    """Rank 1 does not make call 2: rank 0 times out; rank 1 learns of it from rank 0."""
    from comet.runtime.virtual import concurrent_forward
    world = 2
    cfg, layers, w13, w2 = _group("mixtral", world, 128)
    streams = _streams(world)
    xs, ids, ws = _inputs(cfg, world, "random", [64] * world, 3)
    torch.cuda.synchronize()
    started = time.time()
    concurrent_forward(layers[:1], xs[:1], ids[:1], ws[:1], streams[:1])
    torch.cuda.synchronize()
    assert time.time() - started < short_timeout + 2
    _expect_timeout_everywhere(layers, started, budget_s=short_timeout + 2 + 5)
    _reset_and_check(layers, cfg, w13, w2, world, streams)


def test_bad_routing_is_reported_and_the_layer_stays_usable():
    """Rank 1 passes an expert id >= E, then a NaN weight: it raises CometInputError,
    every rank's output treats those slots as "no expert", the next call is clean."""
    from comet.runtime.virtual import concurrent_forward
    world = 2
    cfg, layers, w13, w2 = _group("qwen2-moe", world, 128)
    streams = _streams(world)
    for corrupt, token in (("id", 7), ("weight", 9)):
        xs, ids, ws = _inputs(cfg, world, "random", [64] * world, 5)
        clean_ids = [i.clone() for i in ids]
        clean_ids[1][token, 1] = -1
        if corrupt == "id":
            ids[1][token, 1] = cfg.num_experts + 3
        else:
            ws[1][token, 1] = float("nan")
        torch.cuda.synchronize()
        ys = concurrent_forward(layers, xs, ids, ws, streams)
        layers[0].check_errors_now()
        with pytest.raises(CometInputError, match=f"token {token}, slot 1"):
            layers[1].check_errors_now()
        layers[1].check_errors_now()                 # reported once
        ref = reference.ep_forward(xs, clean_ids, ws, w13, w2, round_to=cfg.dtype)
        assert max(_rel_err(y, r) for y, r in zip(ys, ref)) < 2e-2
        xs, ids, ws, ys = _one_call(layers, cfg, world, 6, streams)
        for layer in layers:
            layer.check_errors_now()
        ref = reference.ep_forward(xs, ids, ws, w13, w2, round_to=cfg.dtype)
        assert max(_rel_err(y, r) for y, r in zip(ys, ref)) < 2e-2


def test_lazy_input_error_is_raised_once_by_a_later_call():
    """Without a sync the error surfaces at a later call -- after that call's work was
    issued, so the ranks stay in step -- exactly once."""
    from comet.runtime.virtual import concurrent_forward
    world = 2
    cfg, layers, w13, w2 = _group("mixtral", world, 64)
    streams = _streams(world)
    raised = 0
    for i in range(8):
        xs, ids, ws = _inputs(cfg, world, "random", [32] * world, 9 + i)
        if i == 0:
            ids[0][3, 0] = -5
        torch.cuda.synchronize()
        out = concurrent_forward(layers, xs, ids, ws, streams, return_exceptions=True)
        raised += isinstance(out[0], CometInputError)
        assert not isinstance(out[1], Exception)
    torch.cuda.synchronize()
    try:
        layers[0].check_errors_now()
    except CometInputError:
        raised += 1
    assert raised == 1, raised


def _spec_grads(xs, ids, ws, dys, w13, w2, activation=SILU, biases=None):
    """fp32 autograd of sum_r <dy_r, moe_forward(x_r)> with every rank's experts in one
    process: (dx per rank, d weights per rank, dW13 shards, dW2 shards), and with
    ``biases`` (gate-up-first b13 shards, b2 shards) the db13 and db2 shards."""
    params = [torch.cat(w13), torch.cat(w2)] + ([torch.cat(b) for b in biases] if biases else [])
    params = [p.float().requires_grad_() for p in params]
    w13f, w2f = params[:2]
    bias = dict(b13=params[2], b2=params[3]) if biases else {}
    leaves = [(x.float().requires_grad_(), w.clone().requires_grad_()) for x, w in zip(xs, ws)]
    loss = sum(p.sum() for p in params) * 0
    for (x, w), i, dy in zip(leaves, ids, dys):
        loss = loss + (reference.moe_forward(x, i, w, w13f, w2f, activation=activation, **bias)
                       * dy.float()).sum()
    loss.backward()
    world = len(w13)
    return ([x.grad for x, _ in leaves], [w.grad for _, w in leaves],
            *(p.grad.chunk(world) for p in params))


@pytest.mark.parametrize("name, world", [("mixtral", 2), ("qwen2-moe", 4), ("phi3.5-moe", 4)])
def test_backward_concurrent_virtual_ranks_full_size(name, world):
    """Training steps of W virtual ranks at full hidden sizes: each round a concurrent
    forward then a concurrent fused backward (comet.runtime.backward), ranks drifting
    apart, splits varying; every gradient checked against fp32 autograd of the spec."""
    from comet.runtime.virtual import concurrent_backward, concurrent_forward
    from comet.weights import gate_up_first
    max_tokens = 384
    cfg, layers, w13, w2 = _group(name, world, max_tokens, backward=True)
    p = layers[0].programs
    splits = [None, (1, 1), (min(16, p - 1),) * 2, (0, 0)]
    kinds = ["random", "skewed", "one_expert"]
    rng = random.Random(world)
    streams = _streams(world)
    worst = {"dx": 0.0, "dw": 0.0, "dw13": 0.0, "dw2": 0.0}
    rounds = 12
    for i in range(rounds):
        tokens = [rng.randint(0, max_tokens) for _ in range(world)]
        xs, ids, ws = _inputs(cfg, world, kinds[i % len(kinds)], tokens, seed=i)
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        dys = [torch.randn(m, cfg.hidden_size, generator=g, device="cuda").to(cfg.dtype)
               for m in tokens]
        torch.cuda.synchronize()
        delays = [rng.choice([0, rng.randint(1, MAX_DELAY_CYCLES)]) for _ in range(world)]
        concurrent_forward(layers, xs, ids, ws, streams, comm_blocks=splits[i % len(splits)],
                           delay_cycles=delays)
        delays = [rng.choice([0, rng.randint(1, MAX_DELAY_CYCLES)]) for _ in range(world)]
        grads = concurrent_backward(layers, dys, xs, ids, ws, streams,
                                    comm_blocks=splits[(i + 1) % len(splits)],
                                    delay_cycles=delays)
        torch.cuda.synchronize()
        dx, dw, d13, d2 = _spec_grads(xs, ids, ws, dys, w13, w2)   # w13: gate-up first
        for r, (gx, gw, g13, g2) in enumerate(grads):
            worst["dx"] = max(worst["dx"], _rel_err(gx, dx[r]))
            worst["dw"] = max(worst["dw"], _rel_err(gw, dw[r]))
            worst["dw13"] = max(worst["dw13"], _rel_err(gate_up_first(g13), d13[r]))
            worst["dw2"] = max(worst["dw2"], _rel_err(g2, d2[r]))
    for layer in layers:
        layer.check_errors_now()
    print(f"{name} W={world}: {rounds} concurrent training rounds, worst rel err {worst}")
    assert max(worst.values()) < 2e-2, worst
    assert all(int(layer.ws.epoch) == 3 * rounds for layer in layers)
