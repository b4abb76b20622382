"""Multi-GPU correctness suite; run under torchrun (tests/test_multigpu.py launches it).

    torchrun --nproc-per-node 4 tests/multigpu_check.py [--quick] [--json out.json]

Every rank rebuilds every rank's inputs from the same seeds, so each can check its own
output against comet.reference.ep_forward without gathering anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from comet import reference  # noqa: E402
from comet.bench.provenance import write_result  # noqa: E402
from comet.config import MoEConfig, TileConfig  # noqa: E402
from comet.runtime.errors import CometTimeoutError  # noqa: E402
from comet.runtime.layer import FusedMoE  # noqa: E402
from comet.weights import interleave_gate_up  # noqa: E402
from routings import KINDS, make_ids, make_tokens  # noqa: E402

SCALED = {
    "mixtral": (8, 2, 1024, 1536),
    "qwen2-moe": (64, 4, 512, 352),
    "phi3.5-moe": (16, 2, 1024, 800),
    "deepseek-v3-like": (32, 8, 896, 256),
}


def log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def global_weights(cfg, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = (torch.randn(e, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(cfg.dtype)
    w2 = (torch.randn(e, f, h, generator=g, device="cuda") * f ** -0.5).to(cfg.dtype)
    return w13, w2


def all_inputs(cfg, world, kind, seed):
    cg = torch.Generator().manual_seed(seed)
    tokens = make_tokens(kind, world, cfg.max_tokens, cg)
    ids = [i.cuda() for i in make_ids(kind, tokens, cfg.num_experts, cfg.top_k, cg)]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g, device="cuda").to(cfg.dtype)
          for i in ids]
    ws = [torch.rand(i.shape, generator=g, device="cuda") for i in ids]
    return xs, ids, ws


def stable_seed(*words: str) -> int:
    """The same seed on every rank: ``hash`` of a str differs from process to process
    (PYTHONHASHSEED), and every rank must rebuild the same inputs of every rank."""
    return zlib.crc32("/".join(words).encode()) % 1000


def rel_err(y, ref):
    if ref.numel() == 0:
        return 0.0
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


#: layer1 variants every correctness check runs: the scatter epilogue (the default) and
#: the column-split reduce (comet.runtime.strategies).
LAYER1 = {"scatter": TileConfig(), "reduce": TileConfig().with_fields(layer1_scatter=False)}


def check_correctness(results, quick, configs):
    world, rank = dist.get_world_size(), dist.get_rank()
    for name in configs:
        e, k, h, f = SCALED[name]
        dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
        for dtype, layer1 in ((d, v) for d in dtypes for v in LAYER1):
            cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                            dtype=dtype, max_tokens=512)
            w13, w2 = global_weights(cfg, 7)
            el = e // world
            layer = FusedMoE(cfg, w13[rank * el:(rank + 1) * el].contiguous(),
                             w2[rank * el:(rank + 1) * el].contiguous(), check_errors="sync",
                             tile=LAYER1[layer1])
            p = layer.programs
            splits = [0, 1, 16, p - 1] if quick else [0, 1, 8, 24, p // 2, p - 1]
            worst = 0.0
            for kind in KINDS:
                xs, ids, ws = all_inputs(cfg, world, kind, seed=stable_seed(name, kind))
                ref = reference.ep_forward(xs, ids, ws, list(w13.split(el)), list(w2.split(el)),
                                           round_to=dtype)[rank]
                for n in splits:
                    y = layer(xs[rank], ids[rank], ws[rank], comm_blocks=n)
                    err = rel_err(y, ref)
                    worst = max(worst, err)
                    assert err < 1e-2, (name, dtype, layer1, kind, n, err)
            results.append({"check": "correctness", "config": name, "dtype": str(dtype),
                            "layer1": layer1, "splits": splits, "kinds": list(KINDS),
                            "worst_rel_err": worst})
            log(f"ok correctness {name} {dtype} {layer1} splits={splits} worst={worst:.2e}")
            del layer
            torch.cuda.empty_cache()


TRAINING_KINDS = ("random", "zero_token_rank", "skewed")


def _training_problem(name):
    """(cfg, full W13 (gate-up first), full W2, this rank's expert slice)."""
    e, k, h, f = SCALED[name]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.bfloat16, max_tokens=512)
    w13, w2 = global_weights(cfg, 11)
    el = e // dist.get_world_size()
    rank = dist.get_rank()
    return cfg, w13, w2, slice(rank * el, (rank + 1) * el)


def _training_inputs(cfg, name, kind):
    """Every rank's (x, ids, weights, dy) of one training step."""
    xs, ids, ws = all_inputs(cfg, dist.get_world_size(), kind,
                             seed=stable_seed(name, kind, "train"))
    g = torch.Generator(device="cuda").manual_seed(5)
    return xs, ids, ws, [torch.randn(x.shape, generator=g, device="cuda").to(x.dtype)
                         for x in xs]


def _spec_grads(xs, ids, ws, dys, w13, w2, mine):
    """Autograd of the fp32 spec over every rank's tokens: (this rank's dx, its d
    weights, dW13 and dW2 of its experts)."""
    rank = dist.get_rank()
    f13, f2 = w13.float().requires_grad_(), w2.float().requires_grad_()
    fx = [t.float().requires_grad_() for t in xs]
    fw = [t.clone().requires_grad_() for t in ws]
    loss = (f13.sum() + f2.sum()) * 0
    for r in range(len(xs)):
        loss = loss + (reference.moe_forward(fx[r], ids[r], fw[r], f13, f2)
                       * dys[r].float()).sum()
    loss.backward()
    return fx[rank].grad, fw[rank].grad, f13.grad[mine], f2.grad[mine]


def _compare(worst, got, want, has_tokens):
    """Fold the relative errors of (dx, d weights, dW13 gate-up first, dW2) into
    ``worst`` (dx and d weights only when the rank has tokens)."""
    keys = ("dx", "d_weights", "dw13", "dw2")
    for key, a, b in zip(keys, got, want):
        if has_tokens or key in ("dw13", "dw2"):
            worst[key] = max(worst.get(key, 0.0), rel_err(a, b))


def check_training(results, configs):
    """CometMoE over the group, one training step with routing passed in, through each
    backward (the default fused one, comet.runtime.backward; the unfused one,
    comet.baseline_backward over NCCL): each rank's gradients of x, the routing weights and its
    own experts as autograd of the fp32 spec over every rank's tokens."""
    from comet import CometMoE
    from comet.weights import gate_up_first
    rank = dist.get_rank()
    for name in configs:
        cfg, w13, w2, mine = _training_problem(name)
        e, k, h, f = SCALED[name]
        moe = CometMoE(e, k, h, f, dtype=torch.bfloat16, max_tokens=512, device="cuda",
                       group=dist.group.WORLD)
        with torch.no_grad():
            moe.experts.w13.copy_(interleave_gate_up(w13[mine]))
            moe.experts.w2.copy_(w2[mine])
        for fused in (True, False):
            moe.fused_backward = fused
            worst = {}
            for kind in TRAINING_KINDS:
                xs, ids, ws, dys = _training_inputs(cfg, name, kind)
                moe.zero_grad()
                x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
                (moe(x, ids[rank], w).float() * dys[rank].float()).sum().backward()
                moe.fused_layer().check_errors_now()
                got = (x.grad, w.grad, gate_up_first(moe.experts.w13.grad),
                       moe.experts.w2.grad)
                _compare(worst, got, _spec_grads(xs, ids, ws, dys, w13, w2, mine),
                         x.shape[0] > 0)
            backward = "fused" if fused else "unfused"
            results.append({"check": "training", "config": name, "backward": backward,
                            "worst_rel_err": worst})
            log(f"training {name} ({backward} backward) worst={worst}")
            assert max(worst.values()) < 2e-2, (name, backward, worst)
        del moe
        torch.cuda.empty_cache()


def check_fused_backward(results, configs):
    """FusedMoE.backward (comet.runtime.backward) over the group after a forward, against
    autograd of the fp32 spec, on a cold kernel cache unless the run already compiled
    them. Error words are read *before* gradients are compared, so a timed-out exchange
    shows as such (and the group is reset to go on) rather than as wrong numbers; every
    config and routing kind runs before the verdict, each logged with its errors."""
    from comet.runtime.errors import CometError
    from comet.runtime.layer import FusedMoE
    from comet.weights import gate_up_first
    rank = dist.get_rank()
    failures = []
    for name in configs:
        cfg, w13, w2, mine = _training_problem(name)
        layer = FusedMoE(cfg, w13[mine].contiguous(), w2[mine].contiguous(),
                         group=dist.group.WORLD, check_errors="sync")
        worst = {}
        for kind in TRAINING_KINDS:
            xs, ids, ws, dys = _training_inputs(cfg, name, kind)
            t0 = time.time()
            try:
                layer(xs[rank], ids[rank], ws[rank])
                dx, dw, d13, d2 = layer.backward(dys[rank], xs[rank], ids[rank], ws[rank])
                layer.check_errors_now()
            except CometError as e:
                failures.append((name, kind, f"error: {e}"))
                log(f"fused backward {name} {kind}: FAILED with {e}")
                layer.reset()
                continue
            errs = {}
            _compare(errs, (dx, dw, gate_up_first(d13), d2),
                     _spec_grads(xs, ids, ws, dys, w13, w2, mine), xs[rank].shape[0] > 0)
            for key, err in errs.items():
                worst[key] = max(worst.get(key, 0.0), err)
            bad = {k: v for k, v in errs.items() if v >= 2e-2}
            if bad:
                failures.append((name, kind, bad))
            log(f"fused backward {name} {kind} ({time.time() - t0:.1f}s): "
                + " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + (" BAD" if bad else ""))
        results.append({"check": "fused_backward", "config": name, "worst_rel_err": worst})
        del layer
        torch.cuda.empty_cache()
    assert not failures, failures


def check_back_to_back_graph_and_sync(results, calls):
    world, rank = dist.get_world_size(), dist.get_rank()
    e, k, h, f = SCALED["phi3.5-moe"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.bfloat16, max_tokens=256)
    w13, w2 = global_weights(cfg, 3)
    el = e // world
    shards13, shards2 = list(w13.split(el)), list(w2.split(el))
    layer = FusedMoE(cfg, shards13[rank].contiguous(), shards2[rank].contiguous())
    keep = []
    t0 = time.time()
    for i in range(calls):
        xs, ids, ws = all_inputs(cfg, world, KINDS[i % len(KINDS)], seed=10_000 + i)
        y = layer(xs[rank], ids[rank], ws[rank])
        if i >= calls - 20:
            keep.append((xs, ids, ws, y))
    layer.check_errors_now()
    elapsed = time.time() - t0
    for xs, ids, ws, y in keep:
        ref = reference.ep_forward(xs, ids, ws, shards13, shards2, round_to=cfg.dtype)[rank]
        assert rel_err(y, ref) < 1e-2
    assert int(layer.ws.epoch) == calls
    results.append({"check": "back_to_back", "calls": calls, "seconds": elapsed})
    log(f"ok {calls} back-to-back calls, no host barrier ({elapsed:.1f}s)")

    xs, ids, ws = all_inputs(cfg, world, "random", seed=5)
    x, i_, w = xs[rank].clone(), ids[rank].clone(), ws[rank].clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, i_, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    log("ok forward under set_sync_debug_mode('error')")

    # CUDA graph: fixed token count, new inputs and routing written into the same tensors.
    m = 200
    xs, ids, ws = all_inputs(cfg.replace(max_tokens=m), world, "random", seed=6)
    x = torch.zeros(m, h, device="cuda", dtype=cfg.dtype)
    i_ = torch.zeros(m, k, device="cuda", dtype=torch.int64)
    w = torch.zeros(m, k, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        layer(x, i_, w)
        with torch.cuda.graph(graph, stream=stream):
            y_static = layer(x, i_, w)
    torch.cuda.current_stream().wait_stream(stream)
    worst = 0.0
    for seed in range(5):
        g = torch.Generator().manual_seed(100 + seed)
        ids = [i.cuda() for i in make_ids(KINDS[seed % 3], [m] * world, e, k, g)]
        gx = torch.Generator(device="cuda").manual_seed(200 + seed)
        xs = [torch.randn(m, h, generator=gx, device="cuda").to(cfg.dtype) for _ in ids]
        ws = [torch.rand(m, k, generator=gx, device="cuda") for _ in ids]
        x.copy_(xs[rank]), i_.copy_(ids[rank]), w.copy_(ws[rank])
        graph.replay()
        ref = reference.ep_forward(xs, ids, ws, shards13, shards2, round_to=cfg.dtype)[rank]
        worst = max(worst, rel_err(y_static, ref))
    layer.check_errors_now()
    assert worst < 1e-2, worst
    results.append({"check": "cuda_graph", "replays": 5, "worst_rel_err": worst})
    log(f"ok CUDA graph replays with new routing (worst {worst:.2e})")
    return layer


def check_missing_rank(results, layer):
    """The last rank skips a call; every other rank must raise within seconds."""
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = os.environ.get("COMET_TIMEOUT_S")
    os.environ["COMET_TIMEOUT_S"] = "2"
    try:
        _skip_a_call(results, layer, world, rank)
    finally:       # later checks compile kernels mid-call: the default timeout again
        if saved is None:
            os.environ.pop("COMET_TIMEOUT_S")
        else:
            os.environ["COMET_TIMEOUT_S"] = saved


def _skip_a_call(results, layer, world, rank):
    cfg = layer.cfg
    xs, ids, ws = all_inputs(cfg, world, "random", seed=77)
    start = time.time()
    raised = False
    if rank != world - 1:
        try:
            layer(xs[rank], ids[rank], ws[rank])
            layer.check_errors_now()
        except CometTimeoutError as e:
            raised = True
            msg = str(e)
        assert raised, "no error raised"
        elapsed = time.time() - start
        assert elapsed < 30, elapsed
        if rank == 0:
            results.append({"check": "missing_rank", "seconds": elapsed, "message": msg})
            log(f"ok missing rank raised after {elapsed:.1f}s: {msg}")


def check_reset_after_failure(results, layer):
    """After check_missing_rank every rank -- the one that skipped the call too, which
    learns of it from its peers' error words -- raises, and reset() on every rank brings
    the group back: the next call is correct."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dist.barrier()                       # the peers have raised by now
    if rank == world - 1:
        try:
            layer.check_errors_now()
            raised = False
        except CometTimeoutError:
            raised = True
        assert raised, "the rank that skipped a call was not told of the failure"
    start = time.time()
    layer.reset()
    cfg = layer.cfg
    el = cfg.num_experts // world
    w13, w2 = global_weights(cfg, 3)
    xs, ids, ws = all_inputs(cfg, world, "random", seed=78)
    y = layer(xs[rank], ids[rank], ws[rank])
    layer.check_errors_now()
    ref = reference.ep_forward(xs, ids, ws, list(w13.split(el)), list(w2.split(el)),
                               round_to=cfg.dtype)[rank]
    err = rel_err(y, ref)
    assert err < 1e-2, err
    results.append({"check": "reset_after_failure", "rel_err": err,
                    "reset_seconds": time.time() - start})
    log(f"ok every rank raised; after reset() the next call is correct (rel err {err:.1e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", nargs="+", default=list(SCALED), choices=list(SCALED))
    ap.add_argument("--only", choices=["fused_backward"], default=None,
                    help="run one check (e.g. again on a warm kernel cache)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    results = []
    if args.only == "fused_backward":
        check_fused_backward(results, args.configs)
        log("FUSED BACKWARD CHECK PASSED")
        os._exit(0)
    check_correctness(results, args.quick, args.configs)
    check_training(results, args.configs)
    layer = check_back_to_back_graph_and_sync(results, args.calls)
    check_missing_rank(results, layer)
    check_reset_after_failure(results, layer)
    check_fused_backward(results, args.configs)
    if dist.get_rank() == 0 and args.json:
        write_result(args.json, {"world_size": dist.get_world_size(), "results": results})
    log("ALL MULTIGPU CHECKS PASSED")
    os._exit(0)


if __name__ == "__main__":
    main()
