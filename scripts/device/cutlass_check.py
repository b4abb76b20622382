"""Build comet's CUTLASS grouped GEMM reference and check it against torch, one GPU (SM90).

For the EP=4 per-rank GEMMs of the four presets (El = E/4 local experts; layer0: K=H, N=2F;
layer1: K=F, N=H) the CUTLASS op (comet.bench.cutlass_ref) runs on bf16 rows grouped by
expert and is compared with ``torch._grouped_mm`` (relative Frobenius error < 1e-2), then
both are timed (CUDA events, median of 30 after 5 warm-up calls). Row distributions:

* ``even``   -- 4096 tokens * top_k rows split evenly over the experts (timed, the headline);
* ``uneven`` -- the same rows in random counts, some experts with none (empty groups);
* ``small``  -- 128 tokens * top_k rows: few rows per expert (CUTLASS's pingpong tile).

torch is timed twice: on B with K contiguous (``torch_us``, its preferred layout, as in
gemm_check.py) and on B as the benchmark holds it, N contiguous (``torch_nmajor_us``); the
CUTLASS op always reads the N-contiguous B.

Headers: the wheel at ``--wheel`` (default wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl,
carried to the GPU machine as an ignored path) is unzipped to a temporary directory and
COMET_CUTLASS_DIR points there -- nothing is pip-installed. An already set COMET_CUTLASS_DIR,
or a missing wheel with nvidia-cutlass installed, is used as it is. nvcc: CUDA_HOME,
/usr/local/cuda, PATH (comet.bench.cutlass_ref.find_nvcc).

    PYTHONPATH=. python3 scripts/device/cutlass_check.py [--configs mixtral ...]

Prints one JSON line per GEMM, a table, the build time; writes $OUT/cutlass_check.json.
Exit status 1 if the op is unavailable or any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zipfile

import torch

from comet.bench.cutlass_ref import load_cutlass_grouped_mm
from comet.config import PRESETS, preset
from gemm_check import median_us   # same folder: scripts/device

WORLD = 4
TOL = 1e-2
WHEEL = "wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl"
CONFIGS = list(PRESETS)
HEADER_PREFIX = "cutlass_library/source/"


def use_wheel_headers(wheel: str, tmp: str) -> str:
    """Where the headers come from (unzipping ``wheel``'s include trees if it is needed)."""
    if os.environ.get("COMET_CUTLASS_DIR"):
        return f"COMET_CUTLASS_DIR={os.environ['COMET_CUTLASS_DIR']} (already set)"
    if not os.path.isfile(wheel):
        return f"{wheel} missing; the installed cutlass_library, if any"
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(
            (HEADER_PREFIX + "include/", HEADER_PREFIX + "tools/util/include/"))]
        z.extractall(tmp, names)
    os.environ["COMET_CUTLASS_DIR"] = os.path.join(tmp, HEADER_PREFIX)
    return f"{wheel} ({len(names)} header files unzipped)"


def split_rows(total: int, groups: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind != "uneven":
        base = [total // groups] * groups
        for i in range(total - sum(base)):
            base[i] += 1
        return base
    # A random share per expert; a quarter of the experts (at least one) get nothing.
    weights = torch.rand(groups, generator=gen)
    weights[torch.randperm(groups, generator=gen)[:max(1, groups // 4)]] = 0
    counts = torch.distributions.Multinomial(total, probs=weights / weights.sum()).sample()
    return [int(c) for c in counts]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def check(mm, name: str, layer: str, a: torch.Tensor, b: torch.Tensor, rows: list[int],
          dist: str) -> dict:
    el, k, n = b.shape
    offs = torch.tensor(rows, device=a.device).cumsum(0).to(torch.int32)
    b_kmajor = b.transpose(1, 2).contiguous().transpose(1, 2)
    out = mm(a, b, rows)
    ref = torch._grouped_mm(a, b_kmajor, offs=offs)
    err = rel_err(out, ref)
    cutlass_us = median_us(lambda: mm(a, b, rows), iters=30)
    torch_us = median_us(lambda: torch._grouped_mm(a, b_kmajor, offs=offs), iters=30)
    try:
        torch_nmajor_us = median_us(lambda: torch._grouped_mm(a, b, offs=offs), iters=30)
    except RuntimeError as e:   # report, don't hide
        print(f"torch._grouped_mm on N-major B failed: {str(e)[:200]}", file=sys.stderr)
        torch_nmajor_us = None
    flop = 2.0 * a.shape[0] * k * n
    live = [r for r in rows if r]
    rec = dict(config=name, layer=layer, rows_dist=dist, experts=el, rows=a.shape[0],
               empty_groups=el - len(live), avg_rows=a.shape[0] / max(len(live), 1), K=k, N=n,
               rel_err=err, ok=err < TOL, cutlass_us=cutlass_us, torch_us=torch_us,
               torch_nmajor_us=torch_nmajor_us,
               cutlass_tflops=flop / cutlass_us / 1e6, torch_tflops=flop / torch_us / 1e6)
    rec["ratio"] = rec["cutlass_tflops"] / rec["torch_tflops"]
    print(json.dumps(rec), flush=True)
    return rec


def run_config(mm, name: str, tokens: int, small_tokens: int) -> list[dict]:
    cfg = preset(name)
    el, h, f = cfg.num_experts // WORLD, cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    w13 = (torch.randn(el, h, 2 * f, device=dev) * h ** -0.5).bfloat16()
    w2 = (torch.randn(el, f, h, device=dev) * f ** -0.5).bfloat16()
    recs = []
    for dist, tok in (("even", tokens), ("uneven", tokens), ("small", small_tokens)):
        rows = split_rows(tok * cfg.top_k, el, dist, gen)
        total = sum(rows)
        recs.append(check(mm, name, "layer0", torch.randn(total, h, device=dev).bfloat16(),
                          w13, rows, dist))
        recs.append(check(mm, name, "layer1", torch.randn(total, f, device=dev).bfloat16(),
                          w2, rows, dist))
    del w13, w2
    torch.cuda.empty_cache()
    return recs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--small-tokens", type=int, default=128)
    ap.add_argument("--wheel", default=WHEEL)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "cutlass_check.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        result["headers"] = use_wheel_headers(args.wheel, tmp)
        t0 = time.perf_counter()
        mm, note = load_cutlass_grouped_mm(torch.device("cuda"))
        result["build_s"] = time.perf_counter() - t0
    result["note"] = note
    print(f"headers: {result['headers']}\n{note}\nbuild/load time: {result['build_s']:.1f} s",
          flush=True)
    recs: list[dict] = []
    if mm is not None:
        for name in args.configs:
            recs += run_config(mm, name, args.tokens, args.small_tokens)
    result["records"] = recs
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{'config':17s} {'layer':6s} {'rows':7s} {'El':>3s} {'R':>6s} {'K':>5s} {'N':>6s} "
          f"{'err':>8s} {'CUTLASS TF/s':>12s} {'torch TF/s':>10s} {'ratio':>6s} "
          f"{'torch N-maj us':>14s}")
    for r in recs:
        nmaj = f"{r['torch_nmajor_us']:14.1f}" if r["torch_nmajor_us"] is not None else " " * 14
        print(f"{r['config']:17s} {r['layer']:6s} {r['rows_dist']:7s} {r['experts']:3d} "
              f"{r['rows']:6d} {r['K']:5d} {r['N']:6d} {r['rel_err']:8.1e} "
              f"{r['cutlass_tflops']:12.0f} {r['torch_tflops']:10.0f} {r['ratio']:6.2f} {nmaj}")
    print(f"build/load time: {result['build_s']:.1f} s; wrote {args.out}")
    return 0 if mm is not None and all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
