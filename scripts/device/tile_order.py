"""Does the order of the m-tile table cost GEMM time on many small experts?

Experiment (it led to kernel revision 9's order). Up to revision 8 the tile table was
local-first: at EP=W every tile whose rows all come from this rank ran before any tile
waiting for a peer, so an expert with rows from several
sources has its m-tiles in several stages, far apart in the table -- and each stage reads
that expert's weights again (no two m-tiles of the expert run on a column block at the
same time, so L2 cannot share it). With ~256 rows per expert (deepseek-v3-like at 4096
tokens/rank, EP=2) weight reads, not FLOPs, may bound layer0.

One GPU, one rank holding 1/``--ep`` of the experts (the per-rank GEMM shapes of EP=ep),
all rows local, compute_only calls (the two GEMMs alone: no waiting, no reduce, no
combine, so the layer's output is not written):

* ``expert-major`` -- the table as built with one source: an expert's tiles adjacent;
* ``stages=S`` -- the same tiles re-ordered the way a local-first table of EP=S orders
  them: each expert's rows cut into S equal segments standing for the S sources, a tile's
  stage that of its last row, stage by stage.

Paired rounds (variants in rotating order, ``--calls`` back-to-back graph replays each);
the median of per-round ratios to expert-major is the answer.

    PYTHONPATH=. python3 scripts/device/tile_order.py --ep 2 --stages 2 4 \\
        --configs deepseek-v3-like mixtral --tokens 4096 16384
"""

import json
import statistics

import torch

from comet.kernels import launch as L
from comet.runtime.layer import FusedMoE
from kernel_times import rank_layer_inputs    # this folder is on sys.path
from paired_tiles import paired_args, paired_rounds

_build_layout = L.launch_layout


def _staged_layout(ws, cfg, tile):
    """The layout kernel, then (for a layer marked with ``ws.emulated_stages``) its tile
    table re-sorted by emulated stage; device ops only, so graphs capture it."""
    _build_layout(ws, cfg, tile)
    stages = getattr(ws, "emulated_stages", 1)
    if stages <= 1:
        return
    p = ws.plan
    cap = p["tile_expert"].shape[0]
    idx = torch.arange(cap, device=p["tile_expert"].device)
    live = idx < p["num_tiles"].long()
    expert = p["tile_expert"].long()
    # An expert's rows: from its first tile's start to its last tile's end.
    start, end = p["tile_row_start"].long(), p["tile_row_end"].long()
    el = int(cfg.num_experts)
    first = torch.full((el,), 2 ** 62, dtype=torch.int64, device=idx.device)
    last = torch.zeros(el, dtype=torch.int64, device=idx.device)
    e = torch.where(live, expert, 0)
    first.scatter_reduce_(0, e, torch.where(live, start, 2 ** 62), "amin")
    last.scatter_reduce_(0, e, torch.where(live, end, 0), "amax")
    span = (last - first).clamp(min=1)[e]
    stage = ((end - 1 - first[e]) * stages // span).clamp(0, stages - 1)
    key = torch.where(live, stage * cap + idx, stages * cap + idx)
    order = torch.argsort(key)
    for name in ("tile_expert", "tile_row_start", "tile_row_end", "tile_wait", "tile_stage"):
        p[name].copy_(p[name][order])


def time_batch(layer, x, ids, w, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        layer(x, ids, w, mode="compute_only")
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def run(name, tokens, ep, stages, rounds, calls):
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg, experts, w13, w2 = rank_layer_inputs(name, tokens, ep, 1, None, g)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=cfg.dtype, generator=g)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(cfg.top_k).indices
    w = torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=g), -1)
    variants = [1] + list(stages)
    layers = []
    for s in variants:
        layer = FusedMoE(cfg, w13, w2)
        layer.ws.emulated_stages = s
        layers.append(layer)
    for layer in layers:
        layer(x, ids, w, mode="sequential")     # rows in place (zeros clock higher)
        for _ in range(3):
            layer(x, ids, w, mode="compute_only")
    torch.cuda.synchronize()
    times, ratios = paired_rounds(lambda i: time_batch(layers[i], x, ids, w, calls),
                                  len(variants), rounds)
    rec = dict(config=name, tokens=tokens, ep=ep, variants=["expert-major"] + [
        f"stages={s}" for s in stages], median_us=[statistics.median(t) for t in times],
        ratio_to_first=ratios, us=times)
    print(f"{name:18s} {tokens:6d} " + "  ".join(
        f"{v}: {m:8.1f} us ({q:.3f})" for v, m, q in
        zip(rec["variants"], rec["median_us"], ratios)), flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return rec


def main():
    ap = paired_args("tile_order", [4096, 16384], 2, 10, 8)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    L.launch_layout = _staged_layout
    recs = [run(c, t, args.ep, args.stages, args.rounds, args.calls)
            for c in args.configs for t in args.tokens]
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
