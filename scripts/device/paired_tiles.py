"""Paired timing of tile-configuration variants of the fused layer, whole calls back to back.

Experiment: does a TileConfig change (a lane shape, a chunk size) pay, when the effect
(1-5%) is smaller than what clocks move between two records on these power-limited GPUs
(torch's own GEMM moved 9% between neighbouring records of ``kernel_times.py``)? One
layer per variant is built on the same weights and inputs; then, round after round, each
variant runs ``--calls`` back-to-back calls (its CUDA graph after the first) timed with
CUDA events, the variants in a rotating order. Each round's times are divided by the
first variant's of the same round, and the median of those ratios over rounds is the
answer: slow drift of the clocks cancels out.

    PYTHONPATH=. python3 scripts/device/paired_tiles.py --ep 2 --configs mixtral \\
        --tokens 4096 --tiles lane_head_rounds=0,lane_tail_rounds=0 comm_rows=64
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/paired_tiles.py ...

The first variant is always the default TileConfig (the reference of the ratios). Under
torchrun every rank runs the same schedule (the ranks are aligned before each batch) and
rank 0 reports the slowest rank's time per batch.
"""

import argparse
import dataclasses
import json
import os
import statistics

import torch
import torch.distributed as dist

from comet.cli.launch import init_ranks
from comet.config import PRESETS
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE
from kernel_times import parse_tile, rank_layer_inputs    # this folder is on sys.path


def batch_us(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` back-to-back calls of ``fn`` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def slowest_rank(us: float, world: int) -> float:
    """The largest of every rank's ``us`` (collective when ``world > 1``)."""
    if world == 1:
        return us
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def time_batch(layer, x, ids, w, calls, comm_blocks, world):
    if world > 1:
        dist.barrier()
    us = batch_us(lambda: layer(x, ids, w, comm_blocks=comm_blocks), calls)
    return slowest_rank(us, world)


def paired_rounds(run_batch, n_variants, rounds):
    """``run_batch(i)`` for every variant ``i``, round after round, the variants in a
    rotating order: ``(times per variant, median over rounds of each variant's time over
    variant 0's in the same round)``."""
    times = [[] for _ in range(n_variants)]
    for r in range(rounds):
        for i in [(i + r) % n_variants for i in range(n_variants)]:
            times[i].append(run_batch(i))
    ratios = [statistics.median(t / b for t, b in zip(times[i], times[0]))
              for i in range(n_variants)]
    return times, ratios


def run(name, tokens, variants, ep, world, rank, rounds, calls, comm_blocks, max_tokens):
    g = torch.Generator(device="cuda").manual_seed(rank)
    cfg, experts, w13, w2 = rank_layer_inputs(name, tokens, ep, world, max_tokens, g)
    h = cfg.hidden_size
    layers = [FusedMoE(cfg, w13, w2, tile=dataclasses.replace(TileConfig(), **v))
              for v in variants]
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype, generator=g)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(cfg.top_k).indices
    w = torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=g), -1)
    for layer in layers:            # compile, capture, and the first call's rows in place
        for _ in range(3):
            layer(x, ids, w, comm_blocks=comm_blocks)
    torch.cuda.synchronize()
    times, ratios = paired_rounds(
        lambda i: time_batch(layers[i], x, ids, w, calls, comm_blocks, world),
        len(variants), rounds)
    for layer in layers:
        layer.check_errors_now()
    rec = dict(config=name, tokens=tokens, ep=ep, world=world, rounds=rounds, calls=calls,
               comm_blocks=list(layers[0].last_comm_blocks),
               variants=variants, median_us=[statistics.median(t) for t in times],
               ratio_to_first=ratios, us=times)
    if rank == 0:
        print(f"{name:18s} {tokens:6d} " + "  ".join(
            f"{json.dumps(v) if v else 'default'}: {statistics.median(t):8.1f} us "
            f"({q:.3f})" for v, t, q in zip(variants, times, ratios)), flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return rec


def paired_args(name: str, tokens: list[int], ep: int, rounds: int, calls: int):
    """The arguments every paired experiment takes (what to run, how often, where the
    JSON goes: ``$OUT/<name>.json``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=tokens)
    ap.add_argument("--ep", type=int, default=ep, help="experts of one rank of EP=ep")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, default=calls, help="back-to-back calls per batch")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), f"{name}.json"))
    return ap


def main():
    ap = paired_args("paired_tiles", [4096], 1, 15, 10)
    ap.add_argument("--tiles", nargs="+", default=[], metavar="FIELD=V[,FIELD=V]",
                    help="variants timed against the default TileConfig")
    ap.add_argument("--comm-blocks", default=None, metavar="N0,N1",
                    help="a fixed split for every variant (default: the layer's choice)")
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()
    _, world, rank = init_ranks()
    variants = [{}] + [parse_tile(t) for t in args.tiles]
    split = None if args.comm_blocks is None else tuple(map(int, args.comm_blocks.split(",")))
    recs = [run(c, t, variants, args.ep, world, rank, args.rounds, args.calls, split,
                args.max_tokens)
            for c in args.configs for t in args.tokens]
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
