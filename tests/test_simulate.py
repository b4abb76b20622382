"""simulate() runs the fused schedules of W virtual ranks and must equal the reference;
simulate_calls() runs consecutive calls on drifting ranks and must never let one call read
another call's data."""

import pytest
import torch

from comet import reference
from comet.scheduler import plan as plan_mod
from comet.scheduler.simulate import ScheduleError, SimConfig, simulate, simulate_calls
from routings import KINDS, make_ids, make_tokens


def _case(world, kind, seed, el=2, top_k=2, hidden=16, ffn=16, max_tokens=9):
    g = torch.Generator().manual_seed(seed)
    tokens = make_tokens(kind, world, max_tokens, g)
    if world > 1 and kind == "random":
        tokens[0] = 1
    ids = make_ids(kind, tokens, world * el, top_k, g)
    xs = [torch.randn(i.shape[0], hidden, generator=g) for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    w13 = [torch.randn(el, hidden, 2 * ffn, generator=g) * 0.3 for _ in range(world)]
    w2 = [torch.randn(el, ffn, hidden, generator=g) * 0.3 for _ in range(world)]
    return xs, ids, wts, w13, w2, max_tokens


@pytest.mark.parametrize("scatter", [True, False], ids=["scatter", "reduce"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_simulate_matches_reference(world, kind, scatter):
    xs, ids, wts, w13, w2, mx = _case(world, kind, seed=world * 31 + len(kind))
    expect = reference.ep_forward(xs, ids, wts, w13, w2)
    for seed in range(2):
        got = simulate(xs, ids, wts, w13, w2, mx, SimConfig(seed=seed, layer1_scatter=scatter))
        for g, e in zip(got, expect):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_simulate_other_tile_shapes():
    xs, ids, wts, w13, w2, mx = _case(4, "random", seed=5, hidden=24, ffn=40)
    cfg = SimConfig(block_m=3, block_n0=16, block_n1=5, blocks_per_split=3, comm_rows=1,
                    comm_entries=5, comm_programs=3, compute_programs=1, seed=7)
    got = simulate(xs, ids, wts, w13, w2, mx, cfg)
    for g, e in zip(got, reference.ep_forward(xs, ids, wts, w13, w2)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_simulate_catches_a_wait_set_that_is_too_small(monkeypatch):
    real = plan_mod.build_tile_table

    def local_only(*args, **kwargs):
        table = real(*args, **kwargs)
        table.wait_mask[:] = 0          # tiles no longer wait for remote rows
        return table

    monkeypatch.setattr("comet.scheduler.simulate.build_tile_table", local_only)
    xs, ids, wts, w13, w2, mx = _case(4, "random", seed=11)
    with pytest.raises(ScheduleError, match="before its rows arrived"):
        for seed in range(5):
            simulate(xs, ids, wts, w13, w2, mx, SimConfig(seed=seed))


def test_simulate_detects_deadlock():
    # With no comm programs nobody pushes rows or sets flags: every tile waits forever.
    xs, ids, wts, w13, w2, mx = _case(2, "random", seed=12)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(xs, ids, wts, w13, w2, mx, SimConfig(comm_programs=0))


def test_simulate_catches_waiting_for_one_chunk_too_few(monkeypatch):
    from comet.scheduler import simulate as sim
    real = sim._chunks_needed
    monkeypatch.setattr(sim, "_chunks_needed", lambda *a: max(real(*a) - 1, 0))
    xs, ids, wts, w13, w2, mx = _case(4, "skewed", seed=13)
    with pytest.raises(ScheduleError, match="before its rows arrived"):
        for seed in range(8):
            simulate(xs, ids, wts, w13, w2, mx, SimConfig(seed=seed, comm_rows=2))


def _drift_case(world, seed, n_calls, el=2, top_k=2, hidden=16, ffn=16, max_tokens=9):
    """One layer's weights and ``n_calls`` calls, each with its own tokens and routing
    (the routing kinds in turn), as simulate_calls takes them."""
    g = torch.Generator().manual_seed(seed)
    w13 = [torch.randn(el, hidden, 2 * ffn, generator=g) * 0.3 for _ in range(world)]
    w2 = [torch.randn(el, ffn, hidden, generator=g) * 0.3 for _ in range(world)]
    calls = []
    for i in range(n_calls):
        kind = KINDS[(seed + i) % len(KINDS)]
        ids = make_ids(kind, make_tokens(kind, world, max_tokens, g), world * el, top_k, g)
        xs = [torch.randn(t.shape[0], hidden, generator=g) for t in ids]
        wts = [torch.rand(t.shape, generator=g) for t in ids]
        calls.append((xs, ids, wts))
    return calls, w13, w2, max_tokens


def _one_fast_rank(world, fast):
    """Rank ``fast`` runs about fifty times as many work items as any other."""
    return tuple(1.0 if r == fast else 0.02 for r in range(world))


def _assert_calls_match(result, calls, modes, w13, w2):
    for (xs, ids, wts), outs, mode in zip(calls, result.outputs, modes):
        if mode == "compute_only":
            assert all(o is None for o in outs)
            continue
        for got, expect in zip(outs, reference.ep_forward(xs, ids, wts, w13, w2)):
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scatter", [True, False], ids=["scatter", "reduce"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_drift_consecutive_fused_calls_match_reference(world, seed, scatter):
    calls, w13, w2, mx = _drift_case(world, seed, n_calls=len(KINDS))
    cfg = SimConfig(seed=seed, speeds=_one_fast_rank(world, seed % world),
                    layer1_scatter=scatter)
    result = simulate_calls(calls, w13, w2, mx, cfg)
    _assert_calls_match(result, calls, ["fused"] * len(calls), w13, w2)
    # Call N + 1 of the fast rank overlapped call N of a slow one -- and the fast rank
    # is one exchange ahead at most, never two.
    assert result.drift == 1


@pytest.mark.parametrize("world", [2, 4])
def test_drift_compute_only_and_fused_calls_mix(world):
    modes = ["compute_only", "fused", "compute_only", "compute_only", "fused", "fused"]
    calls, w13, w2, mx = _drift_case(world, 7, n_calls=len(modes))
    for seed in range(2):
        cfg = SimConfig(seed=seed, speeds=_one_fast_rank(world, seed % world))
        result = simulate_calls(calls, w13, w2, mx, cfg, modes=modes)
        _assert_calls_match(result, calls, modes, w13, w2)
        assert result.drift == 1


def test_drift_single_count_buffer_suffices_between_fused_calls():
    # A fused call ends with the combine waiting for every rank's flag1, which a rank sets
    # only after its layout read the call's counts: no peer pushes the next call's counts
    # before they were read.
    calls, w13, w2, mx = _drift_case(4, 8, n_calls=4)
    for seed in range(2):
        cfg = SimConfig(seed=seed, speeds=_one_fast_rank(4, 0), count_buffers=1)
        result = simulate_calls(calls, w13, w2, mx, cfg)
        _assert_calls_match(result, calls, ["fused"] * len(calls), w13, w2)
        assert result.drift == 1


def test_drift_single_count_buffer_fails_after_compute_only_calls():
    # compute_only calls end without the combine's wait: a fast rank pushes the counts of
    # its next call over counts a slow rank has not read yet.
    modes = ["compute_only", "compute_only", "fused", "fused"]
    calls, w13, w2, mx = _drift_case(2, 9, n_calls=len(modes))
    stale = r"layout \(counts buffer 0\).*in call 2, not call 1"
    with pytest.raises(ScheduleError, match=stale):
        for seed in range(10):
            cfg = SimConfig(seed=seed, speeds=_one_fast_rank(2, 0), count_buffers=1)
            simulate_calls(calls, w13, w2, mx, cfg, modes=modes)


@pytest.mark.parametrize("world", [2, 4])
def test_drift_flags_without_epochs_fail(world):
    # count_flags left at "done" by call N let the fast rank's call N + 1 through the
    # exchange before its peers pushed their counts.
    calls, w13, w2, mx = _drift_case(world, 10, n_calls=3)
    with pytest.raises(ScheduleError, match="not call 2's"):
        for seed in range(10):
            cfg = SimConfig(seed=seed, speeds=_one_fast_rank(world, 0), epoch_flags=False)
            simulate_calls(calls, w13, w2, mx, cfg)


def test_drift_dispatch_flags_without_epochs_fail(monkeypatch):
    # Even with the exchange intact, chunk flags left set by call N satisfy call N + 1's
    # tile waits before that call's rows landed.
    from comet.scheduler import simulate as sim
    monkeypatch.setattr(sim, "_chunk_flag", lambda cfg, epoch: 1)
    calls, w13, w2, mx = _drift_case(4, 11, n_calls=3)
    with pytest.raises(ScheduleError, match="before its rows arrived"):
        for seed in range(10):
            cfg = SimConfig(seed=seed, speeds=_one_fast_rank(4, 0))
            simulate_calls(calls, w13, w2, mx, cfg)


def test_scatter_published_by_the_first_program_to_finish_fails(monkeypatch):
    # flag1 must wait for every layer1 program's rows: set by the first program done,
    # the home's combine sums slots another program has not written yet (or wrote in
    # the previous call).
    from comet.scheduler import simulate as sim
    real = sim._finish_layer1
    monkeypatch.setattr(sim, "_finish_layer1", lambda rk, call, ranks, programs, cfg:
                        real(rk, call, ranks, call.reduce_finished + 1, cfg))
    calls, w13, w2, mx = _drift_case(4, 12, n_calls=3)
    with pytest.raises(ScheduleError, match="combine, rows of its tokens' slots"):
        for seed in range(10):
            simulate_calls(calls, w13, w2, mx, SimConfig(seed=seed))
