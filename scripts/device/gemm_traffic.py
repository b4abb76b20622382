"""Hardware counters of comet's layer kernels and torch's grouped GEMMs, under Nsight Compute.

Experiment (with energy_probe.py): comet's compute-only call spends more energy per cycle
than torch's grouped GEMMs on the same rows. Energy in a GEMM that runs at the tensor
cores' rate goes to the tensor cores (the same for both: the same FLOPs) and to moving
bytes -- HBM, L2, shared memory -- and issuing instructions. This script makes each
variant's two GEMM kernels run once inside a profiled range, for ``ncu`` to count what
they move and issue:

    ncu --profile-from-start off --clock-control none --csv --page raw \\
        -k regex:'layer[01]_kernel|device_kernel|[Gg]emm' --section SpeedOfLight ... \\
        python3 scripts/device/gemm_traffic.py --ep 2 --tokens 4096 [--tiles ...] > ncu.csv
    python3 scripts/device/gemm_traffic.py --summarise ncu.csv

The profiled kernels come in the order printed to stderr (``label: kernels``): torch's
two grouped GEMMs (each after its small ``prepare_grouped_gemm_data`` kernel), then per
comet variant its layer0 and layer1 kernels (the plan kernels are filtered out by the
kernel-name regex).
"""

import argparse
import csv
import io
import json
import sys

#: Counters the summary keeps (those of the sections energy_probe's question needs).
KEEP = {
    "gpu__time_duration.sum": "time_ns",
    "sm__cycles_elapsed.max": "cycles",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_bytes.sum": "l2_bytes",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "l1tex__t_bytes.sum": "l1_bytes",
    "smsp__inst_executed.sum": "instructions",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
}


def profile(args):
    import torch

    from energy_probe import variants_for
    from kernel_times import parse_tile

    tiles = [{}] + [parse_tile(t) for t in args.tiles]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.configs:
        for tokens in args.tokens:
            _, calls = variants_for(name, tokens, args.ep, tiles, g)
            for label, fn in calls.items():
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"{name} {tokens} {label}: 2 kernels", file=sys.stderr, flush=True)
            calls.clear()
            torch.cuda.empty_cache()


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarise(path: str) -> list[dict]:
    """ncu's raw CSV (a header row, a units row, one row per kernel) -> one dict per
    kernel with the KEEP counters."""
    with open(path) as fh:
        text = fh.read()
    start = text.find('"ID"')
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, body = rows[0], rows[2:]
    out = []
    for row in body:
        rec = dict(zip(header, row))
        k = {"kernel": rec.get("Kernel Name", "")[:80]}
        for metric, short in KEEP.items():
            if metric in rec:
                k[short] = number(rec[metric])
        out.append(k)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["mixtral", "qwen2-moe"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--tiles", nargs="+", default=[])
    ap.add_argument("--summarise", metavar="NCU_CSV", help="summarise a profile, run nothing")
    # energy_probe.py's own options (rounds, seconds...) may come along: energy.sh passes
    # the probe's arguments on, so both profile the same variants.
    args, _ = ap.parse_known_args()
    if args.summarise:
        for k in summarise(args.summarise):
            print(json.dumps(k))
    else:
        profile(args)


if __name__ == "__main__":
    main()
