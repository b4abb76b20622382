# usage: PYTHONPATH=. OUT=out python scripts/device/fp8_gemm_probe.py [--variants a,b] [--budget-s S]
"""The FP8 GroupGEMM gate (issue 68, first phase), on one GPU in one call.

Builds, checks and times block-scaled FP8 grouped GEMMs (W8A8 e4m3, 1x128 row scales,
128x128 weight blocks, B K-major as the checkpoints store it) at two shapes:

* prefill -- 8 experts x 2048 rows, N = 28672, K = 4096 (Mixtral's layer0): the gate is
  >= 1000 TFLOP/s;
* decode -- 8 experts x 64 rows, same weights: the gate is <= 1.2x the HBM floor (FP8
  weight bytes + their scales + the rows and their scales, over the HBM read bandwidth
  measured in the same run, comet.bench.floors.hbm_read_gbps).

Each variant's output buffer is poisoned with NaN before its check; the check is against
the fp32 emulation (dequantized operands, fresh random data): rel L2 <= 5e-3 and every
element within atol = rtol = 0.035. Times are triton.testing.do_bench medians over
rotating copies of the inputs. Beside them: cuBLAS FP8 with one scale per tensor
(torch._scaled_mm, the ceiling), cuBLAS with block scales where this torch offers them,
and bf16 (torch.bmm and torch._grouped_mm) on the same shape. Writes
``$OUT/fp8-gemm-probe.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from comet.bench.floors import hbm_read_gbps  # noqa: E402
from comet.bench.provenance import provenance, write_result  # noqa: E402
from comet.kernels.fp8_gemm import Fp8GemmConfig, fp8_group_gemm, m_tiles  # noqa: E402
from comet.quant import E4M3, quantize_rows, quantize_weight  # noqa: E402

#: ``PROBE_SMALL=1``: tiny shapes on the CPU under TRITON_INTERPRET=1 (the harness's own
#: smoke test; ``tl`` variants only, one timed call instead of do_bench).
SMALL = os.environ.get("PROBE_SMALL", "0") == "1"
DEV = "cpu" if SMALL else "cuda"
E, ROWS, N, K = (2, 128, 256, 256) if SMALL else (8, 2048, 28672, 4096)
DECODE_ROWS = 64
ROTATE = 2


# ---------------------------------------------------------------- the per-tensor reference
@triton.jit
def per_tensor_kernel(a_desc, b_desc, out, sa, sb, t_expert, t_start, t_end, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    """One scale per tensor (applied once after the K loop): what an FP8 GEMM costs
    without block scales, in the same tile order."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    w = tl.program_id(0)
    num_tiles = tl.num_programs(0) // n_blocks
    per_group = GROUP_M * n_blocks
    first = (w // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (w % per_group) % size
    nb = (w % per_group) // size
    expert = tl.load(t_expert + tile)
    row_start = tl.load(t_start + tile)
    row_end = tl.load(t_end + tile)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([row_start, k]), b_desc.load([expert * N + nb * BLOCK_N, k]).T,
                     acc)
    acc = acc * (tl.load(sa) * tl.load(sb + expert))
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.bfloat16),
             mask=(rows[:, None] < row_end) & (cols[None, :] < N))


def per_tensor_gemm(a, sa, w, sb, tiles, out, bm=128, bn=256, bk=128, warps=8, stages=3):
    from triton.tools.tensor_descriptor import TensorDescriptor
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [bn, bk])
    grid = (tiles.expert.shape[0] * triton.cdiv(w.shape[1], bn), )
    per_tensor_kernel[grid](a_desc, b_desc, out, sa, sb, tiles.expert, tiles.row_start,
                            tiles.row_end, w.shape[1], w.shape[2], BLOCK_M=bm, BLOCK_N=bn,
                            BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------- operands
class Case:
    """One shape's operands: ROTATE copies of the FP8 rows and weights (and bf16), the
    m-tile tables, and the fp32 emulation of the first copy."""

    def __init__(self, rows_per_expert: int, seed: int):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.rows = rows_per_expert
        self.e_rows = [rows_per_expert] * E
        self.m = rows_per_expert * E
        self.x, self.w, self.xb, self.wb = [], [], [], []
        for _ in range(ROTATE):
            x = torch.randn(self.m, K, device=DEV, generator=g)
            wf = torch.randn(E, N, K, device=DEV, generator=g) / 64
            self.x.append(quantize_rows(x))
            self.w.append(quantize_weight(wf))
            self.xb.append(x.to(torch.bfloat16))
            self.wb.append(wf.to(torch.bfloat16))
            del wf
        self.tiles = {bm: m_tiles(self.e_rows, bm, DEV) for bm in (64, 128)}
        self.i = 0
        torch.cuda.empty_cache()

    def next(self) -> int:
        self.i = (self.i + 1) % ROTATE
        return self.i

    def reference(self) -> torch.Tensor:
        xd, wd = self.x[0].dequantize(), self.w[0].dequantize()
        out = torch.empty(self.m, N, device=DEV)
        for e in range(E):
            r = slice(e * self.rows, (e + 1) * self.rows)
            out[r] = xd[r] @ wd[e].T
        return out

    def flops(self) -> float:
        return 2.0 * self.m * N * K

    def hbm_bytes(self) -> int:
        """FP8 weights + their scales + the rows + their scales (the floor's bytes)."""
        w, a = self.w[0], self.x[0]
        return (w.weight.numel() + w.scale_inv.numel() * 4 + a.data.numel()
                + a.scale.numel() * 4)


def check(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o = out.float()
    finite = bool(torch.isfinite(o).all())
    rel = float((o - ref).norm() / ref.norm()) if finite else float("nan")
    close = finite and bool(torch.isclose(o, ref, atol=0.035, rtol=0.035).all())
    return {"finite": finite, "rel_l2": rel, "max_abs_err": float((o - ref).abs().max()),
            "ok": finite and rel <= 5e-3 and close}


# ---------------------------------------------------------------- variants
def comet_variant(cfg: Fp8GemmConfig):
    def run(case: Case, i: int, out):
        return fp8_group_gemm(case.x[i], case.w[i], case.tiles[cfg.block_m], config=cfg,
                              out=out)
    return run


def gluon_variant(ws: bool, **kw):
    import fp8_gemm_gluon as G

    def run(case: Case, i: int, out):
        a, w = case.x[i], case.w[i]
        fn = G.fp8_gemm_gluon if ws else G.fp8_gemm_gluon_sw
        return fn(a.data, a.scale, w.weight, w.scale_inv, case.tiles[kw.get("block_m", 128)],
                  (128, 128), out=out, **kw)
    return run


def comet_ws_variant(promotion_k: int):
    """The library's warp-specialized kernel (comet.kernels.fp8_ws: 64-row m-tiles, two
    column boxes per item), fp32 promotion every ``promotion_k`` K values."""
    from comet.kernels.fp8_ws import BLOCK_M, ws_group_gemm

    def run(case: Case, i: int, out):
        return ws_group_gemm(case.x[i], case.w[i], case.tiles[BLOCK_M], out=out,
                             promotion_k=promotion_k)
    return run


def per_tensor_variant(**kw):
    scales = {}

    def run(case: Case, i: int, out):
        if (id(case), i) not in scales:   # one scale per tensor: the largest block scale
            for j in range(ROTATE):
                a, w = case.x[j], case.w[j]
                sa = a.scale.max().reshape(1)
                sb = w.scale_inv.amax(dim=(1, 2)).contiguous()
                wq = (w.dequantize() / sb[:, None, None]).clamp(-448, 448).to(E4M3)
                aq = (a.dequantize() / sa).clamp(-448, 448).to(E4M3)
                scales[(id(case), j)] = (aq, sa, wq, sb)
        aq, sa, wq, sb = scales[(id(case), i)]
        return per_tensor_gemm(aq, sa, wq, sb, case.tiles[kw.get("bm", 128)], out, **kw)
    return run, False       # not checked against the block-scaled emulation


def scaled_mm_per_tensor():
    def run(case: Case, i: int, out):
        a, w = case.x[i], case.w[i]
        one = torch.ones((), device=DEV)
        for e in range(E):
            r = slice(e * case.rows, (e + 1) * case.rows)
            out[r] = torch._scaled_mm(a.data[r], w.weight[e].T, scale_a=one, scale_b=one,
                                      out_dtype=torch.bfloat16)
        return out
    return run, False


def scaled_mm_blockwise():
    """cuBLAS with 1x128 x 128x128 block scales, if this torch has it on sm_90."""
    def run(case: Case, i: int, out):
        a, w = case.x[i], case.w[i]
        for e in range(E):
            r = slice(e * case.rows, (e + 1) * case.rows)
            sa = a.scale[r].t().contiguous().t()            # outer-dim major
            sb = w.scale_inv[e].t().contiguous()            # [K/128, N/128]
            out[r] = torch._scaled_mm(a.data[r], w.weight[e].T, scale_a=sa, scale_b=sb,
                                      out_dtype=torch.bfloat16)
        return out
    return run


def bf16_bmm():
    def run(case: Case, i: int, out):
        x = case.xb[i].view(E, case.rows, K)
        torch.bmm(x, case.wb[i].transpose(1, 2), out=out.view(E, case.rows, N))
        return out
    return run, False


def bf16_grouped_mm():
    offs = {}

    def run(case: Case, i: int, out):
        key = id(case)
        if key not in offs:
            offs[key] = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * case.rows
        return torch._grouped_mm(case.xb[i], case.wb[i].transpose(1, 2), offs=offs[key],
                                 out_dtype=torch.bfloat16)
    return run, False


def variants():
    v = {}
    for bm, bn, bk, w, s, p in [(128, 128, 128, 8, 4, None), (128, 128, 128, 8, 5, None),
                                (128, 256, 128, 8, 3, None), (128, 128, 128, 8, 4, 132),
                                (128, 128, 128, 4, 4, None), (64, 128, 128, 4, 4, None),
                                (64, 64, 128, 4, 6, None)]:
        name = f"tl-{bm}x{bn}x{bk}-w{w}-s{s}" + (f"-p{p}" if p else "")
        v[name] = (comet_variant(Fp8GemmConfig(bm, bn, bk, 8, w, s, p)), True)
    for ws, kw in [(True, dict(stages=4)), (True, dict(stages=6)),
                   (True, dict(stages=4, overlap=False)), (True, dict(stages=6, programs=132)),
                   (True, dict(block_m=64, stages=6)),
                   (False, dict(stages=4)), (False, dict(stages=6)),
                   (False, dict(block_m=64, stages=6))]:
        name = ("gluon-ws-" if ws else "gluon-sw-") + "-".join(f"{k}{v_}" for k, v_ in kw.items())
        v[name] = (gluon_variant(ws, **kw), True)
    v["comet-ws"] = (comet_ws_variant(128), True)
    v["comet-ws-k32"] = (comet_ws_variant(32), True)
    v["tl-per-tensor-128x256-w8-s3"] = per_tensor_variant()
    v["tl-per-tensor-128x128-w8-s4"] = per_tensor_variant(bn=128, stages=4)
    v["cublas-fp8-per-tensor"] = scaled_mm_per_tensor()
    v["cublas-fp8-blockwise"] = (scaled_mm_blockwise(), True)
    v["torch-bf16-bmm"] = bf16_bmm()
    v["torch-bf16-grouped-mm"] = bf16_grouped_mm()
    return v


def measure(name, fn, checked, case: Case, ref, budget_end) -> dict:
    rec = {"variant": name, "rows_per_expert": case.rows}
    if time.time() > budget_end:
        rec["skipped"] = "probe time budget spent"
        return rec
    try:
        out = torch.full((case.m, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        t0 = time.time()
        res = fn(case, 0, out)
        if not SMALL:
            torch.cuda.synchronize()
        rec["first_call_s"] = round(time.time() - t0, 2)
        if checked:
            rec.update(check(res, ref))
        else:
            rec["checked"] = "no (another recipe: " + ("per-tensor scales" if "per-tensor" in
                                                       name else "bf16") + ")"
            rec["finite"] = bool(torch.isfinite(res.float()).all())
        del res

        def bench():
            fn(case, case.next(), out)
        if SMALL:
            t0 = time.time()
            bench()
            ms = (time.time() - t0) * 1e3
        else:
            ms = triton.testing.do_bench(bench, warmup=10, rep=60, return_mode="median")
        rec["ms"] = ms
        rec["tflops"] = case.flops() / (ms * 1e-3) / 1e12
    except Exception as e:   # a variant that does not build is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        rec["trace_tail"] = traceback.format_exc()[-1500:]
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--decode-variants", default="",
                    help="variants also timed at 64 rows per expert (default: all checked)")
    ap.add_argument("--budget-s", type=float, default=400)
    args = ap.parse_args()
    start = time.time()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    budget_end = start + args.budget_s
    allv = variants()
    names = [n for n in (args.variants.split(",") if args.variants else allv) if n]
    result = {
        **provenance(device=torch.cuda.get_device_name() if not SMALL else "cpu (interpreter)"),
        "python": platform.python_version(), "shape": {"experts": E, "N": N, "K": K},
        "recipe": "e4m3 W8A8, rows 1x128 fp32 scales, weights 128x128 fp32 scales (B [E,N,K])",
        "hbm_read_gbps": hbm_read_gbps(torch.device(DEV)) or 1.0,
        "prefill": [], "decode": [],
    }
    try:
        result["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:     # noqa: BLE001
        pass
    prefill = Case(ROWS, seed=1)
    ref = prefill.reference()
    for n in names:
        fn, checked = allv[n]
        rec = measure(n, fn, checked, prefill, ref, budget_end)
        result["prefill"].append(rec)
        print(json.dumps(rec)[:400], flush=True)
    del prefill, ref
    torch.cuda.empty_cache()
    decode = Case(DECODE_ROWS, seed=2)
    ref = decode.reference()
    floor_us = decode.hbm_bytes() / (result["hbm_read_gbps"] * 1e3)
    result["decode_floor"] = {"bytes": decode.hbm_bytes(), "us": floor_us}
    dnames = [n for n in (args.decode_variants.split(",") if args.decode_variants else names)
              if n]
    for n in dnames:
        fn, checked = allv[n]
        rec = measure(n, fn, checked, decode, ref, budget_end + 60)
        if "ms" in rec:
            rec["us"] = rec["ms"] * 1e3
            rec["over_hbm_floor"] = rec["us"] / floor_us
        result["decode"].append(rec)
        print(json.dumps(rec)[:400], flush=True)
    result["elapsed_s"] = time.time() - start
    write_result(os.path.join(out_dir, "fp8-gemm-probe.json"), result)
    print(f"\n{result['device']}  HBM {result['hbm_read_gbps']:.0f} GB/s  decode floor "
          f"{floor_us:.1f} us  elapsed {result['elapsed_s']:.0f} s")
    print(f"{'variant':44s} {'prefill TF/s':>12s} {'ok':>5s} {'relL2':>8s} "
          f"{'decode us':>10s} {'x floor':>8s}")
    dec = {r["variant"]: r for r in result["decode"]}
    for r in result["prefill"]:
        d = dec.get(r["variant"], {})
        print(f"{r['variant']:44s} {r.get('tflops', float('nan')):12.1f} "
              f"{str(r.get('ok', r.get('checked', r.get('error', r.get('skipped', '')))))[:5]:>5s} "
              f"{r.get('rel_l2', float('nan')):8.1e} {d.get('us', float('nan')):10.1f} "
              f"{d.get('over_hbm_floor', float('nan')):8.2f}")


if __name__ == "__main__":
    main()
