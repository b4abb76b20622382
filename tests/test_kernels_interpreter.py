"""The fused kernels' role functions for W virtual ranks, on the CPU (TRITON_INTERPRET=1).

Producers are launched before consumers for every rank (comet.runtime.virtual), over
real peer-pointer tables; the @triton.jit functions are those the GPU runs. fp16/fp32
only: the interpreter's tl.dot on bf16 is wrong (the GPU suite covers bf16).
"""


import pytest
import torch
import triton
import triton.language as tl

from comet import reference
from comet.config import MoEConfig, TileConfig
from comet.constants import (ADDRESS_ALIGN, MAX_TRACE_EVENTS, ROLE_COMM, ROLE_COMPUTE,
                             ROLE_FUSED, TRACE_PROGRAM, TRACE_REDUCE, interpreting)
from comet.kernels import exchange
from comet.kernels.group_gemm import lane_shape, strided_take
from comet.kernels.plan import Routing, launch_counts
from comet.kernels.sync import Trace
from comet.runtime.errors import CometTimeoutError, raise_if_failed
from comet.runtime.forward import CallInputs, ForwardCall, Grids, plan_phases
from comet.runtime.staging import address_of, aligned
from comet.runtime.virtual import VirtualEP
from comet.scheduler.plan import lane_of_take
from comet.scheduler.plan import lane_shape as lane_shape_py
from comet.weights import GATE_UP_BLOCK, gate_up_first
from routings import KINDS, make_ids, make_tokens

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="interpreter tests (CPU); the GPU suite runs these "
                                       "kernels compiled")

# The benchmark's four configs, scaled down to interpreter size (E, k, H, F).
SCALED = {
    "mixtral": (8, 2, 32, 48),
    "qwen2-moe": (16, 4, 32, 16),
    "phi3.5-moe": (8, 2, 48, 32),
    "deepseek-v3-like": (16, 4, 32, 16),
}


def _run(world, name, kind, dtype, seed, comm_programs=2, compute_programs=3, tile=None):
    e, k, h, f = SCALED[name]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f, dtype=dtype,
                    max_tokens=12)
    g = torch.Generator().manual_seed(seed)
    el = e // world
    tokens = make_tokens(kind, world, cfg.max_tokens, g)
    ids = make_ids(kind, tokens, e, k, g)
    xs = [torch.randn(i.shape[0], h, generator=g).to(dtype) for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    w13 = [(torch.randn(el, h, 2 * f, generator=g) * h ** -0.5).to(dtype) for _ in range(world)]
    w2 = [(torch.randn(el, f, h, generator=g) * f ** -0.5).to(dtype) for _ in range(world)]
    ep = VirtualEP(cfg, w13, w2, tile)
    ys = ep.forward(xs, ids, wts, comm_programs, compute_programs)
    expect = reference.ep_forward(xs, ids, wts, w13, w2, round_to=dtype)
    return ys, expect, ep


def _close(ys, expect, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    for y, e in zip(ys, expect):
        torch.testing.assert_close(y.float(), e, **tol)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCALED))
def test_configs_fp16(world, name):
    ys, expect, _ = _run(world, name, "random", torch.float16, seed=world)
    _close(ys, expect, torch.float16)


@pytest.mark.parametrize("kind", KINDS)
def test_routings_fp32_world4(kind):
    ys, expect, _ = _run(4, "mixtral", kind, torch.float32, seed=len(kind))
    _close(ys, expect, torch.float32)


#: layer1 as GEMM, then the reduce role (the default tile scatters from the epilogue;
#: the reduce serves the sequential mode and the backward, and was the fused default).
REDUCE = TileConfig.small().with_fields(layer1_scatter=False)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCALED))
def test_configs_fp16_layer1_reduce(world, name):
    ys, expect, ep = _run(world, name, "random", torch.float16, seed=world + 7, tile=REDUCE)
    _close(ys, expect, torch.float16)
    assert not any("pair_out" in ws.local.names() for ws in ep.ws)


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_sums_only_real_pairs(kind):
    """Dropped slots (-1), tokens with no expert, everything on one rank: a slot that
    is not a real pair adds nothing, though its pair_out row holds an older call's."""
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float32, max_tokens=12)
    g = torch.Generator().manual_seed(len(kind))
    w13 = [torch.randn(2, h, 2 * f, generator=g) * 0.2 for _ in range(4)]
    w2 = [torch.randn(2, f, h, generator=g) * 0.2 for _ in range(4)]
    ep = VirtualEP(cfg, w13, w2)
    assert ep.tile.variant.layer1_scatter
    for ws in ep.ws:                    # stale rows a masked slot must not pick up
        ws.local.pair_out.fill_(1e3)
    for call in range(2):
        ids = make_ids(kind, make_tokens(kind, 4, 12, g), e, k, g)
        ids[0][::2, 0] = -1
        xs = [torch.randn(i.shape[0], h, generator=g) for i in ids]
        wts = [torch.rand(i.shape, generator=g) for i in ids]
        ys = ep.forward(xs, ids, wts)
        _close(ys, reference.ep_forward(xs, ids, wts, w13, w2), torch.float32)


@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_small_calls_split_layer1_over_k(split_k):
    """With ``layer1_split_k``, a call whose layer1 items leave programs idle runs each
    item in as many K splits as fit, up to ``layer1_split_k`` (with 4, one split has no K
    left), the last split summing the partials; on too few programs, whole items. All
    match the reference, and the counters say what ran. Expert biases: added once."""
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float32, max_tokens=12)
    g = torch.Generator().manual_seed(split_k)
    w13 = [torch.randn(4, h, 2 * f, generator=g) * 0.2 for _ in range(2)]
    w2 = [torch.randn(4, f, h, generator=g) * 0.2 for _ in range(2)]
    b13 = [torch.randn(4, 2 * f, generator=g) * 0.1 for _ in range(2)]
    b2 = [torch.randn(4, h, generator=g) * 0.1 for _ in range(2)]
    tile = TileConfig.small().with_fields(layer1_split_k=split_k)
    ep = VirtualEP(cfg, w13, w2, tile, b13_shards=b13, b2_shards=b2)
    ids = make_ids("random", [5, 3], e, k, g)
    xs = [torch.randn(i.shape[0], h, generator=g) for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    expect = reference.ep_forward(xs, ids, wts, w13, w2, b13_shards=b13, b2_shards=b2)
    engaged = set()
    for programs in (48, 9, 3):
        _close(ep.forward(xs, ids, wts, compute_programs=programs), expect, torch.float32)
        for ws in ep.ws:
            items = int(ws.plan.tiles.num) * -(-h // tile.gemm.block_n1)
            splits = min(split_k, programs // items)     # as many as fit, up to split_k
            splits = splits if splits >= 2 else 0
            assert items > 0 and ws.count.arrived[:items].tolist() == [splits] * items
            engaged.add(splits)
    assert {0, split_k} <= engaged


def _stream_k_parts(items: int, steps: int, programs: int) -> list[int] | None:
    """Parts per item that a stream-K call sums (0 for an item one run holds whole), or
    None where whole items run from the queue: the rule of
    :func:`comet.kernels.layer0.stream_k_pays`, written out."""
    slots = -(-items // programs) * programs
    if not (items * steps >= programs and items < 2 * programs
            and (slots - items) * 100 >= 10 * slots):
        return None
    total = items * steps
    owner = [max(p for p in range(programs) if p * total // programs <= s)
             for s in range(total)]
    parts = [len(set(owner[i * steps:(i + 1) * steps])) for i in range(items)]
    return [n if n > 1 else 0 for n in parts]


def _four_items_per_rank(tile, bias, seed):
    """A layer of 2 ranks x 2 experts (H 64: 4 K steps of 16; F two one-dot column
    blocks) whose call gives each rank's two experts rows -- four layer0 items per rank
    -- with or without expert biases: ``(ep, (xs, ids, wts), the reference output)``."""
    e, k, h, f = 4, 2, 64, 2 * GATE_UP_BLOCK
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float32, max_tokens=4)
    g = torch.Generator().manual_seed(seed)
    w13 = [torch.randn(2, h, 2 * f, generator=g) * 0.2 for _ in range(2)]
    w2 = [torch.randn(2, f, h, generator=g) * 0.2 for _ in range(2)]
    b13 = [torch.randn(2, 2 * f, generator=g) * 0.1 for _ in range(2)] if bias else None
    b2 = [torch.randn(2, h, generator=g) * 0.1 for _ in range(2)] if bias else None
    ep = VirtualEP(cfg, w13, w2, tile, b13_shards=b13, b2_shards=b2)
    ids = [torch.tensor([[0, 2], [1, 3], [2, 1]]), torch.tensor([[3, 0], [1, 2]])]
    xs = [torch.randn(i.shape[0], h, generator=g) for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    return ep, (xs, ids, wts), reference.ep_forward(xs, ids, wts, w13, w2, b13_shards=b13,
                                                   b2_shards=b2)


@pytest.mark.parametrize("bias", [False, True])
def test_small_calls_run_layer0_as_stream_k(bias):
    """With one-dot layer0 tiles (``block_n0`` the W13 interleave block), a call whose
    work items would leave programs idle runs layer0 as stream-K: equal runs of K steps
    per program, an item cut between runs summed in program order by its last part, then
    bias and activation. On 3 and 5 programs the four items of a rank are cut (two parts
    each for some); on 4 (no program idle) and 2 (two rounds) the queue runs whole items.
    Every output matches the reference; the counters say which items were cut."""
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK, layer0_stream_k=True)
    ep, (xs, ids, wts), expect = _four_items_per_rank(tile, bias, seed=5 + bias)
    h, f = ep.cfg.hidden_size, ep.cfg.intermediate_size
    cut = set()
    for programs in (3, 5, 4, 2):
        _close(ep.forward(xs, ids, wts, compute_programs=programs), expect, torch.float32)
        for ws in ep.ws:
            items = int(ws.plan.tiles.num) * (f // GATE_UP_BLOCK)
            assert items == 4
            parts = _stream_k_parts(items, h // tile.gemm.block_k, programs)
            got = ws.count.l0_arrived[:items].tolist()
            assert got == (parts or [0] * items), (programs, got, parts)
            cut.add(programs if parts and any(parts) else None)
    assert cut == {3, 5, None}


@pytest.mark.parametrize("bias", [False, True])
def test_the_last_partial_round_of_layer0_runs_in_k_splits(bias):
    """``layer0_tail_split``: the queue hands out whole rounds of items, then each item
    of a last round that fills at most half the programs as K splits, summed in split
    order by the item's last split before bias and activation. Four items per rank on 3
    programs: one round, then one item in 3 splits (of 4 K steps: 2, 2 and none); on 2
    programs (no partial round) and 5 (no whole round) nothing is cut. Every output
    matches the reference; the counters say which item was cut into how many splits."""
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK,
                                          layer0_stream_k=False, layer0_tail_split=4)
    ep, (xs, ids, wts), expect = _four_items_per_rank(tile, bias, seed=7 + bias)
    for programs, splits in ((3, [3, 0, 0, 0]), (2, [0] * 4), (5, [0] * 4)):
        _close(ep.forward(xs, ids, wts, compute_programs=programs), expect, torch.float32)
        for ws in ep.ws:
            assert int(ws.plan.tiles.num) * 2 == 4
            assert ws.count.l0_arrived[:4].tolist() == splits, programs


@pytest.mark.parametrize("scatter, stream_k, live_rows, in_place",
                         [(True, False, True, True), (False, True, True, True),
                          (True, False, False, True), (True, False, True, False)])
def test_a_gathered_dispatch_sends_a_token_once_per_rank_and_matches(scatter, stream_k,
                                                                    live_rows, in_place):
    """``layer0_gather``: top-3 of 8 experts on 2 ranks, so most tokens have several pairs
    on a rank. Each rank's token rows land once, at ``tokens[source * Mx + t]`` (a0's
    first rows; the rest of a0 is never written) -- a peer's always, its own only
    without ``layer0_own_in_place`` (with it, the GEMM reads them from x) --, every pair
    is an index entry naming its token's row, and the outputs match the reference --
    with layer1's scatter and with the reduce, and with layer0 as stream-K (a call small
    enough on 5 programs), whose parts read A through the same index; the GEMM loading
    only a tile's own rows (``layer0_live_rows``, a small call's kernel) or whatever rows
    the tile's index entries name (a large call's). A last, smaller call leaves entries
    of the earlier ones past its tokens, and still matches."""
    e, k, h, f = 8, 3, 32, GATE_UP_BLOCK + GATE_UP_BLOCK // 2      # one whole, one half tail
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float32, max_tokens=6)
    g = torch.Generator().manual_seed(11 + scatter)
    w13 = [torch.randn(4, h, 2 * f, generator=g) * h ** -0.5 for _ in range(2)]
    w2 = [torch.randn(4, f, h, generator=g) * f ** -0.5 for _ in range(2)]
    tile = TileConfig.small().with_fields(
        block_n0=GATE_UP_BLOCK, comm_rows=4, comm_copy_rows=2, layer0_gather=True,
        layer1_scatter=scatter, layer0_stream_k=stream_k, layer0_live_rows=live_rows,
        layer0_own_in_place=in_place)
    ep = VirtualEP(cfg, w13, w2, tile)
    programs = 5 if stream_k else 3

    def routed(sizes):
        ids = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
               for m in sizes]
        return ids, [torch.randn(i.shape[0], h, generator=g) for i in ids], \
            [torch.rand(i.shape, generator=g) for i in ids]

    ids, xs, wts = routed((6, 3))
    ids[0][2] = torch.tensor([0, 1, 2])          # all three on rank 0
    ids[1][0] = torch.tensor([-1, 5, -1])        # one pair
    expect = reference.ep_forward(xs, ids, wts, w13, w2)
    for _ in range(2):                            # the second call over the first's rows
        _close(ep.forward(xs, ids, wts, compute_programs=programs), expect, torch.float32)
        if stream_k:                              # some item was cut into parts
            assert any(ws.count.l0_arrived.any() for ws in ep.ws)
    mx = cfg.max_tokens
    for d, ws in enumerate(ep.ws):
        a0 = ws.local.a0
        assert not a0[2 * mx:].any()             # no row placed per pair
        rows = 0
        for s in range(2):
            on_d = ((ids[s] >= 4 * d) & (ids[s] < 4 * d + 4)).any(dim=1)
            for t in range(ids[s].shape[0]):
                landed = a0[s * mx + t]
                copied = on_d[t] and not (in_place and s == d)
                assert torch.equal(landed, xs[s][t]) if copied else not landed.any()
            rows += int(((ids[s] >= 4 * d) & (ids[s] < 4 * d + 4)).sum())
        src = ws.local.a0_src[:rows].long()
        assert sorted(set(src.tolist())) == [s * mx + t for s in range(2)
                                             for t in range(ids[s].shape[0])
                                             if ((ids[s][t] >= 4 * d) & (ids[s][t] < 4 * d + 4)).any()]
    ids, xs, wts = routed((2, 1))
    _close(ep.forward(xs, ids, wts, compute_programs=programs),
           reference.ep_forward(xs, ids, wts, w13, w2), torch.float32)


def test_the_layer_compiles_stream_k_in_only_for_calls_small_enough():
    """A layer with ``layer0_stream_k`` on 4 programs: a 1-token call (2 items of one
    column block) runs the stream-K variant and the device cuts its items; a 40-token
    call (8 items expected: two rounds) runs the tile without the variant
    (Selector.stream_k_by_rule); both, and the small call again, give the reference."""
    from comet.runtime.layer import FusedMoE
    e, k, h, f = 4, 2, 64, GATE_UP_BLOCK
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float32, max_tokens=40)
    g = torch.Generator().manual_seed(9)
    w13 = torch.randn(e, h, 2 * f, generator=g) * 0.2
    w2 = torch.randn(e, f, h, generator=g) * 0.2
    tile = TileConfig.small().with_fields(block_n0=GATE_UP_BLOCK, layer0_stream_k=True)
    layer = FusedMoE(cfg, w13, w2, tile=tile)
    assert layer.programs == 4
    for m, streamed in ((1, True), (40, False), (1, True)):
        x = torch.randn(m, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
        w = torch.rand(m, k, generator=g)
        y = layer(x, ids, w)
        torch.testing.assert_close(y, reference.moe_forward(x, ids, w, w13, w2),
                                   rtol=1e-4, atol=1e-4)
        assert layer.last_tile.variant.layer0_stream_k is streamed, m
        if streamed:      # two items, 4 K steps each, on 4 programs: each cut in two
            assert layer.ws.count.l0_arrived[:2].tolist() == [2, 2]


@pytest.mark.parametrize("comm_programs", [1, 3, 5])
def test_comm_program_counts(comm_programs):
    ys, expect, _ = _run(2, "qwen2-moe", "skewed", torch.float16, seed=comm_programs,
                         comm_programs=comm_programs, compute_programs=2, tile=REDUCE)
    _close(ys, expect, torch.float16)


@pytest.mark.parametrize("parts", [1, 4])
def test_a_small_calls_chunks_are_copied_in_parts(parts):
    """A call with fewer dispatch chunks than comm programs cuts each row chunk's copy
    into parts (``CommConfig.dispatch_parts``), the last part to arrive publishing the
    chunk: 12 rows to each destination are one 16-row chunk, and with 8 dispatch
    programs for 4 chunks (a row chunk and a return-entry chunk per destination) each
    chunk is taken as 2 parts -- the row chunk copied as 8 + 4 rows, the entry chunk by
    its first part. Outputs match the reference twice over (the counters are zeroed
    when a call opens); with ``dispatch_parts=1`` no part is counted, nor in a 1-token
    call (a row per destination: one copy tile, so one part)."""
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float16, max_tokens=12)
    g = torch.Generator().manual_seed(5)
    w13 = [(torch.randn(4, h, 2 * f, generator=g) * h ** -0.5).half() for _ in range(2)]
    w2 = [(torch.randn(4, f, h, generator=g) * f ** -0.5).half() for _ in range(2)]
    tile = TileConfig.small().with_fields(comm_rows=16, comm_copy_rows=8, dispatch_parts=parts)
    ep = VirtualEP(cfg, w13, w2, tile)
    # every token has one expert on each rank: 12 rows to each destination
    ids = [torch.stack([torch.tensor([t % 4, 4 + (t + r) % 4]) for t in range(12)])
           for r in range(2)]
    xs = [torch.randn(12, h, generator=g).half() for _ in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    expect = reference.ep_forward(xs, ids, wts, w13, w2, round_to=torch.float16)
    for _ in range(2):
        _close(ep.forward(xs, ids, wts, dispatchers=8), expect, torch.float16)
        for ws in ep.ws:
            counted = ws.count.l0_parts
            if parts == 1:
                assert not counted.any()
            else:
                assert counted[:4].tolist() == [2, 2, 2, 2] and not counted[4:].any()
    one = [i[:1] for i in ids]
    _close(ep.forward([x[:1] for x in xs], one, [w[:1] for w in wts], dispatchers=8),
           reference.ep_forward([x[:1] for x in xs], one, [w[:1] for w in wts], w13, w2,
                                round_to=torch.float16), torch.float16)
    assert not any(ws.count.l0_parts.any() for ws in ep.ws)


def test_back_to_back_calls_reuse_the_workspace():
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float16, max_tokens=12)
    g = torch.Generator().manual_seed(0)
    w13 = [(torch.randn(4, h, 2 * f, generator=g) * 0.2).half() for _ in range(2)]
    w2 = [(torch.randn(4, f, h, generator=g) * 0.2).half() for _ in range(2)]
    ep = VirtualEP(cfg, w13, w2)
    for call in range(3):
        kind = KINDS[call % len(KINDS)]
        ids = make_ids(kind, make_tokens(kind, 2, 12, g), e, k, g)
        xs = [torch.randn(i.shape[0], h, generator=g).half() for i in ids]
        wts = [torch.rand(i.shape, generator=g) for i in ids]
        ys = ep.forward(xs, ids, wts)
        _close(ys, reference.ep_forward(xs, ids, wts, w13, w2, round_to=torch.float16),
               torch.float16)
    assert int(ep.ws[0].epoch) == 3


def _rank_call(ep, r, x, ids, wts, y=None, split=0):
    """Rank ``r``'s forward call of ``ep`` with its roles apart, on these inputs."""
    y = torch.empty_like(x) if y is None else y
    m = torch.full((1,), x.shape[0], dtype=torch.int64)
    splits = [torch.full((1,), split, dtype=torch.int64) for _ in range(2)]
    inputs = CallInputs(address_of(x), address_of(y), m, *splits, ids, wts)
    return ForwardCall(ep.ws[r], ep.w13[r], ep.w2[r], ep.tile, inputs, Grids(3, 1, 2, 3),
                       cooperative=False, roles_apart=True)


def _plan_rank0_of_two(ep):
    """Both ranks of a W=2 group open a call and exchange counts; rank 0 alone builds its
    plan. Returns rank 0's call."""
    cfg, tile = ep.cfg, ep.tile
    g = torch.Generator().manual_seed(9)
    ids = [torch.tensor([[0, 5], [6, 7]]), torch.tensor([[1, 4]])]
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).half() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    plans = [plan_phases(ep.ws[r], Routing.of(ids[r], wts[r]), tile) for r in range(2)]
    for open_call, _ in plans:
        open_call()
    plans[0][1]()
    return _rank_call(ep, 0, xs[0], ids[0], wts[0])


def test_missing_peer_is_a_clear_error():
    """Rank 1 never dispatches: rank 0's GroupGEMM gives up and names the missing rank."""
    _, _, ep = _run(2, "mixtral", "random", torch.float16, seed=3)
    call = _plan_rank0_of_two(ep)
    call.launch_layer0(ROLE_COMM, 1)
    call.launch_layer0(ROLE_COMPUTE, 2)
    with pytest.raises(CometTimeoutError, match=r"layer0 on rank 0 .* from rank 1"):
        raise_if_failed(ep.ws[0].fatal_word, 0)


def _open_alone(ws, ep):
    """Rank ``ws.rank`` opens a call and runs the whole count exchange alone."""
    ws.begin_call()
    launch_counts(ws.plan, Routing.of(torch.tensor([[0, 1]]), torch.ones(1, 2)),
                  ws.input_word, ws.sync, ws.shape, ws.exchange(in_plan=False))
    exchange.launch_exchange(ws.plan.block_counts[-1], ws.exchange(in_plan=False),
                             ws.sync, ws.shape)


def test_exchange_timeout_names_the_peer():
    _, _, ep = _run(2, "mixtral", "random", torch.float16, seed=4)
    ws = ep.ws[0]
    _open_alone(ws, ep)                               # rank 1 never publishes
    with pytest.raises(CometTimeoutError, match=r"exchange on rank 0 .* from rank 1"):
        raise_if_failed(ws.fatal_word, 0)


def test_the_layout_kernel_waits_for_every_peers_counts():
    """A forward call's count exchange rides on its plan kernels (the scan pushes, the
    layout waits): a rank whose peer never opens the call times out in the layout
    kernel, naming the peer, and builds no plan from counts that are not there."""
    _, _, ep = _run(2, "mixtral", "random", torch.float16, seed=4)
    ws = ep.ws[0]
    open_call, plan = plan_phases(ws, Routing.of(torch.tensor([[0, 1]]), torch.ones(1, 2)),
                                  ep.tile)
    open_call()                                       # rank 1 never opens
    plan()
    with pytest.raises(CometTimeoutError, match=r"exchange on rank 0 .* from rank 1"):
        raise_if_failed(ws.fatal_word, 0)


def test_fused_layer_w1_on_cpu_and_bad_inputs_leave_it_usable():
    """FusedMoE itself (staging, device-side addresses and counts, the per-call plan) on
    one rank; rejected inputs raise before anything runs and do not touch the epoch."""
    from comet.runtime.layer import FusedMoE
    e, k, h, f = SCALED["phi3.5-moe"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float16, max_tokens=10)
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(e, h, 2 * f, generator=g) * h ** -0.5).half()
    w2 = (torch.randn(e, f, h, generator=g) * f ** -0.5).half()
    layer = FusedMoE(cfg, w13, w2)
    x = torch.randn(7, h, generator=g).half()
    ids = make_ids("skewed", [7], e, k, g)[0]
    ids[2, 1] = -1
    w = torch.rand(7, k, generator=g)
    bad = [(x.float(), ids, w, TypeError), (x[:, :16].contiguous(), ids, w, ValueError),
           (torch.cat([x, x]), torch.cat([ids, ids]), torch.cat([w, w]), ValueError),
           (x, ids[:, :1], w, ValueError), (x.t().contiguous().t(), ids, w, ValueError)]
    for bx, bi, bw, err in bad:
        with pytest.raises(err):
            layer(bx, bi, bw)
    assert int(layer.ws.epoch) == 0
    for call in range(2):
        y = layer(x, ids, w, comm_blocks=call)
        ref = reference.moe_forward(x, ids, w, w13, w2, round_to=torch.float16)
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert int(layer.ws.epoch) == 2


def test_the_first_launch_stages_any_routing_a_caller_passes():
    """The call's first launch copies the routing from the caller's tensors (addresses
    staged with the scalars): int32 ids, half-precision weights (converted on the host),
    transposed views, an empty call and a full one all give the reference's output."""
    from comet.runtime.layer import FusedMoE
    cfg, w13, w2, _, _, _ = _w1_inputs("mixtral", seed=11, max_tokens=16)
    e, k, h = cfg.num_experts, cfg.top_k, cfg.hidden_size
    layer = FusedMoE(cfg, w13, w2)
    g = torch.Generator().manual_seed(11)
    for m, ids_dtype, w_dtype, transposed in [(7, torch.int64, torch.float32, False),
                                              (5, torch.int32, torch.float16, False),
                                              (9, torch.int64, torch.float32, True),
                                              (0, torch.int64, torch.float32, False),
                                              (16, torch.int64, torch.bfloat16, False)]:
        x = torch.randn(m, h, generator=g).half()
        ids = torch.randint(0, e, (k, m) if transposed else (m, k), generator=g)
        w = torch.rand(*ids.shape, generator=g)
        if transposed:
            ids, w = ids.t(), w.t()
        y = layer(x, ids.to(ids_dtype), w.to(w_dtype))
        ref = reference.moe_forward(x, ids, w.to(w_dtype).float(), w13, w2,
                                    round_to=torch.float16)
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_layer_built_under_inference_mode_serves_calls_outside_it():
    """A server warms up under torch.inference_mode(); the layer's state (workspace,
    staging, counters) must still take in-place updates from calls made outside it."""
    from comet.runtime.layer import FusedMoE
    cfg, w13, w2, x, ids, w = _w1_inputs()
    with torch.inference_mode():
        layer = FusedMoE(cfg, w13, w2)
        inside = layer(x, ids, w)
    with torch.no_grad():
        outside = layer(x, ids, w)
    torch.testing.assert_close(outside, inside)
    assert int(layer.ws.epoch) == 2


def _w1_inputs(name="phi3.5-moe", seed=5, max_tokens=10):
    """cfg, weights and a 7-token call of one rank holding all of ``name``'s (scaled)
    experts, fp16."""
    e, k, h, f = SCALED[name]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float16, max_tokens=max_tokens)
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, h, 2 * f, generator=g) * h ** -0.5).half()
    w2 = (torch.randn(e, f, h, generator=g) * f ** -0.5).half()
    x = torch.randn(7, h, generator=g).half()
    ids = make_ids("random", [7], e, k, g)[0]
    w = torch.rand(7, k, generator=g)
    return cfg, w13, w2, x, ids, w


def _w1_layer(seed=5, max_tokens=10):
    from comet.runtime.layer import FusedMoE
    cfg, w13, w2, x, ids, w = _w1_inputs(seed=seed, max_tokens=max_tokens)
    return FusedMoE(cfg, w13, w2), cfg, x, ids, w


@pytest.mark.parametrize("bad", ["id_too_large", "id_below_minus_one", "nan_weight",
                                 "inf_weight"])
def test_bad_routing_is_reported_on_the_device_and_the_layer_stays_usable(bad):
    from comet.runtime.errors import CometInputError
    layer, cfg, x, ids, w = _w1_layer()
    bad_ids, bad_w, clean_ids = ids.clone(), w.clone(), ids.clone()
    clean_ids[4, 1] = -1
    if bad == "id_too_large":
        bad_ids[4, 1] = cfg.num_experts
    elif bad == "id_below_minus_one":
        bad_ids[4, 1] = -2
    else:
        bad_w[4, 1] = float("nan") if bad == "nan_weight" else float("inf")
    with pytest.raises(CometInputError, match="token 4, slot 1"):
        layer(x, bad_ids, bad_w)
    # The call completed with the slot dropped; the next one is clean and correct.
    y = layer(x, ids, w)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.float16)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert int(layer.ws.epoch) == 2
    # -1 is "no expert", not an error.
    y = layer(x, clean_ids, w)
    ref = reference.moe_forward(x, clean_ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.float16)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_failed_layer_raises_until_reset():
    from comet.runtime.errors import CometError
    layer, cfg, x, ids, w = _w1_layer()
    layer(x, ids, w)
    # As a peer's report would leave it: layer1 of rank 0 gave up on rank 0's entries.
    layer.ws.fatal_word.copy_(torch.tensor([1, 6, 0, 0], dtype=torch.int32))
    with pytest.raises(CometTimeoutError, match="layer1 on rank 0 .* return entries"):
        layer(x, ids, w)
    for _ in range(2):
        with pytest.raises(CometError, match="reset"):
            layer(x, ids, w)
    epoch = int(layer.ws.epoch)
    layer.reset()
    assert int(layer.ws.epoch) == 0 and not layer.ws.local.error.any()
    y = layer(x, ids, w)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.float16)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert epoch == 2 and int(layer.ws.epoch) == 1


def test_a_timeout_is_written_into_every_peers_error_word():
    """Rank 0 gives up on rank 1's counts; rank 1 (and rank 2) learn it from rank 0, so
    their next waits give up at once instead of each waiting out its own timeout."""
    _, _, ep = _run(4, "mixtral", "random", torch.float16, seed=4)
    _open_alone(ep.ws[0], ep)
    for r in range(4):
        with pytest.raises(CometTimeoutError, match=rf"exchange on rank 0 .* from rank 1 "
                                                     rf"\(observed by rank {r}\)"):
            raise_if_failed(ep.ws[r].fatal_word, r)


def test_small_calls_take_the_decode_tile():
    """A call whose layer1 work items leave programs idle runs on the decode tile
    (narrower layer1 column blocks), with the same output; where the default tile keeps
    every program as busy, it stays. The choice is the host's, per token count."""
    from comet.runtime.layer import FusedMoE
    cfg, w13, w2, x, ids, w = _w1_inputs("mixtral", seed=7)
    ref = reference.moe_forward(x, ids, w, w13, w2, round_to=torch.float16)
    tile = TileConfig.small().with_fields(decode_block_n1=16)
    # 8 experts x 1 m-tile: 8 items of 32 columns on 4 programs (2 waves, 64 columns a
    # program) or 16 of 16 (4 waves, 64 again): the default stays.
    few = FusedMoE(cfg, w13, w2, tile=tile)
    assert few.selection.tile_for(7) is few.tile
    # On 64 programs, one wave either way: 16 columns a program instead of 32.
    many = FusedMoE(cfg, w13, w2, tile=tile)
    many.programs = 64
    assert many.selection.tile_for(7).gemm.block_n1 == 16
    assert many.selection.tile_for(7) is many.selection.tile_for(7)
    many.preload()
    for layer in (few, many):
        for call in range(2):
            y = layer(x, ids, w, comm_blocks=call)
            torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert few.last_tile is few.tile and many.last_tile.gemm.block_n1 == 16
    assert many.tile.decode_tile().decode_tile() is None


def test_preload_runs_every_variant_locally_and_leaves_a_fresh_workspace():
    layer, cfg, x, ids, w = _w1_layer()
    layer.preload()
    assert int(layer.ws.epoch) == 0 and not layer.ws.local.error.any()
    y = layer(x, ids, w)
    ref = reference.moe_forward(x, ids, w, gate_up_first(layer.w13), layer.w2, round_to=torch.float16)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_comm_blocks_join_the_gemm_and_gemm_blocks_join_the_reduce():
    """The fused launches of one rank (the interpreter runs programs in order, so one
    rank is what it can run fused): layer0 program 0 dispatches and then, from the work
    queue, takes every GEMM tile, the others find the queue empty; in layer1 (no comm
    block, one program: its GEMM blocks stride over fixed shares, so a second program's
    tiles would only run after the first waited for them) the program runs every GEMM
    tile and then every reduce item. The trace shows which block did what; the output
    must still be exact."""
    e, k, h, f = SCALED["mixtral"]
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    dtype=torch.float16, max_tokens=12)
    g = torch.Generator().manual_seed(11)
    ids = make_ids("random", [12], e, k, g)[0]
    x = torch.randn(12, h, generator=g).half()
    wts = torch.rand(ids.shape, generator=g)
    w13 = (torch.randn(e, h, 2 * f, generator=g) * h ** -0.5).half()
    w2 = (torch.randn(e, f, h, generator=g) * f ** -0.5).half()
    ep = VirtualEP(cfg, [w13], [w2], REDUCE)
    ws, tile = ep.ws[0], ep.tile
    y = torch.empty_like(x)
    call = _rank_call(ep, 0, x, ids, wts, y, split=1)
    for phase in call.stages()[0][1]:                   # the plan
        phase()
    grid = 3
    traces = [torch.full((grid, MAX_TRACE_EVENTS, 4), -1, dtype=torch.int64)
              for _ in range(2)]
    call.launch_layer0(ROLE_FUSED, grid, trace=Trace.on(traces[0]))
    call.inputs.split1.fill_(0)
    call.launch_layer1(ROLE_FUSED, 1, trace=Trace.on(traces[1][:1]))
    call.combine(grid)
    raise_if_failed(ws.fatal_word, 0)
    torch.testing.assert_close(y.float(), reference.moe_forward(x, ids, wts, w13, w2,
                                                                round_to=torch.float16),
                               rtol=2e-2, atol=2e-2)

    def kinds(layer, block):
        ev = traces[layer][block]
        return ev[ev[:, 0] >= 0, 0].tolist()

    world, reduce_kind = 1, int(TRACE_REDUCE)
    assert set(kinds(0, 0)) >= {0, world}, "layer0 block 0 must push, then take tiles"
    assert kinds(0, 0).index(world) > kinds(0, 0).index(0)
    assert kinds(0, 1) == [] and kinds(0, 2) == []
    l1 = kinds(1, 0)
    assert any(k < reduce_kind for k in l1) and any(k >= reduce_kind for k in l1)
    assert max(i for i, k in enumerate(l1) if k < reduce_kind) < min(
        i for i, k in enumerate(l1) if k >= reduce_kind), "GEMM tiles, then reduce items"
    # Every program of each traced launch records its own run in its row's last slot.
    assert traces[0][:, -1, 0].tolist() == [int(TRACE_PROGRAM)] * grid
    assert traces[1][0, -1, 0].item() == int(TRACE_PROGRAM)
    n_items = int(ws.count.l1_reduce) - 1    # the program takes one item past the end
    assert n_items == tile.n_splits(h) * -(-int(ws.plan.recv_entries[0]) // tile.comm.reduce_item)


def test_misaligned_inputs_are_staged_through_an_aligned_copy():
    # The kernels read the input through its address with 16-byte vectors.
    flat = torch.randn(1 + 4 * 32)
    view = flat[1:].view(4, 32)          # 4-byte offset
    assert view.data_ptr() % int(ADDRESS_ALIGN) != 0
    staged = aligned(view)
    assert staged.data_ptr() % int(ADDRESS_ALIGN) == 0 and torch.equal(staged, view)
    ok = flat[:128].view(4, 32)
    assert aligned(ok) is ok


@triton.jit
def _record_takes(queue, out, total, programs, LANE_ITEMS: tl.constexpr,
                  HEAD_ROUNDS: tl.constexpr, TAIL_ROUNDS: tl.constexpr,
                  MAX_TAKES: tl.constexpr):
    items, head, lanes_end = lane_shape(total, programs, LANE_ITEMS, HEAD_ROUNDS,
                                        TAIL_ROUNDS)
    for i in range(MAX_TAKES):
        first, end = strided_take(queue, programs, items, head, lanes_end)
        tl.store(out + 2 * i, first)
        tl.store(out + 2 * i + 1, end)


@pytest.mark.parametrize("total,programs,head,tail", [
    (0, 4, 1, 1), (3, 4, 1, 1), (37, 4, 1, 1), (100, 7, 1, 1), (100, 7, 0, 0),
    (100, 7, 2, 0), (100, 7, 0, 2), (16, 4, 0, 0)])
def test_the_layer0_queue_kernel_matches_its_mirror(total, programs, head, tail):
    """strided_take/lane_shape (what layer0's GEMM blocks run) hand out the takes of
    comet.scheduler.plan.lane_of_take, the order the simulator checks."""
    lane_items, takes = 4, 60
    out = torch.full((2 * takes,), -1, dtype=torch.int32)
    _record_takes[(1,)](torch.zeros(1, dtype=torch.int32), out, total, programs,
                        LANE_ITEMS=lane_items, HEAD_ROUNDS=head, TAIL_ROUNDS=tail,
                        MAX_TAKES=takes)
    shape = lane_shape_py(total, programs, lane_items, head, tail)
    expect = [lane_of_take(q, programs, *shape) for q in range(takes)]
    assert [tuple(p) for p in out.view(-1, 2).tolist()] == expect

