# usage: PYTHONPATH=. OUT=out python scripts/device/fp8_ws_trace.py [--base TREE] [--no-mma] [--pairs] [--programs P ...] [--configs ...] [--tokens N]
"""Where an item of the warp-specialized FP8 GEMM (comet.kernels.fp8_ws) spends its time:
``%clock64`` stamps per item of every program, on one GPU.

The kernel's source (this tree's, and with ``--base`` another checkout's) is loaded as an
instrumented copy (:func:`instrument`): each consumer partition stamps an item's start
(before its table entries), the end of its K loop and the end of its epilogue; the producer
stamps the item's start and when it issued the item's last step (``--no-mma``: also a
copy of this tree's kernel with every wgmma taken out, each slot still waited for, its
garbage promoted and the slot released -- what moving the boxes through the ring costs a
step without the tensor core). The GEMM then runs once
on a persistent grid of one program per SM (``--programs``: also fewer; a K step that
costs fewer cycles on half the SMs is bound by something they share, L2's bandwidth say,
not by the SM's own loop) at a preset's prefill shape (``tokens * top_k`` rows spread
evenly over the experts, 128x128-block weights), gated as layer0 runs it and plain (bf16
store, layer1's shape of epilogue) and at layer1's shape (``layer1``: N = H, K = F, plain,
bf16 store: the short K loops) -- with ``--pairs`` also on paired m-tiles (``gated-paired``,
its K loop both passes over K; ``layer1-paired``) -- and the stamps are summarized as
medians over items (each program's first item left out):

* ``kloop``  -- an item's K loop, per consumer (``cyc/step``: its cycles over the K steps);
* ``epi``    -- its epilogue: the tensor core idles for it, both consumers work one item in
  lockstep (``skew``: consumer 1's K-loop end minus consumer 0's);
* ``gap``    -- from one item's epilogue end to the next item's start;
* ``lead``   -- how far the producer started the item before consumer 0;
* ``outside`` -- the share of an item outside its K loop (epilogue and gap).

Microseconds use the clock estimated from the programs' spans over the kernel's time
(``do_bench`` median, uninstrumented stamps included: a stamp is a register read and, per
item, a few stores). Writes ``$OUT/fp8-ws-trace.json`` and prints a line per shape, kernel
and epilogue.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import fp8_ws_probe as probe  # noqa: E402

from comet.activation import SILU  # noqa: E402
from comet.bench.provenance import provenance, write_result  # noqa: E402
from comet.bench.timing import median  # noqa: E402
from comet.kernels.fp8_gemm import m_tiles  # noqa: E402
from comet.quant import quantize_rows  # noqa: E402

#: Items a program may stamp (deepseek-v3-like's layer0 at 16384 tokens: 248).
MAX_ITEMS = 4096
#: int64 stamps per item: consumer 0's start, K-loop end, epilogue end; consumer 1's three;
#: the producer's start and last issue.
STAMPS = 8

_CLOCK = '''
STAMPS = [None]


@gluon.jit
def _clock(x):
    """``%clock64``, after ``x`` is computed (its operand keeps the read in place)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64,
                                     is_pure=False, pack=1)

'''


def _sub(src: str, pattern: str, repl: str) -> str:
    """``re.sub`` once; a kernel source without ``pattern`` is one this script does not
    know how to stamp."""
    out, n = re.subn(pattern, repl, src, count=1)
    if n != 1:
        raise ValueError(f"comet/kernels/fp8_ws.py has changed: no match for {pattern!r}")
    return out


def _function(src: str, name: str) -> tuple[int, int]:
    """The span of ``def name(`` up to the next top-level definition or section comment."""
    start = src.index(f"def {name}(")
    end = min(i for i in (src.find("\n@gluon.jit", start), src.find("\n# ---", start))
              if i >= 0)
    return start, end


def instrument(src: str, no_mma: bool = False) -> str:
    """``comet/kernels/fp8_ws.py``'s source with the stamps; the stamp buffer is the
    module's ``STAMPS[0]`` when a launch is built (``int64 [programs * MAX_ITEMS * STAMPS]``).
    ``no_mma``: each wgmma replaced by its operand tile and each wait by the token (its
    output is garbage; only the stamps mean anything)."""
    if no_mma:
        src = _sub(src, r"return warpgroup_mma\(a, b\.permute\(\(1, 0\)\), into, use_acc=False, "
                        r"is_async=True\)", "return into")
        src = _sub(src, r"d = warpgroup_mma_wait\(num_outstanding=1, deps=\(tok, \)\)", "d = tok")
        src = _sub(src, r"d = warpgroup_mma_wait\(num_outstanding=0, deps=\(tok, \)\)", "d = tok")
    src = _sub(src, r"\n# -+ producer", _CLOCK + r"\g<0>")
    src = _sub(src, r"\n    K: int\n", "\n    K: int\n    stamps: torch.Tensor = None\n")
    src = _sub(src, r"(op = WsOperands\([^)]*)\)", r"\1, STAMPS[0])")
    a, b = _function(src, "producer")
    body = src[a:b]
    body = _sub(body, r"    it = 0\n", "    it = 0\n    pj = 0\n")
    body = _sub(body, r"(\n        expert, row_start, row_end, n0 = _item\()",
                r"\n        p0 = _clock(pj)\1")
    body = _sub(body, r"\n                it \+= 1\n",
                "\n                it += 1\n        p1 = _clock(it)\n"
                f"        at = op.stamps + (gl.program_id(0) * {MAX_ITEMS} + pj) * {STAMPS} + 6\n"
                "        gl.store(at, p0)\n        gl.store(at + 1, p1)\n        pj += 1\n")
    src = src[:a] + body + src[b:]
    a, b = _function(src, "_paired_gated")
    body = src[a:b]
    body = _sub(body, r"(\n    up, it = _tile_acc\([^\n]*\n[^\n]*\)\n)", r"\1    t1 = _clock(it)\n")
    body = _sub(body, r"\n    return it\n", "\n    return it, t1\n")
    src = src[:a] + body + src[b:]
    a, b = _function(src, "consumer")
    body = src[a:b]
    body = _sub(body, r"(\n        expert, row_start, row_end, n0 = _item\()",
                r"\n        t0 = _clock(j)\1")
    # each K loop's end: the default items', the paired plain ones', the paired gated
    # ones' (after the up pass, inside _paired_gated, which returns it)
    call = r"acc, it = _tile_acc\([^\n]*\n[^\n]*, op, gather, t, "
    body = _sub(body, r"(\n {12}" + call + r"0\)\n)", r"\1            t1 = _clock(it)\n")
    body = _sub(body, r"(\n {16}" + call + r"BOX\)\n)", r"\1                t1 = _clock(it)\n")
    body = _sub(body, r"\n {16}it = _paired_gated\(", "\n                it, t1 = _paired_gated(")
    body = _sub(body, r"\n        j \+= 1\n",
                "\n        t2 = _clock(j)\n"
                f"        at = op.stamps + (gl.program_id(0) * {MAX_ITEMS} + j) * {STAMPS}"
                " + BOX * 3\n"
                "        gl.store(at, t0)\n        gl.store(at + 1, t1)\n"
                "        gl.store(at + 2, t2)\n"
                "        j += 1\n")
    return src[:a] + body + src[b:]


def load(tree: str, tag: str, no_mma: bool = False):
    """``tree``'s kernel, instrumented, as a module of its own."""
    with open(os.path.join(tree, "comet", "kernels", "fp8_ws.py")) as f:
        src = instrument(f.read(), no_mma)
    path = os.path.join(tempfile.mkdtemp(), f"fp8_ws_trace_{tag}.py")
    with open(path, "w") as f:
        f.write(src)
    return probe.load_module(path, f"fp8_ws_trace_{tag}")


def _median(xs: list[int]) -> float:
    return median(xs) if xs else float("nan")


def summarize(stamps: torch.Tensor, items: int, programs: int, steps: int, us: float) -> dict:
    """Medians of the stamped intervals (cycles and us) over every program's items but its
    first; the clock is the median program span over the kernel time ``us``."""
    st = stamps[:programs * MAX_ITEMS * STAMPS].view(programs, MAX_ITEMS, STAMPS).cpu()
    spans = []
    parts = {k: [] for k in ("c0_kloop", "c0_epi", "c0_gap", "c1_kloop", "c1_epi", "c1_gap",
                             "producer_item", "lead", "skew", "first_kloop")}
    for p in range(min(programs, items)):
        s = st[p, :len(range(p, items, programs))].tolist()
        spans.append(max(s[-1][2], s[-1][5]) - min(s[0][0], s[0][3]))
        parts["first_kloop"].append(s[0][1] - s[0][0])
        for j in range(1, len(s)):
            for c, o in (("c0", 0), ("c1", 3)):
                parts[f"{c}_kloop"].append(s[j][o + 1] - s[j][o])
                parts[f"{c}_epi"].append(s[j][o + 2] - s[j][o + 1])
                parts[f"{c}_gap"].append(s[j][o] - s[j - 1][o + 2])
            parts["producer_item"].append(s[j][7] - s[j][6])
            parts["lead"].append(s[j][0] - s[j][6])
            parts["skew"].append(s[j][4] - s[j][1])
    ghz = _median(spans) / us / 1e3
    out = {"ghz": ghz, "items_per_program": items / programs, "steps": steps, "kernel_us": us}
    for k, v in parts.items():
        out[f"{k}_cyc"] = _median(v)
        out[f"{k}_us"] = _median(v) / ghz / 1e3
    out["cyc_per_step"] = out["c0_kloop_cyc"] / steps
    item = out["c0_kloop_cyc"] + out["c0_epi_cyc"] + out["c0_gap_cyc"]
    out["outside"] = (out["c0_epi_cyc"] + out["c0_gap_cyc"]) / item
    return out


def trace(name: str, tokens: int, kernels: dict, stamps: torch.Tensor, programs: int,
          pairs: bool = False) -> list:
    e, k, hid, f = probe.shape(name)
    rows = [tokens * k // e] * e
    g = torch.Generator(device="cuda").manual_seed(0)
    x = quantize_rows(torch.randn(sum(rows), hid, device="cuda", generator=g))
    w = probe.weights(e, 2 * f, hid, g)
    tiles = m_tiles(rows, 64, "cuda")
    tiles2 = m_tiles(rows, 128, "cuda")
    y = torch.empty(sum(rows), 2 * f, dtype=torch.bfloat16, device="cuda")
    h = quantize_rows(torch.randn(sum(rows), f, device="cuda", generator=g))
    w2 = probe.weights(e, hid, f, g)
    y2 = torch.empty(sum(rows), hid, dtype=torch.bfloat16, device="cuda")
    records = []
    for label, mod in kernels.items():
        mod.STAMPS[0] = stamps
        # (kind, m-tiles, output columns an item, K steps an item, launch)
        kinds = [
            ("gated", tiles, 128, triton.cdiv(hid, 128), f,
             lambda: mod.ws_group_gemm(x, w, tiles, activation=SILU, programs=programs)),
            ("plain", tiles, 256, triton.cdiv(hid, 128), 2 * f,
             lambda: mod.ws_group_gemm(x, w, tiles, out=y, programs=programs)),
            ("layer1", tiles, 256, triton.cdiv(f, 128), hid,
             lambda: mod.ws_group_gemm(h, w2, tiles, out=y2, programs=programs))]
        if pairs and label != "base":   # 128-row items, one B box at a time (gated: two
                                        # passes over K); a base tree may have none
            kinds += [
                ("gated-paired", tiles2, 128, 2 * triton.cdiv(hid, 128), f,
                 lambda: mod.ws_group_gemm(x, w, tiles2, activation=SILU, programs=programs,
                                           paired=True)),
                ("layer1-paired", tiles2, 128, triton.cdiv(f, 128), hid,
                 lambda: mod.ws_group_gemm(h, w2, tiles2, out=y2, programs=programs,
                                           paired=True))]
        for kind, mt, item_cols, steps, cols, fn in kinds:
            items = mt.expert.shape[0] * triton.cdiv(cols, item_cols)
            us = 1e3 * triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")
            stamps.zero_()
            fn()
            torch.cuda.synchronize()
            rec = {"config": name, "tokens": tokens, "kernel": label, "epilogue": kind,
                   "programs": programs,
                   **summarize(stamps, items, programs, steps, us)}
            records.append(rec)
            print(f"{name:18s} {kind:13s} {label:5s} {programs:3d} {us:8.1f} us  "
                  f"{rec['ghz']:.2f} GHz  "
                  f"{rec['items_per_program']:4.0f} items x {rec['steps']:2d} steps: "
                  f"kloop {rec['c0_kloop_us']:6.2f} us ({rec['cyc_per_step']:4.0f} cyc/step) "
                  f"epi {rec['c0_epi_us']:5.2f} gap {rec['c0_gap_us']:4.2f} "
                  f"(consumer 1: {rec['c1_kloop_us']:.2f} / {rec['c1_epi_us']:.2f} / "
                  f"{rec['c1_gap_us']:.2f}) skew {rec['skew_us']:5.2f} lead {rec['lead_us']:.2f} "
                  f"outside {rec['outside']:.2f}", flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="", help="another checkout whose kernel to trace beside")
    ap.add_argument("--configs", nargs="+",
                    default=["qwen2-moe", "deepseek-v3-like", "mixtral", "phi3.5-moe"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--no-mma", action="store_true",
                    help="also this tree's kernel without its wgmmas (the ring alone)")
    ap.add_argument("--pairs", action="store_true",
                    help="also the paired m-tiles' GEMMs (gated and at layer1's shape)")
    ap.add_argument("--programs", nargs="+", type=int, default=[],
                    help="persistent programs (default: one per SM)")
    args = ap.parse_args()
    kernels = {"this": load(".", "this")}
    if args.base:
        kernels["base"] = load(args.base, "base")
    if args.no_mma:
        kernels["nomma"] = load(".", "nomma", no_mma=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = args.programs or [sms]
    stamps = torch.zeros(max(grids) * MAX_ITEMS * STAMPS, dtype=torch.int64, device="cuda")
    result = {**provenance(), "base": args.base or None, "records": []}
    for name in args.configs:
        for programs in grids:
            result["records"] += trace(name, args.tokens, kernels, stamps, programs,
                                       args.pairs)
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    write_result(os.path.join(out_dir, "fp8-ws-trace.json"), result)


if __name__ == "__main__":
    main()
