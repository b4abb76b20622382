# usage: PYTHONPATH=. python scripts/device/fp8_paired_layer_equal.py
"""The one-rank FP8 layer at qwen2-moe size with and without paired m-tiles
(``Variant.fp8_ws_paired_rows=128``, both with ``fp8_ws_min_rows=128``) over 60 drifting
calls of 1-4096 tokens: whether their outputs are equal byte for byte, and how far each
lies past issue 68's elementwise bound (atol = rtol = 0.035) from the fp32 emulation.
Prints a line per call once either exceeds it, then the totals (one GPU)."""

import sys

import torch

sys.path.insert(0, "tests")
from comet.config import PRESETS  # noqa: E402
from comet.quant import Fp8  # noqa: E402
from comet.runtime.layer import FusedMoE, default_tile  # noqa: E402
from test_gpu_fp8 import TOL, _emulate, _experts, _inputs  # noqa: E402

cfg = PRESETS["qwen2-moe"].replace(max_tokens=4096, fp8=Fp8())
gu, dn, gu8, dn8 = _experts(cfg, 0)
layers = {}
for paired in (False, True):
    tile = default_tile(cfg=cfg).with_fields(fp8_ws_min_rows=128, fp8_ws_paired_rows=128 if paired else 0)
    layers[paired] = FusedMoE(cfg, gu8, dn8, check_errors="sync", tile=tile)
drift = [int(v) for v in torch.randint(1, 4097, (60, ), generator=torch.Generator().manual_seed(6))]
xs, ids, ws = _inputs(cfg, drift, 7)
neq, worst = 0, {False: 0.0, True: 0.0}
for n, x, i, w in zip(drift, xs, ids, ws):
    y = {p: layers[p](x, i, w) for p in (False, True)}
    e = _emulate(x, i, w, gu8, dn8, cfg.activation)
    same = torch.equal(y[False], y[True])
    neq += not same
    for p in (False, True):
        d = (y[p].float() - e).abs() - (TOL["atol"] + TOL["rtol"] * e.abs())
        worst[p] = max(worst[p], float(d.max()))
    if not same or worst[True] > 0:
        print(n, "paired on:", layers[True].last_tile.variant.fp8_ws_paired_rows, "equal", same,
              "excess over tol: unpaired %.4f paired %.4f" % (worst[False], worst[True]), flush=True)
print("calls", len(drift), "unequal", neq, "worst excess over atol+rtol: unpaired", worst[False], "paired", worst[True])
