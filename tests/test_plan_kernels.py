"""The plan kernels (comet.kernels.plan) against the torch specification
(comet.routing, comet.scheduler.plan): same send lists, return entries and tile tables."""

import pytest
import torch
import triton

from comet.config import MoEConfig, TileConfig
from comet.constants import interpreting
from comet.kernels.plan import Routing
from comet.routing import build_recv_layout, build_send_plan, local_counts, recv_capacity
from comet.runtime.forward import plan_phases
from comet.runtime.workspace import allocate_virtual
from comet.scheduler.plan import build_tile_table
from routings import KINDS, make_ids, make_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs TRITON_INTERPRET=1 on a CPU")


def _run_plan(wss, cfg, tile, ids, wts, num_tokens, small=False):
    phases = [plan_phases(ws, Routing.of(i, w, n), tile, small=small)
              for ws, i, w, n in zip(wss, ids, wts, num_tokens)]
    for open_call, _ in phases:
        open_call()
    for _, plan in phases:
        plan()


def _plan_both(world, el, k, max_tokens, kind, seed, block_m=4, staged=False, small=False):
    """Plan one call on the kernels; with ``staged``, the way a layer stages it: after a
    full-size call (stale tables), the routing padded to ``max_tokens`` rows with real
    expert ids and NaN weights, and the token count on the device -- the padding must
    never be read. ``small``: the two-launch plan (open_kernel, the layout placing)."""
    cfg = MoEConfig(num_experts=world * el, top_k=k, hidden_size=16, intermediate_size=16,
                    dtype=torch.float16, max_tokens=max_tokens)
    g = torch.Generator().manual_seed(seed)
    tokens = make_tokens(kind, world, max_tokens, g)
    ids = [i.to(DEVICE) for i in make_ids(kind, tokens, world * el, k, g)]
    if kind == "random" and ids[0].numel():
        ids[0][0, -1] = -1                                # "no expert" slots too
    wts = [torch.rand(i.shape, generator=g).to(DEVICE) for i in ids]
    tile = TileConfig.small().with_fields(block_m=block_m)
    wss = allocate_virtual(cfg, world, DEVICE, tile)
    if not staged:
        _run_plan(wss, cfg, tile, ids, wts, [None] * world, small)
    else:
        def padded(t, fill):
            pad = fill((max_tokens - t.shape[0], k)).to(DEVICE, t.dtype)
            return torch.cat([t, pad])
        full = [torch.randint(0, world * el, (max_tokens, k), generator=g).to(DEVICE)
                for _ in range(world)]
        ones = [torch.ones(max_tokens, k, device=DEVICE) for _ in range(world)]
        _run_plan(wss, cfg, tile, full, ones, [None] * world, small)
        junk_ids = lambda shape: torch.randint(0, world * el, shape, generator=g)
        nan = lambda shape: torch.full(shape, float("nan"))
        _run_plan(wss, cfg, tile, [padded(i, junk_ids) for i in ids],
                  [padded(w, nan) for w in wts],
                  [torch.tensor([i.shape[0]], device=DEVICE) for i in ids], small)
        assert not any(int(ws.input_word[0]) for ws in wss), "padding was read"
    counts = torch.stack([local_counts(i, world, el) for i in ids])
    layout = build_recv_layout(counts)
    return cfg, ids, wts, wss, counts, layout, tile


@pytest.mark.parametrize("world, el, k", [(1, 4, 2), (2, 2, 2), (4, 2, 3), (4, 4, 4),
                                          (8, 1, 2)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("staged, small", [(False, False), (True, False), (True, True)],
                         ids=["exact", "staged", "staged-small"])
def test_plan_kernels_match_the_spec(world, el, k, kind, staged, small):
    """The plan of seven launches, and the two-launch plan of small calls (open_kernel,
    the layout kernel placing) on staged rows after a full-size call."""
    _check_against_spec(world, el, k, 9, kind, staged, small)


@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize("staged", [False, True], ids=["exact", "staged"])
def test_the_small_plan_matches_the_spec_over_several_blocks(kind, staged):
    """The two-launch plan counts a call's token blocks a step at a time and places them
    a block per layout program (right for any size; the host keeps it to a few): 40
    tokens at top-4 are 3 blocks of 16 (one step), 2 at top-3."""
    from comet.kernels.plan import plan_block_tokens
    assert 40 > 2 * plan_block_tokens(4)
    for world, el, k in ((4, 4, 4), (2, 3, 3)):
        _check_against_spec(world, el, k, 40, kind, staged, small=True)


@pytest.mark.parametrize("staged", [False, True], ids=["exact", "staged"])
def test_the_small_plan_counts_its_blocks_in_steps(staged):
    """The opening counts several token blocks per step, fewer the more experts there
    are: at 128 experts a step is 4 blocks, so 150 tokens at top-3 (10 blocks of 16) take
    two whole steps and a partial one, each carrying the counts before it."""
    from comet.kernels.plan import open_step_blocks, plan_block_tokens
    step = open_step_blocks(128)
    blocks = -(-150 // plan_block_tokens(3))
    assert step == 4 and 2 * step < blocks < 3 * step
    _check_against_spec(2, 64, 3, 150, "random", staged, small=True)


def _check_against_spec(world, el, k, mx, kind, staged, small):
    cfg, ids, wts, wss, counts, layout, tile = _plan_both(world, el, k, mx, kind,
                                                          seed=world * 10 + el + len(kind),
                                                          staged=staged, small=small)
    for r in range(world):
        p = wss[r].plan
        parity = int(wss[r].epoch) % 2                      # epoch 1: the second buffer
        got = wss[r].local.counts[parity].view(world, world, el + 1).cpu()
        assert torch.equal(got, counts.cpu().int())
        spec = build_send_plan(ids[r], wts[r], counts, layout, r, mx)
        assert torch.equal(p.send.off.cpu(), spec.send_off.cpu())
        n = int(spec.send_off[-1])
        assert torch.equal(p.send.pair[:n].cpu(), spec.send_pair[:n].cpu())
        assert torch.equal(p.send.row[:n].cpu(), spec.send_row[:n].cpu())
        assert torch.equal(p.send.weight[:n].cpu(), spec.send_weight[:n].cpu())
        assert torch.equal(p.send.first[:n].cpu(), spec.send_first[:n].cpu())
        assert torch.equal(p.entry_count.cpu(), spec.entry_count.cpu())
        for d in range(world):
            q = int(spec.entry_count[d])
            assert torch.equal(p.entries.token[d, :q].cpu(), spec.entry_token[d, :q].cpu())
            assert torch.equal(p.entries.rows[d, :q].cpu(), spec.entry_rows[d, :q].cpu())
            assert torch.equal(p.entries.weight[d, :q].cpu(), spec.entry_weight[d, :q].cpu())
        m = ids[r].shape[0]
        assert torch.equal(p.dest_mask[:m].cpu(), spec.dest_mask[:m].cpu())
        assert torch.equal(p.pair_live[:m].cpu(), spec.pair_live[:m].cpu())
        tiles = build_tile_table(layout, r, recv_capacity(world, mx, k), tile.gemm.block_m,
                                 tile.gemm.local_head_tiles)
        nt = int(tiles.num_tiles)
        assert int(p.tiles.num) == nt
        for name, ref in (("expert", tiles.expert), ("row_start", tiles.row_start),
                          ("row_end", tiles.row_end), ("wait", tiles.wait_mask),
                          ("stage", tiles.stage)):
            assert torch.equal(getattr(p.tiles, name)[:nt].cpu(), ref[:nt].cpu()), name
        assert torch.equal(p.segments.start.cpu(), layout.seg_off[r].cpu())
        assert torch.equal(p.segments.rows.cpu(), layout.seg_rows[r].cpu())
        assert torch.equal(p.recv_entries.cpu(), layout.entries[r].cpu())
        rows_from = counts[:, r, :-1].sum(1).tolist()       # chunks of rows, then entries
        assert p.chunks.tolist() == [
            -(-rows_from[s] // tile.comm.comm_rows)
            + -(-int(layout.entries[r][s]) // tile.comm.dispatch_entries) for s in range(world)]


@pytest.mark.parametrize("tokens, has_count", [(23 * 3, False), (23 * 3 - 2, True), (5, True)])
def test_scan_carries_across_steps_and_programs(tokens, has_count):
    """The block-count scan at small constexpr steps, so one call takes several row steps
    per program and several programs (the launcher's 256 x 16 needs > 4096 token blocks
    for that): rows past the call's blocks stay as they were, the totals land last."""
    from comet.kernels.exchange import Exchange
    from comet.kernels.plan import scan_kernel
    blocks, cols, block_t = 30, 10, 3
    g = torch.Generator().manual_seed(tokens)
    counts = torch.randint(0, 5, (blocks + 1, cols), generator=g, dtype=torch.int32)
    counts[0] = 0
    bc = counts.clone().to(DEVICE)
    routing = torch.zeros(tokens if not has_count else tokens + 7, 2, device=DEVICE)
    n = torch.tensor([tokens], device=DEVICE)
    scan_kernel[(triton.cdiv(cols, 4),)](bc, blocks, Routing.of(routing, routing,
                                                                n if has_count else None),
                                         Exchange(None, None), None, None, COLS=cols,
                                         BLOCK_T=block_t, SCAN_ROWS=4, SCAN_COLS=4,
                                         num_warps=1)
    used = -(-tokens // block_t)
    want = counts.clone()
    want[1:used + 1] = torch.cumsum(counts[1:used + 1], 0)
    want[blocks] = counts[1:used + 1].sum(0)
    assert torch.equal(bc.cpu(), want)


def test_the_scan_pushes_the_counts_after_every_program_has_summed():
    """The scan's last program pushes a forward call's counts (the exchange in the plan):
    with several token blocks and two scan programs (E + W = 20 columns), a push by any
    earlier program would send the second program's columns (tokens per rank) unsummed."""
    from comet.kernels.plan import SCAN_COLS, plan_block_tokens
    world, el, k, mx = 4, 4, 4, 40
    assert world * el + world > SCAN_COLS and mx > plan_block_tokens(k)
    _, ids, _, wss, counts, _, _ = _plan_both(world, el, k, mx, "random", seed=9)
    assert sum(i.shape[0] > plan_block_tokens(k) for i in ids) >= 2   # several blocks
    for r in range(world):
        got = wss[r].local.counts[int(wss[r].epoch) % 2].view(world, world, el + 1).cpu()
        assert torch.equal(got, counts.cpu().int())
        assert int(wss[r].count.scanned) == 2       # both programs arrived; the last pushed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("el, rows", [(4, 8), (6, 3), (2, 5)])
def test_paired_tiles_cover_a_one_rank_plan_in_longer_tiles(kind, el, rows):
    """paired_tiles over a one-rank plan's segments: the table m_tiles builds from each
    expert's rows at ``rows`` rows a tile (experts with no rows have no tile), whatever
    the table held before."""
    from comet.kernels.fp8_gemm import MTiles, m_tiles
    from comet.kernels.plan import paired_tiles
    cfg, ids, wts, wss, counts, layout, tile = _plan_both(1, el, min(3, el), 40, kind,
                                                          seed=el + rows)
    plan = wss[0].plan
    cap = plan.tiles.expert.shape[0]
    out = MTiles(*(torch.full((cap, ), 77, dtype=torch.int32, device=DEVICE)
                   for _ in range(3)), torch.zeros(1, dtype=torch.int32, device=DEVICE))
    paired_tiles(plan.segments, out, wss[0].shape, rows)
    want = m_tiles(counts[0, 0, :el].tolist(), rows)    # [source, destination, expert]
    n = int(out.num)
    assert n == int(want.num) <= cap
    for got, exp in zip(out[:3], want[:3]):
        assert got[:n].cpu().tolist() == exp.tolist()
