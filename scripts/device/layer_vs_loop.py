"""Why the layer kernels gain less than the tile loops promised: both under one timer.

Experiment, one GPU. A one-rank FusedMoE holding E/``--ep`` experts (one rank of EP=ep:
its GEMM shapes) plans one call; then, on that call's own rows, tile table and weights,
and alternating with ``torch._grouped_mm`` on the same rows (gemm_variants' paired
timing: the ratio is torch's time over the candidate's, median of 5 rounds):

* ``kernel``  -- the layer kernel itself, compute role only (no waits);
* ``loop``    -- gemm_variants' loop of the same shape (layer0: strided lanes of 4;
  layer1: static flattened stride) over the layer's tables, descriptors and buffers;
* ``kernel1split`` -- layer1's kernel with one column split (one flattened loop, as
  ``loop``; the default runs one per split);
* ``own``     -- the same loop over gemm_variants' own tables on rows sized to the call
  (what the earlier variant runs measured).

Timed as device time (CUDA graph replays, gemm_variants.paired); ``synced_us`` is one
synchronised call at a time, as gemm_variants timed before: device time plus what the
launch costs the host.

``kernel`` vs ``loop`` isolates the kernel code (same data); ``loop`` vs ``own`` isolates
the data (the plan's tile table, a workspace-sized A). Writes ``$OUT/layer_vs_loop.json``.

    PYTHONPATH=. python3 scripts/device/layer_vs_loop.py [--configs ...] [--tokens 4096]
"""

import argparse
import dataclasses
import json
import os

import torch

from comet.config import preset
from comet.kernels import launch as L
from comet.runtime.layer import FusedMoE
from comet.weights import GATE_UP_BLOCK
from gemm_check import median_us   # same folder
from gemm_variants import (LOOPS, paired, preset_arguments, tile_table,   # same folder
                           variant_kernel)

LANE = 4


def _variant(a, b, c, tables, queue, k, n, loop, gated, tile, grid):
    """A call of gemm_variants' kernel (``tables``: expert, row start, row end, count)."""
    bm, bn, bk = tile.block_m, (tile.block_n0 if gated else tile.block_n1), tile.k_step(k)
    one_dot = gated and bn == GATE_UP_BLOCK
    a_desc = L.descriptor(a, [bm, bk])
    b_desc = L.descriptor(b.view(-1, b.shape[-1]), [bk, bn * (2 if one_dot else 1)])

    def call():
        queue.zero_()
        variant_kernel[(grid,)](a_desc, b_desc, c, *tables, queue, k, n, LOOP=LOOPS[loop],
                                BATCH=LANE, GATED=gated, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                EPILOGUE=0, num_warps=tile.num_warps,
                                num_stages=tile.num_stages)
    return call


def run(name, tokens, ep):
    base = preset(name)
    el = base.num_experts // ep
    cfg = base.replace(num_experts=el, top_k=min(base.top_k, el),
                       n_group=min(base.n_group, el), max_tokens=tokens)
    h, f = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(el, h, 2 * f, device="cuda", generator=g) * h ** -0.5).to(cfg.dtype)
    w2 = (torch.randn(el, f, h, device="cuda", generator=g) * f ** -0.5).to(cfg.dtype)
    layer = FusedMoE(cfg, w13, w2, use_graphs=False)
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype)
    ids = torch.stack([torch.randperm(el, device="cuda")[:cfg.top_k] for _ in range(tokens)])
    wts = torch.rand(ids.shape, device="cuda")
    layer(x, ids, wts, mode="compute_only")
    torch.cuda.synchronize()
    ws, tile, s, grid = layer.ws, layer.last_tile, layer._static, layer.programs
    p = ws.plan
    ws.a0.normal_()
    ws.h.normal_()
    counts = torch.bincount(ids.flatten(), minlength=el)
    rows = int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tables = (p["tile_expert"], p["tile_row_start"], p["tile_row_end"], p["num_tiles"])
    own = tile_table(counts.tolist(), tile.block_m)
    own = (*own, torch.tensor([own[0].numel()], dtype=torch.int32, device="cuda"))
    queue = torch.zeros(1, dtype=torch.int32, device="cuda")
    l0_queue = ws.counter_view()["l0_queue"]
    a0, hid = ws.a0[:rows], ws.h[:rows]
    bt13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    bt2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    w13_kernel = layer.w13

    def kernel0():
        l0_queue.zero_()
        L.launch_layer0(ws, cfg, s.addr[0:1], w13_kernel, tile, L.ROLE_COMPUTE, s.split[0:1],
                        grid, wait=False)

    def kernel1(t=tile):
        L.launch_layer1(ws, cfg, layer.w2, t, L.ROLE_COMPUTE, s.split[1:2], grid)

    h_own = torch.empty(rows, f, device="cuda", dtype=cfg.dtype)
    o_own = torch.empty(rows, h, device="cuda", dtype=cfg.dtype)
    layers = {
        "layer0": (lambda: torch._grouped_mm(a0, bt13, offs=offs), 2.0 * rows * h * 2 * f, {
            "kernel": kernel0,
            "loop": _variant(ws.a0, w13_kernel, ws.h, tables, queue, h, f, "strided", True,
                             tile, grid),
            "own": _variant(a0.clone(), w13_kernel, h_own, own, queue, h, f, "strided", True,
                            tile, grid)}),
        "layer1": (lambda: torch._grouped_mm(hid, bt2, offs=offs), 2.0 * rows * f * h, {
            "kernel": kernel1,
            "kernel1split": lambda: kernel1(dataclasses.replace(tile, splits=1)),
            "loop": _variant(ws.h, layer.w2, ws.out1, tables, queue, f, h, "flat", False,
                             tile, grid),
            "own": _variant(hid.clone(), layer.w2, o_own, own, queue, f, h, "flat", False,
                            tile, grid)}),
    }
    recs = []
    for lname, (ref, flops, cands) in layers.items():
        for cname, call in cands.items():
            us, ratio = paired(call, ref)
            rec = dict(config=name, tokens=tokens, ep=ep, layer=lname, candidate=cname,
                       rows=rows, us=us, tflops=flops / us / 1e6, ratio=ratio,
                       synced_us=median_us(call, iters=10, warmup=2))
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    return recs


def main():
    ap = argparse.ArgumentParser()
    preset_arguments(ap)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "layer_vs_loop.json"))
    args = ap.parse_args()
    recs = [r for c in args.configs for t in args.tokens for r in run(c, t, args.ep)]
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh, indent=1)
    names = list(dict.fromkeys(r["candidate"] for r in recs))
    print(f"{'config':18s} {'tokens':>6s} {'layer':6s} " + " ".join(
        f"{c:>12s}" for c in names) + "   (torch / candidate device time)")
    for key in dict.fromkeys((r["config"], r["tokens"], r["layer"]) for r in recs):
        row = {r["candidate"]: r["ratio"] for r in recs
               if (r["config"], r["tokens"], r["layer"]) == key}
        print(f"{key[0]:18s} {key[1]:6d} {key[2]:6s} "
              + " ".join(f"{row.get(c, float('nan')):12.2f}" for c in names))


if __name__ == "__main__":
    main()
