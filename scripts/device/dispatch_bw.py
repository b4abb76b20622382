"""Bandwidth of one comm-role block, one GPU, no link in the way.

Experiment. A one-rank FusedMoE in ``comm_only`` mode runs the comm roles alone on a grid
of ``--programs`` blocks (every block in the comm role). ``--layer layer0``: the dispatch
gathers the token rows into the rank's own shared tensor ``a0``, the same loads, stores
and publications as a push to a peer, minus NVLink (``torch.index_select`` of the same
rows is the reference for what HBM allows). ``--layer layer1``: the reduce reads the
top-k expert rows of every token and writes one summed row (bytes counted: both).
The phase time gives GB/s per block for each tile. If one block moves far less than a
link's share, the kernel, not the link, limits the comm role; and a comm role that needs
many SMs to keep pace costs the GEMM running beside it more than the overlap saves.

    PYTHONPATH=. python3 scripts/device/dispatch_bw.py [--configs qwen2-moe mixtral]
    PYTHONPATH=. python3 scripts/device/dispatch_bw.py --layer layer1 --tiles 16,256,8 ...
"""

import argparse
import dataclasses
import json
import os

import torch

from comet.config import preset
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE, PhaseTimer


def median(xs):
    return sorted(xs)[len(xs) // 2]


def run(name, tokens, programs, tile, phase="layer0", iters=15):
    cfg = preset(name, max_tokens=tokens)
    el, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.zeros(el, h, 2 * f, device="cuda", dtype=cfg.dtype)
    w2 = torch.zeros(el, f, h, device="cuda", dtype=cfg.dtype)
    layer = FusedMoE(cfg, w13, w2, tile=tile, use_graphs=False)
    layer.programs = programs
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype)
    ids = torch.stack([torch.randperm(el, device="cuda")[:cfg.top_k] for _ in range(tokens)])
    w = torch.rand(ids.shape, device="cuda")
    times = []
    for i in range(iters + 3):
        timer = PhaseTimer()
        layer(x, ids, w, mode="comm_only", timer=timer)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(timer.elapsed_us()[phase])
    layer.check_errors_now()
    us = median(times)
    # The phase time includes the host's launch of the kernel; the profiler's kernel time
    # does not.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x, ids, w, mode="comm_only", timer=PhaseTimer())
        torch.cuda.synchronize()
    kernel_us = [e.device_time for e in prof.key_averages()
                 if e.key.startswith(f"{phase}_kernel")]
    rows = tokens * cfg.top_k
    # layer1 on one rank: every token's top-k rows read, one summed row written.
    gbytes = (rows if phase == "layer0" else rows + tokens) * h * x.element_size() / 1e9
    return dict(config=name, tokens=tokens, layer=phase, programs=programs, rows=rows,
                copy_rows=tile.comm_copy_rows, block_h=tile.comm_block_h,
                chunk_rows=tile.comm_rows, entries=tile.comm_entries,
                block_c=tile.comm_block_c, warps=tile.num_warps, us=us,
                kernel_us=kernel_us[0] if kernel_us else None,
                gb_per_s=gbytes / (us * 1e-6), gb_per_s_per_block=gbytes / (us * 1e-6) / programs)


def torch_ref(name, tokens):
    cfg = preset(name)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=cfg.dtype)
    idx = torch.randint(0, tokens, (tokens * cfg.top_k,), device="cuda")
    out = torch.empty(idx.numel(), cfg.hidden_size, device="cuda", dtype=cfg.dtype)
    times = []
    for i in range(18):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.index_select(x, 0, idx, out=out)
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) * 1e3)
    us = median(times)
    return dict(config=name, tokens=tokens, reference="torch.index_select", us=us,
                gb_per_s=out.numel() * out.element_size() / 1e9 / (us * 1e-6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["qwen2-moe", "mixtral"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--programs", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--layer", choices=["layer0", "layer1"], default="layer0")
    ap.add_argument("--tiles", nargs="+", default=["32,512,8", "64,512,8", "32,1024,8",
                                                     "16,2048,8", "32,512,4", "64,1024,8"],
                    help="ROWS,COLUMNS,WARPS: of the dispatch copy (layer0, comm_copy_rows, "
                         "comm_block_h) or of the reduce (layer1, comm_entries, comm_block_c)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "comm_bw.json"))
    args = ap.parse_args()
    recs = []
    for name in args.configs:
        if args.layer == "layer0":
            recs.append(torch_ref(name, args.tokens))
            print(json.dumps(recs[-1]), flush=True)
        for spec in args.tiles:
            rows, cols, warps = map(int, spec.split(","))
            fields = (dict(comm_copy_rows=rows, comm_block_h=cols) if args.layer == "layer0"
                      else dict(comm_entries=rows, comm_block_c=cols,
                                reduce_item=max(rows, TileConfig.reduce_item)))
            tile = dataclasses.replace(TileConfig(), num_warps=warps, **fields)
            for p in args.programs:
                recs.append(run(name, args.tokens, p, tile, args.layer))
                print(json.dumps(recs[-1]), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
