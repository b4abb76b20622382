"""Where the GroupGEMM loses to torch: the same tile body under different tile loops.

Experiment, one GPU. For each preset's EP=4 per-rank GEMM (uniform routing, rows grouped
by expert), time comet's ``gemm_tile`` (the body both layer kernels use) driven by:

* ``queue``  -- a device work queue (``take``), one item per take (the kernels until
  2026-11-24);
* ``static`` -- a persistent grid striding over work items (no atomics);
* ``flat``   -- the same stride loop as ``tl.range(..., flatten=True)``, which lets
  Triton's pipeliner prefetch the next tile's operands during this tile's epilogue
  (layer1 now);
* ``batch``  -- the queue, but one atomic takes ``BATCH`` consecutive items, looped
  with ``flatten=True`` (epilogue overlap inside a batch, queue between batches);
* ``grid``   -- one program per work item (no persistence);
* ``strided`` -- the queue, one take = ``BATCH`` items strided by the grid, looped with
  ``flatten=True`` (``strided_take``: layer0 now);
against ``torch._grouped_mm`` on the same rows. Prints one JSON line per record and
writes them to ``$OUT/gemm_variants.json``.

    PYTHONPATH=. python3 scripts/device/gemm_variants.py [--configs qwen2-moe mixtral]
"""

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.config import preset
from comet.kernels.launch import TileConfig
from comet.kernels.group_gemm import gemm_acc, gemm_tile, grouped_work, strided_take
from comet.kernels.sync import take
from comet.weights import GATE_UP_BLOCK, interleave_gate_up
from gemm_check import graph_us, graphed   # same folder: scripts/device

LOOPS = {"queue": 0, "static": 1, "flat": 2, "batch": 3, "grid": 4, "strided": 6}
#: Epilogues of the ``queue`` loop: masked ``tl.store`` (the kernels'), TMA store through a
#: per-tile device descriptor, none (the store skipped: what the epilogue costs at most),
#: twodot (layer0 only: gate and up as two dots of BLOCK_N columns, the kernels before W13
#: was interleaved; the others run one dot over the interleave block, comet.weights).
EPILOGUES = {"store": 0, "tma": 1, "none": 2, "twodot": 3}
GATE_UP = tl.constexpr(GATE_UP_BLOCK)
GROUP_M = tl.constexpr(TileConfig.group_m)


@triton.jit
def _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end, num_tiles,
          n_blocks, K, N, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPILOGUE: tl.constexpr = 0):
    t, nb = grouped_work(w, num_tiles, n_blocks, GROUP_M)
    expert = tl.load(tile_expert + t)
    r0 = tl.load(tile_row_start + t)
    r1 = tl.load(tile_row_end + t)
    one_dot: tl.constexpr = EPILOGUE != 3 and BLOCK_N == GATE_UP
    if EPILOGUE == 0 or EPILOGUE == 3:
        gemm_tile(a_desc, b_desc, c_ptr, N, expert, r0, r1, nb * BLOCK_N, K, N, GATED,
                  GATE_UP, one_dot, BLOCK_M, BLOCK_N, BLOCK_K, "tf32")
    else:
        acc = gemm_acc(a_desc, b_desc, expert, r0, nb * BLOCK_N, K, N, GATED, GATE_UP,
                       one_dot, BLOCK_M, BLOCK_N, BLOCK_K, "tf32")
        if EPILOGUE == 1:
            # TMA store through a descriptor bounded by this expert's rows (built on the
            # device per tile): rows past row_end belong to the next expert's tiles.
            c_desc = tl.make_tensor_descriptor(c_ptr + r0.to(tl.int64) * N, shape=[r1 - r0, N],
                                               strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
            c_desc.store([0, nb * BLOCK_N], acc.to(c_ptr.dtype.element_ty))
        elif r1 < 0:   # never true: the GEMM without its store (upper bound of the epilogue)
            tl.store(c_ptr + tl.arange(0, BLOCK_M)[:, None] * N
                     + tl.arange(0, BLOCK_N)[None, :], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def variant_kernel(a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                   num_tiles_ptr, queue, K, N, LOOP: tl.constexpr, BATCH: tl.constexpr,
                   GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EPILOGUE: tl.constexpr):
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(N, BLOCK_N)
    total = num_tiles * n_blocks
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if LOOP == 0:
        w = take(queue)
        while w < total:
            _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                  num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
            w = take(queue)
    elif LOOP == 1:
        for w in range(pid, total, nprog):
            _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                  num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
    elif LOOP == 2:
        for w in tl.range(pid, total, nprog, flatten=True):
            _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                  num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
    elif LOOP == 3:
        base = tl.atomic_add(queue, BATCH, sem="relaxed", scope="gpu")
        while base < total:
            for w in tl.range(base, tl.minimum(base + BATCH, total), flatten=True):
                _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                      num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
            base = tl.atomic_add(queue, BATCH, sem="relaxed", scope="gpu")
    elif LOOP == 4:
        _item(pid, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
              num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
    elif LOOP == 6:
        first, end = strided_take(queue, nprog, BATCH)
        while first < total:
            for w in tl.range(first, tl.minimum(end, total), nprog, flatten=True):
                _item(w, a_desc, b_desc, c_ptr, tile_expert, tile_row_start, tile_row_end,
                      num_tiles, n_blocks, K, N, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE)
            first, end = strided_take(queue, nprog, BATCH)


#: Rounds of the paired timing: clocks on these machines drift by ~10% over seconds, so
#: the variant and torch are timed in alternation and the ratio is taken per round.
PAIRED_ROUNDS = 5


def paired(call, reference):
    """(median device us of ``call``, median over rounds of reference time / call time),
    both replayed from CUDA graphs (gemm_check.graphed). Runs before 2026-11-23's seventh
    session timed one synchronised call at a time, host launch included."""
    call_graph, ref_graph = graphed(call), graphed(reference)
    times, ratios = [], []
    for _ in range(PAIRED_ROUNDS):
        us = graph_us(call_graph)
        times.append(us)
        ratios.append(graph_us(ref_graph) / us)
    return sorted(times)[len(times) // 2], sorted(ratios)[len(ratios) // 2]


def tile_table(counts, block_m):
    experts, starts, ends = [], [], []
    row = 0
    for e, c in enumerate(counts):
        for r in range(row, row + c, block_m):
            experts.append(e)
            starts.append(r)
            ends.append(min(r + block_m, row + c))
        row += c
    dev = "cuda"
    return (torch.tensor(experts, dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
            torch.tensor(ends, dtype=torch.int32, device=dev))


def run_layer(name, layer, a, b, counts, gated, tile, sms, loops, batch, per_sm=1):
    """Time one layer's GEMM (``a [R, K]`` rows by expert, ``b [El, K, N']``) with
    ``per_sm`` persistent programs per SM."""
    bm, bn, bk, warps, stages = tile
    el, k, n_full = b.shape
    n = n_full // 2 if gated else n_full
    c = torch.empty(a.shape[0], n, device="cuda", dtype=a.dtype)
    te, ts, tend = tile_table(counts, bm)
    num_tiles = torch.tensor([te.numel()], dtype=torch.int32, device="cuda")
    queue = torch.zeros(1, dtype=torch.int32, device="cuda")
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b.view(el * k, n_full), [bk, bn])
    if gated:   # the kernels' W13 layout: gate and up interleaved by GATE_UP_BLOCK columns
        bi = interleave_gate_up(b)
        bi_one = TensorDescriptor.from_tensor(bi.view(el * k, n_full), [bk, 2 * bn])
        bi_two = TensorDescriptor.from_tensor(bi.view(el * k, n_full), [bk, bn])
    items = te.numel() * triton.cdiv(n, bn)
    flops = 2.0 * a.shape[0] * k * n_full
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).to(torch.int32)
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)
    ref = torch._grouped_mm(a, bt, offs=offs)
    if gated:
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    torch_call = lambda: torch._grouped_mm(a, bt, offs=offs)  # noqa: E731
    t_us = graph_us(graphed(torch_call))
    weight_bytes = b.numel() * b.element_size()
    recs = []
    for variant in loops:
        loop, _, epilogue = variant.partition("+")
        base = loop.rstrip("0123456789")
        items_per_take = int(loop[len(base):]) if loop != base else batch
        loop = base
        if epilogue == "twodot" and not gated:
            continue
        kernel_b = b_desc
        if gated:
            kernel_b = bi_two if epilogue == "twodot" or bn != GATE_UP_BLOCK else bi_one
        grid = items if loop == "grid" else sms * per_sm

        def call():
            queue.zero_()
            variant_kernel[(grid,)](a_desc, kernel_b, c, te, ts, tend, num_tiles, queue,
                                    k, n,
                                    LOOP=LOOPS[loop], BATCH=items_per_take, GATED=gated, BLOCK_M=bm,
                                    BLOCK_N=bn, BLOCK_K=bk,
                                    EPILOGUE=EPILOGUES[epilogue or "store"], num_warps=warps,
                                    num_stages=stages)
        rec = dict(config=name, layer=layer, loop=variant, tile=list(tile), per_sm=per_sm,
                   rows=a.shape[0],
                   experts=el, K=k, N=n_full, torch_us=t_us,
                   torch_tflops=flops / t_us / 1e6)
        try:
            c.zero_()
            call()
            torch.cuda.synchronize()
            err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            us, ratio = paired(call, torch_call)
            # Weight bytes over time: at decode sizes every weight is read once and the
            # GEMM is bound by HBM, not tensor cores (hbm_bw.py measures the rate).
            rec.update(us=us, tflops=flops / us / 1e6, weight_tbs=weight_bytes / us / 1e6,
                       ratio=ratio, rel_err=err)
        except Exception as e:   # a variant that does not compile is a result too
            rec.update(error=repr(e)[:300])
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


def preset_arguments(ap: argparse.ArgumentParser) -> None:
    """``--configs`` (default: the four presets) and ``--tokens`` (per rank)."""
    ap.add_argument("--configs", nargs="+",
                    default=["qwen2-moe", "mixtral", "phi3.5-moe", "deepseek-v3-like"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])


def main():
    ap = argparse.ArgumentParser()
    preset_arguments(ap)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--loops", nargs="+", default=list(LOOPS),
                    help="tile loops; LOOP+EPILOGUE for another epilogue of queue or flat "
                         f"({', '.join(EPILOGUES)}), e.g. queue+tma")
    ap.add_argument("--batch", type=int, default=4,
                    help="items per take of the batch loop (batchN in --loops: N)")
    ap.add_argument("--tile0", nargs="+", default=["128,128,64,8,3"],
                    help="BM,BN,BK,warps,stages (several: each is timed)")
    ap.add_argument("--tile1", nargs="+", default=["128,256,64,8,3"])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1],
                    help="persistent programs per SM (2: two tiles' main loops and "
                         "epilogues interleave on an SM, where smem and registers allow)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "gemm_variants.json"))
    args = ap.parse_args()
    # Device-built descriptors (the tma epilogue) live in global scratch from this hook.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles0 = [tuple(map(int, t.split(","))) for t in args.tile0]
    tiles1 = [tuple(map(int, t.split(","))) for t in args.tile1]
    recs = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.configs:
        cfg = preset(name)
        el = cfg.num_experts // args.world
        h, f = cfg.hidden_size, cfg.intermediate_size
        w13 = (torch.randn(el, h, 2 * f, device="cuda", generator=g) * h ** -0.5).bfloat16()
        w2 = (torch.randn(el, f, h, device="cuda", generator=g) * f ** -0.5).bfloat16()
        for tokens in args.tokens:
            rows = tokens * cfg.top_k
            counts = [rows // el + (1 if e < rows % el else 0) for e in range(el)]
            a = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
            hid = torch.randn(rows, f, device="cuda", generator=g).bfloat16()
            for pps in args.programs_per_sm:
                for t0 in tiles0:
                    recs += [dict(r, tokens=tokens) for r in run_layer(
                        name, "layer0", a, w13, counts, True, t0, sms, args.loops,
                        args.batch, pps)]
                for t1 in tiles1:
                    recs += [dict(r, tokens=tokens) for r in run_layer(
                        name, "layer1", hid, w2, counts, False, t1, sms, args.loops,
                        args.batch, pps)]
            del a, hid
        del w13, w2
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(),
                   "world": args.world, "records": recs}, fh, indent=1)
    print(f"{'config':18s} {'tokens':>6s} {'layer':6s} {'tile':16s} per_sm " +
          " ".join(f"{lp:>7s}" for lp in args.loops) + "   (torch / variant time)")

    def key(r):
        return r["config"], r["tokens"], r["layer"], tuple(r["tile"]), r["per_sm"]
    for k in dict.fromkeys(map(key, recs)):
        name, tokens, layer, tile, pps = k
        row = {r["loop"]: r for r in recs if key(r) == k}
        print(f"{name:18s} {tokens:6d} {layer:6s} {','.join(map(str, tile)):16s} {pps:6d} "
              + " ".join(f"{row[lp].get('ratio', float('nan')) if lp in row else float('nan'):7.2f}"
                         for lp in args.loops))


if __name__ == "__main__":
    main()
