"""Property tests of the routing plan and the tile schedules (hypothesis)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comet import reference
from comet.routing import build_recv_layout, build_send_plan, local_counts, recv_capacity
from comet.scheduler.plan import (build_tile_table, column_work, grouped_work, lane_of_take,
                                  lane_shape)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routings(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    el = draw(st.integers(1, 3))
    num_experts = world * el
    top_k = draw(st.integers(1, min(3, num_experts)))
    max_tokens = draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["random", "one_expert", "silent_ranks", "with_none"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = []
    for r in range(world):
        m = draw(st.sampled_from([0, 1, max_tokens, draw(st.integers(0, max_tokens))]))
        if kind == "silent_ranks" and r % 2 == 1:
            m = 0
        scores = torch.rand(m, num_experts, generator=g)
        if kind == "one_expert":
            scores[:, 0] += 2.0
        chosen = scores.topk(top_k, dim=1).indices
        if kind == "with_none" and m:
            chosen[torch.rand(m, generator=g) < 0.3, -1] = -1
        ids.append(chosen)
    return world, el, top_k, max_tokens, ids, g


def _plans(world, el, max_tokens, ids, g):
    counts = torch.stack([local_counts(i, world, el) for i in ids])
    layout = build_recv_layout(counts)
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    sends = [build_send_plan(i, w, counts, layout, r, max_tokens)
             for r, (i, w) in enumerate(zip(ids, wts))]
    return counts, layout, wts, sends


@SETTINGS
@given(routings())
def test_counts_match_routing(case):
    world, el, top_k, max_tokens, ids, g = case
    for i in ids:
        c = local_counts(i, world, el)
        for e in range(world * el):
            assert c[e // el, e % el] == (i == e).sum()
        for d in range(world):
            sent = ((i >= d * el) & (i < (d + 1) * el)).any(dim=1).sum()
            assert c[d, el] == sent


@SETTINGS
@given(routings())
def test_rows_land_where_the_spec_says(case):
    world, el, top_k, max_tokens, ids, g = case
    counts, layout, wts, sends = _plans(world, el, max_tokens, ids, g)
    for d in range(world):
        spec = reference.ep_receive_order(ids, d, el)
        n = len(spec.token)
        assert int(layout.expert_off[d, -1]) == n
        landed = {}
        for s, plan in enumerate(sends):
            lo, hi = int(plan.send_off[d]), int(plan.send_off[d + 1])
            for i in range(lo, hi):
                row = int(plan.send_row[i])
                assert row not in landed, "two rows pushed to one slot"
                landed[row] = (s, int(plan.send_pair[i]) // top_k)
        assert landed == {r: (int(spec.source[r]), int(spec.token[r])) for r in range(n)}
        # Return entries name exactly the rows (and weights) of each token's slots on d.
        for s, plan in enumerate(sends):
            sent = sorted(set(spec.token[spec.source == s].tolist()))
            q = int(plan.entry_count[d])
            assert plan.entry_token[d, :q].tolist() == sent
            for qi, t in enumerate(sent):
                for j in range(ids[s].shape[1]):
                    row = int(plan.entry_rows[d, qi, j])
                    on_d = d * el <= int(ids[s][t, j]) < (d + 1) * el
                    assert (row >= 0) == on_d
                    if on_d:
                        assert (int(spec.source[row]), int(spec.token[row]),
                                int(spec.slot[row])) == (s, t, j)
                        assert float(plan.entry_weight[d, qi, j]) == float(wts[s][t, j])
            assert int(layout.entries[d, s]) == q


@SETTINGS
@given(routings())
def test_a_gathered_dispatch_sends_each_token_once_before_its_other_pairs(case):
    """``send_first`` marks one pair per (token, destination) with a pair there -- the
    first in send order, so every later pair of the token on that destination sits in
    the same or a later row chunk, whose prefix a tile waits for."""
    world, el, top_k, max_tokens, ids, g = case
    counts, layout, wts, sends = _plans(world, el, max_tokens, ids, g)
    for s, plan in enumerate(sends):
        for d in range(world):
            lo, hi = int(plan.send_off[d]), int(plan.send_off[d + 1])
            seen = set()
            for i in range(lo, hi):
                token = int(plan.send_pair[i]) // top_k
                assert bool(plan.send_first[i]) == (token not in seen)
                seen.add(token)
            assert len(seen) == int(plan.entry_count[d])
        assert not plan.send_first[int(plan.send_off[-1]):].any()


@SETTINGS
@given(routings(), st.sampled_from([1, 2, 4]), st.sampled_from([0, 1, 3, 1000]))
def test_layer0_tiles(case, block_m, head_tiles):
    world, el, top_k, max_tokens, ids, g = case
    counts, layout, _, _ = _plans(world, el, max_tokens, ids, g)
    cap = recv_capacity(world, max_tokens, top_k)
    for d in range(world):
        spec = reference.ep_receive_order(ids, d, el)
        t = build_tile_table(layout, d, cap, block_m, head_tiles)
        n = int(t.num_tiles)
        covered = torch.zeros(len(spec.token), dtype=torch.int64)
        stages = []
        for i in range(n):
            r0, r1 = int(t.row_start[i]), int(t.row_end[i])
            assert 0 < r1 - r0 <= block_m
            covered[r0:r1] += 1
            assert (spec.expert[r0:r1] == int(t.expert[i])).all(), "tile spans experts"
            sources = set(spec.source[r0:r1].tolist())
            mask = int(t.wait_mask[i])
            assert {s for s in range(world) if mask >> s & 1} == sources, "wait set != sources"
            stage = max((s - d) % world for s in sources)
            assert int(t.stage[i]) == stage
            stages.append(stage)
        assert (covered == 1).all(), "every output row in exactly one tile"
        # Order: the first head_tiles local-only tiles, then everything else by row (an
        # expert's tiles side by side, whatever their sources).
        head = min(head_tiles, stages.count(0))
        starts = [int(t.row_start[i]) for i in range(n)]
        assert stages[:head] == [0] * head, "the head holds local rows only"
        local_starts = sorted(r for r, s in zip(starts, stages) if s == 0)
        assert starts[:head] == local_starts[:head], "the first local tiles, in row order"
        assert starts[head:] == sorted(starts[head:]), "expert-major after the head"
        # Work items: every (tile, column block) exactly once; groups keep the order.
        for n_blocks in (1, 3):
            seen = [grouped_work(w, n, n_blocks, 8) for w in range(n * n_blocks)]
            assert sorted(seen) == [(a, b) for a in range(n) for b in range(n_blocks)]


@given(st.integers(0, 40), st.integers(1, 12), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_layer1_order_is_column_major(num_tiles, n_blocks, per_split):
    items = [column_work(w, num_tiles, n_blocks, per_split) for w in range(num_tiles * n_blocks)]
    assert sorted((t, b) for t, b, _ in items) == [(t, b) for t in range(num_tiles)
                                                    for b in range(n_blocks)]
    splits = [s for _, _, s in items]
    assert splits == sorted(splits), "all tiles of split s before split s + 1"
    for t, b, s in items:
        assert b // per_split == s


def layer0_takes(total, programs, lane_items, head_rounds, tail_rounds):
    """Every take of layer0's queue until it runs dry, as lists of item indices."""
    shape = lane_shape(total, programs, lane_items, head_rounds, tail_rounds)
    takes, q = [], 0
    while True:
        first, end = lane_of_take(q, programs, *shape)
        if first >= total:
            return takes
        takes.append(list(range(first, min(end, total), programs)))
        q += 1


@given(st.integers(0, 3000), st.integers(1, 140), st.sampled_from([1, 4]),
       st.integers(0, 2), st.integers(0, 2))
@settings(max_examples=200, deadline=None)
def test_layer0_queue_hands_out_every_item_once(total, programs, lane_items, head, tail):
    takes = layer0_takes(total, programs, lane_items, head, tail)
    flat = sorted(w for t in takes for w in t)
    assert flat == list(range(total)), "every item exactly once, and nothing past the end"
    firsts = [t[0] for t in takes]
    assert firsts == sorted(firsts), "takes follow the table's order"
    # Items taken at once stay one window of the order (weight blocks shared in L2): the
    # takes of one round of the grid span at most a round of lanes.
    for i in range(0, len(takes), programs):
        window = [w for t in takes[i:i + programs] for w in t]
        assert max(window) - min(window) < programs * lane_items
    if total >= programs * (lane_items + head + tail):
        # The head: each block's first take is one item of the first round, so it waits
        # for the rows of one round, not of a lane reaching ``lane_items`` rounds ahead.
        assert all(len(t) == 1 and t[0] < head * programs for t in takes[:head * programs])
        # The tail: the last round (at least) goes one item per take.
        assert all(len(t) == 1 for t in takes[-tail * programs:] if tail)
        assert max(len(t) for t in takes) == lane_items
