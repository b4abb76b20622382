# usage: PYTHONPATH=. OUT=out python scripts/device/fp8_ws_probe.py [--base TREE] [--configs ...] [--tokens ...] [--no-gather] [--pairs] [--k-sweep [K ...]]
"""layer0's warp-specialized FP8 GEMM (comet.kernels.fp8_ws, gated: the activation and h's
requantization in its epilogue) at the presets' prefill shapes, on one GPU in one call.

For each preset and token count: ``tokens * top_k`` rows spread evenly over the experts,
each a copy of one of ``tokens`` quantized token rows (as a dispatch places them); the
layer's ``[E, 2F, H]`` weights in 128x128 blocks; a persistent grid of one program per SM,
as the layer launches it (before ``a0b81fd``: one program per item, which hid whatever
overlaps items). Timed (do_bench medians, two alternating rounds, the faster kept):

* ``gated``      -- this tree's kernel, as layer0 runs it on placed rows;
* ``gather-gated`` -- the same reading each row through the index from the tokens'
  packed rows (``A_GATHER``: no row copied per pair; ``--no-gather`` leaves it out);
* ``base-gated`` -- with ``--base TREE``, that tree's ``comet/kernels/fp8_ws.py`` loaded
  beside it (another commit's kernel, on the same operands in the same process);
* ``plain``      -- the same GEMM storing bf16 ``[rows, 2F]`` (no activation, no
  requantization): what the gated epilogue costs is the difference.
* with ``--pairs``: ``gated-paired`` and ``plain-paired``, layer0's GEMMs on paired
  m-tiles (``ws_gemm``'s ``paired``: 128-row m-tiles, one B box at a time, a K step moving
  32 KiB in place of 40; gated: the gate box over K, parked, then the up box), and
  layer1's shape (N = H, K = F) plain, ``l1``, beside ``l1-paired`` and ``l1-paired6``
  (6 ring slots); their outputs must equal the default's byte for byte.

With ``--k-sweep``: the plain GEMM at one M and N over K, on a persistent grid as the
layer runs it, and a fit of its time into a cost per K step and a cost per item.

Checks: h of the first two experts against the fp32 emulation (scales within 1e-3, the
dequantized tile within rel L2 1e-2); the gathered h equal to the placed one's, and with
``--base`` to the base kernel's, byte for byte. Writes ``$OUT/fp8-ws-probe.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import triton

from comet.activation import SILU, gated
from comet.bench.provenance import provenance, write_result
from comet.config import PRESETS
from comet.kernels.fp8_gemm import Fp8Gather, m_tiles
from comet.kernels.fp8_roles import pack_rows
from comet.quant import Fp8Rows, Fp8Weight, quantize_rows, quantize_weight
from comet.reference import grouped_gemm_fp8

#: How far h's scales may sit from the emulation's: the tensor cores sum K in another order
#: than torch's fp32 matmul (tests/fp8_checks.py's bound on a GPU; 9.8e-4 seen at
#: mixtral's K = 4096 on an H100).
SCALE_RTOL = 1e-3
#: ``(experts, top_k, H, F)`` of the shapes beside the presets.
EXTRA = {"qwen3-30b-a3b-like": (128, 8, 2048, 768)}


def shape(name: str) -> tuple[int, int, int, int]:
    if name in EXTRA:
        return EXTRA[name]
    c = PRESETS[name]
    return c.num_experts, c.top_k, c.hidden_size, c.intermediate_size


def load_module(path: str, name: str):
    """The Python file ``path`` as a module ``name`` of its own (another tree's kernel,
    or an instrumented copy of one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_base(tree: str):
    """``comet/kernels/fp8_ws.py`` of another checkout as a module of its own."""
    return load_module(os.path.join(tree, "comet", "kernels", "fp8_ws.py"), "base_fp8_ws")


def weights(e: int, n: int, k: int, g: torch.Generator) -> Fp8Weight:
    """``[e, n, k]`` Gaussian weights in FP8, quantized a few experts at a time (a preset's
    fp32 weights at once would not fit)."""
    parts = [quantize_weight(torch.randn(min(8, e - i), n, k, device="cuda", generator=g)
                             / k ** 0.5) for i in range(0, e, 8)]
    return Fp8Weight(torch.cat([p.weight for p in parts]),
                     torch.cat([p.scale_inv for p in parts]), parts[0].blocks)


def same_h(a: Fp8Rows, b: Fp8Rows) -> bool:
    """Whether two h outputs are equal byte for byte (values and scales)."""
    return bool(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                and torch.equal(a.scale, b.scale))


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def probe(name: str, tokens: int, kernels: dict, seed: int, gather: bool,
          pairs: bool = False) -> dict:
    e, k, hid, f = shape(name)
    per = tokens * k // e
    rows = [per] * e
    g = torch.Generator(device="cuda").manual_seed(seed)
    # A row per (token, expert) pair, as a dispatch places them; the gathered GEMM reads
    # the same rows through the index from the tokens' packed rows.
    tok = quantize_rows(torch.randn(tokens, hid, device="cuda", generator=g))
    src = (torch.randperm(sum(rows), device="cuda", generator=g) % tokens).to(torch.int32)
    x = Fp8Rows(tok.data[src.long()], tok.scale[src.long()])
    packed = pack_rows(tok)
    w = weights(e, 2 * f, hid, g)
    tiles = m_tiles(rows, 64, "cuda")
    rec = {"config": name, "tokens": tokens, "experts": e, "rows_per_expert": per,
           "H": hid, "F": f, "gated_flop": 2.0 * sum(rows) * 2 * f * hid}
    outs = {}
    calls = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for label, mod in kernels.items():
        calls[label + "gated"] = lambda mod=mod: mod.ws_group_gemm(x, w, tiles, activation=SILU,
                                                                   programs=sms)
    if gather:
        calls["gather-gated"] = lambda: kernels[""].ws_group_gemm(
            Fp8Gather(src, packed, packed.shape[1]), w, tiles, activation=SILU, programs=sms)
    plain_out = torch.empty(sum(rows), 2 * f, dtype=torch.bfloat16, device="cuda")
    calls["plain"] = lambda: kernels[""].ws_group_gemm(x, w, tiles, out=plain_out,
                                                       programs=sms)
    flop = {label: rec["gated_flop"] for label in calls}
    if pairs:
        # 128-row m-tiles, one B box an item, the consumers on its row halves; beside the
        # default at layer0's plain shape and at layer1's (N = H, K = F).
        tiles2 = m_tiles(rows, 128, "cuda")
        h = quantize_rows(torch.randn(sum(rows), f, device="cuda", generator=g))
        w2 = weights(e, hid, f, g)
        pair_out = torch.empty_like(plain_out)
        l1_out = {v: torch.empty(sum(rows), hid, dtype=torch.bfloat16, device="cuda")
                  for v in ("", "-paired", "-paired6")}
        mod = kernels[""]
        calls["gated-paired"] = lambda: mod.ws_group_gemm(x, w, tiles2, activation=SILU,
                                                          programs=sms, paired=True)
        calls["plain-paired"] = lambda: mod.ws_group_gemm(x, w, tiles2, out=pair_out,
                                                          programs=sms, paired=True)
        calls["l1"] = lambda: mod.ws_group_gemm(h, w2, tiles, out=l1_out[""], programs=sms)
        calls["l1-paired"] = lambda: mod.ws_group_gemm(h, w2, tiles2, out=l1_out["-paired"],
                                                       programs=sms, paired=True)
        calls["l1-paired6"] = lambda: mod.ws_group_gemm(h, w2, tiles2,
                                                        out=l1_out["-paired6"], programs=sms,
                                                        paired=True, stages=6)
        flop.update({"gated-paired": rec["gated_flop"], "plain-paired": rec["gated_flop"],
                     **{f"l1{v}": 2.0 * sum(rows) * hid * f for v in l1_out}})
    for label, fn in calls.items():
        outs[label] = fn()
    torch.cuda.synchronize()
    best = {label: float("inf") for label in calls}
    for _ in range(2):
        for label, fn in calls.items():
            best[label] = min(best[label], timed(fn))
    for label, ms in best.items():
        rec[f"{label}_us"] = ms * 1e3
        rec[f"{label}_tflops"] = flop[label] / (ms * 1e-3) / 1e12
    if pairs:   # the same wgmmas and promotions on the same rows: equal bf16 outputs
        rec["paired_equal"] = bool(torch.equal(outs["plain-paired"], outs["plain"])
                                   and same_h(outs["gated-paired"], outs["gated"])
                                   and torch.equal(outs["l1-paired"], outs["l1"])
                                   and torch.equal(outs["l1-paired6"], outs["l1"]))
        rec["gated_paired_over_gated"] = rec["gated-paired_us"] / rec["gated_us"]
        rec["plain_paired_over_plain"] = rec["plain-paired_us"] / rec["plain_us"]
        rec["l1_paired_over_l1"] = rec["l1-paired_us"] / rec["l1_us"]
        rec["l1_paired6_over_l1"] = rec["l1-paired6_us"] / rec["l1_us"]
    # The emulation on the first two experts' rows.
    two = sum(rows[:2])
    gu = grouped_gemm_fp8(Fp8Rows(x.data[:two], x.scale[:two]),
                          Fp8Weight(w.weight[:2], w.scale_inv[:2], w.blocks), rows[:2])
    ref = quantize_rows(gated(gu[:, :f], gu[:, f:], SILU))
    h = outs["gated"]
    rec["scale_max_rel_err"] = float(((h.scale[:two] - ref.scale).abs() / ref.scale).max())
    hd = h.dequantize()[:two]
    rd = ref.dequantize()
    rec["h_rel_l2"] = float((hd - rd).norm() / rd.norm())
    rec["ok"] = (rec["scale_max_rel_err"] <= SCALE_RTOL and rec["h_rel_l2"] <= 1e-2
                 and rec.get("paired_equal", True))
    for other, equal in (("gather-gated", "gather_equal"), ("base-gated", "equal_to_base")):
        if other in outs:
            rec[equal] = same_h(outs[other], h)
            rec["ok"] = rec["ok"] and rec[equal]
    if "gather-gated" in outs:
        rec["gather_over_placed"] = rec["gather-gated_us"] / rec["gated_us"]
    if "base-gated" in outs:
        rec["gated_over_base"] = rec["gated_us"] / rec["base-gated_us"]
    return rec


def k_sweep(kernels: dict, ks: list[int], programs: int, seed: int = 0) -> dict:
    """The plain GEMM (bf16 store) on a persistent grid of ``programs`` at one M and N
    (8 experts x 2048 rows, N = 4096: 4096 items of 64 x 256) and K = ``ks``: an item's
    time against its K steps, ``us_per_round = steps * step_us + item_us`` fitted over
    the sweep (a round: one item on every program), separates what an item costs
    whatever its K (its start, its drain, its epilogue) from what a step costs."""
    e, per, n = 8, 2048, 4096
    rows = [per] * e
    tiles = m_tiles(rows, 64, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    items = e * per // 64 * (n // 256)
    rounds = -(-items // programs)
    out = {"experts": e, "rows_per_expert": per, "N": n, "programs": programs,
           "items": items, "rounds": rounds, "points": []}
    y = torch.empty(e * per, n, dtype=torch.bfloat16, device="cuda")
    for k in ks:
        x = quantize_rows(torch.randn(e * per, k, device="cuda", generator=g))
        w = weights(e, n, k, g)
        point = {"K": k, "steps": k // 128, "flop": 2.0 * e * per * n * k}
        for label, mod in kernels.items():
            us = 1e3 * min(timed(lambda mod=mod: mod.ws_group_gemm(x, w, tiles, out=y,
                                                                   programs=programs))
                           for _ in range(2))
            point[f"{label}plain_us"] = us
            point[f"{label}plain_tflops"] = point["flop"] / (us * 1e-6) / 1e12
        out["points"].append(point)
        print(json.dumps(point), flush=True)
    for label in kernels:
        steps = torch.tensor([p["steps"] for p in out["points"]], dtype=torch.float64)
        per_round = torch.tensor([p[f"{label}plain_us"] / rounds for p in out["points"]],
                                 dtype=torch.float64)
        a = torch.stack([steps, torch.ones_like(steps)], 1)
        step_us, item_us = torch.linalg.lstsq(a, per_round[:, None]).solution[:, 0].tolist()
        out[f"{label}step_us"], out[f"{label}item_us"] = step_us, item_us
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="", help="another checkout whose fp8_ws.py to time beside")
    ap.add_argument("--configs", nargs="+",
                    default=["qwen2-moe", "mixtral", "phi3.5-moe", "deepseek-v3-like",
                             "qwen3-30b-a3b-like"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--no-gather", action="store_true",
                    help="leave out the GEMM reading its rows through the index")
    ap.add_argument("--pairs", action="store_true",
                    help="also the GEMMs on paired m-tiles (128 rows, one B box at a "
                         "time) beside the default, at layer0's and layer1's shapes")
    ap.add_argument("--k-sweep", nargs="*", type=int, default=None, metavar="K",
                    help="also the plain GEMM at one M, N and these K (default 512 1024 "
                         "2048 4096 8192) on a persistent grid: per-step and per-item cost")
    args = ap.parse_args()
    import comet.kernels.fp8_ws as current
    kernels = {"": current}

    if args.base:
        kernels["base-"] = load_base(args.base)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    result = {**provenance(), "base": args.base or None, "records": []}
    start = time.time()
    for i, name in enumerate(args.configs):
        for tokens in args.tokens:
            try:
                rec = probe(name, tokens, kernels, seed=i, gather=not args.no_gather,
                            pairs=args.pairs)
            except Exception as exc:   # noqa: BLE001 -- a shape that fails is a result too
                rec = {"config": name, "tokens": tokens, "error": f"{type(exc).__name__}: {exc}"[:800]}
            result["records"].append(rec)
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
    if args.k_sweep is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        result["k_sweep"] = k_sweep(kernels, args.k_sweep or [512, 1024, 2048, 4096, 8192],
                                    sms)
    result["elapsed_s"] = time.time() - start
    write_result(os.path.join(out_dir, "fp8-ws-probe.json"), result)
    print(f"\n{'config':20s} {'tokens':>6s} {'gated TF/s':>10s} {'base TF/s':>10s} "
          f"{'new/base':>8s} {'plain TF/s':>10s} {'gather/placed':>13s} {'ok':>5s}")
    for r in result["records"]:
        if "error" in r:
            print(f"{r['config']:20s} {r['tokens']:6d} {r['error'][:60]}")
            continue
        print(f"{r['config']:20s} {r['tokens']:6d} {r['gated_tflops']:10.1f} "
              f"{r.get('base-gated_tflops', float('nan')):10.1f} "
              f"{r.get('gated_over_base', float('nan')):8.3f} {r['plain_tflops']:10.1f} "
              f"{r.get('gather_over_placed', float('nan')):13.3f} {str(r['ok']):>5s}")
        if "paired_equal" in r:
            print(f"{'':27s} paired / default: gated {r['gated_paired_over_gated']:.3f}, "
                  f"plain {r['plain_paired_over_plain']:.3f}, "
                  f"layer1 {r['l1_paired_over_l1']:.3f} (6 stages "
                  f"{r['l1_paired6_over_l1']:.3f}); layer1 TF/s {r['l1_tflops']:.0f} -> "
                  f"{r['l1-paired_tflops']:.0f} / {r['l1-paired6_tflops']:.0f}; equal "
                  f"{r['paired_equal']}")
    sweep = result.get("k_sweep")
    if sweep:
        print(f"\nplain GEMM, {sweep['items']} items of 64 x 256 on {sweep['programs']} "
              f"programs ({sweep['rounds']} rounds):")
        for label in kernels:
            print(f"  {label or 'this tree'}: " + "  ".join(
                f"K={p['K']} {p[label + 'plain_tflops']:.0f} TF/s" for p in sweep["points"])
                + f"; fit: {sweep[label + 'step_us']:.3f} us a step, "
                  f"{sweep[label + 'item_us']:.2f} us an item")


if __name__ == "__main__":
    main()
