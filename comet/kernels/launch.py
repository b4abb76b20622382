"""Host launchers of comet's kernels: one function per phase of a call.

A call on one rank is the sequence

    counts -> exchange (push, wait) -> layout -> place -> layer0 -> layer1 -> combine

and each launcher below runs one phase for one rank. :class:`comet.runtime.layer.FusedMoE`
runs them back to back on a stream (fused roles: one launch per layer); the virtual-rank
driver (:mod:`comet.runtime.virtual`) runs each phase for all ranks before the next, with
the producer role launched before the consumer role, which is what lets W ranks share one
process under the Triton interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.config import MoEConfig
from comet.kernels import tile_field_error
from comet.kernels import layer0 as l0
from comet.kernels import layer1 as l1
from comet.kernels import plan as kplan
from comet.runtime.workspace import (COUNT_BUFFERS, LAYOUT_PROGRAMS, Workspace,
                                     plan_block_tokens)
from comet.weights import GATE_UP_BLOCK

ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE = 0, 1, 2
PHASE_PUSH, PHASE_WAIT, PHASE_BOTH = 1, 2, 3


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU, one program at a time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shapes of the fused kernels.

    block_m: rows of an m-tile (both layers share the tile table).
    block_n0: columns of a layer0 work item, per half (gate and up); divides
        comet.weights.GATE_UP_BLOCK, and one dot computes both halves when equal to it.
    block_n1: columns of a layer1 work item.
    block_k: K step (shrunk to divide H and F where needed).
    splits: target number of layer1 column splits (the comm role's unit of waiting). The
        GEMM runs split by split, so every split reads all of layer1's A rows again: 8
        splits cost qwen2-moe's layer1 29% and phi3.5's 9% at 16384 tokens against 2, and
        2 is within 0-4% of the best count at 1024-16384 tokens for the four presets (H100,
        W=1, `h100-kernel-times-layer1-splits-count.json`); fewer splits only leave more of
        the reduce after the GEMM.
    comm_rows: rows of a dispatch chunk, the unit a destination waits for (each chunk
        has its own flag). The first GEMM tiles wait for the first round of chunks, one
        chunk copy by one comm block (256 rows: 36-118 us for the presets at 4096
        tokens/rank, EP=2 timelines); each chunk also costs one remote release.
    comm_copy_rows / comm_block_h: tile of the dispatch copy (rows x columns).
    group_m: m-tiles of layer0's table that sweep the column blocks together
        (:func:`kernels.group_gemm.grouped_work`): each group reads its experts' weight
        blocks once, so an expert's W13 comes from HBM once per group of its m-tiles,
        while the group's A rows must stay in L2. Mixtral at EP=2 rank shapes, 16384
        tokens/rank (64 m-tiles per expert): layer0 read 9.5 GB from HBM with 8, 7.7
        with 16, 12.7 with 32 (H100, ncu); compute-only calls with 16 took 0.97x (H100)
        and 0.99x (H200) the time, phi3.5-moe 0.99x; no change at 4096 tokens, and
        qwen2-moe (4 m-tiles per expert: a group of 16 spans four experts' weights) up
        to 1.01x slower (``benchmarks/results/2026-11-25``). Per token bucket a tuned
        table may set it (:data:`comet.kernels.TUNABLE_TILE_FIELDS`).
    local_head_tiles: m-tiles of this rank's own rows that open layer0's tile table, ahead
        of the expert-major rest (comet.scheduler.plan): work for the GEMM blocks while
        the first remote rows are in flight. Each expert in the head has its weights
        read once more (its remote tiles come later). Tunable per bucket, like group_m
        (none paid at 4096 tokens/rank, 16 at 16384, in fused EP=2 calls).
    lane_head_rounds / lane_tail_rounds: rounds (one item per program) of layer0's work
        queue handed out one item per take at its start and its end, the rest in lanes
        of ``kernels.layer0.LANE_ITEMS`` (:func:`kernels.group_gemm.lane_shape`). Paired
        whole calls against lanes to the end (H100, EP=2 rank shapes, 24 comm blocks,
        ``h100-paired-lanes-ep2.json``): a tail round takes qwen2-moe at 4096 tokens
        6.7% less time, the other presets within 1.5% at 4096 and 16384; a head round on
        top of it does not pay there (deepseek-v3-like at 4096 2.6% slower), so it is off.
    dispatch_entries: return entries per dispatch chunk (same reason as comm_rows).
    comm_entries / comm_block_c: tile of the layer1 reduce (entries x columns); also the
        copy tile of return entries in the dispatch.
    reduce_item: return entries per item of layer1's reduce queue (a multiple of
        comm_entries): one queue atomic per item, so items carry tens of KB.
    combine_rows / combine_block_h / combine_warps: tile of the final combine, a pure HBM
        stream: one token row per step at 8 warps, with COMBINE_PROGRAMS_PER_SM programs
        per SM, moved 2.8 TB/s on an H100; 16 x 512 at 4 warps, one program per SM, 1.0
        (scripts/device/combine_bw.py).
    layer1_scatter: layer1's epilogue writes each output row, weighted, straight into its
        token's home (``pair_out`` of the token's rank, one row per slot), and the final
        combine sums a token's ``top_k`` rows -- instead of the column-split reduce role
        that sums a token's rows on each expert rank and sends one row per (token, rank)
        after its split's GEMM. No reduce pass and no reduce tail; more bytes cross the
        link when a token has several experts on one rank (top-k > W), and the combine
        reads top-k rows per token instead of W. Only fused calls use it (the sequential
        and single-part modes keep the reduce, so they stay the decomposition of a call).
    decode_block_n1: layer1's column block in calls too small to give layer1 a work
        item per SM with ``block_n1`` (:meth:`decode_tile`; 0: none). At 128 tokens/rank,
        EP=4 (H200), Mixtral's layer1 has 2 experts x 1 m-tile x 16 column blocks = 32
        items for 132 SMs: 138 us against torch's 70; 128-column blocks 116 us (phi3.5-moe
        72 -> 64, torch 75; ``h200-gemm-decode-ep4.json``). 64-row tiles do better on
        layer1 alone (79 and 54 us) but share the tile table with layer0, which they slow
        down by 7-20% (``h200-kernel-times-ep4-decode-64.json``).
    a_gather: an experiment, off by default: layer0's gated GEMM reads its A rows with
        ``tl.load`` through a row index (here each row itself) instead of a TMA box --
        what a dispatch by copy engines would need (they can broadcast token rows to the
        peers, a size the host knows, but not place each pair's row), so its cost is
        the price of that dispatch (``scripts/device/paired_tiles.py --tiles a_gather=1``).
    copy_dispatch: layer0's dispatch by the copy engines (fused calls; needs
        ``layer1_scatter``): each rank's host sends its whole input and its send list to
        every peer with ``cudaMemcpyAsync`` (a size it knows: tokens x H) and then the
        call's epoch as the peer's flag, and the comm blocks *place* rows -- from this
        rank's input and the copies that landed, into the shared tensor, a local HBM
        copy -- instead of pushing each pair's row over NVLink
        (:func:`comet.kernels.layer0.place_role`, :mod:`comet.runtime.copy_dispatch`).
        Why: on 2x H200 copies by the copy engines hid 0.75-1.03 of their time beside
        the power-capped GEMMs, SM-driven communication 0.38 or less for qwen2-moe
        (docs/benchmarks.md, "How much communication can overlap hide"); and a token
        crosses the link once per peer instead of once per pair (top-k 4 and 8 at EP=2:
        2x and 4x fewer bytes; top-k 2 at EP=4: 2x more). Costs the workspace
        ``W x max_tokens x H`` more, and the other modes keep the push.
    """

    block_m: int = 128
    block_n0: int = GATE_UP_BLOCK
    block_n1: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    splits: int = 2
    comm_rows: int = 256
    comm_copy_rows: int = 32
    comm_block_h: int = 512
    group_m: int = 8
    local_head_tiles: int = 16
    lane_head_rounds: int = 0
    lane_tail_rounds: int = 1
    dispatch_entries: int = 1024
    comm_entries: int = 64
    reduce_item: int = 64
    comm_block_c: int = 256
    combine_rows: int = 1
    combine_block_h: int = 4096
    combine_warps: int = 8
    decode_block_n1: int = 128
    layer1_scatter: bool = True
    a_gather: bool = False
    copy_dispatch: bool = False

    def __post_init__(self):
        # A layer0 tile must not straddle two blocks of the interleaved W13.
        if GATE_UP_BLOCK % self.block_n0:
            raise ValueError(f"block_n0 must divide the W13 interleave block "
                             f"({GATE_UP_BLOCK}), got {self.block_n0}")
        # The placing side sends no return entries: only the scatter epilogue does
        # without them.
        if self.copy_dispatch and not self.layer1_scatter:
            raise ValueError("copy_dispatch needs layer1_scatter (the reduce role reads "
                             "return entries, which only the pushing dispatch sends)")

    def with_overrides(self, overrides: Mapping[str, int]) -> "TileConfig":
        """This configuration with some :data:`comet.kernels.TUNABLE_TILE_FIELDS` set (a
        tuned table's per-bucket choice, or a call's override); ValueError for any other
        field or a value below the field's minimum."""
        for name, value in overrides.items():
            if (why := tile_field_error(name, value)) is not None:
                raise ValueError(why)
        return dataclasses.replace(self, **overrides) if overrides else self

    def decode_tile(self) -> "TileConfig | None":
        """The tile configuration of small calls: this one with layer1's column block
        ``decode_block_n1`` (everything else unchanged, so both share one workspace and
        one tile table), or None."""
        if not self.decode_block_n1 or self.decode_block_n1 == self.block_n1:
            return None
        return dataclasses.replace(self, block_n1=self.decode_block_n1, decode_block_n1=0)

    def n_splits_max(self, hidden: int) -> int:
        """Most layer1 column splits any call may use (sizes the split counters)."""
        decode = self.decode_tile()
        return max(self.n_splits(hidden), decode.n_splits(hidden) if decode else 0)

    def layer1_items(self, rows_per_expert: int, local_experts: int, hidden: int) -> int:
        """layer1's work items (m-tiles x column blocks) when each local expert gets
        ``rows_per_expert`` rows."""
        m_tiles = local_experts * -(-rows_per_expert // self.block_m)
        return m_tiles * -(-hidden // self.block_n1)

    def decode_pays(self, rows_per_expert: int, local_experts: int, hidden: int,
                    programs: int) -> bool:
        """Whether layer1 should run on :meth:`decode_tile`, by a rule (a tuned table
        overrides it): when this tile gives layer1 fewer work items than ``programs``
        (part of the GPU idle) *and* the decode tile gives fewer columns per program --
        waves of items over the programs times the columns of an item.

        Both halves were measured to matter. Columns alone: Qwen2-MoE at 128 tokens/rank,
        EP=4, has 120 items for 132 SMs, and 240 narrower ones (two waves) made its layer1
        slower (H200, ``h200-kernel-times-ep4-decode.json``). Waves alone picked the
        decode tile for large calls whose last wave was ragged, where 128-column tiles
        cost layer1 1.2-1.5x (H100, EP=1, DBRX sizes at 3000-16384 tokens, OLMoE and
        Qwen3-30B-A3B at 8192-16384; ``h100-tune-check-ep1-tiles/``)."""
        decode = self.decode_tile()
        if decode is None:
            return False
        items = self.layer1_items(rows_per_expert, local_experts, hidden)
        decode_items = decode.layer1_items(rows_per_expert, local_experts, hidden)
        return (items < programs and -(-decode_items // programs) * decode.block_n1
                < -(-items // programs) * self.block_n1)

    @staticmethod
    def small() -> "TileConfig":
        """Tiny tiles for the interpreter and unit tests."""
        return TileConfig(block_m=16, block_n0=16, block_n1=32, block_k=16, num_warps=4,
                          num_stages=1, splits=2, comm_rows=16, comm_copy_rows=8,
                          comm_block_h=32, local_head_tiles=2, dispatch_entries=16,
                          comm_entries=8, reduce_item=16, comm_block_c=16, combine_rows=8,
                          combine_block_h=32, combine_warps=4, decode_block_n1=0)

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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _asm() -> bool:
    return not interpreting()


#: Bytes the kernels assume an address-held buffer is aligned to (kernels.address).
ADDRESS_ALIGN = 16


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its address is not :data:`ADDRESS_ALIGN`-byte aligned
    (a view at an odd offset): the kernels read such buffers with 16-byte vectors."""
    return t if t.data_ptr() % ADDRESS_ALIGN == 0 else t.clone()


def address_of(t: torch.Tensor) -> torch.Tensor:
    """A device int64 holding ``t``'s address (kernels load it, so graphs stay valid)."""
    return torch.full((1,), t.data_ptr(), dtype=torch.int64, device=t.device)


def split_of(n_comm: int, device) -> torch.Tensor:
    """A device int64 holding a comm-block count (read by the fused kernels)."""
    return torch.full((1,), n_comm, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------- plan
#: Tile of the block-count scan: rows per step, columns per program. The steps of one
#: program are a serial chain (~2 us each), so few tall steps and more programs: 64 x 64
#: took 59 us for deepseek-v3-like at 16384 tokens (2048 block rows), 256 x 16 23 us (H100).
SCAN_ROWS, SCAN_COLS = 256, 16


def _token_count(num_tokens: torch.Tensor | None, topk_ids: torch.Tensor) -> dict:
    """Kernel arguments bounding the plan to the call's tokens: the routing's rows, and
    the device-held count when the routing sits in a larger staging buffer."""
    return {"num_tokens_ptr": topk_ids if num_tokens is None else num_tokens,
            "HAS_NUM_TOKENS": num_tokens is not None}


def launch_counts(ws: Workspace, cfg: MoEConfig, topk_ids: torch.Tensor,
                  num_tokens: torch.Tensor | None = None) -> None:
    """Per-block routing counts, prefix-summed: ``plan["block_counts"][-1]`` holds this
    rank's totals (pairs per expert, tokens per destination). ``num_tokens`` (device,
    one int64): the call's tokens when ``topk_ids`` has more rows (padding is never read).
    """
    p, k = ws.plan, cfg.top_k
    bt = plan_block_tokens(k)
    blocks = p["block_counts"].shape[0] - 1
    cols = cfg.num_experts + ws.world
    rows = _token_count(num_tokens, topk_ids)
    kplan.count_kernel[(blocks,)](
        topk_ids, p["block_counts"], topk_ids.shape[0], ws.input_word, ws.epoch,
        TOPK=k, TOPK_P2=_next_pow2(k), NUM_EXPERTS=cfg.num_experts,
        LOCAL_EXPERTS=cfg.num_experts // ws.world, WORLD=ws.world,
        BINS=_next_pow2(cfg.num_experts + 1), BLOCK_T=bt, num_warps=4, **rows)
    kplan.scan_kernel[(triton.cdiv(cols, SCAN_COLS),)](
        p["block_counts"], blocks, topk_ids.shape[0], COLS=cols, BLOCK_T=bt,
        SCAN_ROWS=SCAN_ROWS, SCAN_COLS=SCAN_COLS, num_warps=4, **rows)


def launch_exchange(ws: Workspace, cfg: MoEConfig, phase: int = PHASE_BOTH) -> None:
    """All-gather this rank's totals into every peer's ``counts``; wait for all peers."""
    el = cfg.num_experts // ws.world
    l0.exchange_counts_kernel[(1,)](
        ws.plan["block_counts"][-1], ws.peer_ptrs["counts"], ws.peer_ptrs["count_flags"],
        ws.count_flags, ws.epoch, ws.peer_ptrs["error"], ws.rank, ws.timeout,
        WORLD=ws.world, LOCAL_EXPERTS=el, COUNT_BUFFERS=COUNT_BUFFERS,
        BLOCK=_next_pow2(ws.world * (el + 1)),
        PUSH=bool(phase & PHASE_PUSH), WAIT=bool(phase & PHASE_WAIT), USE_ASM=_asm(),
        num_warps=1)


def launch_layout(ws: Workspace, cfg: MoEConfig, tile: TileConfig) -> None:
    """Offsets and the tile table from the exchanged counts."""
    p, el = ws.plan, cfg.num_experts // ws.world
    kplan.layout_kernel[(min(LAYOUT_PROGRAMS, cfg.num_experts),)](
        ws.counts, ws.epoch, ws.rank, p["send_base"], p["dst_base"], p["send_off"],
        p["ret_count"],
        p["seg_start"], p["seg_rows"], p["pre"], p["chunks_total"], p["entries"],
        p["tile_expert"], p["tile_row_start"], p["tile_row_end"], p["tile_wait"],
        p["tile_stage"], p["num_tiles"], p["scratch"],
        WORLD=ws.world, W_P2=_next_pow2(ws.world), LOCAL_EXPERTS=el,
        EL_P2=_next_pow2(el), COUNT_BUFFERS=COUNT_BUFFERS, BLOCK_M=tile.block_m,
        COMM_ROWS=tile.comm_rows,
        COMM_ENTRIES=tile.dispatch_entries, TILE_CHUNK=64, HEAD_TILES=tile.local_head_tiles,
        num_warps=4)


def launch_place(ws: Workspace, cfg: MoEConfig, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
    """Send list and return entries of this rank (one program per token block;
    ``num_tokens`` as in :func:`launch_counts`)."""
    p, k = ws.plan, cfg.top_k
    blocks = p["block_counts"].shape[0] - 1
    kplan.place_kernel[(blocks,)](
        topk_ids, topk_weights, p["block_counts"], p["send_base"], p["dst_base"],
        p["send_pair"], p["send_row"], p["send_weight"], p["ret_token"], p["ret_rows"],
        p["ret_weight"], p["dest_mask"], p["pair_live"], topk_ids.shape[0], cfg.max_tokens,
        ws.input_word, ws.epoch,
        TOPK=k, TOPK_P2=_next_pow2(k), NUM_EXPERTS=cfg.num_experts,
        LOCAL_EXPERTS=cfg.num_experts // ws.world, WORLD=ws.world,
        BLOCK_T=plan_block_tokens(k), num_warps=4, **_token_count(num_tokens, topk_ids))


def launch_plan(ws: Workspace, cfg: MoEConfig, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, tile: TileConfig,
                num_tokens: torch.Tensor | None = None) -> None:
    """The whole plan of one call for one rank (the exchange waits for every peer)."""
    launch_counts(ws, cfg, topk_ids, num_tokens)
    launch_exchange(ws, cfg)
    launch_layout(ws, cfg, tile)
    launch_place(ws, cfg, topk_ids, topk_weights, num_tokens)


# ----------------------------------------------------------------------- descriptors
def descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 2-D tensor (built by Triton's launcher at launch time)."""
    return TensorDescriptor.from_tensor(t2d, block)


#: Events each program may record when tracing (comet bench --timeline).
MAX_TRACE_EVENTS = 512


def _trace_args(trace: torch.Tensor | None, device) -> tuple[torch.Tensor, dict]:
    """The trace buffer ``[programs, MAX_TRACE_EVENTS, 4]`` int64 (or a dummy)."""
    if trace is None:
        return torch.zeros(1, dtype=torch.int64, device=device), {"TRACE": False,
                                                                   "MAX_EVENTS": 1}
    return trace, {"TRACE": True, "MAX_EVENTS": MAX_TRACE_EVENTS}


def _cooperative(role: int, cooperative: bool) -> dict:
    """A fused launch is cooperative: co-residency of its roles is guaranteed, or the
    launch fails instead of hanging. Virtual ranks sharing one GPU launch without it (their
    grids are sized to fit side by side; see FusedMoE.virtual_group)."""
    if interpreting() or role != ROLE_FUSED or not cooperative:
        return {}
    return {"launch_cooperative_grid": True}


# ----------------------------------------------------------------------- layers
def _home_tables(ws: Workspace, scatter: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer tables of ``row_home`` and ``row_weight`` (stand-ins the kernels never read
    when the layer has no scatter epilogue)."""
    if not scatter:
        return ws.peer_ptrs["ret_rows"], ws.peer_ptrs["ret_weight"]
    return ws.peer_ptrs["row_home"], ws.peer_ptrs["row_weight"]


def _home_maps(ws: Workspace, scatter: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``row_home`` and ``row_weight`` (or stand-ins, as above)."""
    if not scatter:
        return ws.ret_rows, ws.ret_weight
    return ws.row_home, ws.row_weight


def _copy_buffers(ws: Workspace, copy: bool) -> tuple[torch.Tensor, ...]:
    """What layer0's placing comm role reads (``x_recv``, ``sent_pair``, ``sent_row``,
    ``sent_weight``, ``sent_off``, ``copy_flags``), or stand-ins it never reads."""
    if not copy:
        return (ws.a0, *(ws.plan[n] for n in ("send_pair", "send_row", "send_weight",
                                              "send_off")), ws.flag0)
    return tuple(ws.buffers[n] for n in ("x_recv", "sent_pair", "sent_row", "sent_weight",
                                         "sent_off", "copy_flags"))


def launch_layer0(ws: Workspace, cfg: MoEConfig, x_addr: torch.Tensor, w13: torch.Tensor,
                  tile: TileConfig, role: int, split: torch.Tensor, grid: int,
                  wait: bool = True, trace: torch.Tensor | None = None,
                  cooperative: bool = True, *, out: torch.Tensor | None = None,
                  transposed: bool = False, row_home: bool = False,
                  copy: bool = False) -> None:
    """Dispatch + GroupGEMM(W13) + SiLU*up for one rank (``role``: fused/comm/compute);
    ``w13`` in the interleaved layout of :mod:`comet.weights`. ``row_home``: the dispatch
    also sends each row's home and weight (for layer1's scatter epilogue). ``copy``: the
    comm role places rows the peers' copy engines sent (``TileConfig.copy_dispatch``;
    implies ``row_home``) instead of pushing this rank's.

    ``x_addr``: device int64 with the address of the input ``[M, H]``; ``split``: device
    int32 with the comm-block count (fused role only).

    With ``out`` (``[rows, N]``, the backward's): a plain GEMM of the dispatched rows into
    ``out`` instead, no activation -- ``a0 @ w`` for ``w [El, H, N]``, or ``a0 @ w^T`` for
    ``w [El, N, H]`` with ``transposed``; on layer1's column block."""
    el, h = w13.shape[0], cfg.hidden_size
    bk = tile.k_step(h)
    p = ws.plan
    row_home = row_home or copy
    trace, trace_kw = _trace_args(trace, w13.device)
    counters = ws.counter_view()
    if out is None:
        n, c, block_n = cfg.intermediate_size, ws.h, tile.block_n0
        one_dot = block_n == GATE_UP_BLOCK and n % GATE_UP_BLOCK == 0
        b = descriptor(w13.view(el * h, 2 * n), [bk, block_n * (2 if one_dot else 1)])
        gather = tile.a_gather and one_dot
    else:
        gather = False
        n, c, block_n, one_dot = out.shape[1], out, tile.block_n1, False
        b = (descriptor(w13.view(el * n, h), [block_n, bk]) if transposed
             else descriptor(w13.view(el * h, n), [bk, block_n]))
    l0.layer0_kernel[(grid,)](
        x_addr, p["send_pair"], p["send_row"], p["send_weight"], p["send_off"],
        p["ret_token"], p["ret_rows"], p["ret_weight"], p["ret_count"], ws.peer_ptrs["a0"],
        ws.peer_ptrs["ret_token"], ws.peer_ptrs["ret_rows"], ws.peer_ptrs["ret_weight"],
        ws.peer_ptrs["flag0"], *_home_tables(ws, row_home),
        ws.ret_token, ws.ret_rows, ws.ret_weight, *_home_maps(ws, row_home),
        ws.flag0.shape[1], cfg.max_tokens, *_copy_buffers(ws, copy),
        ws.a0, descriptor(ws.a0, [tile.block_m, bk]),
        _identity_rows(ws.a0.shape[0], ws.a0.device) if gather else ws.a0, b, c, h, n,
        p["tile_expert"], p["tile_row_start"], p["tile_row_end"], p["tile_wait"],
        p["num_tiles"], p["seg_start"], p["seg_rows"], p["pre"], counters["l0_queue"],
        counters["l0_dispatch"],
        ws.flag0, ws.epoch, ws.peer_ptrs["error"], ws.rank, split, ws.timeout, trace,
        ROLE=role, WAIT=wait, WORLD=ws.world, W_P2=_next_pow2(ws.world), LOCAL_EXPERTS=el,
        TOPK=cfg.top_k, TOPK_P2=_next_pow2(cfg.top_k), COMM_ROWS=tile.comm_rows,
        COMM_COPY_ROWS=tile.comm_copy_rows, COMM_BLOCK_H=tile.comm_block_h,
        COMM_ENTRIES=tile.dispatch_entries, COMM_ENTRY_TILE=tile.comm_entries,
        ROW_HOME=row_home, GATED=out is None, TRANS_B=transposed, GATE_UP=GATE_UP_BLOCK,
        ONE_DOT=one_dot,
        BLOCK_M=tile.block_m, BLOCK_N=block_n, BLOCK_K=bk,
        DOT_PRECISION=_dot_precision(cfg.dtype), GROUP_M=tile.group_m,
        HEAD_ROUNDS=tile.lane_head_rounds,
        TAIL_ROUNDS=tile.lane_tail_rounds, USE_ASM=_asm(), **trace_kw, A_GATHER=gather,
        COPY_DISPATCH=copy, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **_cooperative(role, cooperative))


@functools.lru_cache(maxsize=8)
def _identity_rows(rows: int, device: torch.device) -> torch.Tensor:
    """``arange(rows)`` as int32: ``TileConfig.a_gather``'s index (each row itself)."""
    return torch.arange(rows, dtype=torch.int32, device=device)


def launch_layer1(ws: Workspace, cfg: MoEConfig, w2: torch.Tensor, tile: TileConfig,
                  role: int, split: torch.Tensor, grid: int, wait: bool = True,
                  trace: torch.Tensor | None = None, cooperative: bool = True, *,
                  a: torch.Tensor | None = None, pair_src: torch.Tensor | None = None,
                  scatter: bool = False) -> None:
    """GroupGEMM(W2) + top-k reduce + send to the sources, for one rank. With
    ``scatter`` (:attr:`TileConfig.layer1_scatter`): the GroupGEMM alone on every block
    of the grid, its epilogue sending each row home (``role`` and ``split`` unused).

    With ``a`` (``[rows, K]``, the backward's ``d(gate, up)``): the GEMM is ``a @ w2^T``
    for ``w2 [El, H, K]`` (W13 as stored) and the reduce an unweighted sum; ``pair_src``
    (``[rows]`` fp32) then also goes home, one scalar per (token, slot), into the
    sources' ``pair_grad``."""
    el, h = w2.shape[0], cfg.hidden_size
    p = ws.plan
    counters = ws.counter_view()
    trace, trace_kw = _trace_args(trace, w2.device)
    backward = a is not None
    if not backward:
        a, k = ws.h, cfg.intermediate_size
        bk = tile.k_step(k)
        b = descriptor(w2.view(el * k, h), [bk, tile.block_n1])
    else:
        k = a.shape[1]
        bk = tile.k_step(k)
        b = descriptor(w2.view(el * h, k), [tile.block_n1, bk])
    pairs = pair_src is not None
    out_table, pair_out = ((ws.peer_ptrs["pair_out"], ws.pair_out) if scatter
                           else (ws.peer_ptrs["comb"], ws.comb))
    l1.layer1_kernel[(grid,)](
        descriptor(a, [tile.block_m, bk]), b, ws.out1, k, h, p["tile_expert"],
        p["tile_row_start"], p["tile_row_end"],
        p["num_tiles"], counters["split"],
        ws.ret_token, ws.ret_rows, ws.ret_weight, p["entries"], ws.flag0, ws.flag0.shape[1],
        p["chunks_total"],
        ws.peer_ptrs["comb"], ws.comb, ws.peer_ptrs["flag1"], ws.flag1,
        counters["l1_done"], counters["l1_reduce"], ws.epoch,
        ws.peer_ptrs["error"], ws.rank, cfg.max_tokens, split, ws.timeout,
        pair_src if pairs else ws.pair_grad, ws.peer_ptrs["pair_grad"], ws.pair_grad,
        *_home_maps(ws, scatter), out_table, pair_out, trace,
        ROLE=role, WAIT=wait, SCATTER=scatter, WORLD=ws.world, TOPK=cfg.top_k,
        COMM_ENTRIES=tile.comm_entries, COMM_ITEM=tile.reduce_item,
        COMM_BLOCK_C=tile.comm_block_c,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n1, BLOCK_K=bk,
        BLOCKS_PER_SPLIT=tile.blocks_per_split(h), N_SPLITS=tile.n_splits(h),
        DOT_PRECISION=_dot_precision(cfg.dtype), TRANS_B=backward,
        WEIGHTED=not backward, PAIRS=pairs,
        USE_ASM=_asm(), **trace_kw, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **_cooperative(role, cooperative))


#: Combine programs per SM on a GPU of its own: loads in flight, not threads, bound a
#: stream, and one program per SM left HBM two-thirds idle (combine_bw.py). (Virtual ranks
#: sharing a GPU launch fewer: a combine spins on its peers' flags, which a peer can only
#: raise on the SMs left to it.)
COMBINE_PROGRAMS_PER_SM = 4


def launch_combine(ws: Workspace, cfg: MoEConfig, y_addr: torch.Tensor,
                   num_tokens: torch.Tensor, tile: TileConfig, grid: int,
                   wait: bool = True, scatter: bool = False) -> None:
    """Sum the partial rows sent back by every rank (``scatter``: the weighted rows of
    every slot) into the output whose address is in ``y_addr`` (``[M, H]``, ``M`` in the
    device scalar ``num_tokens``), on at most ``grid`` programs."""
    # Even with no tokens every program waits for every rank's flag1: the wait closes
    # the call (see comet.runtime.workspace).
    grid = max(1, min(grid, triton.cdiv(cfg.max_tokens, tile.combine_rows)))
    block_h = min(tile.combine_block_h, _next_pow2(cfg.hidden_size))
    # At least one 16-byte vector per thread, or narrow rows would compile to 2-byte copies.
    per_warp = 32 * (ADDRESS_ALIGN // cfg.dtype.itemsize)
    warps = max(1, min(tile.combine_warps, tile.combine_rows * block_h // per_warp))
    if scatter:     # pair_out [Mx, k, H]: part j of token t is row t * k + j
        parts, live, n_parts, strides = (ws.pair_out, ws.plan["pair_live"], cfg.top_k,
                                         (1, cfg.top_k))
    else:           # comb [W, Mx, H]: part d of token t is row d * Mx + t
        parts, live, n_parts, strides = (ws.comb, ws.plan["dest_mask"], ws.world,
                                         (cfg.max_tokens, 1))
    l1.combine_kernel[(grid,)](
        parts, ws.flag1, live, y_addr, num_tokens, cfg.hidden_size, *strides,
        ws.epoch, ws.peer_ptrs["error"], ws.rank, ws.timeout,
        WAIT=wait, WORLD=ws.world, PARTS=n_parts, ROWS=tile.combine_rows, BLOCK_H=block_h,
        USE_ASM=_asm(), num_warps=warps)
