"""Per-block timelines of one fused call, as a Chrome/Perfetto trace and as a PNG.

Input: per rank, the entries :func:`record_timeline` returns --
``dict(block, role="comm"|"compute", layer="layer0"|"layer1", unit, start_ns, end_ns)``,
one per work unit a block did, stamped with the GPU's global timer. Times are shown
relative to each rank's first stamp: the global timers of different GPUs are not
guaranteed to agree, so ranks are not aligned with each other.

Open the trace at https://ui.perfetto.dev or chrome://tracing: one process per rank, one
track per thread block, comm and compute units named (and coloured) apart per layer.

:func:`where_time_goes` reads a trace back into the milestones of each rank's call (when
the GEMM starts, how unevenly layer0's blocks end, layer1's reduce after its GEMM) and
the time a perfectly packed GEMM would take; ``python -m comet.bench.trace FILE...``
prints them for saved traces.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from comet.bench.provenance import provenance, write_result
from comet.constants import MAX_TRACE_EVENTS, TRACE_PROGRAM, TRACE_REDUCE

#: chrome://tracing's reserved colour names (Perfetto colours by event name instead).
_CNAME = {("comm", "layer0"): "rail_load", ("comm", "layer1"): "terrible",
          ("compute", "layer0"): "good", ("compute", "layer1"): "rail_response"}
_COLOR = {("comm", "layer0"): "tab:orange", ("comm", "layer1"): "tab:red",
          ("compute", "layer0"): "tab:blue", ("compute", "layer1"): "tab:green"}

Timelines = Mapping[int, Sequence[dict]]


def _describe(layer: str, kind: int, world: int) -> tuple[str, str]:
    """(role, label) of a trace event's ``kind`` (see the stamps in comet.kernels). Blocks
    change work during a call (comm blocks join the GEMM, GEMM blocks join the reduce),
    so the role is that of the unit of work, not of the block that started it."""
    if layer == "layer0":
        if kind < world:
            return "comm", f"push to rank {kind}"
        return "compute", f"expert {kind - world} tile"
    if kind >= TRACE_REDUCE:
        return "comm", f"reduce+send split {kind - TRACE_REDUCE}"
    return "compute", f"tile of split {kind}"


def record_timeline(layer, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, comm_blocks=None,
                    align: Callable[[], None] | None = None,
                    phases: dict | None = None, programs: list | None = None
                    ) -> list[dict]:
    """One fused call of the :class:`~comet.runtime.layer.FusedMoE` ``layer`` with every
    block stamping the start and end of each unit of work (global timer, ns). Returns
    records ``{block, role, layer, unit, what, start_ns, end_ns}``, times relative to the
    earliest stamp. Collective, like any call (two calls, in fact: the first compiles).
    layer0 runs fused with at least one comm block (with none it is two untraced
    launches); layer1 keeps the chosen split, 0 included (every block runs the GEMM, then
    the reduce) -- or, with the scatter epilogue, has no comm role (every block runs the
    GEMM, which sends). ``align`` runs after the first call has finished on this GPU, so
    that the ranks start the recorded call together: without it a rank still busy on the
    host entered a recorded call 450 us after its peers, whose timelines then showed
    their wait for its rows (qwen2-moe, EP=4,
    ``2026-11-26/h200x4-timeline-ep4-qwen2-moe-4096``). ``comet bench --timeline`` passes
    a barrier that then parks the GPU while the host issues the call
    (comet.bench.timing.park_and_align): the traced call is eager, its launches cost the
    host tens of microseconds each, and a small call's kernels otherwise reached the GPU
    late -- layer1 29-255 us after layer0 in 1-32-token traces
    (``2026-11-27/h100x4-r19-timeline-*``).

    With a list ``programs``, it receives each program's whole run in each layer kernel
    (the last slot of its trace row, :func:`comet.kernels.sync.stamp_program`) as
    ``{block, layer, start_ns, end_ns}``, on the units' clock and origin.

    With a dict ``phases``, the recorded call is also timed by the layer's phase timer
    (CUDA events between its launches), and ``phases`` receives ``{plan, layer0, layer1,
    combine}`` in microseconds: with :func:`phase_budget`, each layer kernel's time
    outside its stamped units. Not torch's profiler: under it the same call's
    cross-GPU handshakes slowed several-fold (a 1-token qwen2-moe call spanned 385 us
    profiled against 107 unprofiled, its dispatch unit 83 us against 5;
    ``2026-11-27/h100x4-r25-timeline-*``)."""
    n0, n1 = layer.selection.comm_blocks(x.shape[0], comm_blocks)
    n0 = max(n0, 1)
    shape = (layer.programs, int(MAX_TRACE_EVENTS), 4)
    buffers = {name: torch.full(shape, -1, dtype=torch.int64, device=layer.device)
               for name in ("layer0", "layer1")}
    timer = None
    # The first traced call compiles the traced kernels between the launches of the two
    # layers; only the second call's stamps show the layer as it runs.
    for call in range(2):
        # Blocks take work from queues, so a block's event count differs from call to
        # call: clear the first call's stamps.
        for t in buffers.values():
            t.fill_(-1)
        timed = {}
        if call == 1:
            if phases is not None:
                from comet.runtime.layer import PhaseTimer
                timer = PhaseTimer()
                timed = {"timer": timer}
            if align is not None:
                if x.is_cuda:
                    torch.cuda.synchronize(x.device)
                align()
        layer(x, topk_ids, topk_weights, comm_blocks=(n0, n1), trace=buffers, **timed)
    layer.check_errors_now()     # synchronises: the events and stamps are complete
    if timer is not None:
        phases.update(timer.elapsed_us())
    raw = {k: v.cpu() for k, v in buffers.items()}
    world = layer.par.world_size
    records, runs = [], []
    for name in ("layer0", "layer1"):
        for block in range(layer.programs):
            *units, (kind, _, start, end) = raw[name][block].tolist()
            if kind == TRACE_PROGRAM and start >= 0:
                runs.append({"block": block, "layer": name, "start_ns": start, "end_ns": end})
            for kind, unit, start, end in units:
                if start < 0:
                    break
                role, what = _describe(name, kind, world)
                records.append({"block": block, "role": role, "layer": name, "unit": unit,
                                "what": what, "start_ns": start, "end_ns": end})
    t0 = min((r["start_ns"] for r in records + runs), default=0)
    for r in records + runs:
        r["start_ns"] -= t0
        r["end_ns"] -= t0
    if programs is not None:
        programs[:] = runs
    return records


#: The phases of a call, in order (comet.runtime.layer.PhaseTimer's names).
PHASES = ("plan", "layer0", "layer1", "combine")


def phase_budget(phases: Mapping[str, float], entries: Sequence[Mapping],
                 programs: Sequence[Mapping] = ()) -> dict:
    """One rank's recorded call as its phases' GPU times (:func:`record_timeline`'s
    ``phases``) beside its stamped units and programs. Per layer: ``<layer>_units``, the
    span from its first unit's start to its last unit's end; with ``programs``,
    ``<layer>_setup`` (the first program's entry to the first unit) and
    ``<layer>_drain`` (the last unit's end to the last program's exit); and
    ``<layer>_outside``, the phase's time outside all of these (launch, and what the
    stamps cannot see). ``sum``: the phases' total."""
    out = {name: float(phases.get(name, 0.0)) for name in PHASES}
    for name in ("layer0", "layer1"):
        units = [e for e in entries if e["layer"] == name]
        runs = [p for p in programs if p["layer"] == name]
        first = min((e["start_ns"] for e in units), default=0)
        last = max((e["end_ns"] for e in units), default=first)
        entered = min((p["start_ns"] for p in runs), default=first)
        exited = max((p["end_ns"] for p in runs), default=last)
        out[f"{name}_units"] = (last - first) / 1e3
        out[f"{name}_setup"] = (first - entered) / 1e3 if units else 0.0
        out[f"{name}_drain"] = (exited - last) / 1e3 if units else 0.0
        seen = (exited - entered) / 1e3 if units or runs else 0.0
        out[f"{name}_outside"] = out[name] - seen if name in phases else 0.0
    out["sum"] = sum(out[name] for name in PHASES)
    return out


def format_phase_budget(budgets: Mapping[int, Mapping[str, float]]) -> str:
    """Per rank, :func:`phase_budget` on one line."""
    lines = []
    for rank, b in sorted(budgets.items()):
        if not b.get("sum"):
            lines.append(f"rank {rank}: the call's phases were not timed")
            continue
        layers = " | ".join(
            f"{n} {b[n]:.1f} (set-up {b[n + '_setup']:.1f}, units "
            f"{b[n + '_units']:.1f}, drain {b[n + '_drain']:.1f}, outside "
            f"{b[n + '_outside']:.1f})" for n in ("layer0", "layer1"))
        lines.append(f"rank {rank}, the call's phases on the GPU (CUDA events): plan "
                     f"{b['plan']:.1f} | {layers} | combine {b['combine']:.1f} | sum "
                     f"{b['sum']:.1f} us")
    lines.append("  set-up: first program's entry to first unit; drain: last unit's end to "
                 "last program's exit; outside: the phase's time beyond both (launch)")
    return "\n".join(lines)


def _origin(entries: Sequence[dict]) -> int:
    return min((e["start_ns"] for e in entries), default=0)


def chrome_trace(timelines: Timelines, metadata: dict | None = None) -> dict:
    """The trace as a dict in the Trace Event Format (``{"traceEvents": [...]}``)."""
    events: list[dict] = []
    for rank, entries in sorted(timelines.items()):
        t0 = _origin(entries)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for block in sorted({e["block"] for e in entries}):
            roles = sorted({f"{e['layer']}:{e['role']}" for e in entries if e["block"] == block})
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": block,
                           "args": {"name": f"block {block} ({', '.join(roles)})"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": block,
                           "args": {"sort_index": block}})
        for e in entries:
            key = (e["role"], e["layer"])
            events.append({
                "ph": "X", "name": f"{e['role']} {e['layer']}", "cat": f"{e['role']},{e['layer']}",
                "pid": rank, "tid": e["block"],
                "ts": (e["start_ns"] - t0) / 1e3, "dur": max(e["end_ns"] - e["start_ns"], 0) / 1e3,
                "cname": _CNAME.get(key, "generic_work"),
                "args": {"unit": e["unit"], "role": e["role"], "layer": e["layer"]},
            })
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": metadata or {}}


def write_trace(timelines: Timelines, path: str, metadata: dict | None = None) -> dict:
    """Write :func:`chrome_trace` to ``path`` (JSON), with :func:`where_time_goes` in its
    ``otherData``; returns the trace written."""
    chrome = chrome_trace(timelines, metadata)
    chrome["otherData"] = {**chrome["otherData"], "where_time_goes": where_time_goes(chrome)}
    chrome = {**provenance(), **chrome}       # trace viewers ignore the extra keys
    write_result(path, chrome, indent=None)
    return chrome


def plot_timeline(timelines: Timelines, path: str, title: str = "") -> tuple[str | None, str]:
    """Blocks on y, microseconds on x, one panel per rank. Returns ``(path or None, note)``."""
    if not any(timelines.values()):
        return None, "timeline plot skipped: no timeline entries"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None, ("timeline plot skipped: matplotlib is not installed "
                      "(pip install 'comet-moe[plot]')")
    ranks = sorted(timelines)
    blocks = max((e["block"] for r in ranks for e in timelines[r]), default=0) + 1
    fig, axes = plt.subplots(len(ranks), 1, squeeze=False, sharex=True,
                             figsize=(12, 1.0 + min(0.08 * blocks, 6.0) * len(ranks)))
    for ax, rank in zip(axes[:, 0], ranks):
        entries = timelines[rank]
        t0 = _origin(entries)
        bars: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        for e in entries:
            bars.setdefault((e["block"], e["role"], e["layer"]), []).append(
                ((e["start_ns"] - t0) / 1e3, max(e["end_ns"] - e["start_ns"], 0) / 1e3))
        for (block, role, layer), spans in bars.items():
            ax.broken_barh(spans, (block - 0.4, 0.8), facecolors=_COLOR.get((role, layer), "grey"))
        ax.set_ylabel(f"rank {rank}\nblock")
        ax.set_ylim(-0.5, blocks - 0.5)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("microseconds since the rank's first stamp")
    fig.legend(handles=[Patch(color=c, label=f"{role} {layer}")
                        for (role, layer), c in _COLOR.items()], loc="upper right", ncol=4,
               fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, f"timeline plot written to {path}"


#: Milestones of :func:`where_time_goes`, in the order they are printed, and what they are
#: (microseconds; times since the rank's first stamp).
MILESTONES = {
    "gemm_start_us": "first layer0 GEMM unit starts (the wait for the first rows)",
    "dispatch_end_us": "last layer0 comm unit ends",
    "layer0_tail_us": "layer0's last block ends this long after its median block",
    "layer1_gap_us": "layer1's first unit starts this long after layer0's last ends",
    "reduce_tail_us": "layer1's last unit ends this long after its last GEMM unit",
    "end_us": "the rank's last stamp",
    "packed_gemm_us": "all GEMM units' time over the blocks that ran them: the call with "
                      "no wait, no tail and no communication left over",
}


def _end(events: Sequence[Mapping]) -> float:
    """When the last of ``events`` ends (0 for none)."""
    return max((e["ts"] + e["dur"] for e in events), default=0.0)


def where_time_goes(trace: Mapping) -> dict[int, dict[str, float]]:
    """Per rank, the :data:`MILESTONES` of one call's trace (the dict
    :func:`chrome_trace` builds, or a trace file loaded back)."""
    spans: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            spans.setdefault(e["pid"], []).append(e)
    out = {}
    for rank, events in sorted(spans.items()):
        def of(role, layer):
            return [e for e in events if e["args"]["role"] == role and e["args"]["layer"] == layer]

        gemm0, comm0 = of("compute", "layer0"), of("comm", "layer0")
        gemm1 = of("compute", "layer1")
        layer1 = gemm1 + of("comm", "layer1")
        block_end: dict[int, float] = {}
        for e in gemm0:
            block_end[e["tid"]] = max(block_end.get(e["tid"], 0.0), e["ts"] + e["dur"])
        gemm = gemm0 + gemm1
        blocks = len({e["tid"] for e in gemm})
        out[rank] = {
            "gemm_start_us": min((e["ts"] for e in gemm0), default=0.0),
            "dispatch_end_us": _end(comm0),
            "layer0_tail_us": (_end(gemm0) - statistics.median(block_end.values())
                               if block_end else 0.0),
            "layer1_gap_us": (min(e["ts"] for e in layer1) - _end(gemm0)
                              if layer1 and gemm0 else 0.0),
            "reduce_tail_us": max(_end(layer1) - _end(gemm1), 0.0),
            "end_us": _end(events),
            "packed_gemm_us": sum(e["dur"] for e in gemm) / max(blocks, 1),
        }
    return out


def format_where_time_goes(summary: Mapping[int, Mapping[str, float]]) -> str:
    """The milestones as a table, one row per rank, and what each column means."""
    cols = list(MILESTONES)
    lines = ["rank " + " ".join(f"{c[:-3]:>15s}" for c in cols)]
    for rank, m in sorted(summary.items()):
        lines.append(f"{rank:4d} " + " ".join(f"{m[c]:15.1f}" for c in cols))
    lines += [f"  {c}: {what}" for c, what in MILESTONES.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m comet.bench.trace",
                                 description="Where the time of a traced call goes "
                                             "(comet bench --timeline's JSON files).")
    ap.add_argument("traces", nargs="+", help="timeline-*.json files (or .json.gz)")
    args = ap.parse_args(argv)
    for path in args.traces:
        loaded = read_trace(path)
        print(f"{path}\n{format_where_time_goes(where_time_goes(loaded))}")
        budgets = loaded.get("otherData", {}).get("phases")
        if budgets:
            print(format_phase_budget({int(r): b for r, b in budgets.items()}))
    return 0


def read_trace(path: str | os.PathLike) -> dict:
    """A trace written by :func:`write_trace`, plain or gzipped (``.gz``: how the traces
    committed under benchmarks/results are stored -- a 4096-token trace is 3-6 MB of
    JSON; Perfetto opens either)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    raise SystemExit(main())
