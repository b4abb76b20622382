"""Per-block timelines of one fused call, as a Chrome/Perfetto trace and as a PNG.

Input: per rank, the entries :meth:`comet.runtime.layer.FusedMoE.timeline` returns --
``dict(block, role="comm"|"compute", layer="layer0"|"layer1", unit, start_ns, end_ns)``,
one per work unit a block did, stamped with the GPU's global timer. Times are shown
relative to each rank's first stamp: the global timers of different GPUs are not
guaranteed to agree, so ranks are not aligned with each other.

Open the trace at https://ui.perfetto.dev or chrome://tracing: one process per rank, one
track per thread block, comm and compute units named (and coloured) apart per layer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

#: chrome://tracing's reserved colour names (Perfetto colours by event name instead).
_CNAME = {("comm", "layer0"): "rail_load", ("comm", "layer1"): "terrible",
          ("compute", "layer0"): "good", ("compute", "layer1"): "rail_response"}
_COLOR = {("comm", "layer0"): "tab:orange", ("comm", "layer1"): "tab:red",
          ("compute", "layer0"): "tab:blue", ("compute", "layer1"): "tab:green"}

Timelines = Mapping[int, Sequence[dict]]


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


def write_trace(timelines: Timelines, path: str, metadata: dict | None = None) -> str:
    """Write :func:`chrome_trace` to ``path`` (JSON); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines, metadata), f)
    return path


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
