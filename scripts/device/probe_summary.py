"""usage: PYTHONPATH=. python scripts/device/probe_summary.py DIR NAME [BASELINE]

One line per (tile variant, round, record) of the bench JSONs ``DIR/NAME-<variant>.json``
(or ``DIR/NAME-<variant>-round<i>.json`` with ``ROUNDS``) that ``tile_probe.sh`` writes:
the whole call (fused, compute-only, torch GEMM, HBM floor, the host's time per call), the
comm blocks it ran with, the best fixed split's time (with ``--fixed-splits``), and each
layer's comet GEMM time over torch's. Then every variant's whole call over BASELINE's
(a variant tag; default: ``default`` if present, else the first), record by record: the
median over the rounds of the ratio of round ``i`` to the baseline's round ``i`` (run
next to each other), its range, and the geomean over the records.

The comm blocks are shown because a ``--tile`` variant is not served by the tuned tables
-- unless its fields equal the default tile's (``dispatch_head_parts=0``, say): its
calls run the analytic split where the default variant runs the table's, so a
difference in the fused time may be the split, not the tile. A ratio whose two records
ran different comm blocks says so (``comm blocks [32, 0] vs [53, 0]``; two probes of
2026-11-27 were read as paired when they were not). Compare the best fixed splits, or
the fused call's phases (``comet_phases_us``); not the compute-only column, whose
decomposed call runs layer1's column-split reduce whatever the tile
(comet.runtime.strategies.strategy_for).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
import sys

from comet.bench.records import wrong_fused
from comet.bench.report import over_decode_bound

Key = tuple[str, int, str]


def load_runs(out: str, name: str) -> dict[str, dict[int, dict[Key, dict]]]:
    """``{variant: {round: {(config, tokens, routing): {layer: record}}}}``."""
    prefix = os.path.join(out, name) + "-"
    runs: dict[str, dict[int, dict[Key, dict]]] = {}
    for path in sorted(glob.glob(prefix + "*.json")):
        tag = path[len(prefix):-len(".json")]
        m = re.fullmatch(r"(.+)-round(\d+)", tag)
        variant, rnd = (m.group(1), int(m.group(2))) if m else (tag, 1)
        records = json.load(open(path))
        records = records if isinstance(records, list) else records["records"]
        by: dict[Key, dict] = {}
        for r in records:
            by.setdefault((r["config"], r["tokens_per_rank"], r["routing"]), {})[r["layer"]] = r
        runs.setdefault(variant, {})[rnd] = by
    return runs


def record_line(label: str, key: Key, layers: dict) -> str:
    moe = layers.get("moe", {})
    ratios = " ".join(
        f"{l}={layers[l]['comet_gmm_us'] / layers[l]['torch_gmm_us']:.3f}"
        for l in ("layer0", "layer1") if l in layers
        and layers[l].get("comet_gmm_us") and layers[l].get("torch_gmm_us"))
    return (f"{label:28s} {key[0]:18s} {key[1]:6d} {key[2]:8s} "
            f"fused {moe.get('fused_us') or 0:9.1f} "
            f"compute {moe.get('compute_only_us') or 0:9.1f} "
            f"torch {moe.get('torch_gmm_us') or 0:9.1f} "
            f"hbm {moe.get('hbm_floor_us') or 0:8.1f} "
            f"host {moe.get('fused_host_us') or 0:6.1f} "
            f"comm {moe.get('n_comm')} best fixed {moe.get('best_fixed_us') or 0:9.1f} "
            f"comet/torch {ratios}"
            + _bound(key, moe)
            + (f" WRONG output ({moe['max_rel_err']['fused']:.3g})" if wrong_fused([moe]) else ""))


def _bound(key: Key, moe: dict) -> str:
    """A small call's (b) against issue 41's bound (comet.bench.report), in microseconds
    over (+) or under (-) it."""
    over = over_decode_bound(moe)
    return "" if key[1] > 128 or over is None else f" bound {over:+.1f}"


def _fused(layers: dict | None) -> float | None:
    """The whole call's time of a record: the layer's own, else the moe record's."""
    if not layers:
        return None
    rec = layers.get("moe") or next(iter(layers.values()))
    return rec.get("fused_us") or None


#: Record fields a layer derives from its layout and model, not from a probe's variant:
#: where a variant's differ from the baseline's without being the variant's own field, the
#: two ran different layers. (An EP sweep once built its variants on the EP=1 default
#: tile: qwen2-moe's variants gathered their dispatch, the default did not, ~2% apart --
#: docs/notebook.md, "The benchmark protocol", `0d6f48d`.)
DERIVED = ("layer0_gather",)


def _derived_differs(variant: str, base: dict | None, other: dict | None) -> list[str]:
    """The :data:`DERIVED` fields in which two records' moe layers differ, but for the
    fields the variant's tag names."""
    a, b = ((layers or {}).get("moe", {}) for layers in (base, other))
    return [f for f in DERIVED if f not in variant and f in a and f in b and a[f] != b[f]]


def _comm_differs(base: dict | None, other: dict | None) -> str:
    """`` (comm blocks A vs B)`` where two records' moe layers ran different comm-block
    splits, else ``""``."""
    a, b = ((layers or {}).get("moe", {}).get("n_comm") for layers in (base, other))
    return f" (comm blocks {a} vs {b})" if a is not None and b is not None and a != b else ""


def ratio_lines(runs: dict, baseline: str) -> list[str]:
    """Each variant's whole call over ``baseline``'s, paired round by round; a record
    whose layers differ in a :data:`DERIVED` field is marked."""
    base = runs[baseline]
    lines = []
    for variant, rounds in runs.items():
        if variant == baseline:
            continue
        logs = []
        for key in sorted({k for by in rounds.values() for k in by}):
            pairs = [(_fused(base.get(r, {}).get(key)), _fused(by.get(key)))
                     for r, by in sorted(rounds.items())]
            ratios = [v / b for b, v in pairs if b and v]
            if not ratios:
                continue
            mid = statistics.median(ratios)
            logs.append(math.log(mid))
            differs = sorted({f for r, by in rounds.items()
                              for f in _derived_differs(variant, base.get(r, {}).get(key),
                                                        by.get(key))})
            comm = sorted({_comm_differs(base.get(r, {}).get(key), by.get(key))
                           for r, by in rounds.items()} - {""})
            lines.append(f"{variant:28s} {key[0]:18s} {key[1]:6d} {key[2]:8s} "
                         f"{mid:.3f} [{min(ratios):.3f}, {max(ratios):.3f}] over "
                         f"{len(ratios)} round(s)"
                         + (f" NOT PAIRED: {', '.join(differs)} differs" if differs else "")
                         + "".join(comm))
        if logs:
            lines.append(f"{variant:28s} geomean {math.exp(sum(logs) / len(logs)):.3f} over "
                         f"{len(logs)} records")
    return lines


def main(out: str, name: str, baseline: str | None = None) -> None:
    runs = load_runs(out, name)
    several = any(len(rounds) > 1 for rounds in runs.values())
    for variant, rounds in runs.items():
        for rnd, by in sorted(rounds.items()):
            label = f"{variant}#{rnd}" if several else variant
            for key, layers in sorted(by.items()):
                print(record_line(label, key, layers))
    if baseline is None:
        baseline = "default" if "default" in runs else next(iter(runs), None)
    if baseline in runs and len(runs) > 1:
        print(f"\nwhole call over {baseline} (median of the paired rounds [range]):")
        for line in ratio_lines(runs, baseline):
            print(line)


if __name__ == "__main__":
    main(*sys.argv[1:])
