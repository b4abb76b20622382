"""Tile schedules of the two fused layers, as int32/int64 device tables.

Both layers cut the receiving rank's rows into *m-tiles*: ``block_m`` rows of one local
expert (an expert's last tile may be short). The tables have a fixed capacity
(:func:`tile_capacity`) and a live count ``num_tiles`` kept on the device.

layer0 (dispatch -> GroupGEMM, shared tensor decomposed along M):
    m-tiles are ordered by *stage* -- the largest ring offset among the sources whose rows
    the tile holds -- then by expert and row. Stage-0 tiles hold only this rank's own rows
    and run while remote rows are still in flight. Each tile carries its *wait set*: a
    bitmask of exactly the source ranks whose segments its rows overlap. Work item ``w`` of
    the compute role is (m-tile ``w // n_blocks``, column block ``w % n_blocks``).

layer1 (GroupGEMM -> top-k reduce + combine, shared tensor decomposed along N):
    column-wise: work item ``w`` is (column block ``w // num_tiles``, m-tile
    ``w % num_tiles``), so every expert's tiles of column block ``n`` finish before column
    block ``n + 1`` starts, and the comm role reduces and sends block ``n`` while ``n + 1``
    computes. A column block is complete when ``num_tiles`` tiles have reported it
    (:func:`layer1_work` is that contract, shared by the kernel and the simulator).
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
                     block_m: int) -> TileTable:
    """The local-first m-tile table of destination ``rank`` (see module docstring)."""
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

    # Local-first order: by stage, then by (expert, row) -- idx already follows those.
    key = torch.where(live, stage * cap + idx, torch.full_like(idx, world * cap) + idx)
    order = torch.argsort(key)
    return TileTable(
        expert=expert[order].to(torch.int32),
        row_start=row_start[order].to(torch.int32),
        row_end=row_end[order].to(torch.int32),
        wait_mask=wait_mask[order],
        stage=stage[order].to(torch.int32),
        num_tiles=num_tiles,
    )


def layer0_work(w: int, n_blocks: int) -> tuple[int, int]:
    """layer0 work item -> (tile index in the table, column block)."""
    return w // n_blocks, w % n_blocks


def layer1_work(w: int, num_tiles: int) -> tuple[int, int]:
    """layer1 work item -> (tile index in the table, column block): column-major."""
    return w % num_tiles, w // num_tiles
