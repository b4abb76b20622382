"""Times every variant of one benchmark case (config, tokens per rank, routing).

All variants see the same input sets (rotated through, L2 flushed between iterations);
each variant's per-iteration times (and phases) are the slowest rank's, then the median
is taken. Per-layer numbers come from phase timers inside whole calls:

=============  ===================================================  ========================
variant        layer0                                               layer1
=============  ===================================================  ========================
baseline       route + counts + gather + dispatch + permute +       gemm1 + unpermute +
               gemm0 + act                                          combine + reduce
comet modes    plan + layer0 (the FusedMoE PhaseTimer phases)       layer1 + combine
torch GEMM     gemm0                                                gemm1
NCCL a2a       dispatch                                             combine
=============  ===================================================  ========================

"moe" is the whole call, of every variant timed in separate iterations without phase
events: a phase-timed iteration parks the GPU in a sleep first (see comet.bench.timing),
and on these power-limited GPUs a call that starts rested runs faster (docs/notebook.md,
"The benchmark protocol"). So the layer and its references
(torch's and CUTLASS's GEMMs, NCCL) are held against each other in one regime. The
baseline's phase events would also add host work to a pipeline that is host-bound at
small token counts. GEMM TFLOP/s, a GEMM-against-GEMM ratio, come from the phases (both
sides rested), and comet's GEMM alone has no whole-call time (``comet_gmm_us`` is None in
"moe" records).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from comet import reference
from comet.activation import gated
from comet.baseline import chunked_ep_moe_forward, ep_moe_forward, plan_dispatch
from comet.bench import records as rec
from comet.bench.deepgemm import (MAX_DIFF, DeepGemm, check_layout, layouts_for,
                                   weight_operand)
from comet.bench.floors import (dispatch_rows, expert_bytes, fp8_expert_bytes,
                                 fp8_row_bytes, hbm_floor_us, link_rows)
from comet.bench.inputs import InputSet, make_input_sets
from comet.bench.peers import PeerLayer, PeerUnavailable, Peers
from comet.bench.timing import (L2Flush, PhaseClock, median, reduce_over_ranks, time_calls,
                                timed_sets)
from comet.config import MoEConfig
from comet.grouped import grouped_mm
from comet.kernels.fp8_gemm import quantize_rows_triton
from comet.kernels.fp8_roles import packed_row_bytes
from comet.quant import Fp8Weight

# compute_only after modes that dispatch: its GEMMs then read real rows. On a zeroed
# workspace they run 15-18% faster (a power-limited GPU clocks higher when the tensor
# cores' inputs do not toggle; benchmarks/results/2026-11-23/h200-zeros-probe.json).
FUSED_MODES = ("fused", "sequential", "compute_only", "comm_only")

LAYER_PHASES: dict[str, dict[str, tuple[str, ...]]] = {
    "baseline": {"layer0": ("route", "counts", "gather", "dispatch", "permute", "gemm0", "act"),
                 "layer1": ("gemm1", "unpermute", "combine", "reduce")},
    "comet": {"layer0": ("plan", "layer0"), "layer1": ("layer1", "combine")},
    # The GEMM kernels alone: torch's grouped GEMM is timed without routing.
    "comet_kernels": {"layer0": ("layer0",), "layer1": ("layer1",)},
    "gmm": {"layer0": ("gemm0",), "layer1": ("gemm1",)},
    "a2a": {"layer0": ("dispatch",), "layer1": ("combine",)},
}
#: For TFLOP/s only: "moe" as the sum of the two GEMM phases, on both sides.
_RATE_PHASES = {
    "comet_kernels": {**LAYER_PHASES["comet_kernels"], "moe": ("layer0", "layer1")},
    "gmm": {**LAYER_PHASES["gmm"], "moe": ("gemm0", "gemm1")},
}

#: Baseline phases summed into the breakdown columns (comet.baseline's phases).
BASELINE_BREAKDOWN = {
    "sync": ("counts",),
    "a2a": ("dispatch", "combine"),
    "gemm": ("gemm0", "gemm1"),
    "act": ("act",),
    "permute": ("route", "gather", "permute", "unpermute", "reduce"),
}


@dataclass
class Settings:
    """How to measure (shared by every case of a run)."""

    device: torch.device
    group: object = None
    world: int = 1
    rank: int = 0
    iters: int = 20
    warmup: int = 5
    n_sets: int = 4
    seed: int = 0
    comm_blocks: int | tuple[int, int] | None = None
    chunk_options: tuple[int, ...] = (2, 4)
    #: Comm-block counts (both layers) the fused layer is also timed at, to hold the
    #: per-call choice against the best fixed split of each record.
    fixed_splits: tuple[int, ...] = ()
    #: HBM read bandwidth measured in this run (:func:`comet.bench.floors.hbm_read_gbps`),
    #: for the records' HBM floor; None off a GPU.
    hbm_gbps: float | None = None
    #: Microseconds the GPU sleeps before each whole-call iteration, so the host issues
    #: the call ahead (comet.bench.timing.time_calls; 0: calls back to back).
    lead_us: float = 0.0
    #: Time comet's layer alone: no baselines, reference GEMMs or NCCL (their columns
    #: None), for sweeps that hold the layer against itself (``--dtype bf16 fp8``).
    only_fused: bool = False


@dataclass
class Case:
    """One benchmark point."""

    config: str
    cfg: MoEConfig
    tokens: int
    routing: str


@dataclass
class Fused:
    """comet's layer for one config, as the runner drives it.

    layer: ``layer(x, topk_ids, topk_weights, comm_blocks=, mode=, timer=)`` with
    ``last_comm_blocks``; make_timer: builds its phase timer (``PhaseTimer``).
    """

    layer: object
    make_timer: Callable[[], object]


@dataclass
class Series:
    """One variant's reduced per-iteration times by phase, plus the view per layer."""

    series: dict[str, list[float]]
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def layer(self, name: str, phases: dict[str, tuple[str, ...]] | None = None
              ) -> list[float] | None:
        parts = (self.phases if phases is None else phases).get(name)
        if parts is None:
            return self.series.get("total") if name == "moe" else None
        present = [self.series[p] for p in parts if p in self.series]
        return [sum(v) for v in zip(*present)] if present else None

    def median(self, name: str) -> float | None:
        return median(self.layer(name))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (y.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _gemm_flops(rows: int, cfg: MoEConfig) -> dict[str, float]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    l0, l1 = 2.0 * rows * h * 2 * f, 2.0 * rows * f * h
    return {"layer0": l0, "layer1": l1, "moe": l0 + l1}


def case_timer(st: Settings, flush: L2Flush) -> Callable[..., dict[str, list[float]]]:
    """``timed(fn, make_timer=None)``: ``fn``'s series over a case's input sets
    (:func:`comet.bench.timing.time_calls`), each reduced over the ranks to the slowest --
    the timing every variant of a case shares."""
    def timed(fn, make_timer=None) -> dict[str, list[float]]:
        series = time_calls(fn, n_sets=st.n_sets, iters=st.iters, warmup=st.warmup,
                            device=st.device, group=st.group, make_timer=make_timer,
                            flush=flush, lead_us=st.lead_us)
        return reduce_over_ranks(series, st.group)
    return timed


def reference_series(timed: Callable, fn, phases: dict[str, tuple[str, ...]],
                     device: torch.device) -> Series:
    """A reference's :class:`Series`: ``fn``'s phases from calls with events, its whole-call
    time from calls without (``timed``: :func:`case_timer`'s)."""
    series = timed(fn, lambda: PhaseClock(device))
    series["total"] = timed(fn)["total"]
    return Series(series, phases)


def fp8_gemm_mode(fused: Fused) -> str:
    """The mode whose layer0 and layer1 phases time the GEMMs comet's last fused FP8 call
    ran: ``"compute_only"`` (c), or ``"fused"`` where that call took the warp-specialized
    GEMMs, which the decomposed modes never run (their layer1 reduces:
    comet.runtime.forward) -- its phases then also hold the dispatch launch (the home
    quantizer, the rows' copies), so its GEMM time is an upper bound."""
    return "fused" if getattr(fused.layer, "last_ws_gemm", False) else "compute_only"


def gemm_rate(out: dict[str, Series], variant: str, layer: str,
              phases: dict[str, tuple[str, ...]], flops: dict[str, list[float]],
              st: Settings) -> float | None:
    """TFLOP/s of ``variant``'s ``layer`` (``phases``: its GEMM phases, "moe" their sum):
    each iteration's GEMM work over all ranks over its time on the slowest, the median; None
    where it was not timed."""
    times = out[variant].layer(layer, phases) if variant in out else None
    if not times:
        return None
    return median([rec.tflops(f, st.world * t) for f, t in zip(flops[layer], times)])


def run_case(case: Case, st: Settings, w13: torch.Tensor, w2: torch.Tensor,
             fused: Fused | None = None,
             cutlass_mm: Callable | None = None,
             layers: Sequence[str] = rec.LAYERS,
             peers: Peers | None = None) -> list[dict]:
    """Measure every variant of ``case``; collective over ``st.group``.

    Args:
        w13, w2: this rank's expert weights ``[El, H, 2F]``, ``[El, F, H]``.
        fused: comet's layer for this config, or None (no GPU, or it failed to build):
            its columns are then None.
        cutlass_mm: the CUTLASS grouped GEMM reference, or None.
        layers: which of "layer0", "layer1", "moe" to return records for.
        peers: other projects' layers built for this config (:mod:`comet.bench.peers`) and
            why the others asked for are not: each built one's output is checked against
            the baseline's, and only a matching one is timed, whole layer only
            (``peer_<name>_us``; ``peers`` holds every one's status).

    Returns:
        One record per layer with the measured fields and the derived ratios (no
        run metadata: the caller adds device, layout, date, command).
    """
    cfg, dev, group = case.cfg, st.device, st.group
    el = w13.shape[0]
    sets = make_input_sets(cfg, case.config, case.tokens, case.routing, st.n_sets, st.rank,
                           st.seed, dev)
    plans = [plan_dispatch(s.topk_ids, el, group) for s in sets]
    flush = L2Flush(dev)

    timed = case_timer(st, flush)

    def baseline(s: InputSet, timer=None):
        return ep_moe_forward(s.x, s.topk_ids, s.topk_weights, w13, w2, group, timer=timer)

    def phase_clock():
        return PhaseClock(dev)

    def reference(fn, phases) -> Series:
        return reference_series(timed, fn, phases, dev)

    out: dict[str, Series] = {}
    if not st.only_fused:
        # The whole-call time of the baseline comes from calls without phase events: its
        # small-token regime is host-bound, and ~20 event records would add to it.
        phases = timed(lambda i, t: baseline(sets[i], t), phase_clock)
        phases["total"] = timed(lambda i, t: baseline(sets[i]))["total"]
        out["baseline"] = Series(phases, LAYER_PHASES["baseline"])
        for n in st.chunk_options:
            out[f"chunked{n}"] = Series(timed(lambda i, t, n=n: chunked_ep_moe_forward(
                sets[i].x, sets[i].topk_ids, sets[i].topk_weights, w13, w2, group,
                chunks=n)))
    ref = baseline(sets[0])
    peer_status = _time_peers(peers, sets, ref, timed, out, group) if peers is not None else {}
    n_comm = None
    decode_tile = None
    tile_overrides = None
    if fused is not None:
        for mode in FUSED_MODES:
            out[mode] = fused_series(timed, fused, sets,
                                     None if mode == "sequential" else st.comm_blocks, mode)
        for n in fixed_splits(st, fused):
            out[f"fixed{n}"] = fused_series(timed, fused, sets, n, "fused")
        fused.layer(sets[0].x, sets[0].topk_ids, sets[0].topk_weights,
                    comm_blocks=st.comm_blocks, mode="fused")
        n_comm = _gather([list(fused.layer.last_comm_blocks)], group)
        decode_tile = fused.layer.last_decode
        tile_overrides = fused.layer.last_tile_overrides
    if not st.only_fused:
        _time_references(out, reference, plans, cfg, w13, w2, cutlass_mm, sets, st)

    flops_by_set = [_gemm_flops(p.rows, cfg) for p in plans]
    order = timed_sets(st.n_sets, st.iters, st.warmup)
    flops = reduce_over_ranks({name: [flops_by_set[s][name] for s in order]
                               for name in rec.LAYERS}, group, sums=rec.LAYERS)
    hbm_floor = hbm_floors(plans, order, cfg.hidden_size, cfg.intermediate_size,
                           w13.element_size(), st)
    link = link_columns([s.topk_ids for s in sets], el, st)
    dispatch = dispatch_columns([s.topk_ids for s in sets], el, st, layer_gathers(fused),
                                cfg.hidden_size * w13.element_size())
    checks = {**_checks(sets[0], ref, w13, w2, st, fused),
              **{f"peer_{name}": s["max_rel_err"] for name, s in peer_status.items()
                 if "max_rel_err" in s}}

    results = []
    for layer in layers:
        def med(variant, phases=None, layer=layer):
            return median(out[variant].layer(layer, phases)) if variant in out else None

        chunked = {n: med(f"chunked{n}") for n in st.chunk_options}
        best = min((n for n in chunked if chunked[n] is not None), key=chunked.get,
                   default=None)

        def gmm_tflops(variant, phases, layer=layer):
            return gemm_rate(out, variant, layer, phases, flops, st)

        r = {
            **case_columns(case, layer),
            "baseline_us": med("baseline"), "fused_us": med("fused"),
            "sequential_us": med("sequential"), "compute_only_us": med("compute_only"),
            "comm_only_us": med("comm_only"),
            "chunked_us": chunked[best] if best is not None else None,
            "chunked_chunks": best,
            **{f"chunked{n}_us": chunked[n] for n in st.chunk_options},
            "torch_gmm_us": med("torch_gmm"),
            "torch_gmm_tflops": gmm_tflops("torch_gmm", _RATE_PHASES["gmm"]),
            "comet_gmm_tflops": gmm_tflops("compute_only", _RATE_PHASES["comet_kernels"]),
            "cutlass_gmm_tflops": gmm_tflops("cutlass_gmm", _RATE_PHASES["gmm"]),
            "comet_gmm_us": (med("compute_only", LAYER_PHASES["comet_kernels"])
                             if layer != "moe" else None),
            "cutlass_gmm_us": med("cutlass_gmm"),
            "nccl_a2a_us": med("nccl"),
            **fixed_columns({n: med(f"fixed{n}") for n in st.fixed_splits}),
            # Whole layer only: a peer has no phases, so its layer rows are None.
            **({**{f"peer_{name}_us": med(f"peer_{name}") for name in peers.names},
                "peers": peer_status} if peers is not None else {}),
            **call_columns(out, layer, fused, n_comm, decode_tile, tile_overrides,
                           flops, st),
            **link,
            **dispatch,
            "max_rel_err": checks,
            **run_columns(st, hbm_floor, layer),
        }
        if layer == "moe":
            r.update(phase_columns(out, BASELINE_BREAKDOWN))
        results.append(rec.derive(r))
    return results


def _time_references(out: dict[str, Series], reference: Callable, plans, cfg: MoEConfig,
                     w13, w2, cutlass_mm, sets: list[InputSet], st: Settings) -> None:
    """Time the GEMMs (torch's, CUTLASS's) on the layer's rows and, across ranks, NCCL's
    all-to-all of them, into ``out`` (``reference(fn, phases)``: phases and whole calls
    of ``fn``)."""
    dev = st.device
    gmm_rows = [(torch.randn(p.rows, cfg.hidden_size, device=dev, dtype=cfg.dtype),
                 torch.randn(p.rows, cfg.intermediate_size, device=dev, dtype=cfg.dtype))
                for p in plans]
    out["torch_gmm"] = reference(gemm_fn(plans, gmm_rows, w13, w2, grouped_mm),
                                 LAYER_PHASES["gmm"])
    if cutlass_mm is not None:
        out["cutlass_gmm"] = reference(gemm_fn(
            plans, gmm_rows, w13, w2, lambda a, b, rows, _: cutlass_mm(a, b, rows)),
            LAYER_PHASES["gmm"])
    del gmm_rows
    if st.world > 1:
        out["nccl"] = reference(_a2a_fn(sets, plans, st.group), LAYER_PHASES["a2a"])


#: The columns an FP8 record leaves empty, and why: the unfused and chunked baselines,
#: the torch and CUTLASS grouped GEMMs, NCCL's all-to-all and the peers run bf16 rows
#: through bf16 weights; their times are in the bf16 record of the same case (``--dtype
#: bf16 fp8``), which the FP8 one is held against.
FP8_OMITTED = {
    "baseline_us": "the unfused baseline has no FP8 form",
    "chunked_us": "the chunked baseline has no FP8 form",
    "torch_gmm_us": "torch's grouped GEMM takes no block-scaled FP8 operands",
    "cutlass_gmm_us": "the CUTLASS reference is a bf16 grouped GEMM",
    "nccl_a2a_us": "NCCL's reference moves bf16 rows",
    "peers": "the whole-layer peers run bf16 experts; DeepGEMM's grouped FP8 GEMM "
             "(--peers deepgemm) is in deepgemm_gmm_us",
}


def run_fp8_case(case: Case, st: Settings, gate_up: Fp8Weight, down: Fp8Weight,
                 fused: Fused | None, layers: Sequence[str] = rec.LAYERS,
                 deepgemm: DeepGemm | str | None = None, peers: Peers | None = None
                 ) -> list[dict]:
    """:func:`run_case` for comet's FP8 layer (``case.cfg.fp8``; forward only): the fused
    call and its modes, the fixed splits, its HBM floor with FP8 bytes and its dispatch
    bytes, its output against the emulation of the quantized layer (:func:`emulate_fp8`;
    one rank only: it needs every expert). The bf16 variants have no FP8 form
    (:data:`FP8_OMITTED`: their columns are None, ``omitted`` says why). A mode that
    raises is left out (``skipped_modes``: why); collective over ``st.group``.

    ``deepgemm`` (``--peers deepgemm``): DeepGEMM's grouped FP8 GEMMs on the same rows per
    expert, or why it cannot run; the records then have ``deepgemm_gmm_us``,
    ``deepgemm_gmm_tflops`` and ``deepgemm`` (:func:`deepgemm_series`). ``peers``: whole
    FP8 layers of other projects on the same experts (``--peers mega-moe``), checked and
    timed as whole calls (:func:`_time_fp8_peers`): ``peer_<name>_us`` and ``peers``."""
    cfg, group = case.cfg, st.group
    el = gate_up.experts
    sets = make_input_sets(cfg, case.config, case.tokens, case.routing, st.n_sets, st.rank,
                           st.seed, st.device)
    plans = [plan_dispatch(s.topk_ids, el, group) for s in sets]
    timed = case_timer(st, L2Flush(st.device))
    out: dict[str, Series] = {}
    skipped: dict[str, str] = {}
    n_comm = decode_tile = tile_overrides = None
    gmm_mode = "compute_only"
    checks: dict[str, float | None] = {"fused": None}
    if fused is not None:
        for mode in FUSED_MODES:
            try:
                out[mode] = fused_series(timed, fused, sets,
                                         None if mode == "sequential" else st.comm_blocks,
                                         mode)
            except Exception as err:  # a mode the FP8 kernels lack: say so, time the rest
                skipped[mode] = f"{type(err).__name__}: {err}"
    if fused is not None and "fused" in out:
        for n in fixed_splits(st, fused):
            out[f"fixed{n}"] = fused_series(timed, fused, sets, n, "fused")
        y = fused.layer(sets[0].x, sets[0].topk_ids, sets[0].topk_weights,
                        comm_blocks=st.comm_blocks, mode="fused")
        n_comm = _gather([list(fused.layer.last_comm_blocks)], group)
        decode_tile = fused.layer.last_decode
        tile_overrides = fused.layer.last_tile_overrides
        gmm_mode = fp8_gemm_mode(fused)
        if st.world == 1:
            checks["fused"] = rel_err(y, emulate_fp8(sets[0], gate_up, down, cfg))
    order = timed_sets(st.n_sets, st.iters, st.warmup)
    flops_by_set = [_gemm_flops(p.rows, cfg) for p in plans]
    flops = reduce_over_ranks({name: [flops_by_set[s][name] for s in order]
                               for name in rec.LAYERS}, group, sums=rec.LAYERS)
    hbm_floor = hbm_floors(plans, order, cfg.hidden_size, cfg.intermediate_size, 1, st,
                           fp8_expert_bytes(gate_up, down),
                           fp8_row_bytes(cfg.hidden_size, cfg.intermediate_size))
    ids = [s.topk_ids for s in sets]
    link = link_columns(ids, el, st)
    dispatch = dispatch_columns(ids, el, st, layer_gathers(fused),
                                packed_row_bytes(cfg.hidden_size))
    deepgemm_status = None
    if deepgemm is not None:
        deepgemm_status = deepgemm_series(deepgemm, case, plans, gate_up, down, st, timed,
                                          out)
    peer_status = (_time_fp8_peers(peers, sets, gate_up, down, cfg, timed, out)
                   if peers is not None else None)

    results = []
    for layer in layers:
        def med(variant, phases=None, layer=layer):
            return median(out[variant].layer(layer, phases)) if variant in out else None

        r = {
            **case_columns(case, layer),
            **{k: None for k in ("baseline_us", "chunked_us", "torch_gmm_us",
                                 "torch_gmm_tflops", "cutlass_gmm_us", "cutlass_gmm_tflops",
                                 "nccl_a2a_us")},
            "omitted": FP8_OMITTED,
            "fused_us": med("fused"), "sequential_us": med("sequential"),
            "compute_only_us": med("compute_only"), "comm_only_us": med("comm_only"),
            "skipped_modes": skipped or None,
            "comet_gmm_tflops": gemm_rate(out, gmm_mode, layer,
                                          _RATE_PHASES["comet_kernels"], flops, st),
            "comet_gmm_us": (med(gmm_mode, LAYER_PHASES["comet_kernels"])
                             if layer != "moe" else None),
            "comet_gmm_mode": gmm_mode,
            **fixed_columns({n: med(f"fixed{n}") for n in st.fixed_splits}),
            **call_columns(out, layer, fused, n_comm, decode_tile, tile_overrides,
                           flops, st),
            **link,
            **dispatch,
            "max_rel_err": checks,
            **run_columns(st, hbm_floor, layer),
        }
        if peer_status is not None:
            r.update({**{f"peer_{name}_us": med(f"peer_{name}") for name in peers.names},
                      "peers": peer_status})
        if deepgemm_status is not None:
            r.update({"deepgemm_gmm_us": med("deepgemm"),
                      "deepgemm_gmm_tflops": gemm_rate(out, "deepgemm", layer,
                                                       _RATE_PHASES["gmm"], flops, st),
                      "deepgemm": deepgemm_status})
        if layer == "moe":
            r.update(phase_columns(out, {}))
        results.append(rec.derive(r))
    return results


def deepgemm_series(dg: DeepGemm | str, case: Case, plans, gate_up: Fp8Weight,
                    down: Fp8Weight, st: Settings, timed: Callable, out: dict[str, Series]
                    ) -> dict:
    """DeepGEMM's grouped FP8 GEMMs on the rows per expert of ``plans`` (layer0: ``[R, H]``
    times ``gate_up``, N = 2F; layer1: ``[R, F]`` times ``down``, N = H; random rows
    quantized by comet's quantizer, as the bf16 records' reference GEMMs take random rows),
    timed as those are (phases ``gemm0`` / ``gemm1``, whole calls apart) into
    ``out["deepgemm"]``.

    Each layout of :func:`comet.bench.deepgemm.layouts_for` is first checked on the first
    input set against the fp32 emulation on every rank (``calc_diff`` at most
    :data:`comet.bench.deepgemm.MAX_DIFF`); those right everywhere are timed and the
    fastest (median of the two GEMMs' sum) kept. Returns the record's ``deepgemm`` field:
    ``status`` (``timed``, ``wrong``, ``failed``, ``unavailable``), ``reason``, ``backend``,
    ``layout`` (the one kept), ``calc_diff`` and ``layout_us`` per layout, and where one
    layout was timed but another not, ``failed_layouts`` (why, per layout). Collective."""
    if isinstance(dg, str):
        return {"status": "unavailable", "reason": dg}
    try:
        weights = (weight_operand(gate_up), weight_operand(down))
    except PeerUnavailable as err:
        return {"status": "unavailable", "reason": str(err)}
    dev, cfg = st.device, case.cfg
    rows = [tuple(quantize_rows_triton(torch.randn(p.rows, width, device=dev,
                                                   dtype=torch.bfloat16))
                  for width in (cfg.hidden_size, cfg.intermediate_size)) for p in plans]
    status: dict = {"backend": dg.backend, "calc_diff": {}, "layout_us": {}}
    failures: dict[str, str] = {}
    for layout in layouts_for(case.tokens):
        try:
            diff = {name: check_layout(dg, layout, a, w, plans[0].expert_rows)
                    for name, a, w in (("layer0", rows[0][0], gate_up),
                                       ("layer1", rows[0][1], down))}
            failure = None
        except Exception as exc:  # a peer's failure is reported; comet's columns still run
            diff, failure = None, f"{type(exc).__name__}: {exc}"
        verdicts = _gather([(diff, failure)], st.group)
        failure = next((f for _, f in verdicts if f is not None), None)
        if failure is not None:
            failures[layout] = failure
            continue
        worst = {name: max(d[name] for d, _ in verdicts) for name in diff}
        status["calc_diff"][layout] = worst
        if not all(v <= MAX_DIFF for v in worst.values()):   # NaN is not <=: wrong too
            failures[layout] = f"calc_diff {worst} over {MAX_DIFF:g}"
            continue
        # Per input set, each GEMM's rows in the layout and its output (laid out untimed).
        operands = [tuple(dg.operand(layout, a, p.expert_rows, w.n)
                          for a, w in zip(pair, (gate_up, down)))
                    for p, pair in zip(plans, rows)]
        series = reference_series(timed, gemm_fn(
            plans, operands, *weights, lambda a, w, _rows, _offs: dg.launch(a[0], w, a[1])),
            LAYER_PHASES["gmm"], dev)
        us = status["layout_us"][layout] = median(series.layer("moe", _RATE_PHASES["gmm"]))
        if "deepgemm" not in out or us < status["layout_us"][status["layout"]]:
            out["deepgemm"], status["layout"] = series, layout
        del operands
    if "deepgemm" in out:
        status["status"] = "timed"
        if failures:
            status["failed_layouts"] = failures
    else:
        wrong = any(layout in status["calc_diff"] for layout in failures)
        status.update(status="wrong" if wrong else "failed", reason="; ".join(
            f"{layout}: {why}" for layout, why in failures.items()))
    return status


def emulate_fp8(s: InputSet, gate_up: Fp8Weight, down: Fp8Weight, cfg: MoEConfig
                ) -> torch.Tensor:
    """The FP8 layer's output on ``s`` emulated in fp32 as
    :func:`comet.reference.expert_mlp_fp8` does, its rows quantized by the kernels'
    recipe (:func:`comet.kernels.fp8_gemm.quantize_rows_triton`: torch's bits on a GPU,
    the interpreter's casts under it, whose known e4m3 errors would otherwise read as a
    wrong layer), one expert dequantized at a time (a preset's fp32 experts would not
    fit)."""
    f = down.k
    xq = quantize_rows_triton(s.x).dequantize()
    out = torch.zeros(s.x.shape, dtype=torch.float32, device=s.x.device)
    for e in range(gate_up.experts):
        tok, slot = (s.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            w13, w2 = (Fp8Weight(w.weight[e:e + 1], w.scale_inv[e:e + 1], w.blocks,
                                 w.parts).dequantize()[0] for w in (gate_up, down))
            gu = xq[tok] @ w13.T
            h = quantize_rows_triton(gated(gu[:, :f], gu[:, f:], cfg.activation))
            out.index_add_(0, tok, (h.dequantize() @ w2.T)
                           * s.topk_weights[tok, slot].float().unsqueeze(1))
    return out


def hbm_floors(plans, order: list[int], hidden: int, ffn: int, element_size: int,
               st: Settings, per_expert: dict[str, int] | None = None,
               per_row: dict[str, int] | None = None) -> dict[str, list[float]] | None:
    """Per layer, the HBM floor of each timed iteration (the slowest rank's; ``order``:
    the input set of each, :func:`comet.bench.timing.timed_sets`) for ``plans``' rows per
    expert of ``ffn``-wide experts (``per_expert`` / ``per_row``: an FP8 layer's bytes,
    :func:`comet.bench.floors.hbm_floor_us`); None when no HBM rate was measured.
    Collective."""
    if not st.hbm_gbps:
        return None
    per_expert = per_expert or expert_bytes(hidden, ffn, element_size)
    by_set = [hbm_floor_us(p.expert_rows, per_expert, st.hbm_gbps, per_row) for p in plans]
    return reduce_over_ranks({name: [by_set[s][name] for s in order] for name in rec.LAYERS},
                             st.group)


def layer_gathers(fused: Fused | None) -> bool:
    """Whether comet's layer sent a token's row once per rank (``Variant.layer0_gather``)."""
    return bool(fused is not None and fused.layer.tile.variant.layer0_gather)


def gather_column(fused: Fused | None) -> dict:
    """``layer0_gather``: whether comet's layer sent a token's row once per rank (its
    link rows are then ``link_token_rows``, else ``link_rows``); None without one."""
    return {"layer0_gather": None if fused is None else layer_gathers(fused)}


def link_columns(ids: Sequence[torch.Tensor], local_experts: int, st: Settings) -> dict:
    """``link_rows`` / ``link_token_rows`` of a case (:func:`comet.bench.floors.link_rows`
    of each input set's routing as the kernels see it): the slowest rank's, median over
    the sets. Collective."""
    counts = [link_rows(i, local_experts, st.rank, st.world) for i in ids]
    link = reduce_over_ranks({"pairs": [float(p) for p, _ in counts],
                              "tokens": [float(t) for _, t in counts]}, st.group)
    return {"link_rows": median(link["pairs"]), "link_token_rows": median(link["tokens"])}


def dispatch_columns(ids: Sequence[torch.Tensor], local_experts: int, st: Settings,
                     gathered: bool, row_bytes: int) -> dict:
    """``dispatch_rows`` (:func:`comet.bench.floors.dispatch_rows` of each input set, the
    slowest rank's, median over the sets), ``dispatch_row_bytes`` (a row as it crosses)
    and ``dispatch_bytes``, their product. Collective."""
    rows = reduce_over_ranks({"rows": [float(dispatch_rows(i, local_experts, st.world,
                                                           gathered)) for i in ids]},
                             st.group)
    n = median(rows["rows"])
    return {"dispatch_rows": n, "dispatch_row_bytes": row_bytes,
            "dispatch_bytes": None if n is None else n * row_bytes}


def run_columns(st: Settings, hbm_floor: dict | None, layer: str) -> dict:
    """The fields every record of a run shares: the measured HBM rate, this layer's HBM
    floor, the iteration counts."""
    return {"hbm_read_gbps": st.hbm_gbps,
            "hbm_floor_us": median(hbm_floor[layer]) if hbm_floor else None,
            "iters": st.iters, "warmup": st.warmup, "input_sets": st.n_sets}


def case_columns(case: Case, layer: str) -> dict:
    """The fields naming a record's case: config and its shape, tokens, routing, layer."""
    cfg = case.cfg
    return {"config": case.config, "experts": cfg.num_experts, "topk": cfg.top_k,
            "hidden": cfg.hidden_size, "ffn": cfg.intermediate_size,
            "dtype": (rec.FP8 if cfg.fp8 is not None
                      else str(cfg.dtype).removeprefix("torch.")),
            "tokens_per_rank": case.tokens, "routing": case.routing, "layer": layer}


def fused_series(timed: Callable, fused: Fused, sets: Sequence[InputSet], comm_blocks,
                 mode: str) -> Series:
    """comet's layer in ``mode``, timed by ``timed`` (a :func:`comet.bench.timing.time_calls`
    reduced over ranks): phases from calls with events (eager launches), the whole-call
    time and the host's time per call from calls without, which replay comet's CUDA graph
    as a user's call would."""
    def call(i, t):
        return fused.layer(sets[i].x, sets[i].topk_ids, sets[i].topk_weights,
                           comm_blocks=comm_blocks, mode=mode, timer=t)
    phases = timed(call, fused.make_timer)
    whole = timed(call)
    phases["total"], phases["host"] = whole["total"], whole["host"]
    return Series(phases, LAYER_PHASES["comet"])


def call_columns(out: dict[str, Series], layer: str, fused: Fused, n_comm, decode_tile,
                 tile_overrides, flops: dict, st: Settings) -> dict:
    """A record's columns of comet's own calls: the host's time per call, the block split
    and tile each rank chose, the gather, and the GEMM work per rank."""
    return {
        "fused_host_us": fused_host_us(out, layer),
        "n_comm": n_comm[0] if n_comm else None,
        "n_comm_per_rank": n_comm,
        "decode_tile": decode_tile,
        "tile_overrides": tile_overrides,
        **gather_column(fused),
        "gemm_tflop_per_rank": median(flops[layer]) / st.world / 1e12,
    }


def fused_host_us(out: dict[str, Series], layer: str) -> float | None:
    """A whole-layer record's host time to issue one fused call (staging and graph
    replay; slowest rank's iteration, median): where it exceeds ``fused_us`` the GPU
    waited for the host."""
    return median(out["fused"].series.get("host")) if layer == "moe" and "fused" in out else None


def phase_columns(out: dict[str, Series], breakdown: dict[str, tuple[str, ...]]) -> dict:
    """A whole-layer record's breakdowns: the baseline's phases summed into ``breakdown``'s
    columns (those it has), and where comet's time goes, per mode and phase (plan,
    layer0, layer1, combine)."""
    base = out["baseline"].series if "baseline" in out else {}
    return {
        "baseline_phases_us": {
            name: median([sum(v) for v in zip(*[base[p] for p in parts if p in base])])
            for name, parts in breakdown.items() if any(p in base for p in parts)} or None,
        "comet_phases_us": {
            mode: {p: median(v) for p, v in out[mode].series.items()
                   if p not in ("total", "host")}
            for mode in FUSED_MODES if mode in out} or None,
    }


def fixed_splits(st: Settings, fused: Fused) -> list[int]:
    """The fixed splits of ``st`` this layer can run (fewer comm blocks than programs)."""
    programs = fused.layer.programs
    return [n for n in st.fixed_splits if 0 <= n < programs]


def fixed_columns(times: dict[int, float | None]) -> dict:
    """``fixed_split_us`` (by split) and the best of them, for one record."""
    timed = {n: t for n, t in times.items() if t is not None}
    best = min(timed, key=timed.get, default=None)
    return {"fixed_split_us": {str(n): t for n, t in timed.items()} or None,
            "best_fixed_split": best,
            "best_fixed_us": timed[best] if best is not None else None}


def _phase(timer, name: str):
    """``timer.phase(name)``, or nothing in an iteration timed without phases."""
    return contextlib.nullcontext() if timer is None else timer.phase(name)


def gemm_fn(plans, rows, w13, w2, mm):
    """The layer's two grouped GEMMs alone, on rows laid out as the layer's (``rows[i]``:
    random ``[R, H]`` and ``[R, F]`` inputs of set ``i``)."""
    def fn(i, t):
        p, (a0, a1) = plans[i], rows[i]
        with _phase(t, "gemm0"):
            mm(a0, w13, p.expert_rows, p.offs)
        with _phase(t, "gemm1"):
            mm(a1, w2, p.expert_rows, p.offs)
    return fn


def _a2a_fn(sets: list[InputSet], plans, group):
    """NCCL all_to_all_single of the rows the layer moves, split sizes known up front."""
    bufs = []
    for s, p in zip(sets, plans):
        send = torch.empty(len(p.order), s.x.shape[1], dtype=s.x.dtype, device=s.x.device)
        bufs.append((send, send.new_empty(p.rows, send.shape[1]), torch.empty_like(send)))

    def fn(i, t):
        p, (send, recv, back) = plans[i], bufs[i]
        with _phase(t, "dispatch"):
            dist.all_to_all_single(recv, send, p.recv_splits, p.send_splits, group=group)
        with _phase(t, "combine"):
            dist.all_to_all_single(back, recv, p.send_splits, p.recv_splits, group=group)
    return fn


def _gather(value: list, group) -> list:
    """Concatenation of every rank's ``value`` list, in rank order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    return [v for part in parts for v in part]


def _checks(s: InputSet, ref: torch.Tensor, w13, w2, st: Settings, fused: Fused | None
            ) -> dict[str, float]:
    """Max relative error (over ranks) of each variant's output against the baseline's
    (``ref``, on ``s``), and of the baseline against the reference spec when there is a
    single rank."""
    errs = {"chunked": rel_err(chunked_ep_moe_forward(
        s.x, s.topk_ids, s.topk_weights, w13, w2, st.group, chunks=st.chunk_options[0]), ref)}
    if fused is not None:
        errs["fused"] = rel_err(fused.layer(s.x, s.topk_ids, s.topk_weights,
                                             comm_blocks=st.comm_blocks, mode="fused"), ref)
    if st.world == 1:
        spec = reference.moe_forward(s.x, s.topk_ids, s.topk_weights, w13, w2,
                                     round_to=s.x.dtype)
        errs["baseline_vs_reference"] = rel_err(ref, spec)
    reduced = reduce_over_ranks({k: [v] for k, v in errs.items()}, st.group)
    return {k: v[0] for k, v in reduced.items()}


def _time_peers(peers: Peers, sets: list[InputSet], ref: torch.Tensor, timed, out: dict,
                group) -> dict[str, dict]:
    """Check each built peer's output on ``sets[0]`` against the baseline's (``ref``), then
    time those that match as whole calls, into ``out["peer_<name>"]``.

    Returns each peer's status: ``timed``, ``wrong`` (max relative error over
    :data:`comet.bench.records.MAX_REL_ERR`), ``failed`` (the call raised, or gave
    non-finite values, on some rank) or ``unavailable``, with ``reason``, ``backend`` and
    ``max_rel_err`` where known. Every rank reaches the same verdicts.
    """
    status: dict[str, dict] = {name: {"status": "unavailable", "reason": why}
                               for name, why in peers.unavailable.items()}
    for p in peers.ready:
        err, failure = _check_peer(p, sets[0], ref, group)
        entry = {"backend": p.backend, "max_rel_err": err}
        if failure is not None:
            entry.update(status="failed", reason=failure)
        elif not err <= rec.MAX_REL_ERR:
            entry.update(status="wrong",
                         reason=f"max relative error {err:.3g} > {rec.MAX_REL_ERR:g}")
        else:
            entry["status"] = "timed"
            out[f"peer_{p.name}"] = Series(timed(lambda i, t, p=p: p.layer(
                sets[i].x, sets[i].topk_ids, sets[i].topk_weights)))
        status[p.name] = entry
    return status


def _time_fp8_peers(peers: Peers, sets: list[InputSet], gate_up: Fp8Weight,
                    down: Fp8Weight, cfg: MoEConfig, timed, out: dict) -> dict[str, dict]:
    """:func:`_time_peers` for whole FP8 layers (one rank): each is held to the fp32
    emulation of its own recipe (:func:`comet.bench.mega_moe.check_layer`; DeepGEMM's
    Mega MoE quantizes h otherwise than comet, so comet's emulation is no verdict on it),
    and its distance from comet's emulation is reported beside it (``rel_l2``)."""
    from comet.bench.mega_moe import MAX_REL_L2, check_layer
    status: dict[str, dict] = {name: {"status": "unavailable", "reason": why}
                               for name, why in peers.unavailable.items()}
    s = sets[0]
    for p in peers.ready:
        entry: dict = {"backend": p.backend}
        try:
            c = check_layer(p.layer, s.x, s.topk_ids, s.topk_weights, gate_up, down,
                            cfg.activation)
        except Exception as exc:  # a peer's failure is reported; comet's columns still run
            entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            status[p.name] = entry
            continue
        entry.update(rel_l2=c.rel_l2, rel_l2_recipe=c.rel_l2_recipe)
        if c.ok:
            entry["status"] = "timed"
            out[f"peer_{p.name}"] = Series(timed(lambda i, t, p=p: p.layer(
                sets[i].x, sets[i].topk_ids, sets[i].topk_weights)))
        else:
            entry.update(status="wrong", reason=f"rel L2 {c.rel_l2_recipe:.3g} from its own "
                         f"recipe's emulation > {MAX_REL_L2:g}")
        status[p.name] = entry
    return status


def _check_peer(peer: PeerLayer, s: InputSet, ref: torch.Tensor, group
                ) -> tuple[float | None, str | None]:
    """``(max relative error over ranks, None)``, or ``(None, why)`` where the call raised
    or gave non-finite values on some rank."""
    try:
        err, failure = rel_err(peer.layer(s.x, s.topk_ids, s.topk_weights), ref), None
        if not math.isfinite(err):
            err, failure = None, "non-finite output"
    except Exception as exc:  # a peer's failure is reported; comet's columns still run
        err, failure = None, f"{type(exc).__name__}: {exc}"
    verdicts = _gather([(err, failure)], group)
    failures = [f for _, f in verdicts if f is not None]
    if failures:
        return None, failures[0]
    return max(e for e, _ in verdicts), None
