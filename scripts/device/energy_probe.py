"""Energy and cycles per call of comet's GEMMs against torch's grouped GEMM, one GPU.

Experiment: on these power-limited boards (700 W) a long run of GEMMs pulls the SM clock
down until the cap holds, so back to back a call's time is its energy over the cap.
comet's compute-only call is as fast as torch's grouped GEMMs on the same rows when both
start rested (the sweep's phase timers: ``compute eff`` 0.95-1.11 at >= 4096 tokens), yet
2-9% slower back to back, and the power probes caught it at a lower SM clock at the same
power (qwen2-moe 4096: 1560 against torch's 1695 MHz; deepseek-v3-like 1365 against
1508; ``h200x2-overlap-bound-power.json``): it takes fewer cycles but more energy per
cycle. This script measures both per call, so that a tile knob can be judged by the
energy it saves, not only by its rested time.

For each config and token count (one rank of EP=``--ep``'s GEMM shapes; the rows are
this rank's pairs, expert-sorted): ``torch`` is ``torch._grouped_mm`` with W13 then W2 on
the layer's rows (the sweep's ``torch_gmm`` reference: no routing, no activation),
``comet`` comet's compute-only call (routing plan, both layer kernels) with the default
TileConfig, then each ``--tiles`` variant of it. Round after round, the variants in a
rotating order, each runs back-to-back calls for ``--seconds`` while nvidia-smi samples
power and SM clock every ``--interval-ms``: per window, us per call, median power and
clock (its first 20% dropped), so millijoules per call (power x time) and megacycles per
call (clock x time). Ratios to ``torch`` are taken inside each round, the median over
rounds reported. ``rested_us``: single calls each after ~20 ms of GPU sleep (the clock
has recovered, the call is issued before its start event), median -- the time at full
clock.

    PYTHONPATH=. python3 scripts/device/energy_probe.py --ep 2 --tokens 4096 16384 \\
        --tiles num_stages=4 block_k=128,num_stages=2
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from comet.config import PRESETS
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE
from kernel_times import parse_tile, rank_layer_inputs    # this folder is on sys.path
from paired_tiles import batch_us
from power_probe import Sampler, board_limits, window_stats

#: GPU sleep before each rested call: long enough for the SM clock to recover from the
#: previous window's power cap (the cap's controller acts in milliseconds), and for the
#: host to have issued the whole call before the start event (comet's call stages its
#: inputs on the host: timed from an idle GPU, it measured the host).
REST_CYCLES = 40_000_000


def rested_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(REST_CYCLES)
        times.append(batch_us(fn, 1))
    return statistics.median(times)


def variants_for(name, tokens, ep, tiles, generator):
    """``{label: call}``: torch's grouped GEMMs and comet's compute-only call per tile,
    on the same weights, inputs and rows."""
    cfg, experts, w13, w2 = rank_layer_inputs(name, tokens, ep, 1, None, generator)
    h, f = cfg.hidden_size, cfg.intermediate_size
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype, generator=generator)
    ids = torch.rand(tokens, experts, device="cuda", generator=generator).topk(cfg.top_k).indices
    w = torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=generator), -1)
    offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=experts), 0).to(torch.int32)
    a0 = torch.randn(ids.numel(), h, device="cuda", dtype=cfg.dtype, generator=generator)
    a1 = torch.randn(ids.numel(), f, device="cuda", dtype=cfg.dtype, generator=generator)

    def torch_gmm():
        torch._grouped_mm(a0, w13, offs=offs)
        torch._grouped_mm(a1, w2, offs=offs)

    calls = {"torch": torch_gmm}
    for tile in tiles:
        label = "comet" if not tile else "comet " + ",".join(f"{k}={v}" for k, v in tile.items())
        try:
            layer = FusedMoE(cfg, w13, w2, tile=dataclasses.replace(TileConfig(), **tile))
            # The rows in place first: a fresh workspace is zeroed, and on zeros the
            # tensor cores draw less power (the clock, and so the time, would flatter).
            layer(x, ids, w, mode="sequential")
            for _ in range(3):          # compile, capture, first replay
                layer(x, ids, w, mode="compute_only")
            layer.check_errors_now()
        except Exception as e:          # noqa: BLE001 -- a tile the GPU cannot run
            print(f"{name} {tokens} {label}: skipped ({type(e).__name__}: {str(e)[:200]})",
                  flush=True)
            continue
        calls[label] = (lambda layer=layer: layer(x, ids, w, mode="compute_only"))
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    return cfg, calls


def window(samples, t0, t1) -> tuple[float | None, float | None]:
    """Median board power (W) and SM clock (MHz) of GPU 0 over ``[t0, t1]``."""
    stats = window_stats(samples or [], t0, t1).get("0")
    if not stats or not stats["power.draw"] or not stats["clocks.sm"]:
        return None, None
    return stats["power.draw"]["median"], stats["clocks.sm"]["median"]


def run(name, tokens, args, tiles, sampler, g):
    cfg, calls = variants_for(name, tokens, args.ep, tiles, g)
    labels = list(calls)
    est = {k: batch_us(fn, 3) for k, fn in calls.items()}
    n_calls = {k: max(2, round(args.seconds * 1e6 / est[k])) for k in labels}
    # One untimed window of each first: a GPU that has idled through compilation starts
    # below the power cap, and a short first round would report its clock, not the cap's.
    for k in labels:
        batch_us(calls[k], n_calls[k])
    rounds = []
    for r in range(args.rounds):
        got = {}
        for k in [labels[(i + r) % len(labels)] for i in range(len(labels))]:
            torch.cuda.synchronize()
            t0 = time.time()
            us = batch_us(calls[k], n_calls[k])
            got[k] = dict(us=us, window=[t0, time.time()])
        rounds.append(got)
    samples = sampler.samples() if sampler.proc is not None else []
    for got in rounds:
        for v in got.values():
            p, clk = window(samples, *v["window"])
            v.update(power_w=p, sm_mhz=clk,
                     mj=None if p is None else p * v["us"] * 1e-3,
                     mcycles=None if clk is None else clk * v["us"] * 1e-6)
    rested = {k: rested_us(fn, args.rested_calls) for k, fn in calls.items()}

    def med(k, field):
        vals = [got[k][field] for got in rounds if got[k][field] is not None]
        return statistics.median(vals) if vals else None

    def ratio(k, field):
        vals = [got[k][field] / got["torch"][field] for got in rounds
                if got[k][field] is not None and got["torch"][field]]
        return statistics.median(vals) if vals else None

    out = {}
    for k in labels:
        out[k] = {f: med(k, f) for f in ("us", "power_w", "sm_mhz", "mj", "mcycles")}
        out[k]["rested_us"] = rested[k]
        out[k]["over_torch"] = {f: ratio(k, f) for f in ("us", "mj", "mcycles")}
        out[k]["over_torch"]["rested_us"] = rested[k] / rested["torch"]
    h, f = cfg.hidden_size, cfg.intermediate_size
    rows = tokens * cfg.top_k
    rec = dict(config=name, tokens=tokens, ep=args.ep, rounds=args.rounds,
               seconds=args.seconds, calls=n_calls,
               gemm_tflop=2 * rows * h * 3 * f * 1e-12, variants=out, raw=rounds)
    for k in labels:
        v, q = out[k], out[k]["over_torch"]
        fmt = lambda x, s="{:7.0f}": "    n/a" if x is None else s.format(x)  # noqa: E731
        print(f"{name:17s} {tokens:6d} {k:34s} b2b {v['us']:8.1f} us ({fmt(q['us'], '{:.3f}')})"
              f"  rested {v['rested_us']:8.1f} ({q['rested_us']:.3f})"
              f"  {fmt(v['power_w'])} W {fmt(v['sm_mhz'])} MHz"
              f"  {fmt(v['mj'], '{:7.2f}')} mJ ({fmt(q['mj'], '{:.3f}')})"
              f"  {fmt(v['mcycles'], '{:6.2f}')} Mcyc ({fmt(q['mcycles'], '{:.3f}')})",
              flush=True)
    calls.clear()
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--ep", type=int, default=2, help="experts of one rank of EP=ep")
    ap.add_argument("--tiles", nargs="+", default=[], metavar="FIELD=V[,FIELD=V]",
                    help="comet variants timed beside the default TileConfig")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=0.5, help="back-to-back window")
    ap.add_argument("--rested-calls", type=int, default=7)
    ap.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi sampling period")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "energy_probe.json"))
    args = ap.parse_args()
    tiles = [{}] + [parse_tile(t) for t in args.tiles]
    notes: list[str] = []
    sampler = Sampler(args.interval_ms, notes)
    g = torch.Generator(device="cuda").manual_seed(0)
    recs = []
    try:
        for name in args.configs:
            for tokens in args.tokens:
                recs.append(run(name, tokens, args, tiles, sampler, g))
                with open(args.out, "w") as fh:       # what ran survives a timeout
                    json.dump(dict(device=torch.cuda.get_device_name(),
                                   limits=board_limits(), notes=notes, records=recs),
                              fh, indent=1)
    finally:
        sampler.stop()
    for n in notes:
        print("note:", n)


if __name__ == "__main__":
    main()
