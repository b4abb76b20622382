"""Paired timing of layer0's two dispatches on ONE GPU: W virtual ranks, full model sizes.

Experiment: what does the dispatch by copy engines (``TileConfig.copy_dispatch``) cost or
save when no link is involved? W ranks of one EP group share one GPU
(:meth:`FusedMoE.virtual_group`, each on its own stream, calls concurrent): the push
copies each pair's row with SM stores into the peer's shared tensor (here: the same HBM),
the copy dispatch copies each rank's input with the copy engine (same-device memcpy)
and places rows with local loads and stores. What this shows is the placing side's
cost and the mechanics (graphs, copy streams, flags) at full size under drift; what it
cannot show is NVLink (``paired_tiles.py --tiles copy_dispatch=1`` under torchrun is
that measurement).

    PYTHONPATH=. python3 scripts/device/virtual_dispatch.py --world 2 --tokens 4096

Each round times ``--calls`` back-to-back concurrent calls of every variant (host clock
around a synchronised batch), the variants in rotation; ratios inside a round, medians
over rounds. Every variant's output is checked against the push's (bit for bit).
"""

import argparse
import json
import os
import statistics
import time

import torch

from comet.config import PRESETS, preset
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE
from comet.runtime.virtual import concurrent_forward
from comet.weights import interleave_gate_up
from paired_tiles import paired_rounds    # this folder is on sys.path

VARIANTS = {"push": TileConfig(), "copy": TileConfig(copy_dispatch=True)}


def group_inputs(name, tokens, world, g):
    """Every rank's weights (interleaved, shared by the variants) and one call's inputs."""
    cfg = preset(name, max_tokens=tokens)
    el, h, f = cfg.num_experts // world, cfg.hidden_size, cfg.intermediate_size
    w13 = [interleave_gate_up((torch.randn(el, h, 2 * f, device="cuda", generator=g)
                               * h ** -0.5).to(cfg.dtype)) for _ in range(world)]
    w2 = [(torch.randn(el, f, h, device="cuda", generator=g) * f ** -0.5).to(cfg.dtype)
          for _ in range(world)]
    xs = [torch.randn(tokens, h, device="cuda", generator=g).to(cfg.dtype)
          for _ in range(world)]
    ids = [torch.rand(tokens, cfg.num_experts, device="cuda", generator=g)
           .topk(cfg.top_k).indices for _ in range(world)]
    ws = [torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=g), -1)
          for _ in range(world)]
    return cfg, w13, w2, (xs, ids, ws)


def run(name, tokens, world, rounds, calls, comm_blocks):
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg, w13, w2, (xs, ids, ws) = group_inputs(name, tokens, world, g)
    groups = {v: FusedMoE.virtual_group(cfg, w13, w2, tile=t, w13_layout="interleaved")
              for v, t in VARIANTS.items()}
    streams = [torch.cuda.Stream() for _ in range(world)]

    def call(v):
        return concurrent_forward(groups[v], xs, ids, ws, streams, comm_blocks=comm_blocks)

    outs = {}
    for v in groups:                    # compile, capture, check
        for _ in range(3):
            outs[v] = call(v)
    torch.cuda.synchronize()
    same = {v: all(torch.equal(a, b) for a, b in zip(outs[v], outs["push"])) for v in outs}

    def batch(i):
        v = list(groups)[i]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call(v)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6 / calls

    times, ratios = paired_rounds(batch, len(groups), rounds)
    for layers in groups.values():
        for layer in layers:
            layer.check_errors_now()
    rec = dict(config=name, tokens=tokens, world=world, rounds=rounds, calls=calls,
               comm_blocks=list(groups["push"][0].last_comm_blocks),
               variants=list(groups), median_us=[statistics.median(t) for t in times],
               ratio_to_push=ratios, bit_identical_to_push=same, us=times)
    print(f"{name:18s} {tokens:6d} W={world} " + "  ".join(
        f"{v}: {statistics.median(t):8.1f} us ({q:.3f})"
        for v, t, q in zip(groups, times, ratios)) + f"  identical={same}", flush=True)
    groups.clear()
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--comm-blocks", default=None, metavar="N0,N1")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "virtual_dispatch.json"))
    args = ap.parse_args()
    split = None if args.comm_blocks is None else tuple(map(int, args.comm_blocks.split(",")))
    recs = [run(c, t, args.world, args.rounds, args.calls, split)
            for c in args.configs for t in args.tokens]
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
