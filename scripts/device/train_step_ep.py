# usage: PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/train_step_ep.py [--configs ...] [--tokens 4096 16384] [--rounds 20] [--json out.json]
"""A training step of CometMoE across GPUs (torchrun): the fused backward against the
unfused one, at full model sizes.

Experiment: is the fused backward (:mod:`comet.runtime.backward`) right and worth it over
real NVLink, where peers drift apart? For each preset and token count, every rank holds
E/W experts of one ``CometMoE`` over the world group, with its own inputs (uniform
routing):

1. ``--rounds`` back-to-back training steps on fresh inputs, one rank or another held
   back on the host for a random 0-3 ms before each (ranks drift apart; nothing
   synchronises them but the layer's own exchanges). Each round runs the step with the
   fused backward, then with the unfused one (``comet.baseline_backward``: a host sync,
   all_to_alls and torch's grouped GEMMs) on the same inputs; the gradients of x, the
   routing weights, W13 and W2 of the two are compared (relative Frobenius error, worst
   over rounds and ranks).
2. Times (CUDA events, L2 flushed, iterations aligned by a barrier, slowest rank, median):
   the inference forward and the whole step (forward with autograd + backward) with
   either backward.
"""

import argparse
import os
import random
import time

import torch
import torch.distributed as dist

from comet import CometMoE
from comet.bench.inputs import make_input_sets
from comet.bench.provenance import write_result
from comet.bench.timing import L2Flush, median, reduce_over_ranks, time_calls
from comet.config import PRESETS, preset
from train_step import rel_frobenius   # this script's folder is on sys.path

#: Input sets the timing loop rotates through.
N_SETS = 2
#: Largest host delay (s) a rank is held back by before a step of the drift rounds.
MAX_DRIFT_S = 3e-3


def _worst_over_ranks(errs: dict[str, float]) -> dict[str, float]:
    t = torch.tensor(list(errs.values()), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(errs, t.tolist()))


def run(name, tokens, rounds, iters, warmup, seed):
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = preset(name).replace(max_tokens=tokens)
    torch.manual_seed(seed + rank)           # each rank's own experts
    moe = CometMoE.from_config(cfg, device="cuda", group=dist.group.WORLD)
    dev = torch.device("cuda")
    params = [moe.experts.w13, moe.experts.w2]

    def step(x, ids, w, dy, fused: bool):
        moe.fused_backward = fused
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        for t in params:
            t.grad = None
        moe.experts_forward(x, ids, w).backward(dy)
        return x.grad, w.grad, params[0].grad, params[1].grad

    # 1. Back-to-back rounds with drift, fused vs unfused gradients.
    rng = random.Random(seed + 7 * rank)
    worst = dict.fromkeys(("x", "topk_weights", "w13", "w2"), 0.0)
    t0 = time.time()
    for r in range(rounds):
        s = make_input_sets(cfg, name, tokens, "uniform", 1, rank, seed + 1000 + r, dev)[0]
        g = torch.Generator(device="cuda").manual_seed(seed + 31 * rank + r)
        dy = torch.randn(tokens, cfg.hidden_size, generator=g, device="cuda", dtype=cfg.dtype)
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0, MAX_DRIFT_S))
        got = [t.clone() for t in step(s.x, s.topk_ids, s.topk_weights, dy, fused=True)]
        want = step(s.x, s.topk_ids, s.topk_weights, dy, fused=False)
        for key, a, b in zip(worst, got, want):
            worst[key] = max(worst[key], rel_frobenius(a, b))
    moe.fused_layer().check_errors_now()
    torch.cuda.synchronize()
    rec = dict(config=name, ep=world, tokens=tokens, rounds=rounds,
               rounds_seconds=time.time() - t0,
               grad_rel_err_fused_vs_unfused=_worst_over_ranks(worst))

    # 2. Times.
    sets = make_input_sets(cfg, name, tokens, "uniform", N_SETS, rank, seed, dev)
    g = torch.Generator(device="cuda").manual_seed(seed + rank)
    dys = [torch.randn(tokens, cfg.hidden_size, generator=g, device="cuda", dtype=cfg.dtype)
           for _ in sets]
    flush = L2Flush(dev)

    def forward(i, _):
        with torch.no_grad():
            moe.experts_forward(sets[i].x, sets[i].topk_ids, sets[i].topk_weights)

    for label, fn in (("fwd", forward),
                      ("step_fused_bwd", lambda i, _: step(sets[i].x, sets[i].topk_ids,
                                                           sets[i].topk_weights, dys[i], True)),
                      ("step_unfused_bwd", lambda i, _: step(sets[i].x, sets[i].topk_ids,
                                                             sets[i].topk_weights, dys[i],
                                                             False))):
        series = time_calls(fn, n_sets=N_SETS, iters=iters, warmup=warmup, device=dev,
                            group=dist.group.WORLD, flush=flush)
        rec[f"{label}_us"] = median(reduce_over_ranks(series)["total"])
    moe.fused_layer().check_errors_now()
    rec["fused_bwd_speedup"] = rec["step_unfused_bwd_us"] / rec["step_fused_bwd_us"]
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(PRESETS))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384],
                   help="tokens per rank")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                  "train_step_ep.json"))
    args = p.parse_args()
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")     # NVLink multicast off, as the launchers
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    records = []
    for name in args.configs:
        for tokens in args.tokens:
            rec = run(name, tokens, args.rounds, args.iters, args.warmup, args.seed)
            records.append(rec)
            torch.cuda.empty_cache()
            if dist.get_rank() == 0:
                errs = " ".join(f"{k}={v:.1e}" for k, v in
                                rec["grad_rel_err_fused_vs_unfused"].items())
                print(f"{name} ep={rec['ep']} tokens={tokens}: {args.rounds} drifting rounds "
                      f"({rec['rounds_seconds']:.1f}s) fused vs unfused grads {errs}; "
                      f"fwd {rec['fwd_us']:.0f} us, step fused bwd "
                      f"{rec['step_fused_bwd_us']:.0f} us, unfused bwd "
                      f"{rec['step_unfused_bwd_us']:.0f} us "
                      f"({rec['fused_bwd_speedup']:.2f}x)", flush=True)
                write_result(args.json, {"records": records})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
