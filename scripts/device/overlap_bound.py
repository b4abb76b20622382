"""How much communication can any overlap hide on these GPUs? A measured ceiling.

Experiment: issue 11 asks the fused layer to hide 85% of its communication. On a GPU
that runs its GEMMs at the board's power cap, data movement beside them may slow them
down however well it is scheduled. This measures that ceiling with *no dependencies at
all*: the layer's two grouped GEMMs (``torch._grouped_mm`` on the rows the layer
multiplies) on one stream and the layer's data movement on another, started together,
no wait between them. The data movement is either

* ``nccl``: NCCL ``all_to_all_single`` of the rows (dispatch, then combine), SM-driven;
* ``ce``: the same bytes to the peers through the copy engines (``copy_`` into the
  peers' symmetric-memory buffers: ``cudaMemcpyAsync``, no SM), dispatch then return.

The communication stream has the high priority and is launched first, so its kernels
are never queued behind the GEMM's persistent grid. For each pair, per round,
``ceiling = (G + C - both) / min(G, C)``: 1 when the pair costs max(G, C) -- the shorter
completely hidden -- and 0 when it costs G + C. It is the best any schedule can reach on
these rows and this machine, whatever decides the order of tiles.

In the same rounds comet's own calls (``fused``, ``sequential``, ``compute_only``,
``comm_only``: its CUDA graphs) give its hidden fraction ``(c + d - b) / min(c, d)``, and
``c||d`` -- a second layer's ``comm_only`` call beside the first layer's
``compute_only`` call, the same two-stream start -- gives the ceiling of comet's own two
halves with no dependency between them; ``c+ce`` the copy-engine copies beside comet's
compute-only call.

Every variant runs ``--calls`` back-to-back calls per batch, timed with CUDA events, the
variants in a rotating order round after round (``paired_tiles.paired_rounds``); the
ratios are taken within a round and their median over rounds is reported, so the slow
drift of the clocks cancels.

    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/overlap_bound.py
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/overlap_bound.py \\
        --configs mixtral --tokens 4096 --rounds 5

With ``--power S``, every variant then also runs back to back for S seconds while one
nvidia-smi process samples every GPU (``power_probe.Sampler``): each record gets the
board power, SM clock and power-cap fraction of each variant's window -- what the
copies, NCCL's kernels and comet's comm role each draw alone and beside the GEMMs.

Needs two ranks or more (one rank has nothing to communicate). Rank 0 prints one line per
(config, tokens) and writes ``$OUT/overlap_bound.json``.
"""

import json
import statistics
import time

import torch
import torch.distributed as dist

from comet.baseline import grouped_mm, plan_dispatch
from comet.cli.launch import init_ranks
from comet.runtime.layer import FusedMoE
from kernel_times import rank_layer_inputs    # this folder is on sys.path
from paired_tiles import batch_us, paired_args, paired_rounds, slowest_rank
from power_probe import Sampler, window_stats

COMET_MODES = ("fused", "sequential", "compute_only", "comm_only")
#: Variants, in the order of the JSON's ``median_us``.
VARIANTS = ("gemm", "nccl", "ce", "gemm+nccl", "gemm+ce") + COMET_MODES + ("c||d", "c+ce")


def hidden(alone_a: float, alone_b: float, together: float) -> float:
    """``(a + b - together) / min(a, b)``: the fraction of the shorter of two parts that
    running them together hid (1: it cost max(a, b); 0: a + b; negative: worse)."""
    return (alone_a + alone_b - together) / min(alone_a, alone_b)


def derived(t: dict[str, float]) -> dict[str, float]:
    """One round's ratios from its times per variant (``VARIANTS`` keys)."""
    return {
        "ceiling_nccl": hidden(t["gemm"], t["nccl"], t["gemm+nccl"]),
        "ceiling_ce": hidden(t["gemm"], t["ce"], t["gemm+ce"]),
        "ceiling_comet": hidden(t["compute_only"], t["comm_only"], t["c||d"]),
        "ceiling_comet_ce": hidden(t["compute_only"], t["ce"], t["c+ce"]),
        "comet_hidden": hidden(t["compute_only"], t["comm_only"], t["fused"]),
        "fused_over_sequential": t["fused"] / t["sequential"],
        "gemm_stretch_nccl": t["gemm+nccl"] / t["gemm"],
        "gemm_stretch_ce": t["gemm+ce"] / t["gemm"],
    }


def summarise(times: list[list[float]]) -> dict[str, float]:
    """Median over rounds of each :func:`derived` ratio (``times[v][r]``: variant ``v``
    of ``VARIANTS`` in round ``r``)."""
    rounds = [derived({v: times[i][r] for i, v in enumerate(VARIANTS)})
              for r in range(len(times[0]))]
    return {k: statistics.median(d[k] for d in rounds) for k in rounds[0]}


def together(comm, gemm, comm_stream, gemm_stream):
    """``comm`` and ``gemm`` started at once on their streams; the current stream waits
    for both (so that back-to-back calls do not overlap each other)."""
    def call():
        cur = torch.cuda.current_stream()
        comm_stream.wait_stream(cur)
        gemm_stream.wait_stream(cur)
        with torch.cuda.stream(comm_stream):
            comm()
        with torch.cuda.stream(gemm_stream):
            gemm()
        cur.wait_stream(comm_stream)
        cur.wait_stream(gemm_stream)
    return call


class PeerCopies:
    """The layer's bytes to the peers through the copy engines: rows for peer ``d`` into
    ``d``'s symmetric buffer (this rank's block of it), then the same number of rows
    back the other way (the combine's return) -- ``copy_`` between same-device tensors,
    one of them a peer mapping, is a ``cudaMemcpyAsync`` (no SM)."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], hidden_size: int,
                 dtype: torch.dtype, group=None):
        import torch.distributed._symmetric_memory as symm_mem

        group = group if group is not None else dist.group.WORLD
        world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        block = torch.tensor(max(send_splits + recv_splits), device="cuda")
        dist.all_reduce(block, op=dist.ReduceOp.MAX, group=group)
        self.block, self.h = int(block), hidden_size
        n = world * self.block * hidden_size
        self.buf = symm_mem.empty(n, dtype=dtype, device="cuda")
        self.handle = symm_mem.rendezvous(self.buf, group=group)
        self.src = torch.randn(max(sum(send_splits), sum(recv_splits)), hidden_size,
                               device="cuda", dtype=dtype)
        self.peers = [p for p in range(world) if p != self.rank]
        self.views = {p: self.handle.get_buffer(p, (world * self.block, hidden_size), dtype)
                      for p in self.peers}
        self.send, self.recv = send_splits, recv_splits

    def __call__(self):
        for splits in (self.send, self.recv):
            off = 0
            for p in range(len(splits)):
                if p != self.rank and splits[p]:
                    dst = self.views[p][self.rank * self.block:][:splits[p]]
                    dst.copy_(self.src[off:off + splits[p]])
                off += splits[p]


def copy_kind(fn) -> list[str]:
    """What the profiler calls the device work of ``fn`` (to show the copies are memcpy
    operations, not kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages()})


def batch_time(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` back-to-back calls, the slowest rank's."""
    dist.barrier()
    return slowest_rank(batch_us(fn, calls), dist.get_world_size())


def power_windows(fns: dict, medians: dict[str, float], seconds: float) -> dict:
    """Each variant back to back for ``seconds`` (the same number of calls on every rank):
    ``{variant: [start, end]}`` in ``time.time()``'s clock, for the sampler."""
    windows = {}
    for v in VARIANTS:
        calls = max(1, round(seconds * 1e6 / medians[v]))
        t0 = time.time()
        batch_time(fns[v], calls)
        windows[v] = [t0, time.time()]
    return windows


def run(name: str, tokens: int, ep: int, world: int, rank: int, rounds: int,
        calls: int, power_s: float = 0.0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rank)
    cfg, experts, w13, w2 = rank_layer_inputs(name, tokens, ep, world, None, g)
    el, h, f = w13.shape[0], cfg.hidden_size, cfg.intermediate_size
    x = torch.randn(tokens, h, device="cuda", dtype=cfg.dtype, generator=g)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(cfg.top_k).indices
    w = torch.softmax(torch.randn(tokens, cfg.top_k, device="cuda", generator=g), -1)

    plan = plan_dispatch(ids, el)
    a0 = torch.randn(plan.rows, h, device="cuda", dtype=cfg.dtype, generator=g)
    a1 = torch.randn(plan.rows, f, device="cuda", dtype=cfg.dtype, generator=g)
    send = torch.randn(sum(plan.send_splits), h, device="cuda", dtype=cfg.dtype, generator=g)
    recv, back = send.new_empty(plan.rows, h), torch.empty_like(send)

    def gemm():
        grouped_mm(a0, w13, plan.expert_rows, plan.offs)
        grouped_mm(a1, w2, plan.expert_rows, plan.offs)

    def nccl():
        dist.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits)
        dist.all_to_all_single(back, recv, plan.send_splits, plan.recv_splits)

    ce = PeerCopies(plan.send_splits, plan.recv_splits, h, cfg.dtype)
    comm_stream = torch.cuda.Stream(priority=-1)
    gemm_stream = torch.cuda.Stream()
    # Two layers: c||d runs one's compute_only beside the other's comm_only, and each
    # call's shared tensors are its own.
    layers = [FusedMoE(cfg, w13, w2) for _ in range(2)]
    for layer in layers:     # rows in place (a zeroed workspace runs GEMMs faster), graphs
        for mode in ("sequential",) + COMET_MODES:
            layer(x, ids, w, mode=mode)
    fns = {"gemm": gemm, "nccl": nccl, "ce": ce,
           "gemm+nccl": together(nccl, gemm, comm_stream, gemm_stream),
           "gemm+ce": together(ce, gemm, comm_stream, gemm_stream),
           **{m: (lambda m=m: layers[0](x, ids, w, mode=m)) for m in COMET_MODES},
           "c||d": together(lambda: layers[1](x, ids, w, mode="comm_only"),
                            lambda: layers[0](x, ids, w, mode="compute_only"),
                            comm_stream, gemm_stream),
           "c+ce": together(ce, lambda: layers[0](x, ids, w, mode="compute_only"),
                            comm_stream, gemm_stream)}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    kinds = copy_kind(ce)
    times, _ = paired_rounds(lambda i: batch_time(fns[VARIANTS[i]], calls), len(VARIANTS),
                             rounds)
    medians = {v: statistics.median(t) for v, t in zip(VARIANTS, times)}
    windows = power_windows(fns, medians, power_s) if power_s else None
    for layer in layers:
        layer.check_errors_now()
    rec = dict(config=name, tokens=tokens, world=world, rounds=rounds, calls=calls,
               power_windows=windows,
               comm_blocks=list(layers[0].last_comm_blocks), ce_device_work=kinds,
               variants=list(VARIANTS),
               median_us=medians,
               **summarise(times), us=times)
    if rank == 0:
        m = rec["median_us"]
        print(f"{name:18s} {tokens:6d}  gemm {m['gemm']:8.1f} nccl {m['nccl']:7.1f} "
              f"ce {m['ce']:7.1f} | ceiling nccl {rec['ceiling_nccl']:5.2f} "
              f"ce {rec['ceiling_ce']:5.2f} comet c||d {rec['ceiling_comet']:5.2f} "
              f"c+ce {rec['ceiling_comet_ce']:5.2f} | "
              f"comet hidden {rec['comet_hidden']:5.2f} "
              f"b/seq {rec['fused_over_sequential']:.3f}", flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return rec


def main():
    ap = paired_args("overlap_bound", [4096, 16384], 1, 7, 8)
    ap.add_argument("--power", type=float, default=0.0, metavar="S",
                    help="also run each variant S seconds under nvidia-smi sampling")
    ap.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi sampling period")
    args = ap.parse_args()
    _, world, rank = init_ranks()
    if world < 2:
        raise SystemExit("overlap_bound.py needs two ranks or more (torchrun)")
    notes = []
    sampler = Sampler(args.interval_ms, notes) if args.power and rank == 0 else None
    try:
        recs = [run(c, t, args.ep, world, rank, args.rounds, args.calls, args.power)
                for c in args.configs for t in args.tokens]
    finally:
        samples = sampler and sampler.stop()
    if rank != 0:
        return
    for r in recs:
        if samples and r["power_windows"]:
            r["power"] = {v: window_stats(samples, *w) for v, w in r["power_windows"].items()}
            print(f"{r['config']:18s} {r['tokens']:6d}  " + "  ".join(
                f"{v} {power_cell(p)}" for v, p in r["power"].items()), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": recs, "notes": notes},
                  fh, indent=1)


def power_cell(gpus: dict) -> str:
    """``"<W>W/<MHz>"`` of the first GPU's window (medians), for the printed line."""
    g = gpus.get("0") or next(iter(gpus.values()), None)
    if not g or not g.get("power.draw"):
        return "-"
    return f"{g['power.draw']['median']:.0f}W/{g['clocks.sm']['median']:.0f}"


if __name__ == "__main__":
    main()
