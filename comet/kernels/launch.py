"""Host launchers of the fused kernels: one function per phase of a call.

A call on one rank is the sequence

    exchange (push, wait) -> plan (torch, on the device) -> layer0 -> layer1 -> combine

and each launcher below runs one phase for one rank. :class:`comet.runtime.layer.FusedMoE`
runs them back to back on a stream (fused roles: one launch per layer); the virtual-rank
driver (:mod:`comet.runtime.virtual`) runs each phase for all ranks before the next, with
the producer role launched before the consumer role, which is what lets W ranks share one
process under the Triton interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.config import MoEConfig
from comet.kernels import layer0 as l0
from comet.kernels import layer1 as l1
from comet.routing import (RecvLayout, SendPlan, build_recv_layout, build_send_plan,
                           local_counts, recv_capacity)
from comet.runtime.workspace import Workspace
from comet.scheduler.plan import TileTable, build_tile_table

ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE = 0, 1, 2
PHASE_PUSH, PHASE_WAIT, PHASE_BOTH = 1, 2, 3


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU, one program at a time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shapes of the fused kernels.

    block_m: rows of an m-tile (both layers share the tile table).
    block_n0: columns of a layer0 work item, per half (gate and up).
    block_n1: columns of a layer1 work item.
    block_k: K step (shrunk to divide H and F where needed).
    splits: target number of layer1 column splits (the comm role's unit of waiting).
    comm_rows / comm_block_h: tile of the dispatch copy (rows x columns).
    comm_entries / comm_block_c: tile of the layer1 reduce (entries x columns).
    combine_rows / combine_block_h: tile of the final combine.
    """

    block_m: int = 128
    block_n0: int = 128
    block_n1: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    splits: int = 8
    comm_rows: int = 32
    comm_block_h: int = 512
    comm_entries: int = 16
    comm_block_c: int = 256
    combine_rows: int = 16
    combine_block_h: int = 512

    @staticmethod
    def small() -> "TileConfig":
        """Tiny tiles for the interpreter and unit tests."""
        return TileConfig(block_m=16, block_n0=16, block_n1=32, block_k=16, num_warps=4,
                          num_stages=1, splits=2, comm_rows=8, comm_block_h=32,
                          comm_entries=8, comm_block_c=16, combine_rows=8,
                          combine_block_h=32)

    def k_step(self, k: int) -> int:
        """Largest power-of-two step <= block_k dividing ``k`` (B rows must not cross into
        the next expert's weights)."""
        step = self.block_k
        while k % step:
            step //= 2
        return step

    def blocks_per_split(self, hidden: int) -> int:
        n_blocks = -(-hidden // self.block_n1)
        return max(1, -(-n_blocks // self.splits))

    def n_splits(self, hidden: int) -> int:
        n_blocks = -(-hidden // self.block_n1)
        return -(-n_blocks // self.blocks_per_split(hidden))


@dataclass
class CallPlan:
    """Everything one rank computed for one call (device tensors; no host sync)."""

    num_tokens: int
    counts_all: torch.Tensor      # [W, W, El + 1]
    layout: RecvLayout
    send: SendPlan
    tiles: TileTable
    entries: torch.Tensor         # [W] return entries this rank receives, by source


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _timeout_ns() -> int:
    return int(float(os.environ.get("COMET_TIMEOUT_S", "10")) * 1e9)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------- exchange
def launch_exchange(ws: Workspace, topk_ids: torch.Tensor, local_experts: int,
                    phase: int = PHASE_BOTH, my_counts: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Count this rank's routing and all-gather the counts; returns ``my_counts``."""
    if my_counts is None:
        my_counts = local_counts(topk_ids, ws.world, local_experts).contiguous()
    row = my_counts.numel()
    l0.exchange_counts_kernel[(1,)](
        my_counts, ws.peer_ptrs["counts"], ws.peer_ptrs["count_flags"], ws.count_flags,
        ws.epoch, ws.error, ws.rank, _timeout_ns(),
        WORLD=ws.world, ROW=row, BLOCK=_next_pow2(row), PUSH=bool(phase & PHASE_PUSH),
        WAIT=bool(phase & PHASE_WAIT),
        USE_ASM=not interpreting(), num_warps=1)
    return my_counts


def make_plan(ws: Workspace, cfg: MoEConfig, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, tile: TileConfig) -> CallPlan:
    """Routing plan and tile table from the exchanged counts (torch ops on the device)."""
    el = cfg.num_experts // ws.world
    counts_all = ws.counts.view(ws.world, ws.world, el + 1)
    layout = build_recv_layout(counts_all)
    send = build_send_plan(topk_ids, topk_weights, counts_all, layout, ws.rank,
                           cfg.max_tokens)
    rows_cap = recv_capacity(ws.world, cfg.max_tokens, cfg.top_k)
    tiles = build_tile_table(layout, ws.rank, rows_cap, tile.block_m)
    return CallPlan(topk_ids.shape[0], counts_all, layout, send, tiles,
                    layout.entries[ws.rank].contiguous())


# ----------------------------------------------------------------------- descriptors
def descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 2-D tensor (built by Triton's launcher at launch time)."""
    return TensorDescriptor.from_tensor(t2d, block)


# ----------------------------------------------------------------------- layers
def launch_layer0(ws: Workspace, cfg: MoEConfig, plan: CallPlan, x: torch.Tensor,
                  w13: torch.Tensor, tile: TileConfig, role: int, n_comm: int, grid: int,
                  wait: bool = True) -> None:
    """Dispatch + GroupGEMM(W13) + SiLU*up for one rank (``role``: fused/comm/compute)."""
    el, h, f = w13.shape[0], cfg.hidden_size, cfg.intermediate_size
    bk = tile.k_step(h)
    a_desc = descriptor(ws.a0, [tile.block_m, bk])
    w_desc = descriptor(w13.view(el * h, 2 * f), [bk, tile.block_n0])
    counters = ws.counter_view(ws.world)
    s, t = plan.send, plan.tiles
    extra = {} if interpreting() or role != ROLE_FUSED else {"launch_cooperative_grid": True}
    l0.layer0_kernel[(grid,)](
        x, s.send_token, s.send_row, s.send_off, s.ret_token, s.ret_rows, s.ret_weight,
        s.ret_count, ws.peer_ptrs["a0"], ws.peer_ptrs["ret_token"], ws.peer_ptrs["ret_rows"],
        ws.peer_ptrs["ret_weight"], ws.peer_ptrs["flag0"], ws.ret_token, ws.ret_rows,
        ws.ret_weight, counters["dispatch"], cfg.max_tokens,
        ws.a0, a_desc, w_desc, ws.h, h, f,
        t.expert, t.row_start, t.row_end, t.wait_mask, t.num_tiles,
        ws.flag0, ws.epoch, ws.error, ws.rank, n_comm, _timeout_ns(),
        ROLE=role, WAIT=wait, WORLD=ws.world, TOPK=cfg.top_k, TOPK_P2=_next_pow2(cfg.top_k),
        COMM_ROWS=tile.comm_rows, COMM_BLOCK_H=tile.comm_block_h,
        COMM_ENTRIES=tile.comm_entries, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n0,
        BLOCK_K=bk, DOT_PRECISION=_dot_precision(cfg.dtype), USE_ASM=not interpreting(),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **extra)


def launch_layer1(ws: Workspace, cfg: MoEConfig, plan: CallPlan, w2: torch.Tensor,
                  tile: TileConfig, role: int, n_comm: int, grid: int,
                  wait: bool = True) -> None:
    """GroupGEMM(W2) + top-k reduce + send to the sources, for one rank."""
    el, h, f = w2.shape[0], cfg.hidden_size, cfg.intermediate_size
    bk = tile.k_step(f)
    h_desc = descriptor(ws.h, [tile.block_m, bk])
    w_desc = descriptor(w2.view(el * f, h), [bk, tile.block_n1])
    counters = ws.counter_view(ws.world)
    t = plan.tiles
    extra = {} if interpreting() or role != ROLE_FUSED else {"launch_cooperative_grid": True}
    l1.layer1_kernel[(grid,)](
        h_desc, w_desc, ws.out1, f, h,
        t.expert, t.row_start, t.row_end, t.num_tiles, counters["split"],
        ws.ret_token, ws.ret_rows, ws.ret_weight, plan.entries, ws.peer_ptrs["comb"],
        ws.comb, ws.peer_ptrs["flag1"], ws.flag1, counters["l1_done"], ws.epoch, ws.error,
        ws.rank, cfg.max_tokens, n_comm, _timeout_ns(),
        ROLE=role, WAIT=wait, WORLD=ws.world, TOPK=cfg.top_k,
        COMM_ENTRIES=tile.comm_entries, COMM_BLOCK_C=tile.comm_block_c,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n1, BLOCK_K=bk,
        BLOCKS_PER_SPLIT=tile.blocks_per_split(h), DOT_PRECISION=_dot_precision(cfg.dtype),
        USE_ASM=not interpreting(), num_warps=tile.num_warps, num_stages=tile.num_stages,
        **extra)


def launch_combine(ws: Workspace, cfg: MoEConfig, plan: CallPlan, y: torch.Tensor,
                   tile: TileConfig, wait: bool = True) -> None:
    """Sum the partial rows sent back by every rank into ``y [M, H]``."""
    m = plan.num_tokens
    # Even with no tokens, one program waits for every rank's flag1: the wait closes the
    # call (see comet.runtime.workspace on why single buffers are safe).
    grid = max(1, triton.cdiv(m, tile.combine_rows))
    l1.combine_kernel[(grid,)](
        ws.comb, ws.flag1, plan.send.dest_mask, y, m, cfg.hidden_size, ws.epoch, ws.error,
        ws.rank, cfg.max_tokens, _timeout_ns(),
        WAIT=wait, WORLD=ws.world, ROWS=tile.combine_rows, BLOCK_H=tile.combine_block_h,
        USE_ASM=not interpreting(), num_warps=4)
