"""How far small FP8 calls land from the emulation on each GEMM (issue 68).

A one-rank FP8 layer runs calls of at least ``Variant.fp8_ws_min_rows`` expected rows per
expert (4 by default) on the warp-specialized GEMMs, which promote each 128-K step, and
the smaller ones on the ``tl`` kernels, which promote every 32 K. The warp-specialized
GEMMs run small calls faster, but the fewer products a call sums per output, the wider
per-128's error spreads. This script measures it: the four presets at full size, 1-32
tokens, three routings each, every call once with the layer's defaults and once with
``fp8_ws_min_rows=1`` (the warp-specialized GEMMs for every call they take), each against
the fp32 emulation (rel L2 <= 5e-3; atol = rtol = 0.035, reported as the worst ``|y - e|
/ (atol + rtol |e|)``, which must stay <= 1) and against the bf16 layer (calc_diff no more
than 1.1x the emulation's own). Results: docs/precision.md (`fp8_ws_min_rows`).

    PYTHONPATH=.:tests python scripts/device/fp8_small_accuracy.py --output $OUT/acc.json
"""

from __future__ import annotations

import argparse

import torch

from comet.bench.provenance import write_result
from comet.config import PRESETS
from comet.quant import Fp8, calc_diff
from comet.runtime.layer import FusedMoE, default_tile
from test_gpu_fp8 import REL_L2, TOL, _bf16, _emulate, _experts, _inputs

ROUTINGS = ("random", "skewed", "random")


def measure(y: torch.Tensor, expect: torch.Tensor, bf16: torch.Tensor) -> dict:
    y = y.float()
    err = (y - expect).abs() / (TOL["atol"] + TOL["rtol"] * expect.abs())
    return {"rel_l2": float((y - expect).norm() / expect.norm().clamp_min(1e-6)),
            "tol_ratio": float(err.max()),
            "calc_diff_ratio": float(calc_diff(y, bf16) / calc_diff(expect, bf16))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", nargs="+",
                   default=["mixtral", "qwen2-moe", "deepseek-v3-like", "phi3.5-moe"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 5, 8, 16, 32])
    p.add_argument("--output", default="out/fp8_small_accuracy.json")
    a = p.parse_args()
    records = []
    for name in a.configs:
        cfg = PRESETS[name].replace(max_tokens=max(a.tokens), fp8=Fp8())
        gu, dn, gu8, dn8 = _experts(cfg, 21)
        layers = {m: FusedMoE(cfg, gu8, dn8, check_errors="sync",
                              tile=default_tile(cfg=cfg).with_fields(fp8_ws_min_rows=m))
                  for m in (default_tile(cfg=cfg).variant.fp8_ws_min_rows, 1)}
        for tokens in a.tokens:
            for seed, kind in enumerate(ROUTINGS):
                (x,), (i,), (w,) = _inputs(cfg, [tokens], 1000 * tokens + seed, kind)
                expect = _emulate(x, i, w, gu8, dn8, cfg.activation)
                bf16 = _bf16(x, i, w, gu, dn, cfg.activation)
                for min_rows, layer in layers.items():
                    y = layer(x, i, w)
                    records.append({
                        "config": name, "tokens": tokens, "routing": kind, "seed": seed,
                        "fp8_ws_min_rows": min_rows,
                        "ran_ws": layer.last_tile.variant.fp8_ws_min_rows > 0,
                        **measure(y, expect, bf16)})
        del layers
        torch.cuda.empty_cache()
    worst = {}
    for r in records:
        key = (r["config"], r["fp8_ws_min_rows"], r["ran_ws"])
        w = worst.setdefault(key, {"rel_l2": 0.0, "tol_ratio": 0.0, "calc_diff_ratio": 0.0,
                                   "tokens": []})
        for f in ("rel_l2", "tol_ratio", "calc_diff_ratio"):
            w[f] = max(w[f], r[f])
        w["tokens"] = sorted(set(w["tokens"]) | {r["tokens"]})
    summary = [{"config": c, "fp8_ws_min_rows": m, "ran_ws": ws, **v,
                "within_bounds": v["rel_l2"] <= REL_L2 and v["tol_ratio"] <= 1
                and v["calc_diff_ratio"] <= 1.1}
               for (c, m, ws), v in sorted(worst.items())]
    for s in summary:
        print(f"{s['config']:<18} min_rows={s['fp8_ws_min_rows']} "
              f"{'ws' if s['ran_ws'] else 'tl'}: worst rel L2 {s['rel_l2']:.2e} "
              f"(bound {REL_L2}), tol {s['tol_ratio']:.2f} (<= 1), calc_diff "
              f"{s['calc_diff_ratio']:.2f}x the emulation's (<= 1.1), tokens {s['tokens']}")
    write_result(a.output, {"bounds": {"rel_l2": REL_L2, **TOL, "calc_diff_ratio": 1.1},
                            "summary": summary, "records": records})


if __name__ == "__main__":
    main()
