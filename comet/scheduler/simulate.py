"""Run both layers' schedules for W virtual ranks on the CPU, checking every dependency.

Each rank's kernels are modelled as *programs* (thread blocks) that execute their work
items in the order the kernels do -- same routing plan, same tile tables, same work-item
orders, same comm chunking -- and an event loop interleaves the programs of all ranks in
a random (seeded) order, running one work item at a time:

* the count exchange pushes this rank's counts into every peer's counts buffer of the
  call's epoch parity and publishes ``count_flags``; the layout reads the counts back and
  builds the call's routing plan and tile table from *what it read*;
* a layer0 comm program pushes a chunk of rows (or return entries) to a destination and
  publishes that chunk's own flag (no chunk waits for another);
* a layer0 compute program may start a tile only once every source of its wait set has
  published every chunk up to the one holding the tile's last row from it, and then
  asserts that *every row it reads has arrived* -- the wait is sufficient;
* a layer1 compute program counts its tile for its column split; a reduce item may run
  only when its split's count is complete, and asserts that every element it reads was
  computed; the combine waits for every rank's flag and asserts every partial row it
  sums was delivered -- or, with the scatter epilogue (``SimConfig.layer1_scatter``, the
  kernels' default), every program of layer1 computes tiles and writes each row,
  weighted, into its token's home ``pair_out`` (found through the ``row_home`` the
  dispatch delivered with the row, which it asserts is this call's), and the combine
  asserts every slot it sums was written by this call; either way the combine also
  asserts that no part this call wrote for one of its tokens goes unsummed;
* a (tp, ep) layout (:mod:`comet.mesh`) runs as expert parallelism over its shard
  experts: the caller passes :meth:`~comet.mesh.MeshLayout.shard_routing`'s ids and
  weights and :meth:`~comet.mesh.MeshLayout.shard`'s weights. Under the ``"replicated"``
  convention ``SimConfig.home_fanout`` is ``tp``: the scatter writes each row, and the
  reduce each sum, into every rank of the home's group of ``home_fanout`` consecutive
  ranks, and the combine reads the liveness of part ``i`` from its own shard's part of
  ``i``'s group (kernels.combine.Parts) -- its plan knows only its own shard's slots;
* layer0 tiles (in lanes of a few, each lane's rows waited for before its first tile) and
  reduce items come from per-call work queues, layer1 tiles from a static stride, as in
  the kernels: a comm program done dispatching takes layer0 lanes, a layer1 compute
  program out of tiles takes reduce items, and flag1 is published by the last program to
  finish.

Several *consecutive calls* run back to back (:func:`simulate_calls`). The symmetric
buffers persist across calls, as the workspace does, and every element peers write is
tagged with the epoch (call number) of the writer; every read asserts the tag equals the
reader's epoch. Ranks drift -- per-rank ``speeds`` weight the random choice -- so call
``N + 1`` of a fast rank interleaves with call ``N`` of a slow one: a read of data another
call wrote (too early, or overwritten) raises :class:`ScheduleError`. Flags carry the
epoch like the kernels' (``SimConfig.epoch_flags``) and the counts are double-buffered
by parity (``SimConfig.count_buffers``); turning either protection off makes drifting
schedules fail, which the tests check.

Kernel order on one stream is respected (exchange, layout, layer0, layer1, combine; a
rank's next call after its previous one). If no program can make progress the schedule
deadlocks and :class:`ScheduleError` is raised. Every fused call must equal
:func:`comet.reference.ep_forward` (a layout's: :func:`comet.reference.mesh_forward`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from comet.routing import build_recv_layout, build_send_plan, local_counts, recv_capacity
from comet.scheduler.plan import (build_tile_table, column_work, grouped_work, lane_of_take,
                                  lane_shape)

#: Modes of a call (comet.runtime.layer.MODES): the fused layer, or the benchmark's GEMMs
#: on whatever rows are in place -- exchange and layout, then no dispatch, no waits, no
#: reduce, no combine.
MODES = ("fused", "compute_only")


class ScheduleError(AssertionError):
    """A tile ran before its data, a read saw another call's data, a wait could never be
    satisfied, or data went missing."""


@dataclass(frozen=True)
class SimConfig:
    """Tile and launch shape of the simulated kernels (mirrors kernels.launch.TileConfig),
    the interleaving, and the protocol variant.

    blocks_per_split: layer1 column blocks per split (the comm role's unit of waiting).
    reduce_item: return entries per item of layer1's reduce queue.
    local_head_tiles: stage-0 tiles ahead of the expert-major rest of the tile table.
    lane_items: work items per take of layer0's queue (kernels.layer0.LANE_ITEMS).
    lane_head_rounds / lane_tail_rounds: rounds of one-item takes at the queue's ends
        (kernels.launch.TileConfig; a head round here although the kernels' default has
        none, so the schedules checked cover both kinds of take at the queue's start).
    speeds: per-rank weights of the random choice of the next program (None: uniform); a
        large ratio makes one rank run calls ahead of another.
    count_buffers: counts buffers, used by epoch parity (workspace.COUNT_BUFFERS); 1 lets
        a peer one exchange ahead overwrite counts not read yet.
    epoch_flags: flags carry the epoch of the call that set them; False models flags that
        hold only a chunk count or "done", so a value left by an earlier call satisfies a
        later call's wait.
    layer1_scatter: fused calls run layer1 with the scatter epilogue (no reduce role;
        comet.config.Variant.layer1_scatter).
    home_fanout: ranks each part of a token is written to -- the group of that many
        consecutive ranks holding its home (comet.mesh.MeshLayout.home_fanout: ``tp``
        under the ``"replicated"`` convention, else 1); must divide W.
    layer0_gather: layer0's dispatch sends a token's row once per destination, into
        ``tokens[source * Mx + t]``, and each pair as an index entry ``a0_src[row]``; the
        GEMM reads ``tokens[a0_src[row]]`` (kernels.layer0._push_gathered,
        Variant.layer0_gather). gather_with_first: the row goes with the token's first
        pair in send order (``send_first``); False models sending it with the last, which
        a tile waiting for the chunks up to its own last row does not cover.
        own_in_place: with ``layer0_gather``, a rank's own token rows are not copied;
        the GEMM reads them from its input (Variant.layer0_own_in_place).
    fanout_liveness: with ``home_fanout > 1`` the combine takes part ``i``'s liveness
        from the part of its own TP index in ``i``'s group (kernels.combine.Parts); False
        models a combine that reads ``i``'s own entry, which its plan fills only for its
        own shard's parts.
    """

    block_m: int = 4
    block_n0: int = 8
    block_n1: int = 8
    blocks_per_split: int = 2
    group_m: int = 8
    comm_rows: int = 3
    local_head_tiles: int = 2
    comm_entries: int = 2
    reduce_item: int = 3
    lane_items: int = 4
    lane_head_rounds: int = 1
    lane_tail_rounds: int = 1
    comm_programs: int = 2
    compute_programs: int = 3
    seed: int = 0
    speeds: tuple[float, ...] | None = None
    count_buffers: int = 2
    epoch_flags: bool = True
    layer1_scatter: bool = True
    home_fanout: int = 1
    fanout_liveness: bool = True
    layer0_gather: bool = False
    gather_with_first: bool = True
    own_in_place: bool = True


@dataclass
class SimResult:
    """outputs: ``[call][rank]`` fp32 outputs (None for compute_only calls, which have no
    combine). drift: the largest epoch difference seen between two ranks that were both
    inside a call at the same time (1 = call N+1 of one rank overlapped call N of another)."""

    outputs: list[list[torch.Tensor | None]]
    drift: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _done(cfg: SimConfig, epoch: int) -> int:
    """Value of a count_flags / flag1 entry set by call ``epoch``."""
    return epoch if cfg.epoch_flags else 1


def _chunk_flag(cfg: SimConfig, epoch: int) -> int:
    """Value of a flag0 chunk flag set by call ``epoch`` (kernels.layer0.dispatch_role)."""
    return _done(cfg, epoch)


def _home_group(rank: int, cfg: SimConfig) -> range:
    """The ranks a part whose home is ``rank`` is written to: ``rank``'s group of
    ``home_fanout`` (kernels.layer1.scatter_home, reduce_send_role)."""
    first = rank - rank % cfg.home_fanout
    return range(first, first + cfg.home_fanout)


def _known_part(parts: torch.Tensor, rank: int, cfg: SimConfig) -> torch.Tensor:
    """For each part index (a slot, or a rank), the one whose liveness ``rank``'s plan
    knows: itself, or with a fan-out the part of ``rank``'s TP index in its group
    (kernels.combine.combine_kernel)."""
    if cfg.home_fanout == 1 or not cfg.fanout_liveness:
        return parts
    return parts - parts % cfg.home_fanout + rank % cfg.home_fanout


class _Tags:
    """The epoch and the rank that last wrote each slot of one rank's buffer (epoch 0:
    never written), so a read can prove it sees its own call's data."""

    def __init__(self, name: str, owner: int, shape: tuple[int, ...]):
        self.name, self.owner = name, owner
        self.epoch = torch.zeros(shape, dtype=torch.int64)
        self.writer = torch.full(shape, -1, dtype=torch.int64)

    def write(self, index, epoch: int, writer: int) -> None:
        self.epoch[index] = epoch
        self.writer[index] = writer

    def check(self, index, epoch: int, context: str) -> None:
        """Raise unless every slot of ``index`` was written by call ``epoch``."""
        got = self.epoch[index]
        stale = got != epoch
        if bool(stale.any()):
            call, writer = int(got[stale][0]), int(self.writer[index][stale][0])
            origin = ("data never written" if call == 0 else
                      f"data written by rank {writer} in call {call}")
            raise ScheduleError(f"{context}: {self.name} of rank {self.owner} holds {origin}, "
                                f"not call {epoch}'s")


class _Rank:
    """One virtual rank: the buffers of its workspace, which persist across calls -- the
    symmetric ones peers write into, and the local h / out1 -- each slot tagged with the
    call that wrote it; its flags; its epoch; and its current call."""

    def __init__(self, r: int, world: int, el: int, h_dim: int, f_dim: int, top_k: int,
                 max_tokens: int, cfg: SimConfig):
        rows = recv_capacity(world, max_tokens, top_k)
        n_splits = _cdiv(_cdiv(h_dim, cfg.block_n1), cfg.blocks_per_split)
        self.r, self.world, self.rows = r, world, rows
        self.epoch, self.in_call, self.call = 0, False, None
        # [epoch parity][source]: the source's counts_all row [W_dst, El + 1]
        self.counts = [[None] * world for _ in range(cfg.count_buffers)]
        self.counts_tag = _Tags("counts", r, (cfg.count_buffers, world))
        self.count_flags = [0] * world
        self.a0 = torch.zeros(rows, h_dim)
        self.a0_tag = _Tags("a0", r, (rows,))
        # A gathered dispatch's: every source's token rows, and the row each a0 row reads.
        self.tokens = torch.zeros(world * max_tokens, h_dim)
        self.tokens_tag = _Tags("tokens", r, (world * max_tokens,))
        self.a0_src = torch.zeros(rows, dtype=torch.int64)
        self.src_tag = _Tags("a0_src", r, (rows,))
        self.recv_token = torch.zeros(world, max_tokens, dtype=torch.int64)
        self.recv_rows = torch.full((world, max_tokens, top_k), -1, dtype=torch.int64)
        self.recv_weight = torch.zeros(world, max_tokens, top_k)
        self.recv_tag = _Tags("return entries", r, (world, max_tokens))
        self.flag0 = [{} for _ in range(world)]     # [source][chunk], unset: 0
        self.comb = torch.zeros(world, max_tokens, h_dim)
        self.comb_tag = _Tags("comb", r, (world, max_tokens, n_splits))
        self.flag1 = [0] * world
        self.h = torch.zeros(rows, f_dim)
        self.h_tag = _Tags("h", r, (rows, _cdiv(f_dim, cfg.block_n0)))
        self.out1 = torch.zeros(rows, h_dim)
        self.out1_tag = _Tags("out1", r, (rows, _cdiv(h_dim, cfg.block_n1)))
        # The scatter epilogue's: where each received row goes (pushed with the row) and
        # the weighted rows of this rank's tokens, by (token, slot, column block).
        self.row_home = torch.zeros(rows, dtype=torch.int64)
        self.row_w = torch.zeros(rows)
        self.home_tag = _Tags("row_home", r, (rows,))
        self.pair_out = torch.zeros(max_tokens, top_k, h_dim)
        self.pair_tag = _Tags("pair_out", r, (max_tokens, top_k, _cdiv(h_dim, cfg.block_n1)))


class _Call:
    """Call ``n`` on one rank: its inputs, the tables layout_kernel builds from the counts
    the rank read, and the local counters zeroed when the call begins."""

    def __init__(self, rk: _Rank, n: int, x, ids, wts, counts_all, w13, w2, max_tokens: int,
                 cfg: SimConfig):
        r, world = rk.r, rk.world
        layout = build_recv_layout(counts_all)
        self.r, self.n, self.world, self.top_k = r, n, world, ids.shape[1]
        self.slots = max_tokens * self.top_k      # one rank's pair_out rows
        self.max_tokens = max_tokens
        self.x, self.w13, self.w2 = x.float(), w13.float(), w2.float()
        self.send = build_send_plan(ids, wts, counts_all, layout, r, max_tokens)
        # Which pair carries its token's row in a gathered dispatch.
        self.carries_row = (self.send.send_first.bool() if cfg.gather_with_first
                            else _last_of_token(self.send, self.top_k))
        self.tiles = build_tile_table(layout, r, rk.rows, cfg.block_m, cfg.local_head_tiles)
        self.num_tiles = int(self.tiles.num_tiles)
        self.entries = layout.entries[r].tolist()
        # Receiver tables the kernel uses to find the chunk holding a row (layout_kernel).
        pairs = counts_all[:, r, :-1].to(torch.int64)                   # [s, el]
        self.pre = torch.cumsum(pairs, dim=1) - pairs
        self.seg_start = layout.seg_off[r].to(torch.int64)              # [o, el]
        self.seg_rows = layout.seg_rows[r].to(torch.int64)
        self.chunks_total = [_cdiv(int(pairs[s].sum()), cfg.comm_rows)
                             + _cdiv(int(counts_all[s, r, -1]), cfg.comm_entries)
                             for s in range(world)]
        h_dim = self.w2.shape[2]
        self.split_count = [0] * _cdiv(_cdiv(h_dim, cfg.block_n1), cfg.blocks_per_split)
        # Work queues (kernels.sync.take): next lane of layer0's GEMM, next item of
        # layer1's reduce, next dispatch chunk; programs finished with the reduce.
        self.queue = {"l0": 0, "reduce": 0, "dispatch": 0}
        self.reduce_finished = 0

    def take(self, queue: str) -> int:
        """Next item of a work queue (the kernels' atomic counter)."""
        item = self.queue[queue]
        self.queue[queue] += 1
        return item


def simulate(xs, topk_ids, topk_weights, w13_shards, w2_shards, max_tokens: int,
             cfg: SimConfig = SimConfig()) -> list[torch.Tensor]:
    """Execute one fused call for ``len(xs)`` ranks; return each rank's fp32 output.

    Args mirror :func:`comet.reference.ep_forward`; ``max_tokens`` sizes the tables.
    Raises :class:`ScheduleError` on any violated dependency or deadlock.
    """
    return simulate_calls([(xs, topk_ids, topk_weights)], w13_shards, w2_shards, max_tokens,
                          cfg=cfg).outputs[0]


def simulate_calls(calls, w13_shards, w2_shards, max_tokens: int, cfg: SimConfig = SimConfig(),
                   modes=None) -> SimResult:
    """Execute consecutive calls of the layer on ``len(w13_shards)`` ranks.

    calls: per call ``(xs, topk_ids, topk_weights)``, per-rank lists as
        :func:`comet.reference.ep_forward` takes them (same ``top_k`` in every call).
    modes: per call, one of :data:`MODES` (default: every call fused).
    Each rank runs its calls in order on its stream; ranks are not kept in step, so they
    drift apart as far as the protocol lets them. Raises :class:`ScheduleError` on any
    violated dependency, read of another call's data, or deadlock.
    """
    world = len(w13_shards)
    modes = list(modes) if modes is not None else ["fused"] * len(calls)
    if len(modes) != len(calls) or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be one of {MODES} per call, got {modes!r}")
    if cfg.speeds is not None and len(cfg.speeds) != world:
        raise ValueError(f"speeds needs one weight per rank ({world}), got {cfg.speeds!r}")
    if cfg.home_fanout < 1 or world % cfg.home_fanout:
        raise ValueError(f"home_fanout must divide the {world} ranks, got {cfg.home_fanout}")
    el, h_dim, two_f = w13_shards[0].shape
    top_k = calls[0][1][0].shape[1]
    ranks = [_Rank(r, world, el, h_dim, two_f // 2, top_k, max_tokens, cfg)
             for r in range(world)]
    outputs: list[list[torch.Tensor | None]] = [[None] * world for _ in calls]
    streams = [_stream(rk, ranks, calls, modes, w13_shards[rk.r], w2_shards[rk.r],
                       max_tokens, outputs, cfg) for rk in ranks]
    kernels: dict[int, tuple[str, list]] = {}

    def launch_next(r: int) -> None:
        """Start rank r's next kernel with programs, or retire the rank."""
        for name, gens in streams[r]:
            if gens:
                kernels[r] = (name, [[gen, None] for gen in gens])
                return
        del kernels[r]

    for r in range(world):
        launch_next(r)
    rng = random.Random(cfg.seed)
    drift = 0
    while kernels:
        ready = [(r, prog) for r, (_, progs) in kernels.items() for prog in progs
                 if prog[1] is None or prog[1]()]
        if not ready:
            stuck = ", ".join(f"rank {r} call {ranks[r].epoch} {name} ({len(progs)} "
                              f"programs waiting)" for r, (name, progs) in kernels.items())
            raise ScheduleError(f"deadlock: {stuck}")
        if cfg.speeds is None:
            r, prog = rng.choice(ready)
        else:
            r, prog = rng.choices(ready, weights=[cfg.speeds[q] for q, _ in ready])[0]
        try:
            prog[1] = next(prog[0])
        except StopIteration:
            progs = kernels[r][1]
            progs.remove(prog)
            if not progs:
                launch_next(r)
        busy = [rk.epoch for rk in ranks if rk.in_call]
        if busy:
            drift = max(drift, max(busy) - min(busy))
    return SimResult(outputs, drift)


def _stream(rk: _Rank, ranks, calls, modes, w13, w2, max_tokens: int, outputs, cfg):
    """Rank ``rk``'s kernels in stream order, call after call, as (name, programs); the
    event loop asks for the next one only when every program of the previous finished."""
    compute = range(cfg.compute_programs)
    for n, ((xs, ids, wts), mode) in enumerate(zip(calls, modes), start=1):
        counts = local_counts(ids[rk.r], rk.world, w13.shape[0])
        yield "exchange", [_exchange_program(rk, ranks, n, counts, cfg)]
        yield "layout", [_layout_program(rk, n, xs[rk.r], ids[rk.r], wts[rk.r], w13, w2,
                                         max_tokens, cfg)]
        call, fused = rk.call, mode == "fused"
        comm = range(cfg.comm_programs if fused else 0)
        programs = len(comm) + len(compute)
        yield "layer0", ([_chain(_dispatch_program(rk, call, ranks, cfg),
                                 _layer0_program(rk, call, fused, programs, cfg)) for _ in comm]
                         + [_layer0_program(rk, call, fused, programs, cfg) for _ in compute])
        scatter = fused and cfg.layer1_scatter
        if scatter:
            yield "layer1", [_scatter_program(rk, call, ranks, i, programs, cfg)
                             for i in range(programs)]
        else:
            yield "layer1", ([_chain(_layer1_program(rk, call, i, len(compute), cfg),
                                     _reduce_program(rk, call, ranks, programs, cfg) if fused
                                     else iter(())) for i in compute]
                             + [_reduce_program(rk, call, ranks, programs, cfg) for _ in comm])
        if fused:
            yield "combine", [_combine_program(rk, call, ranks, outputs[n - 1], cfg, scatter)]
        rk.in_call = False


def _exchange_program(rk: _Rank, ranks, n: int, counts, cfg: SimConfig):
    """Workspace.begin_call, then the count exchange (comet.kernels.exchange: in a forward
    call the plan scan's last program pushes, the layout kernel waits): push this rank's
    counts into row ``r`` of every peer's counts buffer of this epoch's parity, set every
    peer's ``count_flags[r]``, and wait for every peer's. The wait is the handshake that
    opens a call: no peer writes anything else of call ``n`` into this rank before it."""
    rk.epoch, rk.in_call = n, True
    slot = n % cfg.count_buffers
    for peer in ranks:
        peer.counts[slot][rk.r] = counts
        peer.counts_tag.write((slot, rk.r), n, rk.r)
    for peer in ranks:
        peer.count_flags[rk.r] = _done(cfg, n)
    yield lambda: all(f >= _done(cfg, n) for f in rk.count_flags)


def _layout_program(rk: _Rank, n: int, x, ids, wts, w13, w2, max_tokens: int,
                    cfg: SimConfig):
    """kernels.plan.layout_kernel (with place_kernel): counts_all is what this rank reads
    from its counts buffer of the epoch's parity -- every source's row must be of call
    ``n`` -- and the call's plan and tile table are built from it."""
    slot = n % cfg.count_buffers
    rk.counts_tag.check((slot, slice(None)), n,
                        f"rank {rk.r} call {n} layout (counts buffer {slot})")
    counts_all = torch.stack(rk.counts[slot])
    rk.call = _Call(rk, n, x, ids, wts, counts_all, w13, w2, max_tokens, cfg)
    yield None


def _dispatch_program(rk: _Rank, call: _Call, ranks, cfg: SimConfig):
    """layer0 comm role of one program (kernels.layer0.dispatch_role): chunks from the
    dispatch queue, chunk ``g // W`` of the destination at ring offset ``g % W``, each
    published on its own flag as soon as it is copied."""
    world, n, s = call.world, call.n, call.send

    def chunks(d):
        rows = _cdiv(int(s.send_off[d + 1] - s.send_off[d]), cfg.comm_rows)
        return rows, rows + _cdiv(int(s.entry_count[d]), cfg.comm_entries)

    rounds = max(chunks(d)[1] for d in range(world))
    while (g := call.take("dispatch")) < rounds * world:
        c, d = g // world, (rk.r - g % world) % world
        dst = ranks[d]
        lo, hi = int(s.send_off[d]), int(s.send_off[d + 1])
        n_ent = int(s.entry_count[d])
        row_chunks, total = chunks(d)
        if c < total:
            if c < row_chunks:
                i = torch.arange(lo + c * cfg.comm_rows, min(lo + (c + 1) * cfg.comm_rows, hi))
                rows = s.send_row[i].long()
                placed = dst.src_tag if cfg.layer0_gather else dst.a0_tag
                if bool((placed.epoch[rows] == n).any()):
                    raise ScheduleError(f"rank {rk.r} call {n} overwrote rows of rank {d} "
                                        f"written in the same call")
                pair = s.send_pair[i].long()
                if cfg.layer0_gather:
                    token_row = rk.r * call.max_tokens + pair // call.top_k
                    dst.a0_src[rows] = token_row
                    dst.src_tag.write(rows, n, rk.r)
                    if not (cfg.own_in_place and d == rk.r):
                        carried = token_row[call.carries_row[i]]
                        dst.tokens[carried] = call.x[carried - rk.r * call.max_tokens]
                        dst.tokens_tag.write(carried, n, rk.r)
                else:
                    dst.a0[rows] = call.x[pair // call.top_k]
                    dst.a0_tag.write(rows, n, rk.r)
                if cfg.layer1_scatter:
                    dst.row_home[rows] = rk.r * call.slots + pair
                    dst.row_w[rows] = s.send_weight[i]
                    dst.home_tag.write(rows, n, rk.r)
            else:
                q = torch.arange((c - row_chunks) * cfg.comm_entries,
                                 min((c - row_chunks + 1) * cfg.comm_entries, n_ent))
                dst.recv_token[rk.r, q] = s.entry_token[d, q].long()
                dst.recv_rows[rk.r, q] = s.entry_rows[d, q].long()
                dst.recv_weight[rk.r, q] = s.entry_weight[d, q]
                dst.recv_tag.write((rk.r, q), n, rk.r)
            dst.flag0[rk.r][c] = _chunk_flag(cfg, n)
            yield None


def _last_of_token(send, top_k: int) -> torch.Tensor:
    """The pairs that are their token's last to their destination in send order (what
    ``SimConfig.gather_with_first=False`` sends a token's row with)."""
    last = torch.zeros_like(send.send_first, dtype=torch.bool)
    world = send.send_off.numel() - 1
    for d in range(world):
        seen = set()
        for i in range(int(send.send_off[d + 1]) - 1, int(send.send_off[d]) - 1, -1):
            token = int(send.send_pair[i]) // top_k
            last[i] = token not in seen
            seen.add(token)
    return last


def _chunks_needed(call: _Call, s: int, expert: int, r1: int, cfg: SimConfig) -> int:
    """Leading chunks of source ``s`` up to the one holding the tile's last row from ``s``
    (kernels.layer0._await_rows)."""
    o = (s - call.r) % call.world
    seg0 = int(call.seg_start[o, expert])
    last = min(r1, seg0 + int(call.seg_rows[o, expert])) - 1 - seg0
    return (int(call.pre[s, expert]) + last) // cfg.comm_rows + 1


def _landed(rk: _Rank, s: int, chunks: int, value: int) -> bool:
    """Have chunks ``[0, chunks)`` of source ``s`` landed on ``rk`` (flags >= value)?"""
    return all(rk.flag0[s].get(c, 0) >= value for c in range(chunks))


def _chain(*programs):
    """One program that runs ``programs`` one after the other (a block changing role)."""
    for program in programs:
        yield from program


def _layer0_program(rk: _Rank, call: _Call, wait: bool, programs: int, cfg: SimConfig):
    """layer0 compute role (kernels.layer0.layer0_compute_role): lanes of work items from
    the call's queue (kernels.group_gemm.strided_take over the layer's ``programs``); the
    rows of every tile of a lane are waited for before its first tile runs. Without
    ``wait`` (compute_only) it runs on whatever rows are in place, so reads are not
    checked."""
    f_dim = call.w2.shape[1]
    n_blocks = _cdiv(f_dim, cfg.block_n0)
    t, n = call.tiles, call.n
    total = call.num_tiles * n_blocks
    shape = lane_shape(total, programs, cfg.lane_items, cfg.lane_head_rounds,
                       cfg.lane_tail_rounds)
    while True:
        first, end = lane_of_take(call.take("l0"), programs, *shape)
        if first >= total:
            return
        lane = [grouped_work(w, call.num_tiles, n_blocks, cfg.group_m)
                for w in range(first, min(end, total), programs)]
        if wait:
            need = {}
            for tile, _ in lane:
                mask, e, r1 = int(t.wait_mask[tile]), int(t.expert[tile]), int(t.row_end[tile])
                for s in (s for s in range(call.world) if mask >> s & 1):
                    need[s] = max(need.get(s, 0), _chunks_needed(call, s, e, r1, cfg))
            yield lambda need=need: all(_landed(rk, s, c, _chunk_flag(cfg, n))
                                        for s, c in need.items())
        for tile, nb in lane:
            r0, r1, e = int(t.row_start[tile]), int(t.row_end[tile]), int(t.expert[tile])
            where = f"rank {rk.r} call {n} tile {tile} (rows {r0}:{r1})"
            if cfg.layer0_gather:
                src = rk.a0_src[r0:r1].long()
                t_own = src - rk.r * call.max_tokens
                own = (t_own >= 0) & (t_own < call.x.shape[0]) & cfg.own_in_place
                if wait:
                    rk.src_tag.check(slice(r0, r1), n, f"{where} read an old index")
                    rk.tokens_tag.check(src[~own], n,
                                        f"{where} ran before its token rows arrived")
                a = rk.tokens[src]
                a[own] = call.x[t_own[own]]
            else:
                if wait:
                    rk.a0_tag.check(slice(r0, r1), n, f"{where} ran before its rows arrived")
                a = rk.a0[r0:r1]
            c0, c1 = nb * cfg.block_n0, min((nb + 1) * cfg.block_n0, f_dim)
            gate = a @ call.w13[e][:, c0:c1]
            up = a @ call.w13[e][:, f_dim + c0:f_dim + c1]
            rk.h[r0:r1, c0:c1] = F.silu(gate) * up
            rk.h_tag.write((slice(r0, r1), nb), n, rk.r)
            yield None


def _layer1_program(rk: _Rank, call: _Call, role_pid: int, n_role: int, cfg: SimConfig):
    """layer1 compute role (kernels.layer1.layer1_compute_role): work items ``role_pid +
    i * n_role`` split by split, the split's tiles counted once its share is done."""
    h_dim = call.w2.shape[2]
    n_blocks = _cdiv(h_dim, cfg.block_n1)
    t, n = call.tiles, call.n
    total = call.num_tiles * n_blocks
    per_split = call.num_tiles * cfg.blocks_per_split
    for split in range(_cdiv(n_blocks, cfg.blocks_per_split)):
        lo, hi = split * per_split, min((split + 1) * per_split, total)
        done = 0
        for w in range(lo + (role_pid - lo) % n_role, hi, n_role):
            tile, nb, _ = column_work(w, call.num_tiles, n_blocks, cfg.blocks_per_split)
            r0, r1, e = int(t.row_start[tile]), int(t.row_end[tile]), int(t.expert[tile])
            rk.h_tag.check((slice(r0, r1), slice(None)), n,
                           f"rank {rk.r} call {n} layer1 tile {tile} read unfinished h rows")
            c0, c1 = nb * cfg.block_n1, min((nb + 1) * cfg.block_n1, h_dim)
            rk.out1[r0:r1, c0:c1] = rk.h[r0:r1] @ call.w2[e][:, c0:c1]
            rk.out1_tag.write((slice(r0, r1), nb), n, rk.r)
            done += 1
            yield None
        call.split_count[split] += done


def _scatter_program(rk: _Rank, call: _Call, ranks, pid: int, programs: int,
                     cfg: SimConfig):
    """layer1 with the scatter epilogue (kernels.layer1.scatter_home): work items ``pid +
    i * programs`` in column_work order, each tile's rows times their weights into their
    homes' ``pair_out``; the last of the ``programs`` to finish publishes flag1."""
    n = call.n
    h_dim = call.w2.shape[2]
    n_blocks = _cdiv(h_dim, cfg.block_n1)
    t = call.tiles
    for w in range(pid, call.num_tiles * n_blocks, programs):
        tile, nb, _ = column_work(w, call.num_tiles, n_blocks, cfg.blocks_per_split)
        r0, r1, e = int(t.row_start[tile]), int(t.row_end[tile]), int(t.expert[tile])
        rk.h_tag.check((slice(r0, r1), slice(None)), n,
                       f"rank {rk.r} call {n} layer1 tile {tile} read unfinished h rows")
        rk.home_tag.check(slice(r0, r1), n,
                          f"rank {rk.r} call {n} layer1 tile {tile}: row homes of another call")
        c0, c1 = nb * cfg.block_n1, min((nb + 1) * cfg.block_n1, h_dim)
        out = rk.h[r0:r1] @ call.w2[e][:, c0:c1]
        for row, value in zip(range(r0, r1), out):
            s, slot = divmod(int(rk.row_home[row]), call.slots)
            tok, j = divmod(slot, call.top_k)
            for home in _home_group(s, cfg):
                ranks[home].pair_out[tok, j, c0:c1] = value * rk.row_w[row]
                ranks[home].pair_tag.write((tok, j, nb), n, rk.r)
        yield None
    _finish_layer1(rk, call, ranks, programs, cfg)


def _finish_layer1(rk: _Rank, call: _Call, ranks, programs: int, cfg: SimConfig) -> None:
    """A layer1 program is done: the last of the layer's ``programs`` publishes flag1 on
    every rank (kernels.layer1._release_sources)."""
    call.reduce_finished += 1
    if call.reduce_finished == programs:
        for s in range(call.world):
            ranks[s].flag1[rk.r] = _done(cfg, call.n)


def _reduce_program(rk: _Rank, call: _Call, ranks, programs: int, cfg: SimConfig):
    """layer1 reduce (kernels.layer1.reduce_send_role): items from the call's reduce
    queue, split by split, inside a split source by source in ring order; the last of the
    layer's ``programs`` to finish publishes flag1."""
    world, n = call.world, call.n
    h_dim = call.w2.shape[2]
    n_blocks = _cdiv(h_dim, cfg.block_n1)
    # Return entries travel after the rows: all of a source's chunks must have landed.
    yield lambda: all(_landed(rk, s, call.chunks_total[s], _chunk_flag(cfg, n))
                      for s in range(world))
    for s in range(world):
        rk.recv_tag.check((s, slice(0, call.entries[s])), n,
                         f"rank {rk.r} call {n} reduce, return entries from rank {s}")
    items = [(split, (rk.r + o) % world, q0)
             for split in range(len(call.split_count)) for o in range(world)
             for q0 in range(0, call.entries[(rk.r + o) % world], cfg.reduce_item)]
    while (i := call.take("reduce")) < len(items):
        split, s, q0 = items[i]
        blocks = min(n_blocks - split * cfg.blocks_per_split, cfg.blocks_per_split)
        target = call.num_tiles * blocks
        yield lambda split=split, target=target: call.split_count[split] >= target
        nb0 = split * cfg.blocks_per_split
        c0, c1 = nb0 * cfg.block_n1, min((nb0 + blocks) * cfg.block_n1, h_dim)
        for q in range(q0, min(q0 + cfg.reduce_item, call.entries[s])):
            acc = torch.zeros(c1 - c0)
            for j, row in enumerate(rk.recv_rows[s, q].tolist()):
                if row < 0:
                    continue
                rk.out1_tag.check((row, slice(nb0, nb0 + blocks)), n,
                                  f"rank {rk.r} call {n} reduced split {split} "
                                  f"before row {row} was computed")
                acc += rk.out1[row, c0:c1] * rk.recv_weight[s, q, j]
            tok = int(rk.recv_token[s, q])
            for home in _home_group(s, cfg):
                ranks[home].comb[rk.r, tok, c0:c1] = acc
                ranks[home].comb_tag.write((rk.r, tok, split), n, rk.r)
        yield None
    _finish_layer1(rk, call, ranks, programs, cfg)


def _combine_program(rk: _Rank, call: _Call, ranks, outputs, cfg: SimConfig,
                     scatter: bool = False):
    """kernels.combine.combine_kernel: sum partial rows in rank order (``scatter``: the
    weighted rows of the token's real pairs, in slot order), each part live as the plan
    says of it or, with a fan-out, of its own TP index's part of its group
    (:func:`_known_part`). Asserts every part it sums was written by this call, and that
    no part this call wrote for one of its tokens is left out."""
    n = call.n
    yield lambda: all(f >= _done(cfg, n) for f in rk.flag1)
    m = call.x.shape[0]
    if scatter:
        known = call.send.pair_live[:m].bool()                          # [m, k]
        tags, rows = rk.pair_tag, rk.pair_out[:m]                       # [m, k, H]
    else:
        known = call.send.dest_mask[:m].bool()                          # [m, W]
        tags, rows = rk.comb_tag, rk.comb[:, :m].transpose(0, 1)        # [m, W, H]
    live = known[:, _known_part(torch.arange(known.shape[1]), rk.r, cfg)]
    tokens, parts = live.nonzero(as_tuple=True)
    index = (tokens, parts) if scatter else (parts, tokens)
    what = "rows of its tokens' slots" if scatter else "partial rows of its tokens"
    tags.check(index, n, f"rank {rk.r} call {n} combine, {what}")
    written = tags.epoch[:m] == n if scatter else (tags.epoch[:, :m] == n).transpose(0, 1)
    lost = written.any(dim=-1) & ~live
    if bool(lost.any()):
        tok, part = (int(v[0]) for v in lost.nonzero(as_tuple=True))
        raise ScheduleError(f"rank {rk.r} call {n} combine left out part {part} of token "
                            f"{tok}, which this call wrote: data went missing")
    outputs[rk.r] = (rows * live[:, :, None]).sum(dim=1)
