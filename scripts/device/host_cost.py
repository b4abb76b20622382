"""Host time of one FusedMoE call (graph replay), and where it goes: one GPU.

Experiment. The GPU is parked in a long sleep first, so no call waits for the device and
the host's own cost per call is what perf_counter sees; cProfile then lists the Python
functions that cost the most.

    PYTHONPATH=. python3 scripts/device/host_cost.py [--config qwen2-moe] [--tokens 128]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from comet.config import preset
from comet.runtime.layer import FusedMoE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen2-moe")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    cfg = preset(args.config, max_tokens=max(args.tokens, 256))
    el, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.zeros(el, h, 2 * f, device="cuda", dtype=cfg.dtype)
    w2 = torch.zeros(el, f, h, device="cuda", dtype=cfg.dtype)
    layer = FusedMoE(cfg, w13, w2)
    x = torch.randn(args.tokens, h, device="cuda", dtype=cfg.dtype)
    ids = torch.stack([torch.randperm(el, device="cuda")[:cfg.top_k]
                       for _ in range(args.tokens)])
    w = torch.rand(ids.shape, device="cuda")
    for _ in range(3):
        layer(x, ids, w)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)           # ~2 s: the host never waits for the GPU
    t0 = time.perf_counter()
    for _ in range(args.calls):
        layer(x, ids, w)
    host_us = (time.perf_counter() - t0) / args.calls * 1e6
    torch.cuda.synchronize()
    ops = {}
    buf = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(2_000_000_000)
    for name, fn in [("fill_", lambda: buf[0].fill_(7)),
                     ("copy_ small d2d", lambda: buf[:2].copy_(buf[2:])),
                     ("empty_like", lambda: torch.empty_like(x))]:
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        ops[name] = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        layer(x, ids, w)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    rec = {"device": torch.cuda.get_device_name(), "config": args.config,
           "tokens": args.tokens, "host_us_per_call": host_us, "host_us_per_op": ops}
    print(json.dumps(rec))
    print(out.getvalue())
    with open(os.path.join(os.environ.get("OUT", "."), "host_cost.json"), "w") as fh:
        json.dump({**rec, "profile": out.getvalue()}, fh, indent=1)


if __name__ == "__main__":
    main()
