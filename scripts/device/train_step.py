# usage: PYTHONPATH=. python3 scripts/device/train_step.py [--configs ...] [--tokens 1024 4096] [--ep 2] [--iters 10] [--json out.json]
"""A training step through comet's routed experts against torch's autograd of the
unfused layer, one GPU.

Experiment: what training through ``CometMoE`` costs and whether its gradients are right
at full model sizes. For each preset, one rank's share of an EP=W layer (``--ep W``: E/W
experts, so each expert gets the rows it would at EP=W under uniform routing), and each
token count:

* ``torch``: :func:`comet.baseline.ep_moe_forward` on one rank (sort, gather,
  ``torch._grouped_mm``, SiLU*up, ``torch._grouped_mm``, top-k reduce) with autograd:
  forward, then backward (torch's own grouped-GEMM backward);
* ``torch ckpt``: the same under ``torch.utils.checkpoint`` (what a model that keeps only
  the layer's inputs, as comet does, pays with torch: the forward runs twice);
* ``comet``: ``CometMoE.experts_forward``: the fused forward, then the fused backward
  (:mod:`comet.runtime.backward`: the forward's kernels again, recomputing gate/up);
* ``comet unfused bwd``: the same forward, then the unfused backward
  (``fused_backward=False``, :mod:`comet.baseline_backward`: a host sync, all_to_alls and
  torch's grouped GEMMs).

Times (CUDA events, L2 flushed, median): the inference forward of each, and the whole
step (forward with autograd + backward). Memory: what each forward leaves allocated for
its backward (besides its output), the activation memory a model pays per MoE layer. Gradients of x, the routing weights, W13 and
W2 from the two are compared on the first input set (relative Frobenius error).
"""

import argparse
import os

import torch
from torch.utils.checkpoint import checkpoint

from comet import CometMoE
from comet.baseline import ep_moe_forward
from comet.bench.inputs import make_input_sets
from comet.bench.provenance import write_result
from comet.bench.timing import L2Flush, median, time_calls
from comet.config import PRESETS, preset
from comet.weights import gate_up_first

N_SETS = 2


def rel_frobenius(a, b):
    """Relative Frobenius error, a slice at a time (DeepSeek-V3's W13 in fp32 is 22 GB)."""
    num = den = 0.0
    for x, y in zip(a.flatten(0, -2).split(1 << 14), b.flatten(0, -2).split(1 << 14)):
        num += (x.float() - y.float()).square().sum().item()
        den += y.float().square().sum().item()
    return (num / max(den, 1e-24)) ** 0.5


def _profile(label, fn, path):
    """CUDA time per kernel of ``fn`` over 3 calls, written to ``path`` (a table)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            fn(i % N_SETS, None)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(path, "a") as fh:
        fh.write(f"== {label} (3 calls)\n{table}\n")


def run(name, tokens, ep, iters, warmup, profile=None, backward_graphs=True):
    base = preset(name)
    experts = base.num_experts // ep
    cfg = base.replace(num_experts=experts, top_k=min(base.top_k, experts),
                       n_group=min(base.n_group, experts), max_tokens=tokens)
    moe = CometMoE.from_config(cfg, device="cuda")
    if not backward_graphs:        # experiment: the fused backward's launches all eager
        moe.fused_layer()._capture_segments = lambda call, key: None
    dev = torch.device("cuda")
    sets = make_input_sets(cfg, name, tokens, "uniform", N_SETS, 0, 0, dev)
    g = torch.Generator(device="cuda").manual_seed(1)
    dys = [torch.randn(tokens, cfg.hidden_size, generator=g, device="cuda",
                       dtype=cfg.dtype) for _ in sets]
    leaves = [(s.x.clone().requires_grad_(), s.topk_weights.clone().requires_grad_())
              for s in sets]
    w13 = gate_up_first(moe.experts.w13.detach()).requires_grad_()
    w2 = moe.experts.w2.detach().clone().requires_grad_()
    flush = L2Flush(dev)

    def clear(params):
        for t in params:
            t.grad = None

    comet_params = [moe.experts.w13, moe.experts.w2]

    def comet_step(i, _):
        x, w = leaves[i]
        clear([x, w, *comet_params])
        moe.experts_forward(x, sets[i].topk_ids, w).backward(dys[i])

    def comet_unfused_step(i, _):
        moe.fused_backward = False
        try:
            comet_step(i, _)
        finally:
            moe.fused_backward = True

    def torch_step(i, _):
        x, w = leaves[i]
        clear([x, w, w13, w2])
        ep_moe_forward(x, sets[i].topk_ids, w, w13, w2).backward(dys[i])

    def torch_ckpt_step(i, _):
        # Activation checkpointing: the memory comet keeps (inputs only), torch's way.
        x, w = leaves[i]
        clear([x, w, w13, w2])
        checkpoint(ep_moe_forward, x, sets[i].topk_ids, w, w13, w2,
                   use_reentrant=False).backward(dys[i])

    def comet_fwd(i, _):
        with torch.no_grad():
            moe.experts_forward(sets[i].x, sets[i].topk_ids, sets[i].topk_weights)

    def torch_fwd(i, _):
        with torch.no_grad():
            ep_moe_forward(sets[i].x, sets[i].topk_ids, sets[i].topk_weights, w13, w2)

    rec = dict(config=name, ep=ep, tokens=tokens, experts=experts)
    for label, fn in (("comet_fwd", comet_fwd), ("torch_fwd", torch_fwd),
                      ("comet_step", comet_step), ("comet_unfused_step", comet_unfused_step),
                      ("torch_step", torch_step),
                      ("torch_ckpt_step", torch_ckpt_step)):
        series = time_calls(fn, n_sets=N_SETS, iters=iters, warmup=warmup, device=dev,
                            flush=flush)
        rec[f"{label}_us"] = median(series["total"])
    # Memory the autograd graph keeps from the forward to the backward (set 0).
    for label, forward in (("comet", lambda x, w: moe.experts_forward(x, sets[0].topk_ids, w)),
                           ("torch", lambda x, w: ep_moe_forward(x, sets[0].topk_ids, w, w13,
                                                                 w2))):
        x, w = leaves[0]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = forward(x, w)
        torch.cuda.synchronize()
        rec[f"{label}_saved_mib"] = (torch.cuda.memory_allocated() - before
                                     - y.numel() * y.element_size()) / 2 ** 20
        del y
    if profile:
        _profile(f"{name} {tokens} comet step", comet_step, profile)
        _profile(f"{name} {tokens} comet step, unfused backward", comet_unfused_step, profile)
        _profile(f"{name} {tokens} torch step", torch_step, profile)
    rec["comet_bwd_us"] = rec["comet_step_us"] - rec["comet_fwd_us"]
    rec["torch_bwd_us"] = rec["torch_step_us"] - rec["torch_fwd_us"]
    rec["step_speedup"] = rec["torch_step_us"] / rec["comet_step_us"]
    rec["fused_bwd_speedup"] = rec["comet_unfused_step_us"] / rec["comet_step_us"]
    rec["ckpt_step_speedup"] = rec["torch_ckpt_step_us"] / rec["comet_step_us"]
    # Gradients of both on set 0.
    comet_step(0, None)
    x, w = leaves[0]
    got = [x.grad.clone(), w.grad.clone(), gate_up_first(moe.experts.w13.grad),
           moe.experts.w2.grad.clone()]
    torch_step(0, None)
    want = [x.grad, w.grad, w13.grad, w2.grad]
    moe.zero_grad(set_to_none=True)
    rec["grad_rel_err"] = dict(zip(("x", "topk_weights", "w13", "w2"),
                                   (rel_frobenius(a, b) for a, b in zip(got, want))))
    moe.fused_layer().check_errors_now()
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(PRESETS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-backward-graphs", action="store_true",
                   help="issue the fused backward's launches eagerly (no CUDA graphs)")
    p.add_argument("--profile", default=None,
                   help="also write each step's kernels (torch.profiler table) to this file")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                  "train-step.json"))
    a = p.parse_args()
    out = dict(records=[])
    print(f"{'config':18} {'tokens':>6} {'comet fwd':>10} {'torch fwd':>10} "
          f"{'comet step':>11} {'unfused bwd':>11} {'torch step':>11} {'speedup':>8} "
          f"{'ckpt':>6} {'saved MiB':>15}  "
          "grad rel err")
    for name in a.configs:
        for tokens in a.tokens:
            rec = run(name, tokens, a.ep, a.iters, a.warmup, a.profile,
                      backward_graphs=not a.no_backward_graphs)
            out["records"].append(rec)
            err = " ".join(f"{k} {v:.1e}" for k, v in rec["grad_rel_err"].items())
            print(f"{name:18} {tokens:6d} {rec['comet_fwd_us']:10.0f} {rec['torch_fwd_us']:10.0f} "
                  f"{rec['comet_step_us']:11.0f} {rec['comet_unfused_step_us']:11.0f} "
                  f"{rec['torch_step_us']:11.0f} "
                  f"{rec['step_speedup']:8.2f} {rec['ckpt_step_speedup']:6.2f} "
                  f"{rec['comet_saved_mib']:7.0f}/"
                  f"{rec['torch_saved_mib']:<7.0f}  {err}", flush=True)
            torch.cuda.empty_cache()
    write_result(a.json, out)


if __name__ == "__main__":
    main()
