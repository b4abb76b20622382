"""A layer's launches as typed objects, all called the same way.

Each holds the arguments of one launch, built once per call variant, and is called as
``launch(grid, role, wait=..., trace=..., cooperative=...)``: layer0 (dispatch and gated
GroupGEMM), layer1 (its strategy's kernel: the scatter epilogue or the column reduce)
and the combine. The forward (comet.runtime.forward) and the backward
(comet.runtime.backward) build their phases from them, so a phase is "this launch, in
this role, on this grid" whichever layer it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comet.config import TileConfig
from comet.constants import ROLE_FUSED
from comet.kernels.combine import Combine, launch_combine
from comet.kernels.group_gemm import Gemm, GemmTile
from comet.kernels.layer0 import Dispatch, Work, launch_layer0
from comet.kernels.layer1 import Pairs, Splits
from comet.kernels.plan import Segments, Tiles
from comet.kernels.shape import Shape
from comet.kernels.sync import Sync, Trace
from comet.runtime.workspace import Workspace


@dataclass(frozen=True)
class Layer0Launch:
    """layer0 of one rank: ``dispatch`` sends the rows, the GroupGEMM ``gemm`` of
    ``item`` tiles runs over ``tiles`` (``work``: its queue and stream-K scratch);
    ``split``: the device scalar of its comm blocks."""

    dispatch: Dispatch
    gemm: Gemm
    item: GemmTile
    tiles: Tiles
    segments: Segments
    work: Work
    sync: Sync
    split: torch.Tensor
    shape: Shape
    tile: TileConfig

    def __call__(self, grid: int, role: int, *, wait: bool = True, trace: Trace,
                 cooperative: bool = False) -> None:
        launch_layer0(grid, dispatch=self.dispatch, gemm=self.gemm, item=self.item,
                      tiles=self.tiles, segments=self.segments, work=self.work,
                      sync=self.sync, split=self.split, trace=trace, shape=self.shape,
                      tile=self.tile, role=role, wait=wait, cooperative=cooperative)


@dataclass(frozen=True)
class Layer1Launch:
    """layer1 of one rank on ``ws`` by ``strategy`` (comet.runtime.strategies): the
    GroupGEMM ``gemm`` of ``item`` tiles in column ``splits``; ``split``: the device
    scalar of its comm blocks; ``pairs``: the backward's per-row scalar, or None."""

    strategy: type
    ws: Workspace
    gemm: Gemm
    item: GemmTile
    splits: Splits
    tile: TileConfig
    split: torch.Tensor
    pairs: Pairs | None = None

    def __call__(self, grid: int, role: int, *, wait: bool = True, trace: Trace,
                 cooperative: bool = False) -> None:
        self.strategy.launch(self.ws, grid, gemm=self.gemm, item=self.item,
                             splits=self.splits, tile=self.tile, role=role,
                             split=self.split, trace=trace, wait=wait,
                             cooperative=cooperative, pairs=self.pairs)


@dataclass(frozen=True)
class CombineLaunch:
    """The combine of one rank: ``combine``'s parts summed into its output once every
    rank's ``flag1`` says they landed. It has no roles and no trace: ``role``, ``trace``
    and ``cooperative`` are accepted so that it is called as the layers are."""

    combine: Combine
    flag1: torch.Tensor
    max_tokens: int
    sync: Sync
    tile: TileConfig

    def __call__(self, grid: int, role: int = ROLE_FUSED, *, wait: bool = True,
                 trace: Trace | None = None, cooperative: bool = False) -> None:
        launch_combine(grid, combine=self.combine, flag1=self.flag1,
                       max_tokens=self.max_tokens, sync=self.sync, tile=self.tile,
                       wait=wait)
