"""(tp, ep) layouts (comet.mesh, issue 37) run by the expert-parallel kernels over shard
experts: every rank must return what :func:`comet.reference.mesh_forward` says.

Names: ``tensor_parallel`` for tp > 1 with ep == 1 (and the degenerate (1, 2), one shard
per expert), ``hybrid`` for tp > 1 with ep > 1, so ``pytest -k "tensor_parallel or
hybrid"`` selects the file. Three parts:

* the kernels under the interpreter (:class:`comet.runtime.virtual.VirtualEP` with
  ``mesh=``; fp16/fp32 only: the interpreter's tl.dot on bf16 is wrong), and the
  shard-routing kernel against its torch spec :meth:`MeshLayout.shard_routing`;
* the simulator (:mod:`comet.scheduler.simulate`) on the layouts, one call and drifting
  consecutive calls;
* negative tests: each protocol row the layouts add (pair_out and comb fanned out to the
  TP group, the combine's liveness translation) and the epoch protections under drift,
  taken away, must be caught.

The interpreter is slow (its plan kernels cost about a second per rank and call, whatever
the size), so the layout x convention matrix runs one layer1 strategy, dtype and routing
kind per cell, chosen so each convention meets both strategies at tp > 1.
"""

import dataclasses

import pytest
import torch

from comet import reference
from comet.config import MoEConfig, TileConfig
from comet.constants import interpreting
from comet.kernels.mesh_routing import launch_shard_routing, shard_routing
from comet.mesh import CONVENTIONS, MeshLayout
from comet.runtime.errors import CometInputError, ErrorReports
from comet.runtime.virtual import VirtualEP
from comet.scheduler import simulate as sim
from comet.scheduler.simulate import ScheduleError, SimConfig, simulate, simulate_calls
from comet.weights import GATE_UP_BLOCK
from routings import KINDS, make_ids, make_tokens

interpreter = pytest.mark.skipif(not interpreting(),
                                 reason="interpreter tests (CPU); the GPU suite runs these "
                                        "kernels compiled")

TENSOR_PARALLEL = [(2, 1), (4, 1), (1, 2)]
HYBRID = [(2, 2), (2, 4)]
STRATEGIES = {"scatter": True, "reduce": False}

E, TOP_K = 8, 2


def _ffn(mesh: MeshLayout) -> int:
    """F: shards 16 wide, the narrowest the layout allows."""
    return 16 * mesh.tp


def _inputs(mesh: MeshLayout, convention: str, kind: str, gen: torch.Generator,
            max_tokens: int, hidden: int, dtype=torch.float32, no_expert: bool = True):
    """Every rank's ``(xs, ids, weights)``, global expert ids: one draw per rank, or under
    ``"replicated"`` per TP group, copied to its ranks. ``no_expert``: some slots -1 and
    a token with none at all on the first rank (group)."""
    sources = mesh.world if convention == "sequence" else mesh.ep
    ids = make_ids(kind, make_tokens(kind, sources, max_tokens, gen), E, TOP_K, gen)
    if no_expert and ids[0].shape[0]:
        ids[0][1::2, 1] = -1
        ids[0][0] = -1
    xs = [torch.randn(i.shape[0], hidden, generator=gen).to(dtype) for i in ids]
    wts = [torch.rand(i.shape, generator=gen) for i in ids]
    if convention == "replicated":
        pick = [mesh.coords(r)[0] for r in range(mesh.world)]
        xs, ids, wts = ([a[p] for p in pick] for a in (xs, ids, wts))
    return xs, ids, wts


def _weights(mesh: MeshLayout, gen: torch.Generator, hidden: int, dtype=torch.float32):
    """The full layer's ``(w13 [E, H, 2F], w2 [E, F, H])``."""
    h, f = hidden, _ffn(mesh)
    w13 = (torch.randn(E, h, 2 * f, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(E, f, h, generator=gen) * f ** -0.5).to(dtype)
    return w13, w2


def _shards(mesh: MeshLayout, w13, w2):
    """Per rank ``[El, H, 2F/tp]`` and ``[El, F/tp, H]``."""
    shards = [mesh.shard(r, w13, w2) for r in range(mesh.world)]
    return [s["w13"] for s in shards], [s["w2"] for s in shards]


# ----------------------------------------------------------------- kernels (interpreter)
#: (layout, convention) -> (layer1 strategy, dtype, routing kind): one cell each.
MATRIX = {
    ((2, 1), "sequence"): ("scatter", torch.float16, "random"),
    ((2, 1), "replicated"): ("reduce", torch.float32, "skewed"),
    ((4, 1), "sequence"): ("reduce", torch.float16, "zero_token_rank"),
    ((4, 1), "replicated"): ("scatter", torch.float32, "one_expert"),
    ((1, 2), "sequence"): ("scatter", torch.float32, "empty_expert"),
    ((1, 2), "replicated"): ("reduce", torch.float16, "random"),
    ((2, 2), "sequence"): ("reduce", torch.float32, "skewed"),
    ((2, 2), "replicated"): ("scatter", torch.float16, "zero_token_rank"),
    ((2, 4), "sequence"): ("scatter", torch.float16, "one_expert"),
    ((2, 4), "replicated"): ("reduce", torch.float32, "empty_expert"),
}


def _virtual(mesh: MeshLayout, convention: str, strategy: str, dtype, gen, max_tokens=6,
             hidden=32):
    """``(VirtualEP, w13, w2)``: the layout's ranks and the full layer's weights, every
    part buffer (pair_out, comb) filled with rows a dead part must not pick up."""
    cfg = MoEConfig(num_experts=E, top_k=TOP_K, hidden_size=hidden, intermediate_size=_ffn(mesh),
                    dtype=dtype, max_tokens=max_tokens)
    w13, w2 = _weights(mesh, gen, hidden, dtype)
    tile = TileConfig.small().with_fields(layer1_scatter=STRATEGIES[strategy])
    ep = VirtualEP(cfg, *_shards(mesh, w13, w2), tile=tile, mesh=mesh, convention=convention)
    for ws in ep.ws:
        for t in (ws.local.pair_out, ws.local.comb):
            if t is not None:
                t.fill_(1e3)
    return ep, w13, w2


def _close(ys, expect, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    for y, e in zip(ys, expect):
        torch.testing.assert_close(y.float(), e, **tol)


def _check_matrix_cell(layout, convention):
    strategy, dtype, kind = MATRIX[(layout, convention)]
    mesh = MeshLayout(*layout)
    gen = torch.Generator().manual_seed(sum(layout) * 7 + len(kind))
    ep, w13, w2 = _virtual(mesh, convention, strategy, dtype, gen)
    assert all(ws.fanout == mesh.home_fanout(convention) for ws in ep.ws)
    xs, ids, wts = _inputs(mesh, convention, kind, gen, ep.cfg.max_tokens, w13.shape[1], dtype)
    ys = ep.forward(xs, ids, wts)
    _close(ys, reference.mesh_forward(xs, ids, wts, w13, w2, mesh, convention,
                                      round_to=dtype), dtype)


@interpreter
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", TENSOR_PARALLEL, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_tensor_parallel_kernels_match_mesh_forward(layout, convention):
    """(1, 2) is the degenerate layout: one shard per expert, fan-out 1."""
    _check_matrix_cell(layout, convention)


@interpreter
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", HYBRID, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_hybrid_kernels_match_mesh_forward(layout, convention):
    _check_matrix_cell(layout, convention)


@interpreter
@pytest.mark.parametrize("layout,convention", [((2, 1), "replicated"), ((2, 2), "sequence"),
                                               ((4, 1), "sequence")])
def test_tensor_parallel_and_hybrid_reduce_reads_only_the_ranks_own_shard_slots(layout,
                                                                                convention):
    """An entry's slot ``j * tp + t`` is shard ``t`` of choice ``j``, which only TP index
    ``t`` holds: the reduce gathers slots ``rank % tp + j * tp`` alone (``Reduce.
    first_slot``, ``SLOT_STRIDE``). Every other slot of every received entry is -1, and
    the outputs are the spec's."""
    mesh = MeshLayout(*layout)
    gen = torch.Generator().manual_seed(61)
    ep, w13, w2 = _virtual(mesh, convention, "reduce", torch.float32, gen)
    assert [ws.tp for ws in ep.ws] == [mesh.tp] * mesh.world
    xs, ids, wts = _inputs(mesh, convention, "random", gen, ep.cfg.max_tokens, w13.shape[1])
    ys = ep.forward(xs, ids, wts)
    _close(ys, reference.mesh_forward(xs, ids, wts, w13, w2, mesh, convention,
                                      round_to=torch.float32), torch.float32)
    held = 0
    for r, ws in enumerate(ep.ws):
        rows = ws.recv.rows.local
        for s in range(mesh.world):
            got = rows[s, :int(ws.arrivals.entries[s])].long()
            slot = torch.arange(got.shape[1])
            assert (got[:, slot % mesh.tp != r % mesh.tp] == -1).all()
            held += int((got[:, slot % mesh.tp == r % mesh.tp] >= 0).sum())
    assert held > 0


@interpreter
def test_tensor_parallel_replicated_reduce_fans_each_sum_out_to_four_ranks():
    """The matrix's (4, 1) replicated cell runs the scatter; the reduce's fan-out to a
    group of four (one sum, stored on every rank of the group) runs here."""
    mesh = MeshLayout(4, 1)
    gen = torch.Generator().manual_seed(44)
    ep, w13, w2 = _virtual(mesh, "replicated", "reduce", torch.float32, gen)
    assert all(ws.fanout == 4 for ws in ep.ws)
    xs, ids, wts = _inputs(mesh, "replicated", "random", gen, ep.cfg.max_tokens, w13.shape[1],
                           torch.float32)
    ys = ep.forward(xs, ids, wts)
    _close(ys, reference.mesh_forward(xs, ids, wts, w13, w2, mesh, "replicated",
                                      round_to=torch.float32), torch.float32)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", TENSOR_PARALLEL + HYBRID, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_tensor_parallel_replicated_single_group_runs_the_reduce_by_default(layout, convention):
    """Where every rank holds every expert's shard and passes the same tokens ((tp, 1)
    replicated), a fused call's layer1 is the column reduce: one summed row per token
    to each rank of the group, not ``k`` slot rows. Every other layout keeps the
    scatter; every rank of a layout builds the same choice, and a given tile wins."""
    from comet.runtime.layer import default_tile
    from comet.runtime.virtual import virtual_group
    from comet.runtime.strategies import ColumnReduce, Scatter, strategy_for
    mesh = MeshLayout(*layout)
    reduce = convention == "replicated" and mesh.ep == 1 and mesh.tp > 1
    assert default_tile(mesh, convention).variant.layer1_scatter is not reduce
    cfg = MoEConfig(num_experts=E, top_k=TOP_K, hidden_size=32, intermediate_size=_ffn(mesh),
                    dtype=torch.float32, max_tokens=4)
    w13, w2 = _weights(mesh, torch.Generator().manual_seed(3), 32)
    shards = _shards(mesh, w13, w2)
    layers = virtual_group(cfg, *shards, mesh=mesh, convention=convention,
                           use_graphs=False)
    assert {strategy_for(layer.tile, "fused") for layer in layers} == {
        ColumnReduce if reduce else Scatter}
    given = TileConfig.small().with_fields(layer1_scatter=True)
    layer = virtual_group(cfg, *shards, tile=given, mesh=mesh,
                          convention=convention, use_graphs=False)[0]
    assert strategy_for(layer.tile, "fused") is Scatter


@interpreter
@pytest.mark.parametrize("convention,bad", [("sequence", E), ("replicated", -2)])
def test_tensor_parallel_bad_expert_id_is_reported_and_the_layout_stays_usable(convention,
                                                                               bad):
    """An id outside ``[-1, E)`` (global E) must not become a shard expert: the plan
    kernels report it on the ranks whose slots hold it, as the layer's error reports
    would raise it (naming the global E), the slot adds nothing, and the next call is
    clean and correct."""
    mesh = MeshLayout(2, 1)
    gen = torch.Generator().manual_seed(41)
    ep, w13, w2 = _virtual(mesh, convention, "scatter", torch.float32, gen)
    xs, ids, wts = _inputs(mesh, convention, "random", gen, ep.cfg.max_tokens, w13.shape[1],
                           no_expert=False)
    bad_ids = [i.clone() for i in ids]
    dropped = [i.clone() for i in ids]
    holders = range(mesh.world) if convention == "replicated" else [0]
    for r in holders:
        bad_ids[r][1, 1] = bad
        dropped[r][1, 1] = -1
    ys = ep.forward(xs, bad_ids, wts)
    _close(ys, reference.mesh_forward(xs, dropped, wts, w13, w2, mesh, convention),
           torch.float32)
    for r, ws in enumerate(ep.ws):
        reports = ErrorReports(ws.local.error, r, ep.cfg.num_experts, "sync",
                               slots_per_choice=mesh.tp)
        if r in holders:
            # The caller's slot (1), not the kernels' shard slot (2 or 3).
            with pytest.raises(CometInputError, match=rf"call 1 had an expert id outside "
                                                      rf"\[-1, {E}\) at token 1, slot 1;"):
                reports.check_now()
        reports.check_now()             # reported once, then clear
    ys = ep.forward(xs, ids, wts)
    _close(ys, reference.mesh_forward(xs, ids, wts, w13, w2, mesh, convention),
           torch.float32)
    assert not any(ws.local.error.any() for ws in ep.ws)


@interpreter
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (2, 2), (2, 4)],
                         ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_tensor_parallel_and_hybrid_shard_routing_kernel_matches_its_spec(layout, convention):
    """kernels.mesh_routing against MeshLayout.shard_routing on every rank: -1 slots,
    ids past E and below -1, tokens past the call's count left alone."""
    mesh = MeshLayout(*layout)
    gen = torch.Generator().manual_seed(mesh.world)
    rows, m = 70, 67            # two programs of 64 tokens, the second partly live
    ids = torch.randint(-1, E, (rows, TOP_K), generator=gen)
    ids[3, 0], ids[5, 1], ids[66, 1], ids[68, 0] = E, -2, 1 << 40, E + 3
    wts = torch.rand(rows, TOP_K, generator=gen)
    slots = TOP_K * mesh.tp
    for r in range(mesh.world):
        out_ids = torch.full((rows, slots), -7, dtype=torch.int64)
        out_w = torch.full((rows, slots), -7.0)
        kept = mesh.coords(r)[1] if convention == "replicated" else -1
        launch_shard_routing(shard_routing(
            ids, wts, torch.tensor([m]), out_ids, out_w, num_experts=E, ep=mesh.ep,
            tp=mesh.tp, kept=kept))
        spec_ids, spec_w = mesh.shard_routing(ids[:m], wts[:m], E, r, convention)
        assert torch.equal(out_ids[:m], spec_ids), f"rank {r}"
        assert torch.equal(out_w[:m], spec_w), f"rank {r}"
        assert bool((out_ids[m:] == -7).all() and (out_w[m:] == -7.0).all())


# ----------------------------------------------------------------- simulator
SIM_HIDDEN, SIM_MAX_TOKENS = 16, 9


def _kernel_view(mesh: MeshLayout, convention: str, ids, wts):
    """The shard routing every rank's kernels take: ``(ids, weights)`` lists."""
    routed = [mesh.shard_routing(ids[r], wts[r], E, r, convention) for r in range(mesh.world)]
    return [i for i, _ in routed], [w for _, w in routed]


def _sim_config(mesh: MeshLayout, convention: str, strategy: str, **kwargs) -> SimConfig:
    return SimConfig(layer1_scatter=STRATEGIES[strategy],
                     home_fanout=mesh.home_fanout(convention), **kwargs)


def _sim_case(mesh: MeshLayout, convention: str, seed: int, kind: str = "random"):
    """One call's global inputs, the full weights and the per-rank shards."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _weights(mesh, gen, SIM_HIDDEN)
    xs, ids, wts = _inputs(mesh, convention, kind, gen, SIM_MAX_TOKENS, SIM_HIDDEN)
    return (xs, ids, wts), (w13, w2), _shards(mesh, w13, w2)


def _simulate(mesh, convention, case, cfg):
    (xs, ids, wts), _, (w13s, w2s) = case
    return simulate(xs, *_kernel_view(mesh, convention, ids, wts), w13s, w2s, SIM_MAX_TOKENS,
                    cfg)


def _expect(mesh, convention, case):
    (xs, ids, wts), (w13, w2), _ = case
    return reference.mesh_forward(xs, ids, wts, w13, w2, mesh, convention)


def _matches(got, expect) -> bool:
    return all(torch.allclose(g, e, rtol=1e-5, atol=1e-5) for g, e in zip(got, expect))


def _check_simulate(layout, convention, strategy, **variant):
    mesh = MeshLayout(*layout)
    # A replicated layout's only TP group with no tokens would leave every rank idle.
    idle = "zero_token_rank" if convention == "sequence" or mesh.ep > 1 else "skewed"
    for seed, kind in enumerate(("random", idle)):
        case = _sim_case(mesh, convention, seed=seed * 13 + mesh.world, kind=kind)
        got = _simulate(mesh, convention, case, _sim_config(mesh, convention, strategy,
                                                            seed=seed, **variant))
        for g, e in zip(got, _expect(mesh, convention, case)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", TENSOR_PARALLEL, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_tensor_parallel_simulate_matches_mesh_forward(layout, convention, strategy):
    _check_simulate(layout, convention, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", HYBRID, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_hybrid_simulate_matches_mesh_forward(layout, convention, strategy):
    _check_simulate(layout, convention, strategy)


def _drift_calls(mesh: MeshLayout, convention: str, seed: int, n_calls: int):
    """``n_calls`` calls (the routing kinds in turn) as simulate_calls takes them, each
    with its global inputs; the full weights; the shards."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _weights(mesh, gen, SIM_HIDDEN)
    calls, inputs = [], []
    for i in range(n_calls):
        kind = KINDS[(seed + i) % len(KINDS)]
        xs, ids, wts = _inputs(mesh, convention, kind, gen, SIM_MAX_TOKENS, SIM_HIDDEN)
        inputs.append((xs, ids, wts))
        calls.append((xs, *_kernel_view(mesh, convention, ids, wts)))
    return calls, inputs, (w13, w2), _shards(mesh, w13, w2)


def _one_fast_rank(world: int, fast: int) -> tuple[float, ...]:
    """Rank ``fast`` runs about fifty times as many work items as any other."""
    return tuple(1.0 if r == fast else 0.02 for r in range(world))


def _check_drift(layout, convention, strategy, seed, **variant):
    mesh = MeshLayout(*layout)
    calls, inputs, (w13, w2), shards = _drift_calls(mesh, convention, seed, len(KINDS))
    cfg = _sim_config(mesh, convention, strategy, seed=seed,
                      speeds=_one_fast_rank(mesh.world, seed % mesh.world), **variant)
    result = simulate_calls(calls, *shards, SIM_MAX_TOKENS, cfg)
    for (xs, ids, wts), outs in zip(inputs, result.outputs):
        for got, expect in zip(outs, reference.mesh_forward(xs, ids, wts, w13, w2, mesh,
                                                            convention)):
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    # Call N + 1 of the fast rank overlapped call N of a slow one (the fan-out's writes
    # into TP peers included), and no rank got two exchanges ahead.
    assert result.drift == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", [(2, 1), (4, 1)], ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_tensor_parallel_drift_consecutive_calls_match_mesh_forward(layout, convention,
                                                                    strategy):
    _check_drift(layout, convention, strategy, seed=sum(layout))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("layout", HYBRID, ids=lambda t: f"tp{t[0]}-ep{t[1]}")
def test_hybrid_drift_consecutive_calls_match_mesh_forward(layout, convention, strategy):
    _check_drift(layout, convention, strategy, seed=sum(layout))


def test_tensor_parallel_simulate_rejects_a_fanout_that_does_not_divide_the_ranks():
    mesh = MeshLayout(2, 1)
    case = _sim_case(mesh, "replicated", seed=1)
    with pytest.raises(ValueError, match="home_fanout must divide the 2 ranks"):
        _simulate(mesh, "replicated", case, SimConfig(home_fanout=4))


# ----------------------------------------------------------------- negative: the protocol rows
@pytest.mark.parametrize("strategy", STRATEGIES, ids=["pair_out", "comb"])
def test_hybrid_replicated_without_the_fanout_is_caught(strategy, monkeypatch):
    """pair_out (scatter) or comb (reduce) written on the home rank alone: a replicated
    TP peer sums slots (ranks) it was never sent (ScheduleError), or -- with no fan-out
    at all, the combine reading its own parts only -- returns its own shard's partial
    sum alone (wrong outputs)."""
    mesh = MeshLayout(2, 2)
    case = _sim_case(mesh, "replicated", seed=21)
    expect = _expect(mesh, "replicated", case)
    cfg = _sim_config(mesh, "replicated", strategy)
    assert not _matches(_simulate(mesh, "replicated", case,
                                  dataclasses.replace(cfg, home_fanout=1)), expect)
    monkeypatch.setattr(sim, "_home_group", lambda rank, cfg: range(rank, rank + 1))
    with pytest.raises(ScheduleError, match="combine, .* holds data never written"):
        _simulate(mesh, "replicated", case, cfg)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hybrid_combine_without_the_liveness_translation_fails(strategy):
    """The fan-out delivers every TP peer's parts, but a combine that reads each part's
    own liveness entry -- filled by its plan for its own shard only -- leaves the peers'
    parts out."""
    mesh = MeshLayout(2, 2)
    case = _sim_case(mesh, "replicated", seed=22)
    cfg = _sim_config(mesh, "replicated", strategy, fanout_liveness=False)
    with pytest.raises(ScheduleError, match="combine left out part .* data went missing"):
        _simulate(mesh, "replicated", case, cfg)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_hybrid_drift_flags_without_epochs_fail(convention):
    # count_flags left at "done" by call N let the fast rank's call N + 1 through the
    # exchange before its peers (TP peers included) pushed their counts.
    mesh = MeshLayout(2, 2)
    calls, _, _, shards = _drift_calls(mesh, convention, 10, n_calls=3)
    with pytest.raises(ScheduleError, match="not call 2's"):
        for seed in range(10):
            cfg = _sim_config(mesh, convention, "scatter", seed=seed, epoch_flags=False,
                              speeds=_one_fast_rank(mesh.world, 0))
            simulate_calls(calls, *shards, SIM_MAX_TOKENS, cfg)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_hybrid_drift_single_count_buffer_fails_after_compute_only_calls(convention):
    # compute_only calls end without the combine's wait: a fast rank pushes the counts of
    # its next call over counts a slow rank has not read yet.
    mesh = MeshLayout(2, 2)
    modes = ["compute_only", "compute_only", "fused", "fused"]
    calls, _, _, shards = _drift_calls(mesh, convention, 9, n_calls=len(modes))
    stale = r"layout \(counts buffer 0\).*in call 2, not call 1"
    with pytest.raises(ScheduleError, match=stale):
        for seed in range(10):
            cfg = _sim_config(mesh, convention, "scatter", seed=seed, count_buffers=1,
                              speeds=_one_fast_rank(mesh.world, 0))
            simulate_calls(calls, *shards, SIM_MAX_TOKENS, cfg, modes=modes)


# ----------------------------------------------------------------- the gathered dispatch
#: Each layout with the layer1 strategy its default tile runs (strategies.scatter_pays).
GATHERED = [((2, 1), "sequence", "scatter"), ((2, 1), "replicated", "reduce"),
            ((4, 1), "sequence", "scatter"), ((4, 1), "replicated", "reduce"),
            ((2, 2), "sequence", "scatter"), ((2, 4), "replicated", "scatter")]
_ids = [f"tp{t[0]}-ep{t[1]}-{c}" for t, c, _ in GATHERED]


@pytest.mark.parametrize("in_place", [True, False], ids=["own-in-place", "own-copied"])
@pytest.mark.parametrize("layout, convention, strategy", GATHERED, ids=_ids)
def test_tensor_parallel_and_hybrid_gathered_dispatch_simulates_and_drifts(layout, convention,
                                                                           strategy, in_place):
    """``layer0_gather``: a token's row once per destination, pairs as index entries, the
    GEMM reading ``tokens[a0_src[row]]`` -- or, ``own_in_place``, its own rank's rows from
    its input -- every read tag-checked, one call and drifting calls, against
    mesh_forward."""
    _check_simulate(layout, convention, strategy, layer0_gather=True, own_in_place=in_place)
    _check_drift(layout, convention, strategy, seed=sum(layout), layer0_gather=True,
                 own_in_place=in_place)


@pytest.mark.parametrize("name, top_k", [("deepseek-v3-like", 8), ("qwen2-moe", 4),
                                         ("mixtral", 2), ("phi3.5-moe", 2)])
def test_tensor_parallel_and_hybrid_layouts_gather_where_tokens_have_four_pairs_per_rank(
        name, top_k, monkeypatch):
    """The default tile of a preset (Hopper tiles) takes the gathered dispatch where a
    token has ``top_k / ep >= 4`` slots per rank (strategies.gather_pays), in both
    conventions, and keeps rows per pair elsewhere; a model whose F shard is no whole
    number of half interleave blocks (no one-dot items) never gathers."""
    from comet.config import preset
    from comet.runtime import layer as layer_module
    from comet.runtime.strategies import gather_pays
    monkeypatch.setattr(layer_module, "interpreting", lambda: False)
    cfg = preset(name)
    assert cfg.top_k == top_k
    for tp, ep in ((1, 2), (2, 1), (4, 1), (2, 2), (2, 4), (1, 4)):
        for convention in CONVENTIONS:
            tile = layer_module.default_tile(MeshLayout(tp, ep), convention, cfg)
            assert (top_k >= 4 * ep) is gather_pays(top_k, ep)
            # qwen2-moe's F = 1408 at tp 4: shards of 352 columns, no one-dot items
            one_dot = (cfg.intermediate_size // tp) % (GATE_UP_BLOCK // 2) == 0
            assert tile.variant.layer0_gather is (top_k >= 4 * ep and one_dot), (tp, ep)
    odd = cfg.replace(intermediate_size=2 * 96)          # F shard 96 at tp 2
    assert not layer_module.default_tile(MeshLayout(2, 1), "sequence", odd).variant.layer0_gather
    assert not layer_module.default_tile(MeshLayout(2, 1), "sequence").variant.layer0_gather


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_tensor_parallel_gathered_row_sent_with_a_later_pair_is_caught(convention):
    """The ``tokens`` row: sent with the token's *last* pair to a rank instead of its
    first, a tile of an earlier expert reads the row before its chunk landed (the tile
    waits only for the chunks up to its own last row). Rows copied to the rank itself
    too (no ``own_in_place``): replicated, a rank's rows go only there."""
    mesh = MeshLayout(2, 1)
    case = _sim_case(mesh, convention, seed=40)
    with pytest.raises(ScheduleError, match="before its token rows arrived"):
        for seed in range(10):
            _simulate(mesh, convention, case,
                      _sim_config(mesh, convention, "scatter", seed=seed, layer0_gather=True,
                                  gather_with_first=False, own_in_place=False))


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_tensor_parallel_gathered_index_without_its_chunk_wait_is_caught(convention,
                                                                         monkeypatch):
    """The ``a0_src`` entries: a tile that waits for one chunk too few reads index
    entries (and token rows) of another call."""
    mesh = MeshLayout(2, 1)
    real = sim._chunks_needed
    monkeypatch.setattr(sim, "_chunks_needed", lambda *a: max(real(*a) - 1, 0))
    case = _sim_case(mesh, convention, seed=41)
    with pytest.raises(ScheduleError, match="read an old index|before its token rows"):
        for seed in range(10):
            _simulate(mesh, convention, case,
                      _sim_config(mesh, convention, "scatter", seed=seed, layer0_gather=True))


@interpreter
@pytest.mark.parametrize("layout, convention", [((2, 1), "sequence"), ((2, 1), "replicated"),
                                                ((2, 2), "sequence")],
                         ids=["tp2-ep1-sequence", "tp2-ep1-replicated", "tp2-ep2-sequence"])
def test_tensor_parallel_and_hybrid_gathered_kernels_match_mesh_forward(layout, convention):
    """The kernels with ``layer0_gather`` (one-dot layer0 items: F shards of half an
    interleave block, the half-tail epilogue) on the default strategy of each layout,
    two calls, against mesh_forward; no row of a0 past the token rows is written."""
    mesh = MeshLayout(*layout)
    hidden, f = 32, GATE_UP_BLOCK // 2 * mesh.tp
    gen = torch.Generator().manual_seed(sum(layout) + len(convention))
    cfg = MoEConfig(num_experts=E, top_k=TOP_K, hidden_size=hidden, intermediate_size=f,
                    dtype=torch.float32, max_tokens=6)
    w13 = torch.randn(E, hidden, 2 * f, generator=gen) * hidden ** -0.5
    w2 = torch.randn(E, f, hidden, generator=gen) * f ** -0.5
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK, comm_rows=4,
                                          comm_copy_rows=2, layer0_gather=True,
                                          layer1_scatter=convention == "sequence")
    ep = VirtualEP(cfg, *_shards(mesh, w13, w2), tile=tile, mesh=mesh, convention=convention)
    for kind in ("random", "skewed"):
        xs, ids, wts = _inputs(mesh, convention, kind, gen, cfg.max_tokens, hidden)
        _close(ep.forward(xs, ids, wts),
               reference.mesh_forward(xs, ids, wts, w13, w2, mesh, convention), torch.float32)
    for ws in ep.ws:
        assert not ws.local.a0[mesh.world * cfg.max_tokens:].any()


def test_tensor_parallel_gathered_layer_without_one_dot_shards_is_refused_when_built():
    """``layer0_gather`` on F shards that are no whole number of half interleave blocks
    (96 columns at tp 2): a ValueError naming the field when the layer is built -- before
    a workspace exists -- not at its first call."""
    from comet.runtime.layer import FusedMoE
    from comet.runtime.virtual import virtual_group
    mesh = MeshLayout(2, 1)
    cfg = MoEConfig(num_experts=E, top_k=TOP_K, hidden_size=32, intermediate_size=2 * 96,
                    dtype=torch.float32, max_tokens=4)
    w13, w2 = _shards(mesh, torch.zeros(E, 32, 4 * 96), torch.zeros(E, 2 * 96, 32))
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK, layer0_gather=True)
    with pytest.raises(ValueError, match="layer0_gather needs one-dot layer0 items"):
        virtual_group(cfg, w13, w2, tile=tile, mesh=mesh, use_graphs=False)
    single = cfg.replace(intermediate_size=96)
    with pytest.raises(ValueError, match="F 96"):
        FusedMoE(single, torch.zeros(E, 32, 192), torch.zeros(E, 96, 32), tile=tile)
