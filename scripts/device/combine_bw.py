"""Bandwidth of the final combine, one GPU, by tile and grid.

Experiment. The combine (comet.kernels.layer1.combine_kernel) sums, for every token, the
partial rows its ranks sent back: it reads ``W`` rows per token (where sent) and writes
one, a pure HBM stream. On 2x H200 it cost 325 us at 16384 tokens/rank of a 4096-wide
model in comm-only calls (~1.2 TB/s). Here it runs alone (no flag wait) on synthetic
partial rows for several tiles (rows x columns per step, warps) and grid sizes, against
``torch.sum`` over the same rows as the reference for what HBM allows.

    PYTHONPATH=. python3 scripts/device/combine_bw.py [--tokens 4096 16384] [--world 2]
"""

import argparse
import json
import os

import torch

from comet.kernels import layer1 as l1

#: (rows, block_h, num_warps, programs per SM)
VARIANTS = [(16, 512, 4, 1), (16, 512, 4, 2), (16, 512, 4, 4), (32, 512, 8, 1),
            (32, 512, 8, 2), (8, 1024, 4, 2), (8, 1024, 8, 4), (4, 1024, 4, 4),
            (2, 2048, 8, 4), (1, 4096, 8, 4)]


def timed_us(fn, calls=20, reps=5):
    """Device time per call of ``calls`` back-to-back launches (the GPU is parked in a
    sleep first, so the host's launch cost is not measured), median of ``reps``."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / calls)
    return sorted(out)[len(out) // 2]


def run(tokens, hidden, world, sms):
    dev = "cuda"
    comb = torch.randn(world, tokens, hidden, device=dev, dtype=torch.bfloat16)
    mask = (torch.rand(tokens, world, device=dev) < 0.75).to(torch.int32)
    mask[:, 0] = 1
    y = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
    y_addr = torch.tensor([y.data_ptr()], device=dev, dtype=torch.int64)
    n = torch.tensor([tokens], device=dev, dtype=torch.int64)
    zero = torch.zeros(4, device=dev, dtype=torch.int32)
    zero64 = torch.zeros(1, device=dev, dtype=torch.int64)
    ref = (comb.float() * mask.t()[:, :, None]).sum(0).to(torch.bfloat16)
    moved = (int(mask.sum()) + tokens) * hidden * 2
    records = []
    for rows, block_h, warps, per_sm in VARIANTS:
        grid = min(sms * per_sm, -(-tokens // rows))

        def call():
            l1.combine_kernel[(grid,)](comb, zero, mask, y_addr, n, hidden, tokens, 1,
                                       zero64, zero, 0, zero64, WAIT=False, WORLD=world,
                                       PARTS=world, ROWS=rows, BLOCK_H=block_h,
                                       USE_ASM=True, num_warps=warps)
        call()
        err = (y.float() - ref.float()).abs().max().item()
        us = timed_us(call)
        records.append({"rows": rows, "block_h": block_h, "num_warps": warps,
                        "grid": grid, "us": us, "GBps": moved / us / 1e3, "max_err": err})
        print(json.dumps(records[-1]), flush=True)
    stacked = comb * mask.t()[:, :, None].to(comb.dtype)
    torch_us = timed_us(lambda: torch.sum(stacked, 0))
    return {"tokens": tokens, "hidden": hidden, "world": world, "bytes": moved,
            "torch_sum_us": torch_us, "torch_sum_GBps": moved / torch_us / 1e3,
            "variants": records}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "combine_bw.json"))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"device": torch.cuda.get_device_name(0),
           "records": [run(t, args.hidden, args.world, sms) for t in args.tokens]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
