"""Tables (console and markdown), a summary against the targets, and the speedup plot."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from comet.bench.provenance import repo_relative
from comet.bench.records import (MAX_REL_ERR, geomean, is_fp8, pair_dtypes, peer_names,
                                 wrong_fused)
from comet.constants import kernels_of

Column = tuple[str, Callable[[dict], str]]


def _num(key: str, fmt: str = "{:.1f}", scale: float = 1.0) -> Callable[[dict], str]:
    def get(r: dict) -> str:
        v = r.get(key)
        return "-" if v is None else fmt.format(v * scale)
    return get


def _n_comm(r: dict) -> str:
    """Comm blocks of the fused call; ``d`` after layer1's: it ran on the decode tile;
    then the tile fields a tuned bucket set (``group_m=16``)."""
    n = r.get("n_comm")
    if n is None:
        return "-"
    decode = "d" if r.get("decode_tile") else ""
    tile = "".join(f" {k}={v}" for k, v in sorted((r.get("tile_overrides") or {}).items()))
    if r.get("layer") == "layer0":
        return f"{n[0]}{tile}"
    if r.get("layer") == "layer1":
        return f"{n[1]}{decode}"
    return f"{n[0]}/{n[1]}{decode}{tile}"


def _phase(name: str) -> Callable[[dict], str]:
    def get(r: dict) -> str:
        v = (r.get("baseline_phases_us") or {}).get(name)
        return "-" if v is None else f"{v:.1f}"
    return get


_KEY: list[Column] = [
    ("config", lambda r: str(r["config"])),
    ("tokens/rank", lambda r: str(r["tokens_per_rank"])),
    ("routing", lambda r: str(r["routing"])),
    ("layer", lambda r: str(r["layer"])),
]

#: Times and the headline ratios.
MAIN_COLUMNS: list[Column] = _KEY + [
    ("(a) baseline us", _num("baseline_us")),
    ("(b) fused us", _num("fused_us")),
    # the host's time to enqueue one fused call, beside the device's (b)
    ("b host us", _num("fused_host_us")),
    ("(c) compute us", _num("compute_only_us")),
    ("(d) comm us", _num("comm_only_us")),
    ("(e) chunked us", _num("chunked_us")),
    ("a/b", _num("speedup", "{:.2f}")),
    ("e/b", _num("speedup_vs_chunked", "{:.2f}")),
    ("hidden", _num("hidden_comm_fraction", "{:.2f}")),
    ("n_comm", _n_comm),
]

#: ``--redundant-experts``: the whole layer's time beside how its rows fall on the ranks,
#: with R replicas and without (comet.bench.eplb).
EPLB_COLUMNS: list[Column] = _KEY + [
    ("(b) fused us", _num("fused_us")),
    ("R", lambda r: str(r.get("redundant_experts", "-"))),
    ("rows max/mean", _num("rows_max_over_mean", "{:.3f}")),
    ("R=0 max/mean", _num("rows_max_over_mean_r0", "{:.3f}")),
    ("rows local", _num("rows_local_fraction", "{:.3f}")),
    ("R=0 local", _num("rows_local_fraction_r0", "{:.3f}")),
]

#: Compute and communication against their references.
EFFICIENCY_COLUMNS: list[Column] = _KEY + [
    ("torch GEMM TFLOP/s", _num("torch_gmm_tflops", "{:.4g}")),
    ("comet GEMM TFLOP/s", _num("comet_gmm_tflops", "{:.4g}")),
    ("CUTLASS TFLOP/s", _num("cutlass_gmm_tflops", "{:.4g}")),
    ("compute eff", _num("compute_efficiency", "{:.2f}")),
    ("torch GEMM/b", _num("gmm_over_fused", "{:.2f}")),
    ("torch GEMM/c", _num("gmm_over_compute_only", "{:.2f}")),
    ("GEMM floor us", _num("gemm_floor_us")),
    ("a/floor", _num("speedup_at_floor", "{:.2f}")),
    ("HBM floor us", _num("hbm_floor_us")),
    ("b/HBM floor", _num("fused_over_hbm_floor", "{:.2f}")),
    ("NCCL a2a us", _num("nccl_a2a_us")),
    ("comm eff", _num("comm_efficiency", "{:.2f}")),
    ("sequential us", _num("sequential_us")),
    ("b/seq", _num("fused_over_sequential", "{:.2f}")),
    ("best fixed (n) us", lambda r: "-" if r.get("best_fixed_us") is None else
     f"{r['best_fixed_us']:.1f} ({r['best_fixed_split']})"),
    ("b/best fixed", _num("fused_over_best_fixed", "{:.2f}")),
]

#: Where the unfused baseline's time goes ("moe" rows): its phases (comet.baseline).
BREAKDOWN_COLUMNS: list[Column] = _KEY[:3] + [
    ("count exchange+host sync us", _phase("sync")),
    ("dispatch+combine us", _phase("a2a")),
    ("GEMMs us", _phase("gemm")),
    ("act us", _phase("act")),
    ("permutes+reduce us", _phase("permute")),
    ("whole layer us", _num("baseline_us")),
]


#: comet's FP8 layer (``--dtype fp8``; whole-layer rows) against its bf16 layer of the
#: same run and its FP8 HBM floor.
FP8_COLUMNS: list[Column] = _KEY[:3] + [
    ("FP8 (b) us", _num("fused_us")),
    ("bf16 (b) us", _num("bf16_fused_us")),
    ("FP8/bf16", _num("fp8_over_bf16", "{:.2f}")),
    ("FP8 HBM floor us", _num("hbm_floor_us")),
    ("b/HBM floor", _num("fused_over_hbm_floor", "{:.2f}")),
    ("b host us", _num("fused_host_us")),
    ("(c) compute us", _num("compute_only_us")),
    ("(d) comm us", _num("comm_only_us")),
    ("b/seq", _num("fused_over_sequential", "{:.2f}")),
    ("dispatch MB", _num("dispatch_bytes", "{:.3g}", 1e-6)),
    ("dispatch FP8/bf16", _num("dispatch_bytes_over_bf16", "{:.3f}")),
    ("n_comm", _n_comm),
]

#: With ``--peers deepgemm``: comet's FP8 GEMM phases against DeepGEMM's grouped FP8 GEMMs
#: on the same rows.
DEEPGEMM_COLUMNS: list[Column] = [
    ("comet GEMM TFLOP/s", _num("comet_gmm_tflops", "{:.4g}")),
    ("DeepGEMM TFLOP/s", _num("deepgemm_gmm_tflops", "{:.4g}")),
    ("DeepGEMM layout", lambda r: (r.get("deepgemm") or {}).get("layout") or "-"),
    ("comet/DeepGEMM", _num("fp8_gmm_over_deepgemm", "{:.2f}")),
]


def fp8_columns(records: Sequence[dict]) -> list[Column]:
    """:data:`FP8_COLUMNS`, and :data:`DEEPGEMM_COLUMNS` where a record has DeepGEMM's."""
    return FP8_COLUMNS + (DEEPGEMM_COLUMNS if any("deepgemm" in r for r in records) else [])


def peer_rows(records: Sequence[dict]) -> list[dict]:
    """The whole-layer records, bf16 and FP8, that have a peer column (``--peers``)."""
    return [r for r in records if r["layer"] == "moe" and peer_names(r)]


def peer_columns(records: Sequence[dict]) -> list[Column]:
    """comet against the peers (``--peers``; whole-layer rows): the fused layer, the
    unfused baseline, each peer ("-" where it was not timed: :func:`peer_notes` says why),
    the fastest peer and its time over comet's, and the two floors that bound that ratio
    (torch's grouped GEMMs on the rows, the HBM floor); a dtype column where both dtypes
    have peers; no columns when no record has a peer."""
    names = sorted({n for r in records for n in peer_names(r)})
    if not names:
        return []
    dtype: list[Column] = ([("dtype", lambda r: str(r.get("dtype", "-")))]
                           if len({r.get("dtype") for r in records}) > 1 else [])
    return (_KEY[:3] + dtype + [("(b) fused us", _num("fused_us")),
                        ("(a) baseline us", _num("baseline_us"))]
            + [(f"{n} us", _num(f"peer_{n}_us")) for n in names]
            + [("best peer", lambda r: r.get("best_peer") or "-"),
               ("best peer/b", _num("speedup_vs_best_peer", "{:.2f}")),
               ("torch GEMM us", _num("torch_gmm_us")),
               ("HBM floor us", _num("hbm_floor_us"))])


def peer_notes(records: Sequence[dict]) -> list[str]:
    """What each peer ran (where timed) and why it was not timed elsewhere, once each:
    unavailable peers by reason, wrong or failed ones with the case."""
    lines: dict[str, None] = {}
    for r in _sorted(records):
        for name, s in sorted((r.get("peers") or {}).items()):
            if s["status"] == "timed":
                lines[f"peer {name}: {s['backend']}"] = None
            elif s["status"] == "unavailable":
                lines[f"peer {name} unavailable: {s['reason']}"] = None
            else:
                lines[f"peer {name} {s['status']} ({r['config']}, {r['tokens_per_rank']} "
                      f"tokens/rank, {r['routing']}), not timed: {s['reason']}"] = None
    return list(lines)


def _sorted(records: Sequence[dict]) -> list[dict]:
    layer_order = {"layer0": 0, "layer1": 1, "moe": 2}
    return sorted(records, key=lambda r: (r["config"], r["routing"], r["tokens_per_rank"],
                                          layer_order.get(r["layer"], 3)))


def _rows(records: Sequence[dict], columns: Sequence[Column]) -> list[list[str]]:
    return [[get(r) for _, get in columns] for r in _sorted(records)]


def text_table(records: Sequence[dict], columns: Sequence[Column] = MAIN_COLUMNS) -> str:
    """A fixed-width table for the console."""
    rows = [[name for name, _ in columns]] + _rows(records, columns)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(records: Sequence[dict], columns: Sequence[Column] = MAIN_COLUMNS) -> str:
    """A GitHub markdown table: header row, separator row, one row per record."""
    head = "| " + " | ".join(name for name, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(row) + " |" for row in _rows(records, columns)]
    return "\n".join([head, sep] + body)


#: torch's grouped-GEMM time over the layer's, the least a large call may reach.
GEMM_TARGET = 0.9

#: The benchmark targets (docs/benchmarks.md): (record key, label, "min"/"max", target).
#: Each is checked on the whole-layer rows at >= 4096 tokens/rank, record by record.
LARGE_TARGETS = (
    ("fused_over_sequential", "b/sequential", "max", 0.95),
    ("hidden_comm_fraction", "hidden", "min", 0.85),
    ("gmm_over_fused", "torch GEMM/b", "min", GEMM_TARGET),
    # the same over (c), the plan and the GEMMs alone: below it, no overlap reaches it
    ("gmm_over_compute_only", "torch GEMM/c", "min", GEMM_TARGET),
    ("compute_efficiency", "compute eff", "min", 1.0),
    ("comm_over_nccl", "comm/NCCL", "max", 1.25),
)


def _check(records: Sequence[dict], key: str, label: str, worst: str, target: float) -> str:
    """``label``: how many records meet the target, and the worst value."""
    vals = [r.get(key) for r in records]
    vals = [v for v in vals if v is not None]
    if not vals:
        return f"{label} - (target {target:g})"
    bad = min(vals) if worst == "min" else max(vals)
    met = sum(v >= target if worst == "min" else v <= target for v in vals)
    sign = ">=" if worst == "min" else "<="
    return f"{label} {sign} {target:g} in {met}/{len(vals)} (worst {_fmt(bad)})"


def summary(records: Sequence[dict]) -> list[str]:
    """One line per routing, against the targets these records can speak to.

    Uniform routing (and any other but "skewed"), whole layer: at >= 4096 tokens/rank the
    geomean speedup over the unfused baseline (1.5; and what a layer costing only its
    fastest measured GEMMs would reach, the bound) and over the chunked one (1.2), then
    each of :data:`LARGE_TARGETS` record by record; at <= 128 tokens/rank a/b >= 2 in every
    record, and (b) within issue 41's bound where the HBM floor was measured
    (:data:`DECODE_BOUND_FACTOR` x floor + :data:`DECODE_BOUND_US`). Skewed routing: fused no slower than sequential in any record, layers
    included. Both: against the peers (``--peers``), the geomean of best peer / b at >=
    4096 and at <= 128 tokens/rank (issue 39's 1.2 and 1.5); the per-call split against
    the best fixed one (``--fixed-splits``); a rank alone (EP=1), the host's time per
    fused call against :data:`HOST_TARGET_US`. First, if any, the records whose fused
    output was wrong.
    """
    lines = []
    wrong = wrong_fused(records)
    if wrong:
        lines.append(f"WRONG fused output (max rel err > {MAX_REL_ERR:g}; not a correct "
                     "layer's times) in " + ", ".join(
                         f"{r['config']} {r['tokens_per_rank']} {r['routing']} {r['layer']} "
                         f"({r['max_rel_err']['fused']:.3g})" for r in wrong))
    moe = [r for r in records if r["layer"] == "moe" and r.get("fused_us") is not None
           and not is_fp8(r)]
    lines += fp8_summary([r for r in records if is_fp8(r)])
    for routing in sorted({r["routing"] for r in moe}):
        rows = [r for r in moe if r["routing"] == routing]
        big = [r for r in rows if r["tokens_per_rank"] >= 4096]
        small = [r for r in rows if r["tokens_per_rank"] <= 128]
        parts = []
        if big:
            parts.append(f"geomean a/b at >= 4096 tokens/rank "
                         f"{_fmt(geomean(r['speedup'] for r in big))} (target 1.5"
                         f"{_at_floor(geomean(r.get('speedup_at_floor') for r in big))})")
            parts.append(f"geomean e/b {_fmt(geomean(r['speedup_vs_chunked'] for r in big))}"
                         f" (target 1.2)")
            if routing != "skewed":
                parts += [_check(big, *t) for t in LARGE_TARGETS]
        if routing == "skewed":
            every = [r for r in records if r["routing"] == routing]
            parts.append(_check(every, "fused_over_sequential", "b/sequential, any layer",
                                "max", 1.0))
        if small:
            worst = min((r["speedup_at_floor"] for r in small
                         if r.get("speedup_at_floor") is not None), default=None)
            parts.append(_check(small, "speedup", "a/b at <= 128 tokens/rank", "min", 2.0)
                         + _at_floor(worst, "worst "))
            if any(r.get("hbm_floor_us") for r in small):
                parts.append(_decode_bound(small))
        if any(r.get("speedup_vs_best_peer") is not None for r in rows):
            parts.append(_peer_targets(big, small))
        if any(r.get("fused_over_best_fixed") is not None for r in rows):
            parts.append(_check(rows, "fused_over_best_fixed", "b/best fixed split", "max",
                                1.0))
        if (host := _host_check(rows)) is not None:
            parts.append(host)
        bound = [r for r in rows if _host_bound(r)]
        if bound:
            parts.append("host-bound (b host us >= " f"{HOST_BOUND:g} b) at "
                         + ", ".join(f"{r['config']} {r['tokens_per_rank']}" for r in bound))
        paced = [r for r in rows if _baseline_paced(r)]
        if paced:
            parts.append(f"a above its GPU phases (a >= {BASELINE_PACED:g} x their sum: "
                         "issued late, a/b carries the host) at " + ", ".join(
                             f"{r['config']} {r['tokens_per_rank']}" for r in paced))
        lines.append(f"{routing}: " + "; ".join(parts))
    return lines


#: Issue 41's bound on a small call (<= 128 tokens/rank): (b) at most this many times the
#: HBM floor (the touched experts' weight bytes at the measured read rate) ...
DECODE_BOUND_FACTOR = 1.2
#: ... plus this many microseconds, for the launches and cross-GPU handshakes every call
#: pays.
DECODE_BOUND_US = 30.0


def over_decode_bound(r: dict) -> float | None:
    """Microseconds by which a record's (b) is over (> 0) or under issue 41's bound, or
    None without both (b) and the HBM floor."""
    if not r.get("fused_us") or not r.get("hbm_floor_us"):
        return None
    return r["fused_us"] - (DECODE_BOUND_FACTOR * r["hbm_floor_us"] + DECODE_BOUND_US)


def _decode_bound(small: Sequence[dict]) -> str:
    """How many small records meet issue 41's bound on (b), and the worst one: the furthest
    over it, or the nearest under it."""
    over = {f"{r['config']} {r['tokens_per_rank']}": v
            for r in small if (v := over_decode_bound(r)) is not None}
    if not over:
        return "b against the HBM floor: no record has both"
    met = sum(v <= 0 for v in over.values())
    name, worst = max(over.items(), key=lambda kv: kv[1])
    return (f"b <= {DECODE_BOUND_FACTOR:g} HBM floor + {DECODE_BOUND_US:g} us at <= 128 "
            f"tokens/rank in {met}/{len(over)} (worst: {name}, "
            f"{abs(worst):.1f} us {'over' if worst > 0 else 'under'})")


#: Issue 68's speed criteria for the FP8 layer, each against the bf16 layer's (b) of the
#: same case in the same run (``fp8_over_bf16``), whole layer, one rank: at decode sizes
#: (tokens/rank in FP8_DECODE_TOKENS, bounds included) FP8 (b) at most FP8_DECODE_RATIO
#: of bf16's and within issue 41's bound of the FP8 HBM floor; a one-token call no
#: slower than bf16's; at prefill sizes (>= FP8_PREFILL_TOKENS) bf16 / FP8 at least
#: FP8_PREFILL_MIN in every record and FP8_PREFILL_GEOMEAN in geomean; the dispatch's
#: bytes at most FP8_DISPATCH_RATIO of bf16's.
FP8_DECODE_TOKENS = (8, 128)
FP8_DECODE_RATIO = 0.6
FP8_PREFILL_TOKENS = 4096
FP8_PREFILL_MIN = 1.3
FP8_PREFILL_GEOMEAN = 1.4
FP8_DISPATCH_RATIO = 0.53


def fp8_summary(records: Sequence[dict]) -> list[str]:
    """One line per routing of FP8 whole-layer records against issue 68's criteria
    (:data:`FP8_DECODE_RATIO` and the rest); the ratios need the bf16 record of the same
    case (:func:`comet.bench.records.pair_dtypes`), a '-' says it is missing. The GEMM
    phases against DeepGEMM's grouped FP8 GEMM: :func:`deepgemm_check`."""
    lines = []
    moe = [r for r in records if r["layer"] == "moe" and r.get("fused_us") is not None]
    lo, hi = FP8_DECODE_TOKENS
    for routing in sorted({r["routing"] for r in moe}):
        rows = [r for r in moe if r["routing"] == routing]
        decode = [r for r in rows if lo <= r["tokens_per_rank"] <= hi]
        one = [r for r in rows if r["tokens_per_rank"] == 1]
        big = [r for r in rows if r["tokens_per_rank"] >= FP8_PREFILL_TOKENS]
        parts = []
        if decode:
            parts.append(_check(decode, "fp8_over_bf16", f"FP8/bf16 b at {lo}-{hi} "
                                "tokens/rank", "max", FP8_DECODE_RATIO))
            over = [v for r in decode if (v := over_decode_bound(r)) is not None]
            parts.append(f"b <= {DECODE_BOUND_FACTOR:g} FP8 HBM floor + {DECODE_BOUND_US:g} "
                         f"us at {lo}-{hi} tokens/rank in {sum(v <= 0 for v in over)}/"
                         f"{len(over)}" + (f" (worst {max(over):+.1f} us)" if over else ""))
        if one:
            parts.append(_check(one, "fp8_over_bf16", "FP8/bf16 b at 1 token/rank", "max",
                                1.0))
        if big:
            parts.append(_check(big, "bf16_over_fp8", f"bf16/FP8 b at >= "
                                f"{FP8_PREFILL_TOKENS} tokens/rank", "min", FP8_PREFILL_MIN))
            parts.append(f"geomean bf16/FP8 b at >= {FP8_PREFILL_TOKENS} tokens/rank "
                         f"{_fmt(geomean(r.get('bf16_over_fp8') for r in big))} (target "
                         f"{FP8_PREFILL_GEOMEAN:g})")
        parts.append(_check(rows, "dispatch_bytes_over_bf16", "dispatch bytes FP8/bf16",
                            "max", FP8_DISPATCH_RATIO))
        parts.append(deepgemm_check(rows))
        lines.append(f"fp8 {routing}: " + "; ".join(parts))
    return lines


#: Issue 68: comet's FP8 GEMM phases at least this share of DeepGEMM's grouped FP8 GEMM
#: throughput on the same rows (``fp8_gmm_over_deepgemm``), every record.
FP8_DEEPGEMM_MIN = 0.85


def deepgemm_check(rows: Sequence[dict]) -> str:
    """FP8 records against :data:`FP8_DEEPGEMM_MIN`; "not measured" and why where no record
    has the ratio (no ``--peers deepgemm``, or the peer's reasons)."""
    label = "FP8 GEMM phases vs DeepGEMM's grouped FP8 GEMM"
    asked = [r for r in rows if "deepgemm" in r]
    if not asked:
        return f"{label}: not measured (comet bench --dtype fp8 --peers deepgemm)"
    measured = [r for r in asked if r.get("fp8_gmm_over_deepgemm") is not None]
    if not measured:
        why = sorted({(r.get("deepgemm") or {}).get("reason") or "no GEMM phases"
                      for r in asked})
        return f"{label}: not measured ({'; '.join(why)})"
    missing = len(asked) - len(measured)
    return (_check(measured, "fp8_gmm_over_deepgemm", f"{label}, TFLOP/s ratio", "min",
                   FP8_DEEPGEMM_MIN)
            + (f"; {missing} record(s) without the ratio" if missing else ""))


#: A fused call whose host time is at least this share of (b) had the GPU wait for the
#: host (or close to it): its (b) is the host's pace, not the kernels'.
HOST_BOUND = 0.9


#: Issue 70's bound on the host's time to enqueue one fused call (``fused_host_us``:
#: staging and graph replay, CPU wall time over many calls) of a rank alone (EP=1): a
#: model of many layers pays it once per layer and token when not captured itself.
HOST_TARGET_US = 30.0


def _host_check(rows: Sequence[dict]) -> str | None:
    """Records of one rank alone against :data:`HOST_TARGET_US`, or None if none has a
    host time (across ranks the host also waits for peers' staging: not checked)."""
    alone = [r for r in rows if r.get("world_size") == 1 and r.get("fused_host_us") is not None]
    if not alone:
        return None
    return _check(alone, "fused_host_us", "b host us at EP=1", "max", HOST_TARGET_US)


def _host_bound(r: dict) -> bool:
    host, fused = r.get("fused_host_us"), r.get("fused_us")
    return host is not None and fused is not None and host >= HOST_BOUND * fused


#: An unfused call (a) at least this many times the sum of its phases -- timed issued
#: ahead, so on the GPU -- spent the rest waiting for the host: the TP pipeline at 128
#: tokens took 1.3-3.4x its phases, its a/b up to twice what the GPUs alone gave
#: (benchmarks/results/2026-11-27/h100x2-r24-bench-tp2-*; `--lead-us` issues it ahead).
BASELINE_PACED = 1.2


def _baseline_paced(r: dict) -> bool:
    phases = sum((r.get("baseline_phases_us") or {}).values())
    return bool(phases) and r.get("baseline_us") is not None \
        and r["baseline_us"] >= BASELINE_PACED * phases


#: Issue 39's targets over the best peer (geomean of best peer / b, whole layer).
PEER_TARGETS = {"large": 1.2, "small": 1.5}


def _peer_targets(big: Sequence[dict], small: Sequence[dict]) -> str:
    """Geomean of best peer / b at >= 4096 and at <= 128 tokens/rank, against the targets."""
    return (f"geomean best peer/b at >= 4096 tokens/rank "
            f"{_fmt(geomean(r.get('speedup_vs_best_peer') for r in big))} "
            f"(target {PEER_TARGETS['large']:g}), at <= 128 tokens/rank "
            f"{_fmt(geomean(r.get('speedup_vs_best_peer') for r in small))} "
            f"(target {PEER_TARGETS['small']:g})")


def _at_floor(v: float | None, what: str = "") -> str:
    """The bound a speedup target meets at the GEMM floor (``speedup_at_floor``)."""
    return "" if v is None else f"; at the GEMM floor {what}{v:.2f}"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown_report(records: Sequence[dict], notes: Sequence[str] = ()) -> str:
    """The whole markdown file of one run: metadata, notes, summary, the three tables."""
    first = records[0] if records else {}
    out = [f"# comet bench: {first.get('layout', '?')} on {first.get('device', '?')}", "",
           f"- date: {first.get('date', '?')}",
           f"- command: `{first.get('command', '?')}`",
           f"- dtype: {', '.join(sorted({str(r.get('dtype', '?')) for r in records}))}; "
           f"iterations: {first.get('iters', '?')} "
           f"(median of the slowest rank), warm-up {first.get('warmup', '?')}, "
           f"{first.get('input_sets', '?')} input sets"]
    out += [f"- {name}: {what}" for name, what in (first.get("baselines") or {}).items()]
    out += [f"- note: {n}" for n in notes]
    lines = summary(records)
    if lines:
        out += ["", "## Summary", ""] + [f"- {s}" for s in lines]
    fp8 = [r for r in records if is_fp8(r) and r["layer"] == "moe"]
    peers = peer_rows(records)
    records = [r for r in records if not is_fp8(r)]
    if records or not fp8:
        out += ["", "## Times", "", markdown_table(records, MAIN_COLUMNS),
                "", "## Compute and communication efficiency", "",
                markdown_table(records, EFFICIENCY_COLUMNS)]
    if fp8:
        out += ["", "## The FP8 layer against bf16", "", markdown_table(fp8, fp8_columns(fp8))]
    moe = [r for r in records if r["layer"] == "moe"]
    if moe:
        out += ["", "## Where the unfused baseline spends its time", "",
                markdown_table(moe, BREAKDOWN_COLUMNS)]
    if any("rows_max_over_mean_r0" in r for r in moe):
        out += ["", "## Redundant experts: rows per rank", "", markdown_table(moe, EPLB_COLUMNS)]
    if peers:
        out += ["", "## Against the peers", "", markdown_table(peers, peer_columns(peers)), ""]
        out += [f"- {line}" for line in peer_notes(peers)]
    return "\n".join(out) + "\n"


def plot_speedup(records: Sequence[dict], path: str) -> tuple[str | None, str]:
    """Speedup a/b and hidden-comm fraction against tokens per rank, one line per config
    (solid: uniform routing, dashed: skewed), from the "moe" records.

    Returns ``(path or None, note)``; no plot without matplotlib or fused timings.
    """
    moe = [r for r in records if r["layer"] == "moe" and r.get("speedup") is not None]
    if not moe:
        return None, "plot skipped: no fused timings to plot"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "plot skipped: matplotlib is not installed (pip install 'comet-moe[plot]')"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"uniform": "-", "skewed": "--"}
    for (config, routing), rows in sorted(_group(moe).items()):
        rows = sorted(rows, key=lambda r: r["tokens_per_rank"])
        xs = [r["tokens_per_rank"] for r in rows]
        label = f"{config} ({routing})"
        ls = styles.get(routing, ":")
        axes[0].plot(xs, [r["speedup"] for r in rows], ls, marker="o", label=label)
        axes[1].plot(xs, [r["hidden_comm_fraction"] for r in rows], ls, marker="o", label=label)
    for ax, title, target in ((axes[0], "speedup over the unfused baseline (a/b)", 1.5),
                              (axes[1], "hidden communication (c + d - b) / min(c, d)", 0.85)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_title(title)
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].legend(fontsize=8)
    first = moe[0]
    fig.suptitle(f"comet {first.get('layout', '')} on {first.get('device', '')}, "
                 f"{first.get('dtype', '')}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, f"plot written to {path}"


def _group(records: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["config"], r["routing"]), []).append(r)
    return groups


#: The whole-layer columns the docs show (docs/benchmarks.md: ``comet bench --from-json
#: FILE... --markdown``): times in whole microseconds, ratios to two decimals.
DOCS_COLUMNS: list[Column] = _KEY[:2] + [
    ("(a) unfused", _num("baseline_us", "{:.0f}")),
    ("(b) fused", _num("fused_us", "{:.0f}")),
    ("sequential", _num("sequential_us", "{:.0f}")),
    ("(c) compute only", _num("compute_only_us", "{:.0f}")),
    ("(d) comm only", _num("comm_only_us", "{:.0f}")),
    ("NCCL a2a", _num("nccl_a2a_us", "{:.0f}")),
    ("torch GMM", _num("torch_gmm_us", "{:.0f}")),
    ("a/b", _num("speedup", "{:.2f}")),
    ("b/seq", _num("fused_over_sequential", "{:.2f}")),
    ("hidden", _num("hidden_comm_fraction", "{:.2f}")),
    ("torch GMM/b", _num("gmm_over_fused", "{:.2f}")),
    ("comm/NCCL", _num("comm_over_nccl", "{:.2f}")),
    ("n_comm", _n_comm),
]


def provenance_line(path: str, records: Sequence[dict]) -> str:
    """Where a file's numbers come from: device, layout, commit, kernels, command (what
    an older file did not record is said so: its dated README names it)."""
    first = records[0] if records else {}
    commit = first.get("commit")
    return (f"`{path}`: {first.get('device', '?')}, {first.get('layout', '?')}, commit "
            + (f"`{commit}`" if commit else "not recorded (the date's README names it)")
            + f", kernels {kernels_of(first)}, "
            f"`{repo_relative(first.get('command') or '?')}`")


def docs_markdown(files: Sequence[tuple[str, Sequence[dict]]],
                  routings: Sequence[str] | None = None) -> str:
    """The markdown docs/benchmarks.md shows for these result files, read together: one
    provenance line per file, then per routing (``routings``: default all) the
    whole-layer rows (:data:`DOCS_COLUMNS`), the peers' table where there are peers, and
    the summary against the targets."""
    records = [r for _, recs in files for r in recs
               if routings is None or r.get("routing") in routings]
    moe = [r for r in records if r.get("layer") == "moe"]
    out = [f"- {provenance_line(path, recs)}" for path, recs in files]
    pair_dtypes(records)
    for routing in sorted({r["routing"] for r in moe}):
        rows = [r for r in moe if r["routing"] == routing and not is_fp8(r)]
        fp8 = [r for r in moe if r["routing"] == routing and is_fp8(r)]
        if rows:
            out += ["", f"Whole layer, {routing} routing, slowest rank, median us:", "",
                    markdown_table(rows, DOCS_COLUMNS)]
        if fp8:
            out += ["", f"The FP8 layer against bf16, {routing} routing:", "",
                    markdown_table(fp8, fp8_columns(fp8))]
        if peers := peer_rows(rows + fp8):
            out += ["", f"Against the peers, {routing} routing:", "",
                    markdown_table(peers, peer_columns(peers))]
    out += [""] + [f"- summary: {line}" for line in summary(records)]
    return "\n".join(out) + "\n"
