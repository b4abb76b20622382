"""Does layer0's GroupGEMM keep its speed when it gathers its A rows by index?

Experiment, one GPU. Copy-engine copies beside the GEMMs cost them almost nothing, where
SM-driven data movement costs a third to a half of its own duration (overlap_bound.py).
But a copy engine moves whole host-sized regions: it could broadcast every token row to
every peer (``x_recv [W * tokens, H]``, the size known on the host), not place each
(token, expert) pair's row where layer0's expert-sorted tiles want it. The GEMM would
then read its A rows through an index (``x_recv[row_src[r]]``): pointer loads (cp.async)
instead of one TMA box per A tile. This times, per preset's layer0 at EP=``--world``
shapes, the kernels' tile (``TileConfig()``; interleaved W13, one dot per tile, the
SiLU-and-up epilogue) with A through

* ``tma``    -- a TMA descriptor over the rows already in expert order (the kernels now);
* ``gather`` -- ``tl.load`` of ``x_recv`` rows through ``row_src`` (each expert's rows
  sorted by source row, as a sender's pairs are);

in the same persistent grouped loop (``--gather-tiles``: other tiles for the gather),
against ``torch._grouped_mm`` on the sorted rows, all timed in alternation round after
round (ratios taken per round), and checks every gather gives TMA's output.

    PYTHONPATH=. python3 scripts/device/gather_gemm.py [--configs mixtral] [--tokens 4096] \\
        [--gather-tiles 128,128,64,8,4 64,128,64,4,4]
"""

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.config import preset
from comet.kernels.group_gemm import grouped_work
from comet.kernels.launch import TileConfig
from comet.weights import interleave_gate_up
from gemm_check import graph_us, graphed   # same folder: scripts/device
from gemm_variants import PAIRED_ROUNDS, preset_arguments, tile_table

GROUP_M = tl.constexpr(TileConfig.group_m)


@triton.jit
def gathered_gate_up(a_ptr, row_src, row_start, row_end, b_desc, b_row, n0, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``A @ W13[:, gate and up of n0]`` with A's rows ``a_ptr[row_src[row_start:...]]``
    (rows past ``row_end`` read row 0; the caller masks them at the store)."""
    rows = row_start + tl.arange(0, BLOCK_M)
    src = tl.load(row_src + rows, mask=rows < row_end, other=0).to(tl.int64)
    a_rows = a_ptr + src[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    both = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        both = tl.dot(tl.load(a_rows + k), b_desc.load([b_row + k, 2 * n0]), both)
    return both


@triton.jit
def layer0_gemm(a_desc, a_ptr, row_src, b_desc, c_ptr, tile_expert, tile_row_start,
                tile_row_end, num_tiles, K, N, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n_blocks = tl.cdiv(N, BLOCK_N)
    total = num_tiles * n_blocks
    for w in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=True):
        t, nb = grouped_work(w, num_tiles, n_blocks, GROUP_M)
        expert = tl.load(tile_expert + t)
        r0 = tl.load(tile_row_start + t)
        r1 = tl.load(tile_row_end + t)
        if GATHER:
            both = gathered_gate_up(a_ptr, row_src, r0, r1, b_desc, expert * K, nb * BLOCK_N,
                                    K, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            both = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                both = tl.dot(a_desc.load([r0, k]),
                              b_desc.load([expert * K + k, 2 * nb * BLOCK_N]), both)
        gate, up = both.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
        out = gate * tl.sigmoid(gate) * up
        rows = r0 + tl.arange(0, BLOCK_M)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < r1) & (cols[None, :] < N)
        tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                 out.to(c_ptr.dtype.element_ty), mask=mask)


def run(name, tokens, world, sms, g, gather_tiles):
    cfg, tile = preset(name), TileConfig()
    el = cfg.num_experts // world
    h, f = cfg.hidden_size, cfg.intermediate_size
    tma_tile = (tile.block_m, tile.block_n0, tile.block_k, tile.num_warps, tile.num_stages)
    variants = {"tma": tma_tile, "gather": tma_tile,
                **{"gather@" + ",".join(map(str, t)): t for t in gather_tiles}}
    rows = tokens * cfg.top_k
    counts = [rows // el + (1 if e < rows % el else 0) for e in range(el)]
    w13 = (torch.randn(el, h, 2 * f, device="cuda", generator=g) * h ** -0.5).bfloat16()
    x_recv = torch.randn(world * tokens, h, device="cuda", generator=g).bfloat16()
    # Each expert's rows: distinct tokens of all sources, in source-row order.
    row_src = torch.cat([torch.randperm(world * tokens, device="cuda", generator=g)[:c].sort()
                         .values for c in counts]).to(torch.int32)
    a0 = x_recv[row_src.long()]
    wi = interleave_gate_up(w13)
    outs = {v: torch.empty(rows, f, device="cuda", dtype=torch.bfloat16) for v in variants}

    def call(v):
        bm, bn, bk, warps, stages = variants[v]
        te, ts, tend = tile_table(counts, bm)
        a_desc = TensorDescriptor.from_tensor(a0, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(wi.view(el * h, 2 * f), [bk, 2 * bn])
        return lambda: layer0_gemm[(sms,)](a_desc, x_recv, row_src, b_desc, outs[v], te, ts,
                                           tend, te.numel(), h, f, GATHER=v != "tma",
                                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                           num_warps=warps, num_stages=stages)
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).to(torch.int32)
    bt = w13.transpose(1, 2).contiguous().transpose(1, 2)
    graphs = {"torch": graphed(lambda: torch._grouped_mm(a0, bt, offs=offs))}
    errors = {}
    for v in variants:
        try:
            graphs[v] = graphed(call(v))
        except Exception as e:    # a tile that does not fit is a result too
            errors[v] = repr(e)[:300]
    torch.cuda.synchronize()
    same = {v: torch.equal(outs["tma"], outs[v]) for v in graphs if v not in ("torch", "tma")}
    times = {v: [] for v in graphs}
    for _ in range(PAIRED_ROUNDS):
        for v, gr in graphs.items():
            times[v].append(graph_us(gr))
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    over_tma = {v: sorted(a / b for a, b in zip(times[v], times["tma"]))[PAIRED_ROUNDS // 2]
                for v in times if v not in ("torch", "tma")}
    flops = 2.0 * rows * h * 2 * f
    rec = dict(config=name, tokens=tokens, world=world, rows=rows, experts=el,
               tiles={v: list(t) for v, t in variants.items()}, us=med,
               tflops={v: flops / t / 1e6 for v, t in med.items()},
               over_tma=over_tma, outputs_equal_tma=same, errors=errors, rounds=times)
    print(json.dumps({k: v for k, v in rec.items() if k not in ("rounds", "tiles")}),
          flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    preset_arguments(ap)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gather-tiles", nargs="*", default=[], metavar="BM,BN,BK,W,S",
                    help="more tiles for the gather variant (BN: the W13 interleave block)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "gather_gemm.json"))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    tiles = [tuple(map(int, t.split(","))) for t in args.gather_tiles]
    recs = [run(c, t, args.world, sms, g, tiles) for c in args.configs for t in args.tokens]
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
