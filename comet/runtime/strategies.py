"""layer1's two algorithms, as strategy objects that own their buffers and launch arguments.

Both compute the same function -- each token's ``sum_j weight_j * expert_j(x)`` on its home
rank -- and differ in where the top-k sum happens:

* :class:`ColumnReduce` -- the paper's schedule: the GroupGEMM runs column split by
  column split into a local ``out1``; comm blocks sum each token's rows on this rank per
  split (fp32) and send one row per (token, rank) into the token's rank's ``comb``; the
  combine there adds the ranks' rows. Fewer bytes cross the link when a token has
  several experts on one rank; a reduce pass over ``out1``. The backward and the
  decomposed modes (sequential, compute-only, comm-only) always run it.
* :class:`Scatter` -- the GEMM's epilogue writes each row, weighted, straight into its
  token's slot of ``pair_out`` on the token's rank (the dispatch sent each row's home
  along with it); the combine sums a token's ``k`` slots. No comm role and no reduce
  pass. Fused forward calls run it when ``Variant.layer1_scatter`` is set (default).

A strategy declares the symmetric buffers it needs (:meth:`specs`, allocated with the
workspace's, comet.runtime.workspace), whether layer0 must send row homes, how it
launches layer1, and what the combine sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comet.config import MoEConfig, TileConfig
from comet.constants import constexpr
from comet.kernels.combine import Parts
from comet.kernels.group_gemm import Gemm, GemmTile
from comet.kernels.layer0 import Homes as DispatchHomes
from comet.kernels.layer1 import (Homes, KSplit, Pairs, Progress, Reduce, Splits,
                                  launch_layer1_reduce, launch_layer1_scatter)
from comet.kernels.plan import EntryTables
from comet.kernels.sync import Trace
from comet.routing import recv_capacity


@dataclass(frozen=True)
class BufferSpec:
    """A symmetric buffer: same name, shape and offset on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def progress_of(ws: "Workspace") -> Progress:
    """How layer1 on ``ws`` counts its progress and tells the sources it is done."""
    return Progress(ws.count.split, ws.count.l1_done, ws.peers.flag1)


def scatter_homes(ws: "Workspace") -> Homes:
    """Where the scatter epilogue on ``ws`` sends each row: its token's slot of
    ``pair_out`` on the token's rank (and that rank's group of ``fanout``)."""
    cfg = ws.cfg
    return Homes(ws.local.row_home, ws.local.row_weight, ws.peers.pair_out,
                 cfg.max_tokens * cfg.top_k, constexpr(ws.fanout))


class ColumnReduce:
    """layer1 as GroupGEMM in column splits, then reduce-and-send by comm blocks."""

    name = "reduce"
    #: Whether layer0's dispatch must send each row's home and weight.
    sends_homes = False

    @staticmethod
    def specs(cfg: MoEConfig, world: int) -> list[BufferSpec]:
        # comb[r, t] on rank s: rank r's weighted sum of token t's rows (t of rank s).
        return [BufferSpec("comb", (world, cfg.max_tokens, cfg.hidden_size), cfg.dtype)]

    @staticmethod
    def comm_blocks(requested: int) -> int:
        """layer1's comm blocks as run, for a requested split."""
        return requested

    @staticmethod
    def launch(ws: "Workspace", grid: int, *, gemm: Gemm, item: GemmTile,
               splits: Splits, tile: TileConfig, role: int, split: torch.Tensor,
               trace: Trace, wait: bool = True, cooperative: bool = False,
               pairs: Pairs | None = None) -> None:
        """layer1 on ``ws`` (``role``: fused, comm or compute; ``pairs``: the backward's
        per-row scalar, returned with the rows)."""
        mx = ws.cfg.max_tokens
        recv = EntryTables(*(b.local for b in ws.recv))
        launch_layer1_reduce(
            grid, gemm=gemm, item=item, splits=splits, tiles=ws.plan.tiles,
            progress=progress_of(ws), reduce=Reduce(recv, ws.peers.comb, mx, ws.rank % ws.tp,
                                                  ws.count.l1_reduce, pairs,
                                                  constexpr(ws.fanout), constexpr(ws.tp)),
            arrivals=ws.arrivals, sync=ws.sync, split=split, trace=trace, shape=ws.shape,
            tile=tile, role=role, wait=wait, cooperative=cooperative)

    @staticmethod
    def parts(ws: "Workspace") -> Parts:
        """comb ``[W, Mx, H]``: part ``d`` of token ``t`` is row ``d * Mx + t``."""
        return Parts(ws.local.comb, ws.plan.dest_mask, ws.cfg.max_tokens, 1, ws.world, ws.fanout)


class Scatter:
    """layer1 as GroupGEMM whose epilogue sends every weighted row home."""

    name = "scatter"
    sends_homes = True

    @staticmethod
    def specs(cfg: MoEConfig, world: int) -> list[BufferSpec]:
        rows = recv_capacity(world, cfg.max_tokens, cfg.slots_per_rank)
        mx, k, h = cfg.max_tokens, cfg.top_k, cfg.hidden_size
        # row_home[r]: the slot s * Mx * k + t * k + j row r's output goes to, and
        # row_weight[r] its weight, both pushed with the row; pair_out[t, j]: the
        # weighted output of token t's slot j, written by the rank holding its expert.
        return [BufferSpec("row_home", (rows,), torch.int32),
                BufferSpec("row_weight", (rows,), torch.float32),
                BufferSpec("pair_out", (mx, k, h), cfg.dtype)]

    @staticmethod
    def comm_blocks(requested: int) -> int:
        return 0    # no comm role: the epilogue sends

    @staticmethod
    def homes(ws: "Workspace") -> DispatchHomes:
        """What layer0's dispatch sends with each row."""
        return DispatchHomes(ws.peers.row_home, ws.peers.row_weight)

    @staticmethod
    def launch(ws: "Workspace", grid: int, *, gemm: Gemm, item: GemmTile,
               splits: Splits, tile: TileConfig, role: int, split: torch.Tensor,
               trace: Trace, wait: bool = True, cooperative: bool = False,
               pairs: Pairs | None = None) -> None:
        """layer1 on every program of ``grid`` (``role``, ``split``, ``wait`` and
        ``cooperative`` do not apply: its programs wait for no peer)."""
        assert pairs is None, "the scatter epilogue serves the forward only"
        ksplit = ({"ksplit": KSplit(ws.l1_partial, ws.count.arrived,
                                    constexpr(tile.variant.layer1_split_k))}
                  if tile.variant.layer1_split_k > 1 else {})
        launch_layer1_scatter(grid, gemm=gemm, item=item, splits=splits,
                              tiles=ws.plan.tiles, progress=progress_of(ws),
                              homes=scatter_homes(ws), sync=ws.sync, trace=trace,
                              shape=ws.shape, tile=tile, **ksplit)

    @staticmethod
    def parts(ws: "Workspace") -> Parts:
        """pair_out ``[Mx, k, H]``: part ``j`` of token ``t`` is row ``t * k + j``."""
        return Parts(ws.local.pair_out, ws.plan.pair_live, 1, ws.cfg.top_k, ws.cfg.top_k, ws.fanout)


def scatter_pays(tp: int, ep: int, convention: str) -> bool:
    """Whether the scatter epilogue is a layout's default layer1 (``Variant.layer1_scatter``).

    Not where every rank holds every expert's F shard and every rank passes the same
    tokens (the replicated convention with ``ep == 1``): there each token's ``k`` slots
    are all on every rank, and the scatter stores ``k`` rows per token on each rank of
    the group where the reduce sends one summed row. Elsewhere (``ep > 1``, or the
    sequence convention, where each token has one home) the reduce was not faster at
    every size (docs/notebook.md, "Large calls"). A choice by layout, not by call: every
    rank of a layout makes the same one, which the combine on each token's rank relies on.
    """
    return not (convention == "replicated" and tp > 1 and ep == 1)


#: Mean (token, slot) pairs per (token, destination rank) from which layer0's gathered
#: dispatch (``Variant.layer0_gather``) is a layout's default.
GATHER_PAIRS_PER_RANK = 4


def gather_pays(top_k: int, ep: int) -> bool:
    """Whether a layout's layer0 sends each token's row once per rank and reads its A rows
    through an index (``Variant.layer0_gather``) by default: where a token has, on
    average, at least :data:`GATHER_PAIRS_PER_RANK` of its (shard) slots on a rank --
    ``top_k / ep`` in a (tp, ep) layout, whose kernels see ``tp * top_k`` shard slots
    over ``tp * ep`` ranks. Below that the index's loads cost more than the rows and
    copies they save (docs/notebook.md, "Large calls"). A choice by layout: it sets which
    buffers every rank allocates."""
    return top_k >= GATHER_PAIRS_PER_RANK * ep


def strategies_of(tile: TileConfig) -> list[type]:
    """The strategies a layer with ``tile`` may run (whose buffers it allocates): the
    column-split reduce always (the backward and the decomposed modes), the scatter
    where the tile enables it."""
    return [ColumnReduce, Scatter] if tile.variant.layer1_scatter else [ColumnReduce]


def strategy_for(tile: TileConfig, mode: str) -> type:
    """The strategy a call in ``mode`` runs: the scatter for fused calls of a layer whose
    tile enables it, else the column-split reduce (the decomposed modes keep it, so that
    they stay the decomposition of a fused call)."""
    return Scatter if tile.variant.layer1_scatter and mode == "fused" else ColumnReduce
