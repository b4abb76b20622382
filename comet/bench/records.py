"""Benchmark records: one dict per (config, tokens per rank, routing, layer), and the
ratios derived from its times.

Times are microseconds, each the median over iterations of the slowest rank (see
:mod:`comet.bench.timing`); ``None`` where a variant was not measured (no GPU, one rank,
or a per-layer row of a variant that has no layers). Variants:

* ``baseline_us`` (a) -- :func:`comet.baseline.ep_moe_forward`, unfused.
* ``fused_us`` (b) -- comet's fused layer.
* ``compute_only_us`` (c) -- the same tiles with the rows already in place, no comm.
* ``comm_only_us`` (d) -- dispatch and combine data movement alone.
* ``chunked_us`` (e) -- :func:`comet.baseline.chunked_ep_moe_forward`, the better of 2
  and 4 chunks (``chunked_chunks`` says which).
* ``sequential_us`` -- comet's kernels with 0 comm blocks: comm, then compute.
* ``torch_gmm_us`` -- torch's grouped GEMM on the rows this layer multiplies.
* ``comet_gmm_us`` -- comet's layer kernels in (c), without plan and combine;
  ``cutlass_gmm_us`` -- the CUTLASS grouped GEMM on the same rows.
* ``nccl_a2a_us`` -- NCCL ``all_to_all_single`` of the rows this layer moves.
* ``hbm_floor_us`` -- the slowest rank's weight bytes of its experts with rows over
  ``hbm_read_gbps``, the HBM read bandwidth measured in the same run (a floor, not a
  measurement of the layer).
* ``link_rows`` / ``link_token_rows`` -- rows the slowest rank's dispatch sends to other
  ranks, once per (token, expert) as the placing push sends them and once per (token,
  rank), what the gathered dispatch moves (median over the input sets; counts, not
  times); ``layer0_gather`` says which one comet's layer ran
  (``Variant.layer0_gather``).
* ``fixed_split_us`` -- with ``--fixed-splits``: the fused layer at each fixed comm-block
  count (``{"16": us, ...}``), and ``best_fixed_split`` / ``best_fixed_us`` the fastest.
* ``dispatch_rows`` / ``dispatch_row_bytes`` / ``dispatch_bytes`` -- rows the slowest
  rank's dispatch writes (local ones included; once per (token, rank) where the layer
  gathers), the bytes of one as it crosses (a bf16 row, or the FP8 layer's packed row of
  e4m3 values and fp32 group scales) and their product.
* FP8 records (``dtype`` ``"fp8"``, ``comet bench --dtype fp8``): comet's FP8 layer on
  the same weights quantized; the bf16-only columns are None and ``omitted`` says why,
  a mode the FP8 kernels cannot run is in ``skipped_modes``; ``hbm_floor_us`` counts
  e4m3 weights, their scales and the rows the GEMMs read; ``max_rel_err["fused"]`` is
  against the emulation of the quantized layer (one rank only); ``fp8_promotion_k``
  the layer's :attr:`comet.quant.Fp8.promotion_k` (``--fp8-promotion-k``, ``"auto"``: the
  default; records before 2026-12-06 say ``fp8_accumulation``: ``"fp32"`` was 32 in
  every GEMM, ``"fast"`` 128). With a bf16 record of
  the same case in the same run: ``bf16_fused_us``, ``fp8_over_bf16``,
  ``bf16_over_fp8``, ``dispatch_bytes_over_bf16`` (:func:`pair_dtypes`). With ``--peers
  deepgemm``: ``deepgemm_gmm_us`` / ``deepgemm_gmm_tflops``, DeepGEMM's grouped FP8 GEMMs
  (contiguous or masked layout, the faster; :mod:`comet.bench.deepgemm`) on the same rows
  per expert -- layer0 the gate/up GEMM, layer1 the down GEMM, "moe" both -- and
  ``deepgemm`` (its status, reason, backend, layout, output error); comet's side is its
  GEMM phases (``comet_gmm_tflops``: layer0 and layer1, each a GEMM with its fused
  epilogue, of the mode ``comet_gmm_mode`` names: (c), rows already in place, or the fused
  call where it took the warp-specialized GEMMs, which (c) does not run, its dispatch
  launch included), and ``fp8_gmm_over_deepgemm`` the ratio of the two throughputs.
* ``peer_<name>_us`` -- with ``--peers``: another project's whole layer on the same inputs
  (:mod:`comet.bench.peers`), None where it was not timed (``peers`` says why: its
  status, reason, backend and output error per peer); ``best_peer`` / ``best_peer_us``
  the fastest of them.
"""

from __future__ import annotations

import json
import math

from comet.bench.provenance import write_result

#: Every record has these keys (values may be None); the JSON schema of a result file.
REQUIRED_KEYS = (
    "device", "world_size", "layout", "config", "tokens_per_rank", "routing", "layer",
    "baseline_us", "fused_us", "compute_only_us", "comm_only_us", "chunked_us",
    "torch_gmm_tflops", "comet_gmm_tflops", "cutlass_gmm_tflops", "n_comm", "date", "command",
)

LAYERS = ("layer0", "layer1", "moe")

#: An output further than this from the unfused baseline's (max abs difference over max
#: abs value, worst rank) is wrong: a peer's is not timed (comet.bench.peers), comet's
#: fused one is timed and reported as wrong (:func:`wrong_fused`). The 4104 fused records
#: under benchmarks/results up to 2026-11-27 reach 0.014 at most (bf16), the broken
#: kernels of one experiment 0.60-0.97. scripts/device/stress.py holds its own error
#: (relative L2 norm against comet.reference) to the same number.
MAX_REL_ERR = 2e-2


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, None if either is missing or ``den`` is not positive."""
    if num is None or den is None or not den > 0:
        return None
    return num / den


def hidden_fraction(compute_us: float | None, comm_us: float | None,
                    fused_us: float | None) -> float | None:
    """Share of the shorter of compute and comm that the fused layer hides:
    ``(c + d - b) / min(c, d)``.

    1.0: the fused layer costs ``max(c, d)``; 0.0: it costs ``c + d`` (nothing hidden);
    negative: slower than running the two back to back; above 1.0: faster than the longer
    of the two alone.
    """
    if compute_us is None or comm_us is None or fused_us is None:
        return None
    return ratio(compute_us + comm_us - fused_us, min(compute_us, comm_us))


def tflops(flops: float | None, us: float | None) -> float | None:
    """TFLOP/s of ``flops`` done in ``us`` microseconds."""
    r = ratio(flops, us)
    return None if r is None else r / 1e6


def derive(rec: dict) -> dict:
    """Add the ratios the tables show (in place; also returned).

    speedup: a / b.  speedup_vs_chunked: e / b.  hidden_comm_fraction: see
    :func:`hidden_fraction`.  compute_efficiency: torch grouped GEMM time over (c), i.e.
    comet's GEMM TFLOP/s over torch's on the same rows.  comm_efficiency: NCCL
    all_to_all time of the same rows over (d); comm_over_nccl its inverse.
    gmm_over_fused: torch's grouped GEMM time on the layer's rows over b (1: the layer
    costs no more than its GEMMs).  gmm_over_compute_only: the same over c -- what
    gmm_over_fused would be if the dispatch, layer1's scatter or reduce and the combine
    cost nothing beside the plan and the GEMMs (c runs those alone, timed as b is); below
    a target, the GEMMs or the plan must get faster; above it while gmm_over_fused is
    below, the communication and the combine are what cost.
    fused_over_sequential: b over comet's
    own kernels run one after the other (below 1: the overlap pays).  fused_over_best_fixed:
    b over the fastest fixed split of the record (the per-call choice against hindsight).
    speedup_vs_best_peer: ``best_peer_us`` (the fastest ``peer_<name>_us``) over b.
    fp8_gmm_over_deepgemm: comet's GEMM TFLOP/s over DeepGEMM's grouped FP8 GEMM's on the
    same rows (an FP8 record with ``--peers deepgemm``; issue 68 asks >= 0.85).
    gemm_floor_us: the fastest GEMM measured on the layer's rows (torch, comet's kernels
    alone, CUTLASS); speedup_at_floor: a over it, the speedup of a layer that cost only
    its GEMMs -- where that is below a speedup target, no overlap can reach the target
    without a faster GEMM. fused_over_hbm_floor: b over ``hbm_floor_us``, the time the
    slowest rank needs to read its touched experts' weights once from HBM
    (:mod:`comet.bench.floors`; what bounds a decode-sized call).
    """
    rec["speedup"] = ratio(rec.get("baseline_us"), rec.get("fused_us"))
    rec["speedup_vs_chunked"] = ratio(rec.get("chunked_us"), rec.get("fused_us"))
    rec["hidden_comm_fraction"] = hidden_fraction(
        rec.get("compute_only_us"), rec.get("comm_only_us"), rec.get("fused_us"))
    rec["compute_efficiency"] = ratio(rec.get("comet_gmm_tflops"), rec.get("torch_gmm_tflops"))
    rec["comm_efficiency"] = ratio(rec.get("nccl_a2a_us"), rec.get("comm_only_us"))
    rec["comm_over_nccl"] = ratio(rec.get("comm_only_us"), rec.get("nccl_a2a_us"))
    rec["gmm_over_fused"] = ratio(rec.get("torch_gmm_us"), rec.get("fused_us"))
    rec["gmm_over_compute_only"] = ratio(rec.get("torch_gmm_us"), rec.get("compute_only_us"))
    rec["fused_over_sequential"] = ratio(rec.get("fused_us"), rec.get("sequential_us"))
    rec["fused_over_best_fixed"] = ratio(rec.get("fused_us"), rec.get("best_fixed_us"))
    gemms = [rec.get(k) for k in ("torch_gmm_us", "comet_gmm_us", "cutlass_gmm_us")]
    rec["gemm_floor_us"] = min((t for t in gemms if t is not None and t > 0), default=None)
    rec["speedup_at_floor"] = ratio(rec.get("baseline_us"), rec["gemm_floor_us"])
    rec["fused_over_hbm_floor"] = ratio(rec.get("fused_us"), rec.get("hbm_floor_us"))
    peers = {name: rec[f"peer_{name}_us"] for name in peer_names(rec)
             if rec[f"peer_{name}_us"] is not None and rec[f"peer_{name}_us"] > 0}
    rec["best_peer"] = min(peers, key=peers.get, default=None)
    rec["best_peer_us"] = peers.get(rec["best_peer"])
    rec["speedup_vs_best_peer"] = ratio(rec["best_peer_us"], rec.get("fused_us"))
    rec["fp8_gmm_over_deepgemm"] = ratio(rec.get("comet_gmm_tflops"),
                                         rec.get("deepgemm_gmm_tflops"))
    return rec


#: ``dtype`` of a record of comet's FP8 layer (``comet bench --dtype fp8``); the others
#: name torch's dtype of the rows (``bfloat16``).
FP8 = "fp8"
BF16 = "bfloat16"


def is_fp8(rec: dict) -> bool:
    return rec.get("dtype") == FP8


def pair_dtypes(records: list[dict]) -> list[dict]:
    """Hold each FP8 record against the bf16 record of the same case measured in the same
    run (same date, layout, config, tokens, routing, layer; ``--dtype bf16 fp8``), in
    place: ``bf16_fused_us``, ``fp8_over_bf16`` (FP8 (b) over bf16 (b)),
    ``bf16_over_fp8`` (its inverse, the FP8 layer's speedup) and
    ``dispatch_bytes_over_bf16``; None without such a record -- ratios are never taken
    across runs, whose clocks and power states differ."""
    def key(r: dict) -> tuple:
        return tuple(r.get(k) for k in ("date", "layout", "config", "tokens_per_rank",
                                        "routing", "layer"))
    bf16 = {key(r): r for r in records if r.get("dtype") == BF16}
    for r in records:
        if is_fp8(r):
            b = bf16.get(key(r), {})
            r["bf16_fused_us"] = b.get("fused_us")
            r["fp8_over_bf16"] = ratio(r.get("fused_us"), r["bf16_fused_us"])
            r["bf16_over_fp8"] = ratio(r["bf16_fused_us"], r.get("fused_us"))
            r["dispatch_bytes_over_bf16"] = ratio(r.get("dispatch_bytes"),
                                                  b.get("dispatch_bytes"))
    return records


def wrong_fused(records) -> list[dict]:
    """The records whose fused output is further than :data:`MAX_REL_ERR` from the
    baseline's (or not finite): their times are not those of a correct layer."""
    return [r for r in records
            if (err := (r.get("max_rel_err") or {}).get("fused")) is not None
            and not err <= MAX_REL_ERR]


def peer_names(rec: dict) -> list[str]:
    """The peers a record has a column for (``peer_<name>_us``, timed or not), sorted."""
    return sorted(k[len("peer_"):-len("_us")] for k in rec
                  if k.startswith("peer_") and k.endswith("_us"))


def geomean(values) -> float | None:
    """Geometric mean of the positive values given, None if there are none."""
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def write_json(records: list[dict], path: str) -> str:
    """Write ``records`` as a JSON list through the one results writer (every record
    carrying the provenance fields, paths repo-relative); returns the path."""
    return write_result(path, records)


def read_json(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)
