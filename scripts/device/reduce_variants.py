"""Bytes per second of layer1's top-k reduce, by loop shape, one GPU, outside the layer.

Experiment. The layer1 overlap pays only if a few comm blocks reduce fast: the reduce of
the whole GPU is bound by HBM (every block gets ~1/132 of it), but a handful of blocks
beside a compute-bound GEMM are bound by how many bytes each keeps in flight. The
layer's reduce (``comet.kernels.layer1._reduce_entries``) loads the top-k rows of a
tile of entries into registers, which caps that at a few tens of KB (26-32 GB/s per
block on an H100, ``h100-reduce-bw.json``). The variants here stream the same rows
through shared memory with Triton's pipeliner (``tl.range(num_stages=...)`` pipelines
loads that feed no dot when asked to explicitly):

* ``layer``: the layer's own ``_reduce_entries`` (the reference);
* ``flat``: one flattened loop over (entry tile, column tile), all top-k loads of the
  next iterations in flight;
* ``slot``: the loop runs over (entry tile, column tile, top-k slot), one row tile per
  iteration, the accumulator carried and stored at the last slot;
* ``tma``: one token at a time, each row's column chunk through the TMA engine (a box
  of contiguous columns), the accumulator carried over the top-k slots.

Rows are laid out as the layer's plan lays them out (expert-major, tokens ascending
inside an expert), weights random, on a grid of ``--programs`` blocks taking items of
``--item`` entries from an atomic queue. Each variant is checked against torch. A grid
with more programs than items leaves blocks idle (``items`` in each record): whole-GPU
figures need ``tokens / item >= programs``, and an item smaller than a variant's entry
tile masks part of every tile.

    PYTHONPATH=. python3 scripts/device/reduce_variants.py [--configs mixtral deepseek-v3-like]
        [--programs 4 16 132] [--variants layer flat:16,256,3 slot:64,256,4]
"""

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from comet.config import preset
from comet.kernels.layer1 import _reduce_entries
from comet.kernels.sync import take


@triton.jit
def _item_range(i, n_entries, ITEM: tl.constexpr):
    start = i * ITEM
    return start, tl.minimum(start + ITEM, n_entries)


@triton.jit
def reduce_layer_kernel(out1, H, dst, tok, rows, wgt, n_entries, queue,
                        TOPK: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr,
                        ITEM: tl.constexpr, STAGES: tl.constexpr):
    i = take(queue)
    while i * ITEM < n_entries:
        start, end = _item_range(i, n_entries, ITEM)
        _reduce_entries(out1, H, dst, tok, rows, wgt, start, end, 0, H, TOPK, ENTRIES,
                        BLOCK_C)
        i = take(queue)


@triton.jit
def _weighted_rows(out1, H, rows, wgt, q, live, j, cols, cmask, TOPK: tl.constexpr):
    """``weight * out1[row]`` of top-k slot ``j`` of entries ``q``, columns ``cols``, fp32."""
    row = tl.load(rows + q * TOPK + j, mask=live, other=-1).to(tl.int64)
    wj = tl.load(wgt + q * TOPK + j, mask=live, other=0.0)
    v = tl.load(out1 + row[:, None] * H + cols[None, :], mask=(row[:, None] >= 0) & cmask,
                other=0.0)
    return v.to(tl.float32) * wj[:, None]


@triton.jit
def _tile(start, end, tile, n_c, H, ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr):
    """Entries ``q`` and columns ``cols`` of tile ``tile`` of an item (entry tiles major,
    ``n_c`` column tiles each), with their masks."""
    q = start + (tile // n_c) * ENTRIES + tl.arange(0, ENTRIES)
    cols = (tile % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    return q, q < end, cols, cols[None, :] < H


@triton.jit
def reduce_flat_kernel(out1, H, dst, tok, rows, wgt, n_entries, queue,
                       TOPK: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr,
                       ITEM: tl.constexpr, STAGES: tl.constexpr):
    n_c = tl.cdiv(H, BLOCK_C)
    i = take(queue)
    while i * ITEM < n_entries:
        start, end = _item_range(i, n_entries, ITEM)
        n_e = tl.cdiv(end - start, ENTRIES)
        for w in tl.range(0, n_e * n_c, num_stages=STAGES):
            q, live, cols, cmask = _tile(start, end, w, n_c, H, ENTRIES, BLOCK_C)
            t = tl.load(tok + q, mask=live, other=0).to(tl.int64)
            acc = tl.zeros((ENTRIES, BLOCK_C), dtype=tl.float32)
            for j in tl.static_range(TOPK):
                acc += _weighted_rows(out1, H, rows, wgt, q, live, j, cols, cmask, TOPK)
            tl.store(dst + t[:, None] * H + cols[None, :], acc.to(dst.dtype.element_ty),
                     mask=live[:, None] & cmask)
        i = take(queue)


@triton.jit
def reduce_slot_kernel(out1, H, dst, tok, rows, wgt, n_entries, queue,
                       TOPK: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr,
                       ITEM: tl.constexpr, STAGES: tl.constexpr):
    n_c = tl.cdiv(H, BLOCK_C)
    i = take(queue)
    while i * ITEM < n_entries:
        start, end = _item_range(i, n_entries, ITEM)
        n_e = tl.cdiv(end - start, ENTRIES)
        acc = tl.zeros((ENTRIES, BLOCK_C), dtype=tl.float32)
        for w in tl.range(0, n_e * n_c * TOPK, num_stages=STAGES):
            j = w % TOPK
            q, live, cols, cmask = _tile(start, end, w // TOPK, n_c, H, ENTRIES, BLOCK_C)
            acc = tl.where(j == 0, 0.0, acc) + _weighted_rows(out1, H, rows, wgt, q, live, j,
                                                              cols, cmask, TOPK)
            if j == TOPK - 1:
                t = tl.load(tok + q, mask=live, other=0).to(tl.int64)
                tl.store(dst + t[:, None] * H + cols[None, :], acc.to(dst.dtype.element_ty),
                         mask=live[:, None] & cmask)
        i = take(queue)


@triton.jit
def reduce_tma_kernel(out1_desc, H, dst, tok, rows, wgt, n_entries, queue,
                      TOPK: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_C: tl.constexpr,
                      ITEM: tl.constexpr, STAGES: tl.constexpr):
    """Rows through the TMA engine: ``out1`` viewed as ``[rows * H / BLOCK_C, BLOCK_C]``,
    so a box of ``ENTRIES`` (here: segments) x ``BLOCK_C`` is ``ENTRIES * BLOCK_C``
    contiguous columns of one row; one loop step is one (token, column chunk, top-k
    slot), the accumulator carried over the slots."""
    seg_per_row = H // BLOCK_C
    n_c = seg_per_row // ENTRIES
    i = take(queue)
    while i * ITEM < n_entries:
        start, end = _item_range(i, n_entries, ITEM)
        acc = tl.zeros((ENTRIES, BLOCK_C), dtype=tl.float32)
        for w in tl.range(0, (end - start) * n_c * TOPK, num_stages=STAGES):
            j = w % TOPK
            chunk = (w // TOPK) % n_c
            q = start + w // (TOPK * n_c)
            row = tl.load(rows + q * TOPK + j)
            wj = tl.where(row >= 0, tl.load(wgt + q * TOPK + j), 0.0)
            v = out1_desc.load([tl.maximum(row, 0) * seg_per_row + chunk * ENTRIES, 0])
            acc = tl.where(j == 0, 0.0, acc) + v.to(tl.float32) * wj
            if j == TOPK - 1:
                t = tl.load(tok + q).to(tl.int64)
                off = (chunk * ENTRIES + tl.arange(0, ENTRIES))[:, None] * BLOCK_C \
                    + tl.arange(0, BLOCK_C)[None, :]
                tl.store(dst + t * H + off, acc.to(dst.dtype.element_ty))
        i = take(queue)


KERNELS = {"layer": reduce_layer_kernel, "flat": reduce_flat_kernel,
           "slot": reduce_slot_kernel, "tma": reduce_tma_kernel}


def parse_variant(text):
    """``layer`` / ``flat:16,256,3`` -> (kind, entries, block_c, stages)."""
    kind, _, rest = text.partition(":")
    entries, block_c, stages = (int(v) for v in (rest or "64,256,1").split(","))
    return kind, entries, block_c, stages


def make_inputs(name, tokens, ep, device="cuda", layout="expert"):
    """One rank's reduce inputs at EP=``ep`` rank shapes (uniform routing, every slot on
    this rank, as ``kernel_times.py --ep`` builds them)."""
    cfg = preset(name)
    experts = cfg.num_experts // ep
    topk = min(cfg.top_k, experts)
    h = cfg.hidden_size
    ids = torch.stack([torch.randperm(experts, device=device)[:topk] for _ in range(tokens)])
    # Row of slot (t, j): its place in the expert-major order, tokens ascending inside an
    # expert -- the layout the plan gives layer0's and layer1's shared tensors.
    key = ids.flatten() * tokens + torch.arange(tokens, device=device).repeat_interleave(topk)
    order = torch.argsort(key)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=device)
    if layout == "token":   # locality probe: a token's rows side by side
        rows = torch.arange(order.numel(), device=device)
    rows = rows.view(tokens, topk).to(torch.int32).contiguous()
    out1 = torch.randn(tokens * topk, h, device=device, dtype=cfg.dtype)
    wgt = torch.rand(tokens, topk, device=device)
    tok = torch.arange(tokens, device=device, dtype=torch.int32)
    dst = torch.empty(tokens, h, device=device, dtype=cfg.dtype)
    return cfg, dict(out1=out1, dst=dst, tok=tok, rows=rows, wgt=wgt, topk=topk, h=h)


def run_variant(inp, variant, programs, item, iters=20):
    kind, entries, block_c, stages = variant
    kernel = KERNELS[kind]
    queue = torch.zeros(1, dtype=torch.int32, device="cuda")
    n = inp["tok"].numel()

    first = inp["out1"]
    if kind == "tma":
        if inp["h"] % (entries * block_c):
            raise ValueError(f"a {entries} x {block_c} box does not tile H={inp['h']}")
        from triton.tools.tensor_descriptor import TensorDescriptor
        first = TensorDescriptor.from_tensor(inp["out1"].view(-1, block_c), [entries, block_c])

    def launch():
        queue.zero_()
        kernel[(programs,)](first, inp["h"], inp["dst"], inp["tok"], inp["rows"],
                            inp["wgt"], n, queue, TOPK=inp["topk"], ENTRIES=entries,
                            BLOCK_C=block_c, ITEM=item, STAGES=stages, num_warps=8)

    launch()
    ref = (inp["out1"][inp["rows"].long()].float() * inp["wgt"][..., None]).sum(1)
    err = ((inp["dst"].float() - ref).abs().max() / ref.abs().max()).item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / iters
    nbytes = inp["out1"].numel() * inp["out1"].element_size() + inp["dst"].numel() * 2
    return dict(items=-(-n // item), us=us, gbps=nbytes / us / 1e3, gbps_per_block=nbytes / us / 1e3 / programs,
                rel_err=err)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["mixtral", "deepseek-v3-like"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--programs", type=int, nargs="+", default=[4, 16, 132])
    p.add_argument("--item", type=int, default=64)
    p.add_argument("--layout", choices=["expert", "token"], default="expert",
                   help="row layout: the plan's (expert-major), or token-major (a probe "
                        "of what gathering scattered rows costs)")
    p.add_argument("--variants", nargs="+",
                   default=["layer", "flat:16,256,2", "flat:16,256,3", "flat:8,512,3",
                            "slot:64,256,3", "slot:64,256,4", "slot:32,256,6",
                            "slot:32,512,4"])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "reduce-variants.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    records = []
    for name in args.configs:
        _, inp = make_inputs(name, args.tokens, args.ep, layout=args.layout)
        for text in args.variants:
            for programs in args.programs:
                try:
                    res = run_variant(inp, parse_variant(text), programs, args.item)
                except Exception as e:  # a variant that does not compile is a result too
                    res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                rec = dict(config=name, tokens=args.tokens, ep=args.ep, layout=args.layout,
                           variant=text,
                           programs=programs, **res)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
