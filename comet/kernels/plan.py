"""The routing plan and tile table on the device, in three small kernels.

Computes exactly what :mod:`comet.routing` and :mod:`comet.scheduler.plan` specify in
torch (tests hold the two to equality), in three launches instead of about sixty, so a
call costs microseconds of host time and little GPU time at small token counts:

1. :func:`count_kernel` -- one program per block of tokens: how many (token, slot) pairs
   of the block go to each expert, and how many of its tokens go to each rank; then
   :func:`scan_kernel` turns these into each block's starting offsets and, in the last
   row, this rank's totals, which the count exchange sends to every peer.
2. :func:`layout_kernel` -- one program, after the exchange: from ``counts_all`` the
   offsets this rank needs as a source (where its rows land on each destination, where
   they sit in its send list) and as a destination (its segments, and the tile table
   with wait sets).
3. :func:`place_kernel` -- one program per block of tokens: the send list (pair, row on
   the destination, weight) and the return entries, at offsets from steps 1 and 2.

The count exchange between steps 1 and 2 is :mod:`comet.kernels.exchange`. The tables are
allocated once per workspace (:func:`allocate_plan`) and grouped as the kernels take them
(:class:`Plan`).

A small call (``Variant.small_plan_blocks``) plans in two launches instead of seven:
:func:`open_kernel` opens the call (next epoch, zeroed counters -- two torch ops
otherwise), copies the caller's routing into the staged rows (otherwise a launch of
:mod:`comet.kernels.stage_routing`), counts and sums the token blocks and pushes the
totals, all in one program; and the layout kernel's programs place the send list
(``PLACE``), a token block each. The opening counts the call's blocks a step of several
at a time in its one program, so it is right for any token count and fast for a few
steps only: the host picks the two-launch plan per call (comet.runtime.selection). An FP8
layer's opening also quantizes the call's rows on programs beside it
(:class:`comet.kernels.fp8_roles.HomeQuant`), which needed a launch of their own.

Every kernel stops at the call's token count, read on the device when the routing sits in
a buffer sized for ``max_tokens`` (a captured graph serves every call): the plan of a
decode-sized call costs what its tokens cost, not what the workspace holds.

Pair ``(t, j)`` is slot ``j`` of token ``t``; ids outside ``[0, E)`` mean "no expert".
Only ``-1`` may say so on purpose: any other id outside ``[0, E)`` is reported in the
input error word (comet.runtime.errors) and the pair dropped -- on every rank alike, so
the call completes and the workspace stays usable; a NaN or infinite weight of a real
pair is reported and counts as 0 (the slot adds nothing, as with no expert).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.constants import constexpr, COUNT_BUFFERS, INPUT_BAD_EXPERT, INPUT_BAD_WEIGHT
from comet.config import TileConfig
from comet.kernels.exchange import Exchange, push_counts, wait_counts
from comet.kernels.fp8_gemm import MTiles
from comet.kernels.fp8_roles import HomeQuant, quantize_home_part
from comet.kernels.shape import Shape, next_pow2
from comet.kernels.stage_routing import RoutingStage, caller_ids, stage_pairs
from comet.kernels.sync import Sync, arrive, barrier, record_input_error
from comet.routing import recv_capacity

#: Per-cell tables each layout program keeps in its scratch (layout_kernel): seven for
#: its tile-table cells, then (from ``SOURCE_SCRATCH``) its copies of send_base and
#: dst_base, which its blocks' placing reads (``PLACE``).
LAYOUT_SCRATCH = constexpr(9)
SOURCE_SCRATCH = constexpr(7)
#: Pairs the plan kernels handle per program (a block of whole tokens).
PLAN_BLOCK_PAIRS = 64
#: Programs that fill the tile table (layout_kernel), at most.
LAYOUT_PROGRAMS = 16
#: Tile of the block-count scan: rows per step, columns per program. The steps of one
#: program are a serial chain, so few tall steps and more programs (docs/notebook.md).
SCAN_ROWS, SCAN_COLS = 256, 16
#: Tiles of an expert cell the layout kernel writes per step.
TILE_CHUNK = constexpr(64)
#: A small call's opening (open_kernel) counts several token blocks per step, as many as
#: keep a step's pairs and its (block, expert) histogram cells within these: its
#: registers grow with the cells, and it spilled at 4096 (docs/notebook.md, "Small calls").
OPEN_STEP_PAIRS = 1024
OPEN_STEP_CELLS = 1024


class Routing(NamedTuple):
    """A call's routing as the plan kernels read it."""

    ids: torch.Tensor            # int64 [rows, k]: expert per (token, slot); -1 = none
    weights: torch.Tensor        # [rows, k] routing weights
    rows: int                    # rows of ids (at least the call's tokens)
    num_tokens: torch.Tensor | None  # int64 [1]: the call's tokens, read on the device ...
    HAS_NUM_TOKENS: tl.constexpr  # ... when there is one; else the call has ``rows`` tokens

    @classmethod
    def of(cls, ids: torch.Tensor, weights: torch.Tensor,
           num_tokens: torch.Tensor | None = None) -> "Routing":
        return cls(ids, weights, ids.shape[0], num_tokens, constexpr(num_tokens is not None))


class SendList(NamedTuple):
    """This rank as a source: one entry per (token, slot) pair it sends, grouped by
    destination, then expert (``[max_tokens * k]`` each)."""

    pair: torch.Tensor       # int32: pair ``t * k + j``
    row: torch.Tensor        # int32: its row in the destination's shared tensor
    weight: torch.Tensor     # fp32: its routing weight
    off: torch.Tensor        # int32 [W + 1]: first entry of each destination
    #: int32: 1 where the pair is its token's first to the destination in this order
    #: (the smallest expert, then slot): a gathered dispatch sends the token's row with it
    first: torch.Tensor


class EntryTables(NamedTuple):
    """Return entries, one per (token, rank that holds some of its experts): the token,
    the rows of the rank's shared tensor holding its slots (``-1``: a slot elsewhere), and
    their weights. A source builds them by destination (:class:`Plan`); the dispatch
    delivers them, by source, into the destination's symmetric copies (comet.runtime)."""

    token: object            # int32 [W, max_tokens]
    rows: object             # int32 [W, max_tokens, k]
    weight: object           # fp32 [W, max_tokens, k]


class Segments(NamedTuple):
    """This rank as a destination: where each source's rows of each local expert sit in
    its shared tensor (``[W, El]`` int32 each)."""

    start: torch.Tensor      # by ring offset ``o``: first row of source ``rank + o``
    rows: torch.Tensor       # by ring offset: its row count
    pre: torch.Tensor        # by source: its rows for the experts before ``el``


class Tiles(NamedTuple):
    """The m-tile table in the order layer0 runs it (comet.scheduler.plan.TileTable)."""

    expert: torch.Tensor     # int32 [T]
    row_start: torch.Tensor  # int32 [T]
    row_end: torch.Tensor    # int32 [T]
    wait: torch.Tensor       # int64 [T]: bitmask of the sources its rows come from
    stage: torch.Tensor      # int32 [T]: largest ring offset among them
    num: torch.Tensor        # int32 [1]: live tiles


class Plan(NamedTuple):
    """Every device table of a call's plan, allocated once (:func:`allocate_plan`)."""

    block_counts: torch.Tensor   # [blocks + 1, E + W]: per token block, then scanned
    send_base: torch.Tensor      # [W, El]: first send-list entry of (destination, expert)
    dst_base: torch.Tensor       # [W, El]: first row on the destination of the same
    send: SendList
    entries: EntryTables         # this rank's return entries, by destination
    entry_count: torch.Tensor    # [W]: return entries to each destination
    segments: Segments
    chunks: torch.Tensor         # [W]: dispatch chunks each source sends here
    recv_entries: torch.Tensor   # [W]: return entries each source sends here
    tiles: Tiles
    scratch: torch.Tensor        # the layout programs' private copies
    dest_mask: torch.Tensor      # [Mx, W]: token t has a slot on rank d
    pair_live: torch.Tensor      # [Mx, k]: slot j of token t is a real pair


class Placing(NamedTuple):
    """What placing a call's token blocks reads and writes (:func:`place_kernel`, or the
    layout kernel's programs with ``PLACE``)."""

    routing: Routing
    block_counts: torch.Tensor   # the scanned counts: row ``b`` is block ``b``'s offsets
    send: SendList
    entries: EntryTables
    dest_mask: torch.Tensor
    pair_live: torch.Tensor
    max_tokens: int              # the tables' capacity
    input_err: torch.Tensor      # non-finite weights of real pairs are reported here
    BLOCK_T: tl.constexpr        # tokens per block (plan_block_tokens)

    @classmethod
    def of(cls, plan: "Plan", routing: Routing, input_err: torch.Tensor, max_tokens: int,
           shape: Shape) -> "Placing":
        return cls(routing, plan.block_counts, plan.send, plan.entries, plan.dest_mask,
                   plan.pair_live, max_tokens, input_err,
                   constexpr(plan_block_tokens(shape.TOPK)))


def plan_block_tokens(top_k: int) -> int:
    """Tokens per program of the plan kernels (``PLAN_BLOCK_PAIRS`` slots, whole tokens)."""
    return max(1, PLAN_BLOCK_PAIRS // next_pow2(int(top_k)))


def count_bins(num_experts: int) -> int:
    """Bins of the plan's per-block expert histogram: the experts and one for the slots
    with no expert, as a power of two."""
    return next_pow2(num_experts + 1)


def open_step_blocks(num_experts: int) -> int:
    """Token blocks a step of :func:`open_kernel` counts at once in a layer of
    ``num_experts``: at most ``OPEN_STEP_PAIRS`` pairs and ``OPEN_STEP_CELLS`` cells of
    (block, expert) histogram, at least one block."""
    return max(1, min(OPEN_STEP_PAIRS // PLAN_BLOCK_PAIRS,
                      OPEN_STEP_CELLS // count_bins(num_experts)))


def allocate_plan(num_experts: int, top_k: int, max_tokens: int, world: int, device,
                  block_m: int, rank_slots: int | None = None) -> Plan:
    """The plan tables of a layer (sized for ``max_tokens`` tokens per rank; a token's
    slots that one rank can receive: ``rank_slots``, default ``top_k``)."""
    el = num_experts // world
    mx, k = max_tokens, top_k
    blocks = -(-mx // plan_block_tokens(k))
    tiles = -(-recv_capacity(world, mx, rank_slots or k) // block_m) + el
    i32 = dict(dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    return Plan(
        block_counts=torch.zeros(blocks + 1, num_experts + world, **i32),
        send_base=torch.zeros(world, el, **i32), dst_base=torch.zeros(world, el, **i32),
        send=SendList(torch.zeros(mx * k, **i32), torch.zeros(mx * k, **i32),
                      torch.zeros(mx * k, **f32), torch.zeros(world + 1, **i32),
                      torch.zeros(mx * k, **i32)),
        entries=EntryTables(torch.zeros(world, mx, **i32), torch.zeros(world, mx, k, **i32),
                            torch.zeros(world, mx, k, **f32)),
        entry_count=torch.zeros(world, **i32),
        segments=Segments(*(torch.zeros(world, el, **i32) for _ in range(3))),
        chunks=torch.zeros(world, **i32), recv_entries=torch.zeros(world, **i32),
        tiles=Tiles(torch.zeros(tiles, **i32), torch.zeros(tiles, **i32),
                    torch.zeros(tiles, **i32),
                    torch.zeros(tiles, dtype=torch.int64, device=device),
                    torch.zeros(tiles, **i32), torch.zeros(1, **i32)),
        scratch=torch.zeros(LAYOUT_PROGRAMS * LAYOUT_SCRATCH.value * world * el, **i32),
        dest_mask=torch.zeros(mx, world, **i32), pair_live=torch.zeros(mx, k, **i32))


class Chunking(NamedTuple):
    """Constexpr sizes of the dispatch's chunks (the layout counts them per source)."""

    ROWS: tl.constexpr       # rows per chunk (CommConfig.comm_rows)
    ENTRIES: tl.constexpr    # return entries per chunk (CommConfig.dispatch_entries)

    @classmethod
    def of(cls, tile: TileConfig) -> "Chunking":
        return cls(constexpr(tile.comm.comm_rows), constexpr(tile.comm.dispatch_entries))


# ----------------------------------------------------------------------- launchers
def launch_counts(plan: Plan, routing: Routing, input_err: torch.Tensor, sync: Sync,
                  shape: Shape, exchange: Exchange) -> None:
    """Per-block routing counts, prefix-summed: ``plan.block_counts[-1]`` holds this
    rank's totals (pairs per expert, tokens per rank), what the count exchange sends --
    and with ``exchange.IN_PLAN`` the scan's last program sends them."""
    bt = plan_block_tokens(shape.TOPK)
    blocks = plan.block_counts.shape[0] - 1
    count_kernel[(blocks,)](
        routing=routing, block_counts=plan.block_counts, input_err=input_err,
        epoch=sync.epoch, shape=shape, BINS=count_bins(shape.NUM_EXPERTS), BLOCK_T=bt,
        num_warps=4)
    cols = int(shape.NUM_EXPERTS) + int(shape.WORLD)
    scan_kernel[(triton.cdiv(cols, SCAN_COLS),)](
        block_counts=plan.block_counts, blocks=blocks, routing=routing, exchange=exchange,
        sync=sync, shape=shape, COLS=cols, BLOCK_T=bt, SCAN_ROWS=SCAN_ROWS,
        SCAN_COLS=SCAN_COLS, num_warps=4)


def launch_open(plan: Plan, routing: Routing, input_err: torch.Tensor, sync: Sync,
                shape: Shape, exchange: Exchange, counters: torch.Tensor,
                stage: RoutingStage | None = None, quant: HomeQuant | None = None) -> None:
    """A small call's opening and counts in one program (:func:`open_kernel`): what
    ``Workspace.begin_call``, the routing's staging (with ``stage``) and
    :func:`launch_counts` do in five launches; with ``quant``, an FP8 layer's home
    quantization on programs beside it. ``counters``: the call's local int32 counters,
    zeroed."""
    n = counters.numel()
    programs = 1 + (int(quant.ROWS) * int(quant.COLS) if quant is not None else 0)
    open_kernel[(programs,)](
        routing=routing, stage=stage, block_counts=plan.block_counts,
        blocks=plan.block_counts.shape[0] - 1, counters=counters, input_err=input_err,
        exchange=exchange, sync=sync, shape=shape, quant=quant, COUNTERS=n,
        COUNTERS_P2=next_pow2(n), STAGE=stage is not None, BINS=count_bins(shape.NUM_EXPERTS),
        BLOCK_T=plan_block_tokens(shape.TOPK), STEP_BLOCKS=open_step_blocks(shape.NUM_EXPERTS),
        num_warps=4)


def launch_layout(plan: Plan, exchange: Exchange, sync: Sync, shape: Shape,
                  chunking: Chunking, block_m: int, head_tiles: int, routing: Routing,
                  input_err: torch.Tensor, max_tokens: int, place: bool = False) -> None:
    """Offsets and the tile table from the exchanged counts (``exchange.counts``, this
    rank's symmetric ``[COUNT_BUFFERS, W, W * (El + 1)]``), which with
    ``exchange.IN_PLAN`` every program first waits for; with ``place``, also the send
    list and return entries (what :func:`launch_place` does), a token block per
    program."""
    layout_kernel[(min(LAYOUT_PROGRAMS, int(shape.NUM_EXPERTS)),)](
        exchange=exchange, sync=sync, send_base=plan.send_base,
        dst_base=plan.dst_base, entry_count=plan.entry_count,
        segments=plan.segments, chunks=plan.chunks, recv_entries=plan.recv_entries,
        tiles=plan.tiles, scratch=plan.scratch, shape=shape, chunking=chunking,
        placing=Placing.of(plan, routing, input_err, max_tokens, shape), BLOCK_M=block_m,
        HEAD_TILES=head_tiles, PLACE=place, num_warps=4)


def launch_place(plan: Plan, routing: Routing, input_err: torch.Tensor,
                 epoch: torch.Tensor, max_tokens: int, shape: Shape) -> None:
    """Send list and return entries of this rank (one program per token block)."""
    blocks = plan.block_counts.shape[0] - 1
    place_kernel[(blocks,)](
        placing=Placing.of(plan, routing, input_err, max_tokens, shape),
        send_base=plan.send_base, dst_base=plan.dst_base, epoch=epoch, shape=shape,
        num_warps=4)


# ----------------------------------------------------------------------- kernels
@triton.jit
def _token_rows(routing):
    """Tokens of this call: the routing's rows, capped by the device-held count when
    there is one."""
    rows = routing.rows
    if routing.HAS_NUM_TOKENS:
        rows = tl.minimum(rows, tl.load(routing.num_tokens).to(tl.int32))
    return rows


@triton.jit
def _pairs(ids_ptr, t, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NUM_EXPERTS: tl.constexpr,
           rows):
    """Expert ids of tokens ``t`` (``[BT, TOPK_P2]``; ``ids`` has ``rows`` rows), which
    are real pairs, and which are invalid ids (neither an expert nor -1)."""
    j = tl.arange(0, TOPK_P2)
    inside = (t[:, None] < rows) & (j[None, :] < TOPK)
    e = tl.load(ids_ptr + t[:, None].to(tl.int64) * TOPK + j[None, :], mask=inside, other=-1)
    valid = inside & (e >= 0) & (e < NUM_EXPERTS)
    bad = inside & ((e < -1) | (e >= NUM_EXPERTS))
    return tl.where(valid, e, -1).to(tl.int32), valid, bad


@triton.jit
def _report(bad, t, input_err, code, epoch, TOPK_P2: tl.constexpr):
    """Report the first pair of ``bad [BT, TOPK_P2]`` (tokens ``t``) as input error
    ``code``."""
    if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:
        j = tl.arange(0, TOPK_P2)
        key = tl.where(bad, t[:, None] * TOPK_P2 + j[None, :], 2147483647)
        first = tl.min(tl.min(key, axis=1), axis=0)
        record_input_error(input_err, code, first // TOPK_P2, first % TOPK_P2,
                           tl.load(epoch))


@triton.jit
def count_kernel(routing, block_counts, input_err, epoch, shape, BINS: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Row ``b + 1`` of ``block_counts [blocks + 1, E + W]``: pairs per expert and tokens
    per destination rank of token block ``b`` (row 0 stays zero for the scan); reports
    invalid ids. Blocks past the call's tokens write nothing."""
    b = tl.program_id(0)
    rows = _token_rows(routing)
    if b * BLOCK_T < rows:
        per_expert, per_dest = _count_step(routing.ids, b * BLOCK_T + tl.arange(0, BLOCK_T),
                                           rows, input_err, epoch, shape, BINS, BLOCK_T, 1)
        _store_counts(block_counts + (b + 1) * (shape.NUM_EXPERTS + shape.WORLD),
                      per_expert, per_dest, shape, BINS)


@triton.jit
def open_kernel(routing, stage, block_counts, blocks, counters, input_err, exchange, sync,
                shape, quant, COUNTERS: tl.constexpr, COUNTERS_P2: tl.constexpr,
                STAGE: tl.constexpr, BINS: tl.constexpr, BLOCK_T: tl.constexpr,
                STEP_BLOCKS: tl.constexpr):
    """A small call's opening (:func:`_open`) on program 0; with ``quant`` (not None) the
    FP8 home quantization on the programs after it (the rows are read by this rank's
    kernels only, after this launch: nothing orders them against the opening)."""
    if quant is not None:
        if tl.program_id(0) == 0:
            _open(routing, stage, block_counts, blocks, counters, input_err, exchange, sync,
                  shape, COUNTERS, COUNTERS_P2, STAGE, BINS, BLOCK_T, STEP_BLOCKS)
        else:
            quantize_home_part(quant, tl.program_id(0) - 1)
    else:
        _open(routing, stage, block_counts, blocks, counters, input_err, exchange, sync,
              shape, COUNTERS, COUNTERS_P2, STAGE, BINS, BLOCK_T, STEP_BLOCKS)


@triton.jit
def _open(routing, stage, block_counts, blocks, counters, input_err, exchange, sync, shape,
          COUNTERS: tl.constexpr, COUNTERS_P2: tl.constexpr, STAGE: tl.constexpr,
          BINS: tl.constexpr, BLOCK_T: tl.constexpr, STEP_BLOCKS: tl.constexpr):
    """A small call's opening in one program: the next epoch and ``COUNTERS`` zeroed
    counters; with ``STAGE`` the caller's routing copied into the staged rows; rows ``1..
    used`` of ``block_counts`` as :func:`count_kernel` then :func:`scan_kernel` leave them
    (each block's counts added to those before it, in block order) and the totals in row
    ``blocks``; then the totals pushed to every peer.

    ``STEP_BLOCKS`` token blocks per step (:func:`open_step_blocks`): one load of their
    routing, one histogram of their (block, expert) keys, a prefix over the blocks, one
    store of their rows (a block per step was a chain of dependent loads). A one-block
    call counts its block alone."""
    tl.store(sync.epoch, tl.load(sync.epoch) + 1)
    c = tl.arange(0, COUNTERS_P2)
    tl.store(counters + c, tl.zeros([COUNTERS_P2], tl.int32), mask=c < COUNTERS)
    barrier()    # what follows reads the new epoch (error reports, the push)
    COLS: tl.constexpr = shape.NUM_EXPERTS + shape.WORLD
    rows = _token_rows(routing)
    ids = routing.ids
    if STAGE:    # counted from the caller's ids: the staged copy is this program's stores
        ids = caller_ids(stage)
    # A one-block call (every decode step) counts its block alone: a whole step's masked
    # loads and histogram cells cost it time (docs/notebook.md, "Small calls").
    if rows <= BLOCK_T:
        carry_e, carry_d = _count_steps(ids, stage, block_counts, rows, input_err,
                                        sync.epoch, shape, STAGE, BINS, BLOCK_T, 1)
    else:
        carry_e, carry_d = _count_steps(ids, stage, block_counts, rows, input_err,
                                        sync.epoch, shape, STAGE, BINS, BLOCK_T, STEP_BLOCKS)
    _store_counts(block_counts + blocks * COLS, carry_e[None, :], carry_d[None, :], shape,
                  BINS)
    barrier()    # the push reads the totals back
    push_counts(block_counts + blocks * COLS, exchange.counts, exchange.flags, sync, shape,
                exchange.BLOCK)


@triton.jit
def _count_steps(ids, stage, block_counts, rows, input_err, epoch, shape,
                 STAGE: tl.constexpr, BINS: tl.constexpr, BLOCK_T: tl.constexpr,
                 STEP_BLOCKS: tl.constexpr):
    """Rows ``1..used`` of ``block_counts`` for :func:`open_kernel`, ``STEP_BLOCKS``
    token blocks per step (with ``STAGE``, each step's routing staged too); returns the
    totals (pairs per expert ``[BINS]``, tokens per destination ``[W_P2]``)."""
    COLS: tl.constexpr = shape.NUM_EXPERTS + shape.WORLD
    STEP_T: tl.constexpr = STEP_BLOCKS * BLOCK_T
    carry_e = tl.zeros([BINS], tl.int32)
    carry_d = tl.zeros([shape.W_P2], tl.int32)
    j = tl.arange(0, shape.TOPK_P2)
    g = tl.arange(0, STEP_BLOCKS)
    for b0 in range(0, tl.cdiv(rows, BLOCK_T), STEP_BLOCKS):
        t = b0 * BLOCK_T + tl.arange(0, STEP_T)
        if STAGE:
            stage_pairs(stage, t[:, None] * shape.TOPK + j[None, :],
                        (t[:, None] < rows) & (j[None, :] < shape.TOPK))
        counted_e, counted_d = _count_step(ids, t, rows, input_err, epoch, shape, BINS,
                                           BLOCK_T, STEP_BLOCKS)
        per_expert = tl.cumsum(counted_e, axis=0) + carry_e[None, :]
        per_dest = tl.cumsum(counted_d, axis=0) + carry_d[None, :]
        _store_counts(block_counts + (b0 + 1 + g)[:, None] * COLS, per_expert, per_dest,
                      shape, BINS, (b0 * BLOCK_T + g * BLOCK_T < rows)[:, None])
        carry_e += tl.sum(counted_e, axis=0)
        carry_d += tl.sum(counted_d, axis=0)
    return carry_e, carry_d


@triton.jit
def _count_step(ids, t, rows, input_err, epoch, shape, BINS: tl.constexpr,
                BLOCK_T: tl.constexpr, STEP_BLOCKS: tl.constexpr):
    """Pairs per expert (``[STEP_BLOCKS, BINS]``; bin E holds the slots with no expert)
    and tokens per destination rank (``[STEP_BLOCKS, W_P2]``) of ``STEP_BLOCKS``
    consecutive token blocks (tokens ``t``, ``BLOCK_T`` per block), a row per block;
    reports invalid ids."""
    e, valid, bad = _pairs(ids, t, shape.TOPK, shape.TOPK_P2, shape.NUM_EXPERTS, rows)
    _report(bad, t, input_err, INPUT_BAD_EXPERT, epoch, shape.TOPK_P2)
    STEP_T: tl.constexpr = STEP_BLOCKS * BLOCK_T
    block = (tl.arange(0, STEP_T) // BLOCK_T)[:, None]
    keys = block * BINS + tl.where(valid, e, shape.NUM_EXPERTS)
    per_expert = tl.reshape(
        tl.histogram(tl.reshape(keys, (STEP_T * shape.TOPK_P2,)), STEP_BLOCKS * BINS),
        (STEP_BLOCKS, BINS))
    dests = tl.arange(0, shape.W_P2)
    per_dest = tl.zeros([STEP_BLOCKS, shape.W_P2], tl.int32)
    dest = e // shape.LOCAL_EXPERTS
    for d in range(shape.WORLD):
        on = tl.max((valid & (dest == d)).to(tl.int32), axis=1)
        in_block = tl.sum(tl.reshape(on, (STEP_BLOCKS, BLOCK_T)), axis=1)
        per_dest += tl.where(dests[None, :] == d, in_block[:, None], 0)
    return per_expert, per_dest


@triton.jit
def _store_counts(rows, per_expert, per_dest, shape, BINS: tl.constexpr, live=True):
    """``block_counts`` rows (``rows``: ``[R, 1]`` pointers, or one): pairs per expert
    (``[R, BINS]``), then tokens per destination rank (``[R, W_P2]``); rows where
    ``live`` (``[R, 1]``) is false are left as they are."""
    bins = tl.arange(0, BINS)[None, :]
    dests = tl.arange(0, shape.W_P2)[None, :]
    tl.store(rows + bins, per_expert, mask=live & (bins < shape.NUM_EXPERTS))
    tl.store(rows + shape.NUM_EXPERTS + dests, per_dest, mask=live & (dests < shape.WORLD))


@triton.jit
def scan_kernel(block_counts, blocks, routing, exchange, sync, shape, COLS: tl.constexpr,
                BLOCK_T: tl.constexpr, SCAN_ROWS: tl.constexpr, SCAN_COLS: tl.constexpr):
    """Inclusive prefix sum over the counted rows ``1..used`` of ``block_counts`` (one
    program per ``SCAN_COLS`` columns, ``SCAN_ROWS`` rows per step), so row ``b`` holds
    what blocks before ``b`` counted; the totals also go to the last row, ``blocks``,
    which the count exchange reads whatever the call's size. With ``exchange.IN_PLAN``
    the last program to finish pushes them (comet.kernels.exchange.push_counts): its
    arrival sees every program's totals."""
    cols = tl.program_id(0) * SCAN_COLS + tl.arange(0, SCAN_COLS)
    cmask = cols < COLS
    used = tl.cdiv(_token_rows(routing), BLOCK_T)
    carry = tl.zeros([SCAN_COLS], dtype=tl.int32)
    for r0 in range(1, used + 1, SCAN_ROWS):
        r = r0 + tl.arange(0, SCAN_ROWS)
        mask = (r[:, None] <= used) & cmask[None, :]
        ptrs = block_counts + r[:, None] * COLS + cols[None, :]
        v = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(v, axis=0) + carry[None, :], mask=mask)
        carry += tl.sum(v, axis=0)
    tl.store(block_counts + blocks * COLS + cols, carry, mask=cmask)
    if exchange.IN_PLAN:
        if arrive(exchange.scanned, "gpu") == tl.num_programs(0) - 1:
            push_counts(block_counts + blocks * COLS, exchange.counts, exchange.flags, sync,
                        shape, exchange.BLOCK)


@triton.jit
def layout_kernel(exchange, sync, send_base, dst_base, entry_count, segments,
                  chunks, recv_entries, tiles, scratch, shape, chunking, placing,
                  BLOCK_M: tl.constexpr, HEAD_TILES: tl.constexpr, PLACE: tl.constexpr):
    """Offsets of this rank as a source and as a destination, and its tile table.

    ``exchange.counts [COUNT_BUFFERS, W_src, W_dst, El + 1]``: this call reads the slot
    of its epoch's parity, ``counts_all`` -- with ``exchange.IN_PLAN`` once every peer's
    flag says its counts are there (each program waits for itself). Tables written
    (``[W, El]`` unless noted): send_base/dst_base -- for pairs to expert ``el`` of
    destination ``d``: first index in this rank's send list / first row in ``d``'s
    shared tensor; placing.send.off ``[W + 1]``; entry_count ``[W]``; the segments;
    chunks/recv_entries ``[W]`` -- dispatch chunks and return entries each source sends
    here; the tile table, in the order of :func:`comet.scheduler.plan.build_tile_table`
    (``HEAD_TILES`` stage-0 tiles, then expert-major).

    Every program computes the offsets (a few vector ops on ``counts``); program 0 stores
    them, and the programs split the tile table's cells (segment ``o``, expert ``el``)
    among themselves; with ``PLACE`` they also split the call's token blocks
    (:func:`place_kernel`'s work). Filling a cell, or placing a block, is a chain of
    dependent loads and stores, too long in series for one program at hundreds of
    cells (256 experts). ``scratch``: ``[programs, LAYOUT_SCRATCH, W * El]``
    int32, each program's own copy of what its cells and blocks read, so no program
    reads what another wrote.
    """
    WORLD: tl.constexpr = shape.WORLD
    W_P2: tl.constexpr = shape.W_P2
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    EL_P2: tl.constexpr = shape.EL_P2
    seg_start, seg_rows, pre = segments.start, segments.rows, segments.pre
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    lead = pid == 0
    EL1: tl.constexpr = LOCAL_EXPERTS + 1
    rank = sync.rank
    if exchange.IN_PLAN:
        wait_counts(exchange.flags, sync, shape)
    counts_all = (exchange.counts.local
                  + (tl.load(sync.epoch) % COUNT_BUFFERS) * WORLD * WORLD * EL1)
    s_idx = tl.arange(0, W_P2)
    el_idx = tl.arange(0, EL_P2)
    grid_mask = (s_idx[:, None] < WORLD) & (el_idx[None, :] < LOCAL_EXPERTS)
    w_mask = s_idx < WORLD

    # -- as a source: where my pairs land, and my send list ------------------------------
    n_cells: tl.constexpr = WORLD * LOCAL_EXPERTS
    mine = scratch + pid * LAYOUT_SCRATCH * n_cells
    if lead:
        per_dest = _source_offsets(counts_all, rank, send_base, dst_base, shape)
        send_off = placing.send.off
        tl.store(send_off + s_idx, tl.cumsum(per_dest, axis=0) - per_dest, mask=w_mask)
        tl.store(send_off + WORLD, tl.sum(per_dest, axis=0))
        unique = tl.load(counts_all + rank * WORLD * EL1 + s_idx * EL1 + LOCAL_EXPERTS,
                         mask=w_mask, other=0)
        tl.store(entry_count + s_idx, unique, mask=w_mask)
    if PLACE:    # every program places some blocks, from its own copy of the offsets
        _source_offsets(counts_all, rank, mine + SOURCE_SCRATCH * n_cells,
                        mine + (SOURCE_SCRATCH + 1) * n_cells, shape)

    # -- as a destination: segments, waits and tiles -----------------------------------
    m = tl.load(counts_all + s_idx[:, None] * WORLD * EL1 + rank * EL1 + el_idx[None, :],
                mask=grid_mask, other=0)                        # [s, el]
    ent = tl.load(counts_all + s_idx * WORLD * EL1 + rank * EL1 + LOCAL_EXPERTS,
                  mask=w_mask, other=0)
    o_idx = s_idx                                               # rows of the ring view: o
    src_of_o = (rank + o_idx) % WORLD
    ring_rows = tl.load(counts_all + src_of_o[:, None] * WORLD * EL1 + rank * EL1
                        + el_idx[None, :], mask=grid_mask, other=0)   # [o, el]
    ex_rows = tl.sum(ring_rows, axis=0)
    ex_off = tl.cumsum(ex_rows, axis=0) - ex_rows
    seg_end_rel = tl.cumsum(ring_rows, axis=0)                  # inclusive, within expert
    seg0 = ex_off[None, :] + seg_end_rel - ring_rows
    # A tile's stage is the ring offset of the segment holding its last row, so stage is
    # non-decreasing along an expert's tiles, and the tiles of expert el with stage <= o
    # are those ending at or before the end of segment o (a closed form, no search).
    tiles_el = tl.cdiv(ex_rows, BLOCK_M)[None, :]
    seg_start_rel = seg_end_rel - ring_rows
    upto = tl.where(seg_end_rel >= ex_rows[None, :], tiles_el, seg_end_rel // BLOCK_M)
    before = tl.where(seg_start_rel >= ex_rows[None, :], tiles_el, seg_start_rel // BLOCK_M)
    per_stage = tl.where(grid_mask, upto - before, 0)
    # Table order (comet.scheduler.plan): the first HEAD_TILES stage-0 tiles, by expert;
    # then the rest expert-major -- cells (el, o), o after o within an expert.
    local = tl.sum(tl.where(o_idx[:, None] == 0, per_stage, 0), axis=0)       # [el]
    head_base = tl.cumsum(local, axis=0) - local
    head_in = tl.where(o_idx[:, None] == 0,
                       tl.minimum(tl.maximum(HEAD_TILES - head_base, 0), local)[None, :], 0)
    rest = tl.reshape(tl.trans(per_stage - head_in), (EL_P2 * W_P2,))
    rest_base = tl.trans(tl.reshape(tl.cumsum(rest, axis=0) - rest, (EL_P2, W_P2)))
    rest_base += tl.minimum(HEAD_TILES, tl.sum(local, axis=0))
    cell = o_idx[:, None] * LOCAL_EXPERTS + el_idx[None, :]
    if lead:
        tl.store(pre + s_idx[:, None] * LOCAL_EXPERTS + el_idx[None, :],
                 tl.cumsum(m, axis=1) - m, mask=grid_mask)
        tl.store(recv_entries + s_idx, ent, mask=w_mask)
        tl.store(chunks + s_idx,
                 tl.cdiv(tl.sum(m, axis=1), chunking.ROWS) + tl.cdiv(ent, chunking.ENTRIES),
                 mask=w_mask)
        tl.store(seg_start + cell, seg0, mask=grid_mask)
        tl.store(seg_rows + cell, ring_rows, mask=grid_mask)
        tl.store(tiles.num, tl.sum(tl.sum(per_stage, axis=1), axis=0))
    tl.store(mine + cell, before, mask=grid_mask)
    tl.store(mine + n_cells + cell, per_stage, mask=grid_mask)
    tl.store(mine + 2 * n_cells + cell, tl.broadcast_to(head_base[None, :], (W_P2, EL_P2)),
             mask=grid_mask)
    tl.store(mine + 3 * n_cells + cell, head_in, mask=grid_mask)
    tl.store(mine + 4 * n_cells + cell, rest_base, mask=grid_mask)
    tl.store(mine + 5 * n_cells + cell, seg0, mask=grid_mask)
    tl.store(mine + 6 * n_cells + cell, ring_rows, mask=grid_mask)
    tl.debug_barrier()
    if PLACE:
        rows = _token_rows(placing.routing)
        for b in range(pid, tl.cdiv(rows, placing.BLOCK_T), n_prog):
            _place_block(placing, mine + SOURCE_SCRATCH * n_cells,
                         mine + (SOURCE_SCRATCH + 1) * n_cells, rows, sync.epoch, b, shape)
    for c in range(pid, n_cells, n_prog):
        o = c // LOCAL_EXPERTS
        el = c % LOCAL_EXPERTS
        first = tl.load(mine + c)
        count = tl.load(mine + n_cells + c)
        head_at = tl.load(mine + 2 * n_cells + c)
        in_head = tl.load(mine + 3 * n_cells + c)
        rest_at = tl.load(mine + 4 * n_cells + c)
        # segments of expert el, by ring offset
        seg_o = tl.load(mine + 5 * n_cells + o_idx * LOCAL_EXPERTS + el, mask=w_mask,
                        other=0)
        len_o = tl.load(mine + 6 * n_cells + o_idx * LOCAL_EXPERTS + el, mask=w_mask,
                        other=0)
        e_off = tl.load(mine + 5 * n_cells + el)
        e_end = e_off + tl.sum(len_o, axis=0)
        for c0 in range(0, count, TILE_CHUNK):
            i = c0 + tl.arange(0, TILE_CHUNK)
            live = i < count
            r0 = e_off + (first + i) * BLOCK_M
            r1 = tl.minimum(r0 + BLOCK_M, e_end)
            hit = ((seg_o[None, :] < r1[:, None]) & (seg_o[None, :] + len_o[None, :] > r0[:, None])
                   & (len_o[None, :] > 0))
            one = tl.full([TILE_CHUNK, W_P2], 1, tl.int64)
            bits = tl.where(hit, one << src_of_o[None, :].to(tl.int64), 0)
            dst = tl.where(i < in_head, head_at + i, rest_at + i - in_head)
            tl.store(tiles.expert + dst, tl.full([TILE_CHUNK], el, tl.int32), mask=live)
            tl.store(tiles.row_start + dst, r0, mask=live)
            tl.store(tiles.row_end + dst, r1, mask=live)
            tl.store(tiles.wait + dst, tl.sum(bits, axis=1), mask=live)
            tl.store(tiles.stage + dst, tl.full([TILE_CHUNK], o, tl.int32), mask=live)


@triton.jit
def _source_offsets(counts_all, rank, send_base, dst_base, shape):
    """Store ``send_base`` and ``dst_base`` (``[W, El]``, see :func:`layout_kernel`) from
    ``counts_all``; return this rank's pairs per destination (``[W_P2]``)."""
    WORLD: tl.constexpr = shape.WORLD
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    EL1: tl.constexpr = LOCAL_EXPERTS + 1
    s_idx = tl.arange(0, shape.W_P2)
    el_idx = tl.arange(0, shape.EL_P2)
    grid_mask = (s_idx[:, None] < WORLD) & (el_idx[None, :] < LOCAL_EXPERTS)
    sent = tl.load(counts_all + rank * WORLD * EL1 + s_idx[:, None] * EL1
                   + el_idx[None, :], mask=grid_mask, other=0)     # [d, el]
    flat = tl.reshape(sent, (shape.W_P2 * shape.EL_P2,))
    base = tl.reshape(tl.cumsum(flat, axis=0) - flat, (shape.W_P2, shape.EL_P2))
    tl.store(send_base + s_idx[:, None] * LOCAL_EXPERTS + el_idx[None, :], base,
             mask=grid_mask)
    for d in range(WORLD):
        # rows of every source s for d's experts: m[s, el]
        m = tl.load(counts_all + s_idx[:, None] * WORLD * EL1 + d * EL1 + el_idx[None, :],
                    mask=grid_mask, other=0)
        ex_rows = tl.sum(m, axis=0)
        ex_off = tl.cumsum(ex_rows, axis=0) - ex_rows
        ring = (s_idx - d + WORLD) % WORLD                     # ring offset of source s
        before = tl.sum(tl.where((ring < (rank - d + WORLD) % WORLD)[:, None], m, 0),
                        axis=0)
        tl.store(dst_base + d * LOCAL_EXPERTS + el_idx, ex_off + before,
                 mask=el_idx < LOCAL_EXPERTS)
    return tl.sum(sent, axis=1)


@triton.jit
def place_kernel(placing, send_base, dst_base, epoch, shape):
    """Send list and return entries of token block ``b`` (see module docstring). The
    routing's token count bounds the ids read; ``placing.max_tokens`` is the tables'
    capacity. Reports non-finite weights of real pairs."""
    b = tl.program_id(0)
    rows = _token_rows(placing.routing)
    if b * placing.BLOCK_T < rows:
        _place_block(placing, send_base, dst_base, rows, epoch, b, shape)


@triton.jit
def _place_block(placing, send_base, dst_base, rows, epoch, b, shape):
    routing, block_counts, send, entries = (placing.routing, placing.block_counts,
                                            placing.send, placing.entries)
    dest_mask, pair_live = placing.dest_mask, placing.pair_live
    max_tokens, input_err = placing.max_tokens, placing.input_err
    BLOCK_T: tl.constexpr = placing.BLOCK_T
    TOPK: tl.constexpr = shape.TOPK
    TOPK_P2: tl.constexpr = shape.TOPK_P2
    NUM_EXPERTS: tl.constexpr = shape.NUM_EXPERTS
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    WORLD: tl.constexpr = shape.WORLD
    ids_ptr, weights_ptr = routing.ids, routing.weights
    send_pair, send_row, send_weight = send.pair, send.row, send.weight
    ent_token, ent_rows, ent_weight = entries.token, entries.rows, entries.weight
    P: tl.constexpr = BLOCK_T * TOPK_P2
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, TOPK_P2)
    e, valid, _ = _pairs(ids_ptr, t, TOPK, TOPK_P2, NUM_EXPERTS, rows)
    e_safe = tl.where(valid, e, 0)
    dest = e_safe // LOCAL_EXPERTS
    el = e_safe - dest * LOCAL_EXPERTS
    # Rank of each pair among this block's pairs of the same expert, in (token, slot) order.
    key = tl.reshape(tl.where(valid, e, NUM_EXPERTS), (P,))
    order = tl.arange(0, P)
    earlier = (key[:, None] == key[None, :]) & (order[None, :] < order[:, None])
    rank_in = tl.reshape(tl.sum(earlier.to(tl.int32), axis=1), (BLOCK_T, TOPK_P2))
    row = block_counts + b * (NUM_EXPERTS + WORLD)              # exclusive prefix of block b
    pos = tl.load(row + e_safe, mask=valid, other=0) + rank_in
    dst_row = tl.load(dst_base + dest * LOCAL_EXPERTS + el, mask=valid, other=0) + pos
    idx = tl.load(send_base + dest * LOCAL_EXPERTS + el, mask=valid, other=0) + pos
    pair = t[:, None] * TOPK + j[None, :]
    tl.store(send_pair + idx, pair, mask=valid)
    tl.store(send_row + idx, dst_row, mask=valid)
    w = tl.load(weights_ptr + pair.to(tl.int64), mask=valid, other=0.0).to(tl.float32)
    finite = (w == w) & (tl.abs(w) != float("inf"))
    _report(valid & ~finite, t, input_err, INPUT_BAD_WEIGHT, epoch, TOPK_P2)
    w = tl.where(finite, w, 0.0)      # the slot then adds nothing, as "no expert" would
    tl.store(send_weight + idx, w, mask=valid)
    live_t = t < max_tokens
    tl.store(pair_live + pair, valid.to(tl.int32),
             mask=live_t[:, None] & (t[:, None] < rows) & (j[None, :] < TOPK))
    # A pair is its token's first to d if no pair of the token on d sorts before it.
    code = e_safe * TOPK_P2 + j[None, :]
    for d in range(WORLD):
        on = valid & (dest == d)
        first = on & (code == tl.min(tl.where(on, code, NUM_EXPERTS * TOPK_P2), axis=1)[:, None])
        tl.store(send.first + idx, first.to(tl.int32), mask=on)
        any_d = tl.max(on.to(tl.int32), axis=1)
        q = tl.load(row + NUM_EXPERTS + d) + tl.cumsum(any_d, axis=0) - any_d
        slot = (d * max_tokens + q).to(tl.int64)
        has = any_d != 0
        tl.store(ent_token + slot, t, mask=has)
        jm = has[:, None] & (j[None, :] < TOPK)
        tl.store(ent_rows + slot[:, None] * TOPK + j[None, :], tl.where(on, dst_row, -1), mask=jm)
        tl.store(ent_weight + slot[:, None] * TOPK + j[None, :], tl.where(on, w, 0.0), mask=jm)
        tl.store(dest_mask + t.to(tl.int64) * WORLD + d, any_d, mask=live_t)


@triton.jit
def paired_tiles_kernel(segments, out, shape, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """One program: the m-tile table of ``ROWS``-row tiles (``out``, an
    :class:`comet.kernels.fp8_gemm.MTiles`) over a one-rank call's rows, expert by
    expert as its segments place them (ring offset 0 holds every row). A tile finds its
    expert among the experts' running tile counts, ``CHUNK`` tiles at a time."""
    el = tl.arange(0, shape.EL_P2)
    on = el < shape.LOCAL_EXPERTS
    rows = tl.load(segments.rows + el, mask=on, other=0)
    first = tl.load(segments.start + el, mask=on, other=0)
    tiles = tl.cdiv(rows, ROWS)
    ends = tl.cumsum(tiles, axis=0)                         # tiles up to each expert
    total = tl.sum(tiles, axis=0)
    tl.store(out.num, total)
    for c0 in range(0, total, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        e = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        mine = el[None, :] == e[:, None]
        before = tl.sum(tl.where(mine, ends - tiles, 0), axis=1)
        start = tl.sum(tl.where(mine, first, 0), axis=1) + (t - before) * ROWS
        end = tl.minimum(start + ROWS, tl.sum(tl.where(mine, first + rows, 0), axis=1))
        live = t < total
        tl.store(out.expert + t, e, mask=live)
        tl.store(out.row_start + t, start, mask=live)
        tl.store(out.row_end + t, end, mask=live)


def paired_tiles(segments: Segments, out: MTiles, shape: Shape, rows: int) -> None:
    """Fill ``out`` with :func:`paired_tiles_kernel`'s table of ``rows``-row tiles (room
    for as many as the plan's own table, whose tiles are no longer)."""
    paired_tiles_kernel[(1, )](segments, out, shape, ROWS=rows, CHUNK=64, num_warps=4)
