"""simulate() runs the fused schedules of W virtual ranks and must equal the reference."""

import pytest
import torch

from comet import reference
from comet.scheduler import plan as plan_mod
from comet.scheduler.simulate import ScheduleError, SimConfig, simulate
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


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_simulate_matches_reference(world, kind):
    xs, ids, wts, w13, w2, mx = _case(world, kind, seed=world * 31 + len(kind))
    expect = reference.ep_forward(xs, ids, wts, w13, w2)
    for seed in range(2):
        got = simulate(xs, ids, wts, w13, w2, mx, SimConfig(seed=seed))
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
