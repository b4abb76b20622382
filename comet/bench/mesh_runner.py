"""Times one benchmark case of a tensor- or hybrid-parallel layout (``comet bench --tp``).

The variants, each rank with its shard of the experts (:mod:`comet.mesh`):

==============  ================================================  =========================
variant         layer0                                            layer1
==============  ================================================  =========================
baseline        gather (TP all_gather) + route + permute + gemm0   gemm1 + unpermute +
                + act (+ the EP pipeline's counts and dispatch)    reduce (reduce_scatter or
                                                                   all_reduce; + EP combine)
comet modes     plan + layer0                                      layer1 + combine
torch GEMM      gemm0                                              gemm1
==============  ================================================  =========================

The baseline is :func:`comet.baseline.mesh_moe_forward` (with ``ep == 1``,
:func:`comet.baseline.tp_moe_forward`: no host sync, token counts known as under
sequence parallelism). torch's grouped GEMMs run on the rows this rank's shard experts
compute in the layout (every TP peer's tokens under ``"sequence"``), ``F / tp`` wide: the
GEMM floor of the layout. Timing, reduction over ranks and the records are those of
:mod:`comet.bench.runner`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from comet.baseline import MeshGroups, mesh_moe_forward
from comet.bench import records as rec
from comet.bench.inputs import InputSet, make_input_sets
from comet.bench.runner import (FUSED_MODES, LAYER_PHASES, Case, Fused, Series, Settings,
                                case_columns, case_timer, fixed_columns, fixed_splits,
                                fused_host_us, fused_series, gather_column, gemm_fn,
                                hbm_floors, link_columns, phase_columns, rel_err,
                                run_columns)
from comet.bench.timing import (L2Flush, PhaseClock, median, reduce_over_ranks,
                                timed_sets)
from comet.grouped import grouped_mm
from comet.mesh import Convention, MeshLayout

_BASELINE_PHASES = {
    "layer0": ("gather", "route", "counts", "dispatch", "permute", "gemm0", "act"),
    "layer1": ("gemm1", "unpermute", "combine", "reduce"),
}

#: Baseline phases summed into the breakdown columns.
BASELINE_BREAKDOWN = {
    "sync": ("counts",),
    "a2a": ("gather", "dispatch", "combine", "reduce"),
    "gemm": ("gemm0", "gemm1"),
    "act": ("act",),
    "permute": ("route", "permute", "unpermute"),
}


def layout_name(mesh: MeshLayout) -> str:
    """``"tp2"``, ``"tp2ep2"``: the records' ``layout`` of a layout with ``tp > 1``."""
    return f"tp{mesh.tp}" + (f"ep{mesh.ep}" if mesh.ep > 1 else "")


class _ShardPlan(NamedTuple):
    """The rows of this rank's shard experts in one input set, as
    :func:`comet.bench.runner.gemm_fn` reads a plan: rows per expert and their end
    offsets; and this rank's routing in the shard-slot view it was counted from."""

    expert_rows: list[int]
    offs: torch.Tensor
    shard_ids: torch.Tensor

    @property
    def rows(self) -> int:
        return sum(self.expert_rows)


def _shard_plans(sets: list[InputSet], mesh: MeshLayout, num_experts: int, rank: int,
                 convention: Convention, group) -> list[_ShardPlan]:
    """Per input set, the rows each of this rank's shard experts computes in the layout:
    the shard-slot view of every rank's routing (:meth:`MeshLayout.shard_routing`),
    counted over the world."""
    el = num_experts // mesh.ep
    plans = []
    for s in sets:
        ids, _ = mesh.shard_routing(s.topk_ids, s.topk_weights, num_experts, rank, convention)
        counts = torch.zeros(num_experts * mesh.tp + 1, dtype=torch.int64, device=ids.device)
        valid = ids[ids >= 0]
        counts.scatter_add_(0, valid, torch.ones_like(valid))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        mine = counts[rank * el:(rank + 1) * el]
        plans.append(_ShardPlan(mine.tolist(), torch.cumsum(mine, 0).to(torch.int32), ids))
    return plans


def run_mesh_case(case: Case, st: Settings, mesh: MeshLayout, convention: Convention,
                  shard: dict, groups: MeshGroups, fused: Fused | None = None,
                  layers=rec.LAYERS) -> list[dict]:
    """Measure every variant of ``case`` in a (tp, ep) layout; collective over the world.

    ``shard``: this rank's part of the experts (``w13 [El, H, 2F/tp]`` gate then up, as
    the baseline takes it, ``w2 [El, F/tp, H]``); ``fused``: comet's layer built with the
    same shard and layout, or None. Returns one record per layer (no run metadata)."""
    cfg, dev, group = case.cfg, st.device, st.group
    me = mesh.token_source(st.rank, convention)
    sets = make_input_sets(cfg, case.config, case.tokens, case.routing, st.n_sets, me,
                           st.seed, dev)
    counts = [case.tokens] * mesh.tp
    flush = L2Flush(dev)
    w13, w2 = shard["w13"], shard["w2"]

    timed = case_timer(st, flush)

    def baseline(s: InputSet, timer=None):
        return mesh_moe_forward(s.x, s.topk_ids, s.topk_weights, shard, groups, convention,
                                cfg.activation, timer=timer, token_counts=counts)

    def clock():
        return PhaseClock(dev)

    out: dict[str, Series] = {}
    phases = timed(lambda i, t: baseline(sets[i], t), clock)
    phases["total"] = timed(lambda i, t: baseline(sets[i]))["total"]
    out["baseline"] = Series(phases, _BASELINE_PHASES)
    if fused is not None:
        for mode in FUSED_MODES:
            out[mode] = fused_series(timed, fused, sets, st.comm_blocks, mode)
        for n in fixed_splits(st, fused):
            out[f"fixed{n}"] = fused_series(timed, fused, sets, n, "fused")
    plans = _shard_plans(sets, mesh, cfg.num_experts, st.rank, convention, group)
    gmm_rows = [(torch.randn(p.rows, cfg.hidden_size, device=dev, dtype=cfg.dtype),
                 torch.randn(p.rows, w2.shape[1], device=dev, dtype=cfg.dtype))
                for p in plans]
    series = timed(gemm_fn(plans, gmm_rows, w13, w2, grouped_mm), clock)
    series["total"] = timed(gemm_fn(plans, gmm_rows, w13, w2, grouped_mm))["total"]
    out["torch_gmm"] = Series(series, LAYER_PHASES["gmm"])
    del gmm_rows

    order = timed_sets(st.n_sets, st.iters, st.warmup)
    hbm_floor = hbm_floors(plans, order, cfg.hidden_size, w2.shape[1], w13.element_size(), st)
    link = link_columns([p.shard_ids for p in plans], cfg.num_experts // mesh.ep, st)
    errs = {}
    if fused is not None:
        ref = baseline(sets[0])
        errs["fused"] = rel_err(fused.layer(sets[0].x, sets[0].topk_ids,
                                             sets[0].topk_weights, comm_blocks=st.comm_blocks,
                                             mode="fused"), ref)
    errs = {k: v[0] for k, v in reduce_over_ranks({k: [v] for k, v in errs.items()},
                                                    group).items()}

    results = []
    for layer in layers:
        def med(variant, layer=layer):
            return median(out[variant].layer(layer)) if variant in out else None

        r = {
            **case_columns(case, layer), "tp": mesh.tp, "ep": mesh.ep, "convention": convention,
            "baseline_us": med("baseline"), "fused_us": med("fused"),
            "sequential_us": med("sequential"), "compute_only_us": med("compute_only"),
            "comm_only_us": med("comm_only"), "torch_gmm_us": med("torch_gmm"),
            **fixed_columns({n: med(f"fixed{n}") for n in st.fixed_splits}),
            "fused_host_us": fused_host_us(out, layer),
            "shard_rows_per_rank": median([p.rows for p in plans]),
            **link,
            "n_comm": (list(fused.layer.last_comm_blocks)
                       if fused is not None and fused.layer.last_comm_blocks else None),
            **gather_column(fused),
            "max_rel_err": errs,
            **run_columns(st, hbm_floor, layer),
        }
        if layer == "moe":
            r.update(phase_columns(out, BASELINE_BREAKDOWN))
        results.append(rec.derive(r))
    return results
