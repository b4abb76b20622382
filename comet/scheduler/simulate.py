"""Run both layers' schedules for W virtual ranks on the CPU, checking every dependency.

Each rank's kernels are modelled as *programs* (thread blocks) that execute their work
items in the order the kernels do -- same routing plan, same tile tables, same work-item
orders, same comm chunking -- and an event loop interleaves the programs of all ranks in
a random (seeded) order, running one work item at a time:

* a layer0 comm program pushes a chunk of rows (or return entries) to a destination and
  publishes it once the previous chunk is published, so the destination's flag for this
  source counts a prefix of landed chunks;
* a layer0 compute program may start a tile only once every source of its wait set has
  published the chunk holding the tile's last row from it, and then asserts that *every
  row it reads has arrived* -- the wait is sufficient;
* a layer1 compute program counts its tile for its column split; a layer1 comm program
  may reduce a split only when the count is complete, and asserts that every element it
  reads was computed; the combine waits for every rank's flag and asserts every partial
  row it sums was delivered.

Kernel order on one stream is respected (a rank's layer1 starts after its layer0 is done;
its combine after its layer1). If no program can make progress the schedule deadlocks and
:class:`ScheduleError` is raised. The result must equal :func:`comet.reference.ep_forward`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from comet.routing import build_recv_layout, build_send_plan, local_counts, recv_capacity
from comet.scheduler.plan import build_tile_table, column_work, grouped_work


class ScheduleError(AssertionError):
    """A tile ran before its data, a wait could never be satisfied, or data went missing."""


@dataclass(frozen=True)
class SimConfig:
    """Tile and launch shape of the simulated kernels (mirrors kernels.launch.TileConfig).

    blocks_per_split: layer1 column blocks per split (the comm role's unit of waiting).
    """

    block_m: int = 4
    block_n0: int = 8
    block_n1: int = 8
    blocks_per_split: int = 2
    group_m: int = 8
    comm_rows: int = 3
    comm_entries: int = 2
    comm_programs: int = 2
    compute_programs: int = 3
    seed: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Rank:
    """State of one virtual rank: its shared tensors plus what has arrived / been done."""

    def __init__(self, r, x, ids, wts, w13, w2, counts_all, layout, max_tokens, cfg):
        world = counts_all.shape[0]
        h_dim, f_dim = w13.shape[1], w2.shape[1]
        rows = recv_capacity(world, max_tokens, ids.shape[1])
        self.r, self.x, self.w13, self.w2 = r, x.float(), w13.float(), w2.float()
        self.send = build_send_plan(ids, wts, counts_all, layout, r, max_tokens)
        self.tiles = build_tile_table(layout, r, rows, cfg.block_m)
        self.num_tiles = int(self.tiles.num_tiles)
        self.entries = layout.entries[r].tolist()
        self.a0 = torch.full((rows, h_dim), float("nan"))
        self.arrived = torch.zeros(rows, dtype=torch.bool)
        self.h = torch.full((rows, f_dim), float("nan"))
        self.h_done = torch.zeros(rows, _cdiv(f_dim, cfg.block_n0), dtype=torch.bool)
        self.out1 = torch.full((rows, h_dim), float("nan"))
        self.out1_done = torch.zeros(rows, _cdiv(h_dim, cfg.block_n1), dtype=torch.bool)
        self.ret_tok = torch.zeros(world, max_tokens, dtype=torch.int64)
        self.ret_rows = torch.full((world, max_tokens, ids.shape[1]), -1, dtype=torch.int64)
        self.ret_w = torch.zeros(world, max_tokens, ids.shape[1])
        self.comb = torch.full((world, max_tokens, h_dim), float("nan"))
        self.flag0 = [0] * world            # chunks of each source published here
        self.published = [0] * world        # chunks this rank published to each dest
        # Receiver tables the kernel uses to find the chunk holding a row (layout_kernel).
        pairs = counts_all[:, r, :-1].to(torch.int64)                   # [s, el]
        self.pre = torch.cumsum(pairs, dim=1) - pairs
        self.seg_start = layout.seg_off[r].to(torch.int64)              # [o, el]
        self.seg_rows = layout.seg_rows[r].to(torch.int64)
        self.chunks_total = [_cdiv(int(pairs[s].sum()), cfg.comm_rows)
                             + _cdiv(int(counts_all[s, r, -1]), cfg.comm_entries)
                             for s in range(world)]
        self.entries_in = torch.zeros(world, max_tokens, dtype=torch.bool)
        self.flag1 = [False] * world
        self.split_count = [0] * _cdiv(_cdiv(h_dim, cfg.block_n1), cfg.blocks_per_split)
        self.comm1_finished = 0
        self.pending = {"layer0": 0, "layer1": 0}


def simulate(xs, topk_ids, topk_weights, w13_shards, w2_shards, max_tokens: int,
             cfg: SimConfig = SimConfig()) -> list[torch.Tensor]:
    """Execute the fused schedule for ``len(xs)`` ranks; return each rank's fp32 output.

    Args mirror :func:`comet.reference.ep_forward`; ``max_tokens`` sizes the tables.
    Raises :class:`ScheduleError` on any violated dependency or deadlock.
    """
    world = len(xs)
    el = w13_shards[0].shape[0]
    counts_all = torch.stack([local_counts(i, world, el) for i in topk_ids])
    layout = build_recv_layout(counts_all)
    ranks = [_Rank(r, xs[r], topk_ids[r], topk_weights[r], w13_shards[r], w2_shards[r],
                   counts_all, layout, max_tokens, cfg) for r in range(world)]
    programs: list[tuple[str, int, object]] = []
    for rk in ranks:
        for p in range(cfg.comm_programs):
            programs.append(("layer0", rk.r, _dispatch_program(rk, ranks, p, cfg)))
            programs.append(("layer1", rk.r, _reduce_program(rk, ranks, p, cfg)))
        for p in range(cfg.compute_programs):
            programs.append(("layer0", rk.r, _layer0_program(rk, p, cfg)))
            programs.append(("layer1", rk.r, _layer1_program(rk, p, cfg)))
        rk.pending = {"layer0": cfg.comm_programs + cfg.compute_programs,
                      "layer1": cfg.comm_programs + cfg.compute_programs}
    outputs: list[torch.Tensor | None] = [None] * world
    combines = {rk.r: _combine_program(rk, ranks, outputs) for rk in ranks}
    rng = random.Random(cfg.seed)
    live = [[layer, r, gen, None] for layer, r, gen in programs]
    live += [["combine", r, gen, None] for r, gen in combines.items()]
    while live:
        ready = [p for p in live if _may_run(p, ranks) and _wait_ok(p)]
        if not ready:
            stuck = ", ".join(f"{p[0]}@rank{p[1]} waiting for {p[3]}" for p in live)
            raise ScheduleError(f"deadlock: {stuck}")
        prog = rng.choice(ready)
        try:
            prog[3] = next(prog[2])
        except StopIteration:
            live.remove(prog)
            if prog[0] in ("layer0", "layer1"):
                ranks[prog[1]].pending[prog[0]] -= 1
    return outputs


def _may_run(prog, ranks) -> bool:
    """Stream order on one rank: layer0 kernel, then layer1 kernel, then the combine."""
    layer, r = prog[0], prog[1]
    pending = ranks[r].pending
    if layer == "layer1":
        return pending["layer0"] == 0
    if layer == "combine":
        return pending["layer0"] == 0 and pending["layer1"] == 0
    return True


def _wait_ok(prog) -> bool:
    cond = prog[3]
    return cond is None or cond()


def _dispatch_program(rk: _Rank, ranks, pid: int, cfg: SimConfig):
    """layer0 comm role of one program (kernels.layer0.dispatch_role): chunks striped over
    programs, each published after the previous one (so a destination sees a prefix)."""
    world = len(ranks)
    s = rk.send
    for o in range(world):
        d = (rk.r - o) % world
        dst = ranks[d]
        lo, hi = int(s.send_off[d]), int(s.send_off[d + 1])
        n_ent = int(s.ret_count[d])
        row_chunks = _cdiv(hi - lo, cfg.comm_rows)
        total = row_chunks + _cdiv(n_ent, cfg.comm_entries)
        for c in range(pid, total, cfg.comm_programs):
            if c < row_chunks:
                i = torch.arange(lo + c * cfg.comm_rows, min(lo + (c + 1) * cfg.comm_rows, hi))
                rows = s.send_row[i].long()
                if dst.arrived[rows].any():
                    raise ScheduleError(f"rank {rk.r} overwrote rows of rank {d}")
                dst.a0[rows] = rk.x[s.send_token[i].long()]
                dst.arrived[rows] = True
            else:
                q = torch.arange((c - row_chunks) * cfg.comm_entries,
                                 min((c - row_chunks + 1) * cfg.comm_entries, n_ent))
                dst.ret_tok[rk.r, q] = s.ret_token[d, q].long()
                dst.ret_rows[rk.r, q] = s.ret_rows[d, q].long()
                dst.ret_w[rk.r, q] = s.ret_weight[d, q]
                dst.entries_in[rk.r, q] = True
            yield lambda d=d, c=c: rk.published[d] == c
            rk.published[d] = c + 1
            dst.flag0[rk.r] = c + 1
            yield None


def _chunks_needed(rk: _Rank, s: int, expert: int, r1: int, cfg: SimConfig) -> int:
    """Published chunks of source ``s`` that cover the tile's last row from ``s``
    (kernels.layer0._await_rows)."""
    o = (s - rk.r) % len(rk.flag0)
    seg0 = int(rk.seg_start[o, expert])
    last = min(r1, seg0 + int(rk.seg_rows[o, expert])) - 1 - seg0
    return (int(rk.pre[s, expert]) + last) // cfg.comm_rows + 1


def _layer0_program(rk: _Rank, pid: int, cfg: SimConfig):
    """layer0 compute role (kernels.layer0.layer0_compute_role)."""
    f_dim = rk.w2.shape[1]
    n_blocks = _cdiv(f_dim, cfg.block_n0)
    t = rk.tiles
    for w in range(pid, rk.num_tiles * n_blocks, cfg.compute_programs):
        tile, nb = grouped_work(w, rk.num_tiles, n_blocks, cfg.group_m)
        mask = int(t.wait_mask[tile])
        sources = [s for s in range(len(rk.flag0)) if mask >> s & 1]
        r0, r1, e = int(t.row_start[tile]), int(t.row_end[tile]), int(t.expert[tile])
        need = {s: _chunks_needed(rk, s, e, r1, cfg) for s in sources}
        yield lambda: all(rk.flag0[s] >= n for s, n in need.items())
        if not bool(rk.arrived[r0:r1].all()):
            raise ScheduleError(f"rank {rk.r} tile {tile} (rows {r0}:{r1}) ran before its "
                                f"rows arrived; wait set {sources}")
        c0, c1 = nb * cfg.block_n0, min((nb + 1) * cfg.block_n0, f_dim)
        a = rk.a0[r0:r1]
        gate = a @ rk.w13[e][:, c0:c1]
        up = a @ rk.w13[e][:, f_dim + c0:f_dim + c1]
        rk.h[r0:r1, c0:c1] = F.silu(gate) * up
        rk.h_done[r0:r1, nb] = True


def _layer1_program(rk: _Rank, pid: int, cfg: SimConfig):
    """layer1 compute role (kernels.layer1.layer1_compute_role)."""
    h_dim = rk.w2.shape[2]
    n_blocks = _cdiv(h_dim, cfg.block_n1)
    t = rk.tiles
    for w in range(pid, rk.num_tiles * n_blocks, cfg.compute_programs):
        tile, nb, split = column_work(w, rk.num_tiles, n_blocks, cfg.blocks_per_split)
        r0, r1, e = int(t.row_start[tile]), int(t.row_end[tile]), int(t.expert[tile])
        if not bool(rk.h_done[r0:r1].all()):
            raise ScheduleError(f"rank {rk.r} layer1 tile {tile} read unfinished h rows")
        c0, c1 = nb * cfg.block_n1, min((nb + 1) * cfg.block_n1, h_dim)
        rk.out1[r0:r1, c0:c1] = rk.h[r0:r1] @ rk.w2[e][:, c0:c1]
        rk.out1_done[r0:r1, nb] = True
        rk.split_count[split] += 1
        yield None


def _reduce_program(rk: _Rank, ranks, pid: int, cfg: SimConfig):
    """layer1 comm role (kernels.layer1.reduce_send_role)."""
    world = len(ranks)
    h_dim = rk.w2.shape[2]
    n_blocks = _cdiv(h_dim, cfg.block_n1)
    # Return entries travel after the rows: all of a source's chunks must have landed.
    yield lambda: all(rk.flag0[s] >= rk.chunks_total[s] for s in range(world))
    for s in range(world):
        if not bool(rk.entries_in[s, :rk.entries[s]].all()):
            raise ScheduleError(f"rank {rk.r} reads return entries of rank {s} not delivered")
    for split in range(len(rk.split_count)):
        blocks = min(n_blocks - split * cfg.blocks_per_split, cfg.blocks_per_split)
        target = rk.num_tiles * blocks
        yield lambda split=split, target=target: rk.split_count[split] >= target
        nb0 = split * cfg.blocks_per_split
        c0, c1 = nb0 * cfg.block_n1, min((nb0 + blocks) * cfg.block_n1, h_dim)
        for o in range(world):
            s = (rk.r + o) % world
            n_ent = rk.entries[s]
            for c in range(pid, _cdiv(n_ent, cfg.comm_entries), cfg.comm_programs):
                for q in range(c * cfg.comm_entries, min((c + 1) * cfg.comm_entries, n_ent)):
                    rows = rk.ret_rows[s, q]
                    acc = torch.zeros(c1 - c0)
                    for j, row in enumerate(rows.tolist()):
                        if row < 0:
                            continue
                        if not bool(rk.out1_done[row, nb0:nb0 + blocks].all()):
                            raise ScheduleError(f"rank {rk.r} reduced split {split} before "
                                                f"row {row} was computed")
                        acc += rk.out1[row, c0:c1] * rk.ret_w[s, q, j]
                    ranks[s].comb[rk.r, rk.ret_tok[s, q], c0:c1] = acc
                yield None
    rk.comm1_finished += 1
    if rk.comm1_finished == cfg.comm_programs:
        for s in range(world):
            ranks[s].flag1[rk.r] = True


def _combine_program(rk: _Rank, ranks, outputs):
    """kernels.layer1.combine_kernel: sum partial rows in rank order."""
    world = len(ranks)
    yield lambda: all(rk.flag1)
    m = rk.x.shape[0]
    mask = rk.send.dest_mask[:m].bool()
    y = torch.zeros(m, rk.x.shape[1])
    for d in range(world):
        part = rk.comb[d, :m][mask[:, d]]
        if torch.isnan(part).any():
            raise ScheduleError(f"rank {rk.r} summed a partial row rank {d} never sent")
        y[mask[:, d]] += part
    outputs[rk.r] = y
