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
GPU). Writes ``host_profile.json`` (provenance fields) and ``host_profile.txt`` (the
profile).

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


def lone_bench_us(fn, calls: int) -> float:
    """Median host time per call as ``comet bench`` measures it (its timing loop)."""
    device = torch.device("cuda")
    host = time_calls(lambda i, t: fn(), n_sets=1, iters=calls, warmup=3, device=device,
                      flush=L2Flush(device))["host"]
    return sorted(host)[len(host) // 2]


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
    records, text = [], io.StringIO()
    try:
        profile(a, records, text)
    finally:
        (out_dir / "host_profile.txt").write_text(text.getvalue())
        write_result(out_dir / "host_profile.json", {"records": records})


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
                                "lone_bench_us": round(benched, 2), "steps_us": parts})
                print(name, m, f"whole {whole:.1f} us, alone after a sync {synced:.1f}, "
                      f"in the bench's loop {benched:.1f}", parts, flush=True)
            layer.check_errors_now()


if __name__ == "__main__":
    main()
