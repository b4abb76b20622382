"""Tile schedules of the two fused layers, as int32/int64 device tables.

Both layers cut the receiving rank's rows into *m-tiles*: ``block_m`` rows of one local
expert (an expert's last tile may be short). The tables have a fixed capacity
(:func:`tile_capacity`) and a live count ``num_tiles`` kept on the device.

layer0 (dispatch -> GroupGEMM, shared tensor decomposed along M):
    a tile's *stage* is the largest ring offset among the sources whose rows it holds;
    stage-0 tiles hold only this rank's own rows. The order is a *local head* -- the
    first ``head_tiles`` stage-0 tiles, which run while the first remote rows are in
    flight -- then every other tile by expert and row (*expert-major*): all tiles of an
    expert, whatever their sources, run side by side, so the weight blocks they share are
    read from HBM once and served from L2 to the rest. Ordering every stage-0 tile first
    (the paper's local-first order) cut each expert's tiles into W groups far apart, each
    reading the expert's weights again: on many small experts that made the GEMMs weight-
    bandwidth bound (docs/design.md, "Rescheduling"). The dispatch pushes every
    destination's rows in expert order, all destinations abreast
    (:func:`comet.kernels.layer0.dispatch_role`), so a tile's remote rows land in the
    order the tiles need them. Each tile carries its *wait set*: a bitmask of exactly the
    source ranks whose segments its rows overlap.
    Work items are (m-tile, column block) pairs in :func:`grouped_work` order.

layer1 (GroupGEMM -> top-k reduce + combine, shared tensor decomposed along N):
    column-wise: the columns are cut into *splits* of a few column blocks, and every
    expert's tiles of split ``s`` run before split ``s + 1`` (:func:`column_work`), so the
    comm role reduces and sends split ``s`` while ``s + 1`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comet.routing import RecvLayout

#: Bits in a wait-set mask; world sizes above this need a wider mask.
MAX_WORLD_SIZE = 63


def tile_capacity(rows_capacity: int, local_experts: int, block_m: int) -> int:
    """Most m-tiles a rank can have: every expert may end with one partial tile."""
    return -(-rows_capacity // block_m) + local_experts


@dataclass
class TileTable:
    """m-tiles of one rank, in the order the layer0 compute role runs them.

    expert:    ``[T]`` local expert of the tile.
    row_start: ``[T]`` first row (in the shared tensor).
    row_end:   ``[T]`` one past the last row.
    wait_mask: ``[T]`` int64 bitmask over source ranks whose rows the tile reads.
    stage:     ``[T]`` largest ring offset among those sources (0 = local only).
    num_tiles: ``[1]`` live tiles; entries past it are padding (``row_end == row_start``).
    """

    expert: torch.Tensor
    row_start: torch.Tensor
    row_end: torch.Tensor
    wait_mask: torch.Tensor
    stage: torch.Tensor
    num_tiles: torch.Tensor


def build_tile_table(layout: RecvLayout, rank: int, rows_capacity: int,
                     block_m: int, head_tiles: int = 0) -> TileTable:
    """The m-tile table of destination ``rank``: ``head_tiles`` stage-0 tiles, then
    expert-major (see module docstring)."""
    world, el_count = layout.expert_rows.shape
    if world > MAX_WORLD_SIZE:
        raise ValueError(f"world size {world} exceeds the wait-mask width {MAX_WORLD_SIZE}")
    dev = layout.expert_rows.device
    cap = tile_capacity(rows_capacity, el_count, block_m)
    rows = layout.expert_rows[rank].to(torch.int64)                       # [El]
    tiles_per_expert = (rows + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)                          # inclusive
    num_tiles = tile_end[-1:].to(torch.int32)
    idx = torch.arange(cap, device=dev)
    expert = torch.searchsorted(tile_end, idx, right=True).clamp(max=el_count - 1)
    live = idx < tile_end[-1]
    mb = idx - (tile_end - tiles_per_expert)[expert]
    ex_start = layout.expert_off[rank].to(torch.int64)[expert]
    row_start = ex_start + mb * block_m
    row_end = torch.minimum(row_start + block_m, ex_start + rows[expert])
    row_end = torch.where(live, row_end, row_start)

    seg_start = layout.seg_off[rank].to(torch.int64)[:, expert]           # [W(o), T]
    seg_end = seg_start + layout.seg_rows[rank].to(torch.int64)[:, expert]
    overlap = (seg_start < row_end) & (seg_end > row_start) & (seg_end > seg_start)
    offsets = torch.arange(world, device=dev).view(world, 1)
    source_bit = torch.bitwise_left_shift(torch.ones_like(offsets), (rank + offsets) % world)
    wait_mask = (overlap.to(torch.int64) * source_bit).sum(dim=0)
    stage = torch.where(overlap, offsets, torch.full_like(offsets, -1)).amax(dim=0).clamp(min=0)

    # idx already runs by (expert, row); the head takes the first stage-0 tiles out of it.
    local = live & (stage == 0)
    head = local & (torch.cumsum(local.to(torch.int64), 0) <= head_tiles)
    key = torch.where(head, idx, torch.where(live, cap + idx, 2 * cap + idx))
    order = torch.argsort(key)
    return TileTable(
        expert=expert[order].to(torch.int32),
        row_start=row_start[order].to(torch.int32),
        row_end=row_end[order].to(torch.int32),
        wait_mask=wait_mask[order],
        stage=stage[order].to(torch.int32),
        num_tiles=num_tiles,
    )


def grouped_work(w: int, num_tiles: int, n_blocks: int, group_m: int) -> tuple[int, int]:
    """layer0 work item ``w`` -> (tile index, column block).

    Groups of ``group_m`` consecutive tiles of the table sweep the column blocks together
    (a weight block is then read once per group while it sits in L2); groups follow the
    table's order. Mirrored by ``kernels.group_gemm.grouped_work``.
    """
    per_group = group_m * n_blocks
    first = (w // per_group) * group_m
    size = min(num_tiles - first, group_m)
    within = w % per_group
    return first + within % size, within // size


def lane_shape(total: int, programs: int, lane_items: int, head_rounds: int,
               tail_rounds: int) -> tuple[int, int, int]:
    """How layer0's queue of ``total`` work items is cut into takes: ``(items, head,
    lanes_end)`` -- one item per take below ``head`` and from ``lanes_end`` on, lanes of
    ``items`` in between. Mirrored by ``kernels.group_gemm.lane_shape`` (which says why)."""
    items = lane_items if total >= programs * lane_items else 1
    head = min(head_rounds * programs, total)
    rounds = max(total - head - tail_rounds * programs, 0) // (programs * items)
    return items, head, head + rounds * programs * items


def lane_of_take(q: int, programs: int, items: int, head: int,
                 lanes_end: int) -> tuple[int, int]:
    """Take ``q`` of layer0's queue -> ``(first, end)``: its items are ``first, first +
    programs, ...`` below ``end``. Mirrored by ``kernels.group_gemm.strided_take``."""
    lane_takes = (lanes_end - head) // items
    r = q - head
    if r < 0:
        return q, q + 1
    if r < lane_takes:
        rnd = r // programs
        return head + rnd * programs * items + r % programs, head + (rnd + 1) * programs * items
    first = lanes_end + r - lane_takes
    return first, first + 1


def column_work(w: int, num_tiles: int, n_blocks: int,
                blocks_per_split: int) -> tuple[int, int, int]:
    """layer1 work item ``w`` -> (tile index, column block, column split).

    Split-major: every tile of split ``s`` (``blocks_per_split`` column blocks) comes
    before any of split ``s + 1``; inside a split, tile-major, so an m-tile's rows of h are
    reused from L2 across its column blocks. A split is complete after ``num_tiles *
    blocks`` work items. Mirrored by ``kernels.group_gemm.column_work``.
    """
    split = w // (num_tiles * blocks_per_split)
    within = w % (num_tiles * blocks_per_split)
    first = split * blocks_per_split
    blocks = min(n_blocks - first, blocks_per_split)
    return within // blocks, first + within % blocks, split
