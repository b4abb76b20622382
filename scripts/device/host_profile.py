"""Where the host's time per fused call goes (issue 70: <= 30 us at EP=1).

Builds a preset layer at EP=1 on one GPU, warms each token count up (compile, capture), then
times many back-to-back graph-replayed calls: the whole call (CPU wall per call), each step
of it alone (the same code the layer runs, called in a loop), and a cProfile of the calls.
Beside them, the same call issued alone, as ``comet bench``'s ``fused_host_us`` times it
(which measured 33.5-73.5 us where the loop measured 26-27, 2026-12-05/`abea07a`):
``lone_synced_us`` after a synchronize (an idle GPU, an empty launch queue), and
``lone_bench_us`` through the bench's own timing loop (an L2 flush and an event before each
call, no synchronize: the GPU runs behind). Loop < synced says cold host caches cost the
difference; synced < bench says the bench's loop does (its launches queued behind a busy
GPU). The bench-loop call is also given as a spread (10th, 50th, 90th percentile) and
split into its steps by stamps (``lone_bench_steps_us``: each step of :data:`STAMPED` and
the gaps between them), beside the host's CPU, load and steal time before and after
(``machine``): a lone call that is slow in every step says the host was, one slow step says
where to look. Writes ``host_profile.json`` (provenance fields) and ``host_profile.txt``
(the profile).

    PYTHONPATH=. python scripts/device/host_profile.py --output-dir $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from comet.bench.provenance import write_result
from comet.bench.timing import L2Flush, time_calls
from comet.config import preset
from comet.runtime.inputs import check_inputs
from comet.runtime.layer import FusedMoE


def per_call_us(fn, calls: int) -> float:
    """Median of five rounds of ``calls`` back-to-back calls, microseconds per call."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def layer_of(name: str, max_tokens: int) -> FusedMoE:
    cfg = preset(name, max_tokens=max_tokens)
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(e, h, 2 * f, device="cuda", dtype=cfg.dtype) * h ** -0.5
    w2 = torch.randn(e, f, h, device="cuda", dtype=cfg.dtype) * f ** -0.5
    return FusedMoE(cfg, w13, w2)


def lone_synced_us(fn, calls: int) -> float:
    """Median host time of ``calls`` calls, each issued after a synchronize."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def lone_bench_us(fn, calls: int) -> dict:
    """Host time per call as ``comet bench`` measures it (its timing loop): the median
    and the 10th and 90th percentiles, us."""
    device = torch.device("cuda")
    host = sorted(time_calls(lambda i, t: fn(), n_sets=1, iters=calls, warmup=3,
                             device=device, flush=L2Flush(device))["host"])
    return {q: round(host[int(f * (len(host) - 1))], 2)
            for q, f in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}


#: The layer's steps whose entry and exit a stamped call records, in call order.
STAMPED = (("check", "_check"), ("select", "selection.for_call"),
           ("stage", "_static.stage"), ("replay", "graphs.run"),
           ("errors", "errors.after_launch"))


def lone_bench_steps(layer: FusedMoE, x, ids, w, calls: int) -> dict[str, float]:
    """Where a call's host time goes inside the bench's timing loop: each step of
    :data:`STAMPED` and the gaps between them (the rest of ``__call__`` and
    ``_launch``), median us over ``calls`` calls, from perf_counter stamps taken by
    wrappers (~0.1 us each)."""
    stamps: list[tuple[str, float]] = []
    originals = []
    for label, path in STAMPED:
        *parents, attr = path.split(".")
        owner = layer
        for part in parents:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)

        def wrapped(*a, _fn=fn, _label=label, **k):
            stamps.append((_label + ">", time.perf_counter()))
            try:
                return _fn(*a, **k)
            finally:
                stamps.append(("<" + _label, time.perf_counter()))
        originals.append((owner, attr, fn))
        setattr(owner, attr, wrapped)
    per_call: list[dict[str, float]] = []

    def call():
        stamps.clear()
        stamps.append(("start", time.perf_counter()))
        layer(x, ids, w)
        stamps.append(("end", time.perf_counter()))
        parts = {}
        for (a, ta), (b, tb) in zip(stamps, stamps[1:]):
            parts[f"{a}..{b}"] = parts.get(f"{a}..{b}", 0.0) + (tb - ta) * 1e6
        per_call.append(parts)
    try:
        lone_bench_us(call, calls)
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    names = per_call[-1]
    return {k: round(sorted(p.get(k, 0.0) for p in per_call)[len(per_call) // 2], 2)
            for k in names}


def machine() -> dict:
    """The host's CPU, load and steal time (a busy or shared host shows in lone calls)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        info["cpu_jiffies"] = dict(zip(("user", "nice", "system", "idle", "iowait", "irq",
                                        "softirq", "steal"), map(int, fields)))
    except OSError as e:
        info["error"] = str(e)
    return info


def steps(layer: FusedMoE, x, ids, w) -> dict:
    """Each host step of a call, alone: the same calls the layer makes."""
    cfg, s, m = layer.cfg, layer._static, x.shape[0]
    tile = layer.selection.tile_for(m)
    n0, n1 = layer.selection.comm_blocks(m)
    call = layer._call("fused", n0 > 0, tile)
    n1 = call.strategy.comm_blocks(n1)
    key = ("fused", n0 > 0, tile)
    graphs = layer.graphs._graphs.get(key)
    y, nop = torch.empty_like(x), _Nop()
    out = {
        "module_call_overhead": lambda: nop(x),
        "check_inputs": lambda: check_inputs(cfg, x, ids, w, dtype=cfg.dtype,
                                             device=layer.device, contiguous=True),
        "errors.check_usable": layer.errors.check_usable,
        "selection.comm_blocks": lambda: layer.selection.comm_blocks(m),
        "selection.tile_for": lambda: layer.selection.tile_for(m),
        "ids_weights_to": lambda: (ids.to(torch.int64).contiguous(),
                                   w.to(torch.float32).contiguous()),
        "layer._call_lookup": lambda: layer._call("fused", n0 > 0, tile),
        "hash_call_key": lambda: hash(key),
        "strategy.comm_blocks": lambda: call.strategy.comm_blocks(0),
        "empty_like": lambda: torch.empty_like(x),
        "refresh_timeout": layer._refresh_timeout,
        # The call's own values: a graph replayed after this stage reads them.
        "stage": lambda: s.stage(x.data_ptr(), y.data_ptr(), m, n0, n1, ids.data_ptr(),
                                 w.data_ptr()),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "errors.after_launch": layer.errors.after_launch,
    }
    if graphs:
        out["graph_replay"] = lambda: [g.replay() for g in graphs if g is not None]
    return out


class _Nop(torch.nn.Module):
    def forward(self, x):
        return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", nargs="+",
                   default=["qwen2-moe", "mixtral", "phi3.5-moe", "deepseek-v3-like"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--output-dir", default="out")
    a = p.parse_args()
    out_dir = Path(a.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records, text, start = [], io.StringIO(), machine()
    try:
        profile(a, records, text)
    finally:
        (out_dir / "host_profile.txt").write_text(text.getvalue())
        write_result(out_dir / "host_profile.json", {"records": records,
                                                     "machine": [start, machine()]})


def profile(a, records: list, text: io.StringIO) -> None:
    with torch.inference_mode():
        for name in a.configs:
            layer = layer_of(name, max(a.tokens))
            for m in a.tokens:
                g = torch.Generator(device="cuda").manual_seed(m)
                x = torch.randn(m, layer.cfg.hidden_size, device="cuda",
                                dtype=layer.cfg.dtype, generator=g)
                ids = torch.randint(0, layer.cfg.num_experts, (m, layer.cfg.top_k),
                                    device="cuda", generator=g)
                w = torch.rand(m, layer.cfg.top_k, device="cuda", generator=g)
                for _ in range(5):
                    layer(x, ids, w)
                torch.cuda.synchronize()
                whole = per_call_us(lambda: layer(x, ids, w), a.calls)
                synced = lone_synced_us(lambda: layer(x, ids, w), a.calls)
                benched = lone_bench_us(lambda: layer(x, ids, w), a.calls)
                inside = lone_bench_steps(layer, x, ids, w, a.calls)
                parts = {k: round(per_call_us(fn, a.calls), 2)
                         for k, fn in steps(layer, x, ids, w).items()}
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(a.calls):
                    layer(x, ids, w)
                prof.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
                text.write(f"===== {name} {m} tokens: whole call {whole:.1f} us\n")
                text.write(s.getvalue())
                records.append({"config": name, "tokens": m, "host_us": round(whole, 2),
                                "lone_synced_us": round(synced, 2),
                                "lone_bench_us": benched["p50"],
                                "lone_bench_spread_us": benched,
                                "lone_bench_steps_us": inside, "steps_us": parts})
                print(name, m, f"whole {whole:.1f} us, alone after a sync {synced:.1f}, "
                      f"in the bench's loop {benched}", parts, flush=True)
                print("  inside the bench's loop:", inside, flush=True)
            layer.check_errors_now()


if __name__ == "__main__":
    main()
