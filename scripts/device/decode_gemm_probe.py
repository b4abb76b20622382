# usage: PYTHONPATH=. python3 scripts/device/decode_gemm_probe.py [--tokens 1 8 16] [--out FILE]
"""Probe: how near the weight-streaming time can a decode-sized grouped GEMM get, with the
tokens on the MMA's M side (today's m-tiles) or the weights on it (``W^T x``)?

Experiment, not a kernel of the layer. A 1-token comet call's GEMMs take what torch's
grouped GEMMs take on the same rows, about twice the time of reading the experts'
weights once (docs/notebook.md, "A small call's fixed costs"). Both orientations here
are the same plain Triton GEMM -- ``E`` experts, each ``y_e = x_e @ W_e`` with ``T``
rows of ``x_e`` -- split over K so every SM streams weights, partial sums added with fp32
atomics; they differ only in which operand fills the MMA's 128-wide M side:

* ``rows``: ``acc[BLOCK_M, BLOCK_N] += x[BLOCK_M, BK] @ W[BK, BLOCK_N]``, the T rows
  padded to BLOCK_M = 128 as a comet m-tile is;
* ``weights``: ``acc[BLOCK_N, BT] += W[BK, BLOCK_N]^T @ x[BT, BK]^T``, the tokens padded
  to BT = 16 only.

Each case runs on rotating copies of the weights (more bytes than L2 holds), timed with
CUDA events; reported beside a device-to-device copy of the same bytes (the HBM read
rate of this GPU) and torch's batched matmul. On the CPU (TRITON_INTERPRET=1,
``--check``) it only checks both kernels against torch at tiny shapes.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

#: (experts with rows, K, N) of one rank's layer0 at EP=2 under a 1-token call per
#: rank (N = 2F: gate and up), from the presets.
SHAPES = {"qwen2-moe": (4, 2048, 2816), "phi3.5-moe": (2, 4096, 12800),
          "mixtral": (2, 4096, 28672), "deepseek-v3-like": (8, 7168, 4096)}
#: Weight bytes each timed case cycles through, at least (H100's L2 is 50 MB).
ROTATE_BYTES = 400 << 20


@triton.jit
def rows_on_m(x, w, y, T, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """y[e, :T] += x[e, :T] @ w[e][k-range], tokens on M (padded to BLOCK_M)."""
    n0 = tl.program_id(0) * BLOCK_N
    e = tl.program_id(1)
    ks = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(ks * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(x + e * T * K + rows[:, None] * K + k0 + kk[None, :],
                    mask=rows[:, None] < T, other=0.0)
        b = tl.load(w + e.to(tl.int64) * K * N + (k0 + kk[:, None]) * N + cols[None, :])
        acc = tl.dot(a, b, acc)
    tl.atomic_add(y + e * T * N + rows[:, None] * N + cols[None, :], acc,
                  mask=rows[:, None] < T, sem="relaxed")


@triton.jit
def weights_on_m(x, w, y, T, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The same sums as :func:`rows_on_m`, as ``W^T x^T``: weights on M, tokens on N."""
    n0 = tl.program_id(0) * BLOCK_N
    e = tl.program_id(1)
    ks = tl.program_id(2)
    toks = tl.arange(0, BLOCK_T)
    cols = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(ks * BLOCK_K, K, BLOCK_K * SPLIT_K):
        b = tl.load(w + e.to(tl.int64) * K * N + (k0 + kk[:, None]) * N + cols[None, :])
        xt = tl.load(x + e * T * K + toks[None, :] * K + k0 + kk[:, None],
                     mask=toks[None, :] < T, other=0.0)                  # [BK, BT]
        acc = tl.dot(tl.trans(b), xt, acc)
    tl.atomic_add(y + e * T * N + toks[None, :] * N + cols[:, None], acc,
                  mask=toks[None, :] < T, sem="relaxed")


def launch(kind, x, w, y, split_k, block_n=128, block_k=64, num_warps=4, num_stages=4):
    e, t, k = x.shape
    n = w.shape[2]
    grid = (n // block_n, e, split_k)
    if kind == "rows":
        rows_on_m[grid](x, w, y, t, K=k, N=n, BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k,
                        SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    else:
        weights_on_m[grid](x, w, y, t, K=k, N=n, BLOCK_T=16, BLOCK_N=block_n,
                           BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps,
                           num_stages=num_stages)


def split_for(e, k, n, block_n, block_k, programs):
    """K splits that give every SM about two programs (at least one K step each)."""
    tiles = e * (n // block_n)
    return max(1, min(k // block_k, -(-2 * programs // tiles)))


def check(dtype=torch.float16, device="cpu"):
    """Both kernels against torch at a tiny shape (the interpreter's bf16 dot is wrong)."""
    g = torch.Generator().manual_seed(0)
    for t in (1, 3):
        x = torch.randn(2, t, 64, generator=g).to(device, dtype)
        w = torch.randn(2, 64, 128, generator=g).to(device, dtype)
        ref = torch.bmm(x.float(), w.float())
        for kind in ("rows", "weights"):
            y = torch.zeros(2, t, 128, device=device)
            launch(kind, x, w, y, split_k=2, block_n=64, block_k=16, num_warps=4,
                   num_stages=2)
            torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)
    print("both orientations match torch")


def time_us(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def probe(tokens, iters):
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for name, (e, k, n) in SHAPES.items():
        nbytes = e * k * n * 2
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        ws = [torch.randn(e, k, n, device=dev, dtype=torch.bfloat16) * k ** -0.5
              for _ in range(copies)]
        sink = torch.empty_like(ws[0])
        turn = iter(range(10 ** 9))
        copy_us = time_us(lambda: sink.copy_(ws[next(turn) % copies]), iters)
        for t in tokens:
            x = torch.randn(e, t, k, device=dev, dtype=torch.bfloat16)
            y = torch.zeros(e, t, n, device=dev)
            rec = {"config": name, "experts": e, "K": k, "N": n, "tokens": t,
                   "weight_mb": nbytes / 2 ** 20,
                   "copy_us": copy_us, "hbm_read_us": copy_us / 2}
            rec["torch_us"] = time_us(lambda: torch.bmm(x, ws[next(turn) % copies]), iters)
            ref = torch.bmm(x.float(), ws[0].float())
            for kind in ("rows", "weights"):
                split = split_for(e, k, n, 128, 64, programs)
                launch(kind, x, ws[0], y.zero_(), split)
                rec[f"{kind}_err"] = float((y - ref).norm() / ref.norm())
                rec[f"{kind}_us"] = time_us(
                    lambda: launch(kind, x, ws[next(turn) % copies], y, split), iters)
                rec[f"{kind}_split_k"] = split
            print(f"{name:17s} T={t:3d} weights {rec['weight_mb']:6.1f} MB  read "
                  f"{rec['hbm_read_us']:7.1f} us  torch {rec['torch_us']:7.1f}  rows-on-M "
                  f"{rec['rows_us']:7.1f}  weights-on-M {rec['weights_us']:7.1f}", flush=True)
            out.append(rec)
        del ws, sink
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="only check both kernels (CPU ok)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "decode_gemm_probe.json"))
    args = ap.parse_args()
    if args.check or not torch.cuda.is_available():
        check(device="cuda" if torch.cuda.is_available() else "cpu")
        return
    from comet.bench.provenance import provenance
    recs = probe(args.tokens, args.iters)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), **provenance(),
                   "command": " ".join(["decode_gemm_probe.py", *sys.argv[1:]]),
                   "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
