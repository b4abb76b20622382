"""Power draw and SM clock of each FusedMoE mode, back-to-back calls, sampled by nvidia-smi.

Experiment: is the overlap of communication with the GEMMs bounded by energy, not by
scheduling? These Hopper boards are power-limited: under a long GEMM the SM clock falls
until the board's power cap holds. If a compute_only call already runs at the cap, any
data movement beside it (the NVLink copies of a fused call) draws power the GEMM then
lacks, and the fused call cannot reach max(compute, comm) however its blocks are placed.
For each config, each ``--modes`` entry of ``FusedMoE`` runs back-to-back calls (its CUDA
graph) for ``--seconds``, after a warm-up that compiles and captures; one nvidia-smi
process samples every GPU of the machine every ``--interval-ms`` for the whole run.
Per mode window (its first 20% dropped: the clock settles) and per GPU: median and mean
power, SM and memory clocks, temperature, and the fraction of samples with the software
power cap (and the hardware slowdown) active; 1 s of idle GPUs before the first window,
and the board's power limit and max SM clock, are the baseline.

    PYTHONPATH=. python3 scripts/device/power_probe.py --ep 2 --configs mixtral
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/power_probe.py [--seconds 3]

Under torchrun the layer is a real expert-parallel one; the ranks are aligned before each
window, run the same number of calls, and rank 0 (which samples: one host) reports the
slowest rank's time per call. GPU indices are nvidia-smi's, not CUDA_VISIBLE_DEVICES'.
"""

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from datetime import datetime

import torch
import torch.distributed as dist

from comet.cli.launch import init_ranks
from comet.config import PRESETS
from comet.runtime.layer import MODES, FusedMoE
from kernel_times import rank_layer_inputs    # this folder is on sys.path
from paired_tiles import time_batch

FLAGS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown")
BASIC = ("index", "timestamp", "power.draw", "clocks.sm", "clocks.mem", "temperature.gpu")
QUERY = BASIC + tuple("clocks_event_reasons." + f for f in FLAGS)
SETTLE = 0.2      # fraction of a window dropped at its start


def parse_sample(line: str, fields=QUERY) -> dict | None:
    """One line of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits``:
    the timestamp as epoch seconds (local time, the clock of ``time.time()``), event
    reasons as bools ("Active"), other values as numbers, "[N/A]"-like values as None;
    None for a line that is not a sample (an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(fields):
        return None
    s = {}
    try:
        for k, v in zip(fields, parts):
            if v.startswith("[") or v == "N/A":
                s[k] = None
            elif k == "timestamp":
                s[k] = datetime.strptime(v, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            elif k.startswith("clocks_event_reasons."):
                s[k.split(".")[1]] = v == "Active"
            else:
                s[k] = int(v) if k == "index" else float(v)
    except ValueError:
        return None
    return s


def window_stats(samples: list[dict], t0: float, t1: float, settle: float = SETTLE) -> dict:
    """Per GPU index (a string), over the samples in the last ``1 - settle`` of
    ``[t0, t1]``: their number, median and mean of each measured value, and the fraction
    of samples with each event reason active (None where nothing was reported)."""
    lo = t0 + settle * (t1 - t0)
    by_gpu: dict[int, list[dict]] = {}
    for s in samples:
        if s["index"] is not None and s["timestamp"] is not None and lo <= s["timestamp"] <= t1:
            by_gpu.setdefault(s["index"], []).append(s)
    out = {}
    for gpu, ss in sorted(by_gpu.items()):
        r = {"samples": len(ss)}
        for k in BASIC[2:]:
            v = [s[k] for s in ss if s[k] is not None]
            r[k] = {"median": statistics.median(v), "mean": statistics.fmean(v)} if v else None
        for k in FLAGS:
            v = [s[k] for s in ss if s.get(k) is not None]
            r[k] = sum(v) / len(v) if v else None
        out[str(gpu)] = r
    return out


class Sampler:
    """One nvidia-smi process sampling every GPU into a temp file, for the whole run."""

    def __init__(self, interval_ms: int, notes: list[str]):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            notes.append("nvidia-smi not found: calls timed, no samples")
            return
        # An unsupported field (older drivers lack clocks_event_reasons) makes nvidia-smi
        # print an error and exit at once; a running one is sampling.
        for fields in (QUERY, BASIC):
            self.fields = fields
            self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            # Line-buffered: a file gets block-buffered output, lost when we stop it.
            cmd = (["stdbuf", "-oL"] if shutil.which("stdbuf") else []) + [
                "nvidia-smi", "--query-gpu=" + ",".join(fields),
                "--format=csv,noheader,nounits", "-lms", str(interval_ms)]
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT)
            deadline = time.time() + 3
            while self.proc.poll() is None and time.time() < deadline and not self.samples():
                time.sleep(0.05)
            if self.proc.poll() is None:
                return
            self.file.seek(0)
            notes.append(f"nvidia-smi --query-gpu={','.join(fields)} failed: "
                         f"{self.file.read().strip()[:300]!r}")
            self.proc = None
        notes.append("nvidia-smi sampling failed: calls timed, no samples")

    def samples(self) -> list[dict]:
        self.file.seek(0)
        return [s for line in self.file.read().splitlines()
                if (s := parse_sample(line, self.fields)) is not None]

    def stop(self) -> list[dict] | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.samples()


def board_limits() -> list[dict] | None:
    """Per GPU: power limit (W) and max SM clock (MHz), None without nvidia-smi."""
    fields = ("power.limit", "clocks.max.sm")
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(fields),
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [parse_sample(line, fields) for line in text.splitlines()]


def run(name, args, world, rank, split):
    g = torch.Generator(device="cuda").manual_seed(rank)
    cfg, experts, w13, w2 = rank_layer_inputs(name, args.tokens, args.ep, world, None, g)
    layer = FusedMoE(cfg, w13, w2)
    x = torch.randn(args.tokens, cfg.hidden_size, device="cuda", dtype=cfg.dtype, generator=g)
    ids = torch.rand(args.tokens, experts, device="cuda", generator=g).topk(cfg.top_k).indices
    w = torch.softmax(torch.randn(args.tokens, cfg.top_k, device="cuda", generator=g), -1)
    # The workspace holds this call's rows before any compute_only call: on a fresh
    # (zeroed) one the tensor cores' inputs do not toggle, and the GPU draws less power.
    layer(x, ids, w, mode="sequential", comm_blocks=split)
    recs = []
    for mode in args.modes:
        call = functools.partial(layer, mode=mode)
        for _ in range(3):              # compile, capture, first replay
            call(x, ids, w, comm_blocks=split)
        # Every rank must make the same calls: the count comes from the slowest rank.
        est = time_batch(call, x, ids, w, 5, split, world)
        calls = max(1, round(args.seconds * 1e6 / est))
        torch.cuda.synchronize()
        t0 = time.time()
        us = time_batch(call, x, ids, w, calls, split, world)
        recs.append(dict(config=name, tokens=args.tokens, ep=args.ep, world=world, mode=mode,
                         comm_blocks=list(layer.last_comm_blocks), calls=calls,
                         us_per_call=us, window=[t0, time.time()]))
    layer.check_errors_now()
    return recs


def cell(gpu: str, r: dict) -> str:
    p, c = (r[k]["median"] if r[k] else float("nan") for k in ("power.draw", "clocks.sm"))
    cap = "  - " if r["sw_power_cap"] is None else f"{r['sw_power_cap']:4.0%}"
    return f"g{gpu} {p:4.0f} W {c:5.0f} MHz {cap} capped"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+",
                    default=list(PRESETS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ep", type=int, default=1, help="experts of one rank of EP=ep")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seconds", type=float, default=3.0, help="back-to-back calls per mode")
    ap.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi sampling period")
    ap.add_argument("--comm-blocks", default=None, metavar="N0,N1",
                    help="a fixed split for every call (default: the layer's choice)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "power_probe.json"))
    args = ap.parse_args()
    _, world, rank = init_ranks()
    split = None if args.comm_blocks is None else tuple(map(int, args.comm_blocks.split(",")))
    notes = []
    sampler = Sampler(args.interval_ms, notes) if rank == 0 else None
    try:
        if world > 1:
            dist.barrier()
        idle = [time.time()]
        time.sleep(1.0)                 # every rank idle: the unloaded baseline
        idle.append(time.time())
        recs = []
        for name in args.configs:
            recs += run(name, args, world, rank, split)
            torch.cuda.empty_cache()
    finally:
        samples = sampler and sampler.stop()
    if rank != 0:
        return
    for r in recs:
        r["gpus"] = None if samples is None else window_stats(samples, *r["window"])
        print(f"{r['config']:18s} {r['tokens']:6d} {r['mode']:12s} {r['us_per_call']:9.1f} us  "
              + "  ".join(cell(g, s) for g, s in (r["gpus"] or {}).items()), flush=True)
    limits = board_limits()
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "world": world,
                   "power_limit_w": limits and [b and b["power.limit"] for b in limits],
                   "max_sm_clock_mhz": limits and [b and b["clocks.max.sm"] for b in limits],
                   "idle": {"window": idle, "gpus": None if samples is None else
                                                    window_stats(samples, *idle, 0)},
                   "records": recs, "notes": notes}, fh, indent=1)


if __name__ == "__main__":
    main()
