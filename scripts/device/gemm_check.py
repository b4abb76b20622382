"""Compute efficiency of comet's GroupGEMM role against torch's grouped GEMM, one GPU.

For each benchmark config, the per-rank GEMM shape of EP=4 (E/4 local experts, tokens*k
rows, uniform routing) runs through FusedMoE(mode="compute_only") -- the same kernels the
fused layer uses -- and through torch._grouped_mm on the same rows.

    PYTHONPATH=. python3 scripts/device/gemm_check.py [--tokens 4096 16384]
        [--tiles 128,128,256,64,8,3 64,64,128,64,4,4 ...]

``--tiles`` tries tile configurations (block_m, block_n0, block_n1, block_k, num_warps,
num_stages of comet.kernels.launch.TileConfig) on the same rows, one record each.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

from comet.config import PRESETS, MoEConfig, preset
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE, PhaseTimer

TILE_FIELDS = ("block_m", "block_n0", "block_n1", "block_k", "num_warps", "num_stages")


def grouped_mm(a, b, offs):
    """torch's grouped GEMM on rows grouped by expert (offs: int32 cumulative ends)."""
    return torch._grouped_mm(a, b, offs=offs)


#: Calls captured in one CUDA graph by :func:`graphed`.
GRAPH_CALLS = 10


def graphed(call):
    """``call`` x GRAPH_CALLS captured as one replayable CUDA graph. Its replays time the
    device alone: a synchronised timer per call (:func:`median_us`) also counts the
    launch on the host, which for comet's layer kernels (~60 arguments, descriptors built
    per launch) is 100-450 us more than for a small kernel (H100,
    ``h100-layer-vs-loop.json``)."""
    call()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    return graph


def graph_us(graph, replays=3):
    """Median over ``replays`` of the device time per captured call (us)."""
    graph.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / GRAPH_CALLS)
    return sorted(times)[len(times) // 2]


def median_us(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return sorted(times)[len(times) // 2]


def run(name, tokens, world=4, tile=None):
    base = preset(name)
    el = base.num_experts // world
    cfg = MoEConfig(num_experts=el, top_k=min(base.top_k, el), hidden_size=base.hidden_size,
                    intermediate_size=base.intermediate_size, max_tokens=tokens)
    k = base.top_k
    rows_total = tokens * k
    h, f = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(el, h, 2 * f, device="cuda", generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(el, f, h, device="cuda", generator=g) * f ** -0.5).bfloat16()
    # rows_total rows spread uniformly over el experts: a token may repeat an expert here
    # (k > el for mixtral's 2 local experts is fine: each slot is its own row).
    tok = tokens * k // cfg.top_k
    cfg = cfg.replace(max_tokens=tok)
    layer = FusedMoE(cfg, w13, w2, tile=tile)
    ids = torch.stack([torch.randperm(el, device="cuda")[:cfg.top_k] for _ in range(tok)])
    x = torch.randn(tok, h, device="cuda", generator=g).bfloat16()
    w = torch.rand(ids.shape, device="cuda")
    timer = PhaseTimer()

    def comet_compute():
        layer(x, ids, w, mode="compute_only", timer=timer)
    # Real rows in the shared tensors first: GEMMs on a fresh (zeroed) workspace run
    # 15-18% faster on a power-limited GPU (h200-zeros-probe.json).
    layer(x, ids, w, mode="sequential")
    comet_compute()
    c_us = median_us(lambda: comet_compute())
    # per-phase of the last call
    torch.cuda.synchronize()
    ph = timer.elapsed_us()
    fused_us = median_us(lambda: layer(x, ids, w, mode="fused"))

    counts = torch.bincount(ids.flatten(), minlength=el)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    order = torch.argsort(ids.flatten(), stable=True)
    a = x[order // cfg.top_k].contiguous()
    b13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    b2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    try:
        def torch_gemms():
            gu = grouped_mm(a, b13, offs)
            hh = F.silu(gu[:, :f]) * gu[:, f:]
            return grouped_mm(hh, b2, offs)
        torch_gemms()
        t_us = median_us(torch_gemms)
        hid = torch.randn(a.shape[0], f, device="cuda", dtype=a.dtype)
        t_gemm_only = median_us(lambda: grouped_mm(a, b13, offs)) + median_us(
            lambda: grouped_mm(hid, b2, offs))
    except Exception as e:  # report, don't hide
        print("torch._grouped_mm failed:", repr(e)[:300])
        t_us = t_gemm_only = float("nan")
    flops = 2.0 * rows_total * h * 2 * f + 2.0 * rows_total * f * h
    tile = layer.last_tile
    rec = dict(config=name, tokens_per_rank=tokens, rows=rows_total, experts=el,
               tile={k: getattr(tile, k) for k in TILE_FIELDS},
               comet_compute_us=c_us, comet_layer0_us=ph.get("layer0"),
               comet_layer1_us=ph.get("layer1"), comet_plan_us=ph.get("plan"),
               comet_fused_w1_us=fused_us,
               torch_gemm_act_us=t_us, torch_gemm_only_us=t_gemm_only,
               comet_tflops=flops / ((ph["layer0"] + ph["layer1"]) * 1e-6) / 1e12,
               torch_tflops=flops / (t_gemm_only * 1e-6) / 1e12)
    rec["compute_efficiency"] = rec["comet_tflops"] / rec["torch_tflops"]
    print(json.dumps(rec))
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm_check.json"))
    ap.add_argument("--tiles", nargs="+", default=None, metavar="BM,BN0,BN1,BK,WARPS,STAGES",
                    help="tile configurations to try (default: the default one)")
    args = ap.parse_args()
    tiles = [None] if not args.tiles else [
        TileConfig(**dict(zip(TILE_FIELDS, map(int, t.split(","))))) for t in args.tiles]
    recs = [run(c, t, tile=tile) for c in args.configs for t in args.tokens for tile in tiles]
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, f, indent=1)
    print(f"{'config':18s} {'tok':>6s} {'tile':>22s} {'comet TF/s':>10s} {'torch TF/s':>10s} "
          f"{'ratio':>6s}")
    for r in recs:
        tile = ",".join(str(v) for v in r["tile"].values())
        print(f"{r['config']:18s} {r['tokens_per_rank']:6d} {tile:>22s} {r['comet_tflops']:10.0f} "
              f"{r['torch_tflops']:10.0f} {r['compute_efficiency']:6.2f}")


if __name__ == "__main__":
    main()
