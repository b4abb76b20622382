# usage: PYTHONPATH=. python3 scripts/device/kernel_times.py [--configs ...] [--tokens ...] [--ep W] [--tp T] [--modes ...] [--tiles ...] (or torchrun --nproc-per-node W for python3)
"""Device time of every kernel of one comet call, by kernel, one GPU (profiler).

Experiment: where a call's time goes, kernel by kernel, and what a tile configuration
changes. A one-rank FusedMoE runs fused calls under torch.profiler; the CUDA time of each
kernel (plan kernels, layer kernels, combine, torch ops) is averaged per call. With
``--ep W`` the layer holds E/W experts, which gives one rank of an EP=W layer its GEMM
shapes (rows per local expert = tokens * top_k * W / E under uniform routing); with
``--tp T`` each expert's F/T shard (a (T, W) layout's rank: pass the tokens its GEMMs see,
T times a rank's own in the sequence convention). Under
torchrun the layer is a real expert-parallel one over all ranks, and each rank reports
its own kernels (``--modes fused comm_only`` shows what the communication alone costs).

    PYTHONPATH=. python3 scripts/device/kernel_times.py [--configs ...] [--tokens 128 4096]
        [--ep 2] [--tiles 128,128,256,8,3 128,128,256,8,3,4 comm_rows=64,lane_tail_rounds=0]
        [--max-tokens 16384]
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/kernel_times.py --modes fused comm_only
"""

import argparse
import gc
import json
import os

import torch

from comet.bench.provenance import write_result
from comet.cli.launch import init_ranks
from comet.config import PRESETS, TileConfig, preset
from comet.runtime.layer import FusedMoE

#: ``--tiles`` fields, in order; the last (layer1's column splits) may be left out.
TILE_FIELDS = ("block_m", "block_n0", "block_n1", "num_warps", "num_stages", "splits")
#: TileConfig fields recorded with every result (besides TILE_FIELDS).
RECORDED = ("comm_rows", "lane_head_rounds", "lane_tail_rounds", "layer0_gather",
            "layer0_live_rows", "layer0_stream_k", "layer1_scatter", "small_plan_blocks",
            "comm_entries", "comm_block_c", "local_comm_block_c", "reduce_step_elements")


def parse_tile(text: str) -> dict:
    """``--tiles`` entry: values of TILE_FIELDS in order, or ``field=value`` pairs of any
    TileConfig field, comma separated."""
    if "=" in text:
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
    return dict(zip(TILE_FIELDS, map(int, text.split(","))))


def rank_layer_inputs(name, tokens, ep=1, world=1, max_tokens=None, generator=None, tp=1):
    """``(cfg, experts, w13, w2)`` of one rank: preset ``name`` with ``1/ep`` of its
    experts and ``1/tp`` of their F (one rank of a (tp, ep) layout's GEMM shapes when
    ``world`` is 1), this rank's share of them as random weights, a workspace for
    ``max(tokens, max_tokens)`` tokens."""
    base = preset(name)
    experts = base.num_experts // ep
    el = experts // world
    cfg = base.replace(num_experts=experts, top_k=min(base.top_k, experts),
                       intermediate_size=base.intermediate_size // tp,
                       n_group=min(base.n_group, experts),
                       max_tokens=max(tokens, max_tokens or tokens))
    h, f = cfg.hidden_size, cfg.intermediate_size
    g = generator or torch.Generator(device="cuda").manual_seed(0)
    # drawn in the layer's dtype: an fp32 draw of DeepSeek-V3-like's 128 experts is 15 GB
    w13 = torch.randn(el, h, 2 * f, device="cuda", generator=g, dtype=cfg.dtype) * h ** -0.5
    w2 = torch.randn(el, f, h, device="cuda", generator=g, dtype=cfg.dtype) * f ** -0.5
    return cfg, experts, w13, w2


def run(name, tokens, ep=1, tile=None, mode="fused", world=1, calls=10, max_tokens=None,
        comm_blocks=None, decode_tile=None, tp=1):
    gc.collect()                # the previous record's layer and weights, before new ones
    torch.cuda.empty_cache()
    cfg, experts, w13, w2 = rank_layer_inputs(name, tokens, ep, world, max_tokens, tp=tp)
    h, f = cfg.hidden_size, cfg.intermediate_size
    el = w13.shape[0]
    layer = FusedMoE(cfg, w13, w2, tile=tile, use_graphs=False)
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:cfg.top_k]
                       for _ in range(tokens)])
    w = torch.rand(ids.shape, device="cuda")
    # A sequential call first, so the shared tensors hold this call's rows: a fresh
    # workspace is zeroed, and compute_only on zeros runs measurably faster than on data
    # (a power-limited GPU clocks higher when the tensor cores' inputs do not toggle).
    layer(x, ids, w, mode="sequential", comm_blocks=comm_blocks, decode_tile=decode_tile)
    for _ in range(3):
        layer(x, ids, w, mode=mode, comm_blocks=comm_blocks, decode_tile=decode_tile)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            layer(x, ids, w, mode=mode, comm_blocks=comm_blocks, decode_tile=decode_tile)
        torch.cuda.synchronize()
    layer.check_errors_now()
    per_kernel = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            per_kernel[e.key[:60]] = e.device_time_total / calls
    # torch's grouped GEMMs on the same rows (expert-sorted), device time per call.
    offs = torch.cumsum(torch.bincount(ids.flatten() % el, minlength=el), 0).to(torch.int32)
    a0 = torch.randn(ids.numel(), h, device="cuda", dtype=cfg.dtype)
    a1 = torch.randn(ids.numel(), f, device="cuda", dtype=cfg.dtype)
    b13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    b2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    for _ in range(3):
        torch._grouped_mm(a0, b13, offs=offs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch._grouped_mm(a0, b13, offs=offs)
            torch._grouped_mm(a1, b2, offs=offs)
        torch.cuda.synchronize()
    torch_us = sum(e.device_time_total for e in prof.key_averages()) / calls
    rec = dict(config=name, tokens=tokens, ep=ep, tp=tp, mode=mode, world=world,
               rank=layer.par.rank, torch_gmm_us=torch_us,
               tile={k: layer.last_tile.flat()[k] for k in TILE_FIELDS + RECORDED},
               comm_blocks=list(layer.last_comm_blocks),
               us_per_call=per_kernel, total_us=sum(per_kernel.values()))
    print(json.dumps(rec), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--ep", type=int, default=1, help="experts of one rank of EP=ep")
    ap.add_argument("--tp", type=int, default=1, help="F shards of one rank of TP=tp")
    ap.add_argument("--modes", nargs="+", default=["fused"],
                    help="FusedMoE modes: fused, sequential, compute_only, comm_only")
    ap.add_argument("--tiles", nargs="+", default=None,
                    metavar="BM,BN0,BN1,WARPS,STAGES[,SPLITS] or FIELD=V[,FIELD=V]")
    ap.add_argument("--decode-tile", nargs="+", default=["on"], choices=["on", "off", "force"],
                    help="on: the layer's choice; off: no decode tile "
                         "(TileConfig.decode_tile); force: the decode tile in every call")
    ap.add_argument("--comm-blocks", nargs="+", default=[None], metavar="N0,N1",
                    help="fixed comm-block splits to time (default: the layer's choice)")
    ap.add_argument("--calls", type=int, default=10, help="profiled calls per record")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="workspace size (default: the call's tokens), as a server sizes it")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "kernel_times.json"))
    args = ap.parse_args()
    shapes = [{}] if not args.tiles else [parse_tile(t) for t in args.tiles]
    tiles = [(TileConfig().with_fields(**shape,
                                       **({"decode_block_n1": 0} if d == "off" else {})),
              True if d == "force" else None)
             for shape in shapes for d in args.decode_tile]
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")     # NVLink multicast off, as the launchers
    _, world, rank = init_ranks()
    splits = [None if s is None else tuple(map(int, s.split(","))) for s in args.comm_blocks]
    recs = [run(c, t, args.ep, tile, mode, world, calls=args.calls,
                max_tokens=args.max_tokens, comm_blocks=n, decode_tile=decode, tp=args.tp)
            for c in args.configs for t in args.tokens for tile, decode in tiles
            for mode in args.modes for n in splits]
    if rank != 0:
        return
    write_result(args.out, {"records": recs})
    for r in recs:
        tile = ",".join(str(v) for v in r["tile"].values())
        k = r["us_per_call"]
        print(f"{r['config']:18s} {r['tokens']:6d} {r['mode']:12s} {tile:>16s} "
              f"split {str(r['comm_blocks']):8s} total {r['total_us']:8.1f} us"
              f"  layer0 {k.get('layer0_kernel', 0):8.1f}  layer1 {k.get('layer1_kernel', 0):8.1f}"
              f"  torch gmm {r['torch_gmm_us']:8.1f}")
        top = sorted(k.items(), key=lambda kv: -kv[1])[:6]
        print("      " + "  ".join(f"{name.split('<')[0][:28]} {us:.1f}" for name, us in top))


if __name__ == "__main__":
    main()
