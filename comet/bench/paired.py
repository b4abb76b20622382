"""Paired comparison of two sweeps on the same machine: is a change slower anywhere?

Each sweep is one or more ``comet bench`` JSON files of the same cases (config, dtype,
tokens per rank, routing, layer). Runs of one side are averaged per record (their spread is the
noise estimate); the ratio new / base of each comet column is reported per record, with
the worst and the geometric mean. Run the two sides alternately on one machine
(``scripts/device/paired_bench.sh``): timings on these GPUs drift by several percent
from one process to the next.
"""

from __future__ import annotations

from collections.abc import Sequence

from comet.bench.records import geomean

#: The columns compared: comet's whole call and its decomposition.
COLUMNS = ("fused_us", "sequential_us", "compute_only_us", "comm_only_us")
#: ``dtype`` too: a ``--dtype bf16 fp8`` sweep has a record of each layer per case.
_KEY = ("config", "dtype", "tokens_per_rank", "routing", "layer")


def _by_case(runs: Sequence[Sequence[dict]]) -> dict[tuple, list[dict]]:
    cases: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run:
            cases.setdefault(tuple(r.get(k) for k in _KEY), []).append(r)
    return cases


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def compare(new_runs: Sequence[Sequence[dict]], base_runs: Sequence[Sequence[dict]],
            columns: Sequence[str] = COLUMNS) -> list[dict]:
    """One row per case both sides have: per column the mean of each side, their ratio
    (new / base) and the spread of each side's runs (max / min - 1, the noise)."""
    new, base = _by_case(new_runs), _by_case(base_runs)
    rows = []
    for case in sorted(set(new) & set(base), key=lambda c: tuple(str(v) for v in c)):
        row = dict(zip(_KEY, case))
        for col in columns:
            n, b = ([r.get(col) for r in side[case]] for side in (new, base))
            mn, mb = _mean(n), _mean(b)
            row[col] = {"new": mn, "base": mb,
                        "ratio": mn / mb if mn and mb else None,
                        "noise": max(_spread(n), _spread(b))}
        rows.append(row)
    return rows


def _spread(values) -> float:
    vals = [v for v in values if v]
    return max(vals) / min(vals) - 1 if len(vals) > 1 else 0.0


def summary(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> list[str]:
    """Per column: the geometric mean of new / base, the worst record and its noise."""
    lines = []
    for col in columns:
        pairs = [(r[col]["ratio"], r) for r in rows if r[col]["ratio"]]
        if not pairs:
            continue
        worst, at = max(pairs, key=lambda p: p[0])
        noise = max(r[col]["noise"] for _, r in pairs)
        lines.append(f"{col}: new/base geomean {geomean(p for p, _ in pairs):.3f}, worst "
                     f"{worst:.3f} ({at['config']} {at['tokens_per_rank']} {at['routing']} "
                     f"{at['layer']}), largest run-to-run spread {noise:.3f}, "
                     f"{len(pairs)} records")
    return lines


def text_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    head = ["config", "tokens", "routing", "layer", *(c.removesuffix("_us") for c in columns)]
    body = [[str(r["config"]), str(r["tokens_per_rank"]), str(r["routing"]), str(r["layer"]),
             *("-" if r[c]["ratio"] is None else f"{r[c]['ratio']:.3f}" for c in columns)]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths))
                     for line in [head, *body])
