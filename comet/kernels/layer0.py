"""layer0: dispatch -> GroupGEMM(W13) -> SiLU(gate) * up, in one persistent kernel.

The backward (comet.runtime.backward) runs the same kernel twice more, as plain GEMMs
with no activation: dispatch x and recompute ``gate/up = a0 @ W13``, then dispatch dy and
compute ``a0 @ W2^T``.

Shared tensor: ``a0 [rows, H]``, the token rows this rank receives, laid out by
:mod:`comet.routing` (expert, then source in ring order, then token). It is decomposed
along M: a GEMM tile needs only its own rows, so it can start as soon as the sources in
its wait set have delivered.

Roles (program ids below ``n_comm`` communicate, the rest compute):

* comm (:func:`dispatch_role`) -- *push*: this rank writes its token rows straight into
  every destination's ``a0`` (remote stores beat remote loads on NVLink), every
  destination abreast: chunk ``c`` of each destination before chunk ``c + 1`` of any, so
  each destination receives every source's rows in expert order, the order its
  expert-major tiles consume them (destinations in ring order ``r, r-1, ...`` inside a
  round, so that every rank feeds a different peer). With layer1's scatter epilogue each
  row also carries where its layer1 output goes (``row_home``, ``row_weight``). After a
  destination's rows go the *return entries* layer1's reduce will need. Each chunk has its
  own flag, ``flag0[r, c]`` on the destination, set to the call's epoch once chunk ``c``
  of rank ``r`` landed: chunks publish independently, no chunk waits for another.
  *Gathered* (``Variant.layer0_gather``, :func:`_push_gathered`): the same chunks of
  pairs, but a pair is only an index entry ``a0_src[row]`` (and its home), and a token's
  row crosses once per destination -- into ``tokens[source * Mx + t]`` (a0's first rows),
  with the first of the token's pairs there; the GEMM reads ``tokens[a0_src[row]]``
  (comet.kernels.group_gemm.Gathered). The waits are unchanged: every other pair of the
  token sits in the same or a later chunk, and a tile waits for the chunks up to its own.
  A rank's own rows are not copied (``Variant.layer0_own_in_place``): its GEMM reads
  them from x, and its own chunks carry index entries only.
* compute (:func:`layer0_compute_role`) -- the GroupGEMM over the tile table (a local
  head, then expert-major: comet.scheduler.plan);
  before a tile, wait for exactly the sources of its wait set, and of each for the
  chunks up to the one holding the tile's last row: local rows feed the GEMM as soon as
  they land.
  Tiles come from a device work queue in the table's order (strided lanes of a few
  items, :func:`comet.kernels.group_gemm.strided_take`), and a comm block that has
  pushed its chunks joins it: the split sets how many blocks *start* communicating, no
  SM is lost to communication for the rest of the call. Optionally, a small call whose
  items would leave programs idle runs as stream-K instead (:func:`stream_k_role`,
  ``Variant.layer0_stream_k``): equal runs of K steps per program; and a call whose
  last round of items is mostly empty may take that round's items as K splits
  (:func:`tail_split`, ``Variant.layer0_tail_split``).

FP8 layers (``GemmTile.FP8``, comet.kernels.fp8_gemm.Fp8Tile): the rows that cross are
FP8 rows packed with their scales (comet.kernels.fp8_roles.PackedRows, quantized on their
home rank before the kernel), copied as bytes; the GEMM role runs the block-scaled K loop
on them and stores h in FP8 groups; stream-K and the tail splits cut its K loop as they
cut a one-dot box's (the gate and up tiles of a part side by side in the scratch).

The count exchange that precedes the kernel (comet.kernels.exchange) is where every rank
learns the layout of every destination's shared tensor.

Arguments come in groups (:class:`Dispatch`, :class:`~comet.kernels.group_gemm.Gemm`, the
plan's :class:`~comet.kernels.plan.Tiles` and :class:`~comet.kernels.plan.Segments`,
:class:`~comet.kernels.sync.Sync`, ...), each documented where it is defined;
:func:`launch_layer0` builds the constexpr ones from a TileConfig.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.activation import SILU, GatedActivation
from comet.config import TileConfig
from comet.constants import constexpr, CHUNK_SCAN, ROLE_COMM, ROLE_COMPUTE, SITE_DISPATCH
from comet.kernels.address import PeerBuffer, peer, pointer_at
from comet.kernels.activation import act_tile, gated
from comet.kernels.fp8_gemm import LAYER0_BLOCK_N, block_scaled_k_loop, fp8_item, store_fp8_groups
from comet.kernels.group_gemm import (Gathered, Gemm, GemmTile, descriptor, dot_precision,
                                      gemm_tile, grouped_work, lane_shape, one_dot_acc,
                                      one_dot_epilogue, store_tile, strided_take)
from comet.kernels.plan import EntryTables, Segments, SendList, Tiles
from comet.kernels.roles import assign_role
from comet.kernels.shape import Shape
from comet.kernels.sync import (Sync, Trace, arrive, clock_ns, fence_async_proxy, healthy,
                                release, stamp, stamp_program, take, wait_chunks)
from comet.weights import GATE_UP_BLOCK

#: Work items per take of layer0's queue (one lane of :func:`strided_take`) once the call
#: has at least one full round of them (``programs * LANE_ITEMS`` items; below that, one
#: item per take balances the few items there are). A lane of several items runs as one
#: flattened loop, its tiles' epilogues under the next tile's loads. 4: the fastest
#: measured, near a static flattened loop (docs/notebook.md, "Kernel structure").
LANE_ITEMS = constexpr(4)
#: Dispatch chunks that may be copied in parts, per call (one arrival counter each,
#: ``Dispatch.parts``): parts are cut only when the call's chunks are fewer than the comm
#: programs, which are fewer than the SMs of any GPU comet runs on.
DISPATCH_PART_SLOTS = constexpr(256)
#: Added to a part's arrival when the part skipped its copy (the group had failed): the
#: chunk's last part then leaves its flag unpublished (a part count stays far below it).
PART_SKIPPED = constexpr(1 << 16)
#: Most programs a stream-K call may use (two partial tiles each in the scratch): at
#: least the SMs of any GPU comet runs on (132 on an H100 or H200, 148 on a B200).
STREAM_K_PROGRAMS = constexpr(256)
#: Stream-K runs only where whole work items make fewer than this many rounds of the
#: programs (a call with more keeps the queue: its idle share is small). The host's
#: gate (comet.runtime.selection) applies the same bound to its estimate of the items.
#: The arrival counters, one per item (``Work.arrived``, 2 x STREAM_K_PROGRAMS), rely on
#: it: a bound of 8 overflowed them (docs/notebook.md, "Small calls": stream-K past two
#: rounds, removed in `52bf82e`).
STREAM_K_ROUNDS = constexpr(2)
#: Most rows of an m-tile in a stream-K call (rows a partial tile keeps): small calls only.
STREAM_K_ROWS = constexpr(32)
#: Stream-K runs when whole work items would leave at least this share (percent) of the
#: programs' rounds idle (the last round's empty programs): 100 items on 132 programs
#: leave 24%, 224 items 15%, 128 items 3% (not worth a fix-up per item).
STREAM_K_IDLE_PCT = constexpr(10)
#: Most rows of an m-tile whose item a tail split cuts (``Work.TAIL_SPLIT``): the
#: stream-K scratch viewed as ``STREAM_K_PROGRAMS`` boxes of twice ``STREAM_K_ROWS`` rows,
#: one per unit (a unit per program at most) -- a 128-token call's experts have 32-64.
TAIL_ROWS = constexpr(2 * STREAM_K_ROWS.value)


class Homes(NamedTuple):
    """Where each received row's layer1 output goes (layer1's scatter epilogue): pushed
    with the row, ``[rows]`` on every rank."""

    home: PeerBuffer         # int32: the token's slot ``s * Mx * k + t * k + j`` on its rank
    weight: PeerBuffer       # fp32: the slot's routing weight


class Dispatch(NamedTuple):
    """What layer0's comm role sends and where: this rank's rows and return entries, into
    every destination's symmetric buffers."""

    x_addr: torch.Tensor     # int64 [1]: address of the input [M, H] (read on the device)
    send: SendList           # this rank's pairs, by destination (the plan)
    entries: EntryTables     # this rank's return entries, by destination (the plan)
    entry_count: torch.Tensor  # int32 [W]: how many, per destination
    a0: PeerBuffer           # the shared tensor [rows, H]
    recv: EntryTables        # PeerBuffers: return entries [W, Mx(, k)], by source
    homes: Homes | None      # with ROW_HOME: where layer1 sends each row
    flag0: PeerBuffer        # int64 [W, slots]: chunk c from source s landed in call flag0[s, c]
    chunk_slots: int         # flag0's row stride: chunks one source may send one destination
    max_tokens: int
    queue: torch.Tensor      # int32 [1]: the dispatch's chunk queue (zeroed per call)
    #: GATHER: each destination's token rows and a0 row index (a0 itself is not written)
    gather: "GatherTargets | None" = None
    #: int32 [DISPATCH_PART_SLOTS]: parts copied per chunk, when chunks are cut in parts
    #: (``DispatchTile.PARTS`` > 1; zeroed per call)
    parts: torch.Tensor | None = None
    #: FP8 (``GemmTile.FP8``): bytes of a row as it crosses, its e4m3 values and fp32
    #: scales packed (comet.kernels.fp8_roles.PackedRows); x and a0 are such rows
    row_bytes: int | None = None


class GatherTargets(NamedTuple):
    """Where a gathered dispatch (``Variant.layer0_gather``) writes on a destination:
    a token's row once, at ``tokens[source * max_tokens + t]``, and for every pair the
    index entry ``src[row]`` the GEMM reads its A row through
    (comet.kernels.group_gemm.Gathered)."""

    tokens: PeerBuffer       # [W * max_tokens, H] (the first rows of ``a0``'s memory)
    src: PeerBuffer          # int32 [rows]


class Work(NamedTuple):
    """How the GEMM programs share layer0's work items: a queue of whole items -- or, in
    a small call with ``STREAM_K`` (:func:`stream_k_pays`), equal runs of K steps
    (:func:`stream_k_role`); with ``TAIL_SPLIT``, the queue's last partial round in K
    splits (:func:`tail_split`)."""

    queue: torch.Tensor                   # int32 [1]: the work queue (zeroed per call)
    #: fp32 [2 * STREAM_K_PROGRAMS, STREAM_K_ROWS, 2 * BLOCK_N]: two parts per program
    partial: torch.Tensor | None = None
    #: int32 [2 * STREAM_K_PROGRAMS]: parts in, per item (zeroed per call)
    arrived: torch.Tensor | None = None
    STREAM_K: tl.constexpr = constexpr(False)
    #: most K splits of each item of the queue's last partial round (1: none;
    #: ``Variant.layer0_tail_split``)
    TAIL_SPLIT: tl.constexpr = constexpr(1)


class DispatchTile(NamedTuple):
    """Constexpr tiles of the dispatch."""

    ROWS: tl.constexpr        # rows per chunk (each chunk has its own flag)
    COPY_ROWS: tl.constexpr   # rows x ...
    BLOCK_H: tl.constexpr     # ... columns per copy step
    ENTRIES: tl.constexpr     # return entries per chunk
    ENTRY_TILE: tl.constexpr  # entries per copy step
    ROW_HOME: tl.constexpr    # also send each row's home and weight (:class:`Homes`)
    GATHER: tl.constexpr      # a row per (token, destination), pairs as index entries
    OWN_IN_PLACE: tl.constexpr  # GATHER: no row copied to this rank itself (read from x)
    PARTS: tl.constexpr       # most parts a chunk's copy is cut into (CommConfig.dispatch_parts)


class Lanes(NamedTuple):
    """Constexpr order of layer0's work queue (comet.kernels.group_gemm)."""

    GROUP_M: tl.constexpr      # m-tiles that sweep the column blocks together
    HEAD_ROUNDS: tl.constexpr  # rounds of single-item takes at the start ...
    TAIL_ROUNDS: tl.constexpr  # ... and at the end


class Arrivals(NamedTuple):
    """The dispatch as a destination sees it: which chunks of which source have landed,
    and how many there are this call (rows first, then return entries)."""

    flags: torch.Tensor          # int64 [W, slots]: this rank's flag0
    slots: int                   # flags' row stride
    chunks: torch.Tensor         # int32 [W]: chunks each source sends here (the plan's)
    entries: torch.Tensor        # int32 [W]: return entries each source sends here


@functools.lru_cache(maxsize=64)
def dispatch_tile(tile: TileConfig, row_home: bool, gather: bool,
                  own_in_place: bool) -> DispatchTile:
    """``own_in_place``: the GEMM reads this rank's own rows from x (``GemmTile.A_OWN``),
    so the dispatch copies none of them."""
    c = tile.comm
    return DispatchTile(*(constexpr(v) for v in (
        c.comm_rows, c.comm_copy_rows, c.comm_block_h, c.dispatch_entries, c.comm_entries,
        row_home, gather, own_in_place, c.dispatch_parts)))


@functools.lru_cache(maxsize=64)
def lanes(tile: TileConfig) -> Lanes:
    return Lanes(*(constexpr(v) for v in (tile.gemm.group_m, tile.gemm.lane_head_rounds,
                                             tile.gemm.lane_tail_rounds)))


def one_dot_tiles(block_n0: int, ffn: int) -> bool:
    """Whether layer0's gated items over F = ``ffn`` columns are one dot each: whole
    interleave blocks, or a last half block whose box the half-tail epilogue unpacks
    (F = 704, 2880: TP shards, GPT-OSS). Stream-K runs on such bf16 items only."""
    return block_n0 == GATE_UP_BLOCK and ffn % (GATE_UP_BLOCK // 2) == 0


def item_columns(block_n0: int, fp8: bool) -> int:
    """Columns of one of layer0's work items: ``block_n0``, or an FP8 layer's
    ``LAYER0_BLOCK_N`` (gate and up as two dots of one activation group each)."""
    return LAYER0_BLOCK_N if fp8 else block_n0


def cut_item_columns(block_n0: int, ffn: int, fp8: bool) -> int:
    """:func:`item_columns` if stream-K and the tail splits can cut the items' K loop
    (the scratch keeps a box of twice as many columns per part: FP8 items and one-dot
    ones, :func:`one_dot_tiles`), else 0."""
    cut = fp8 or one_dot_tiles(block_n0, ffn)
    return item_columns(block_n0, fp8) if cut else 0


def check_gather(block_n0: int, ffn: int) -> None:
    """ValueError unless layer0's items over F = ``ffn`` columns can read A through an
    index (``Variant.layer0_gather``): one-dot items only (:func:`one_dot_tiles`)."""
    if not one_dot_tiles(block_n0, ffn):
        raise ValueError(f"layer0_gather needs one-dot layer0 items (block_n0 = "
                         f"{GATE_UP_BLOCK} and F a multiple of {GATE_UP_BLOCK // 2}); got "
                         f"block_n0 {block_n0}, F {ffn}")


def layer0_gemm(a0: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: TileConfig,
                gated: bool, transposed: bool = False, activation: GatedActivation = SILU,
                bias: torch.Tensor | None = None, rows: Gathered | None = None
                ) -> tuple[Gemm, GemmTile]:
    """Operands and work-item shape of layer0's GroupGEMM on the shared tensor ``a0
    [rows, H]``, into ``out [rows, N]``: ``gated``, ``act(a0 @ gate) * (a0 @ up)``
    (``activation``) with ``w [El, H, 2N]`` in the interleaved layout (comet.weights), on
    ``block_n0``-column items (one dot each when they are whole interleave blocks); else
    the backward's plain ``a0 @ w`` for ``w [El, H, N]``, or ``a0 @ w^T`` for ``w [El, N,
    H]`` (``transposed``), on ``block_n1``-column items. ``bias``: ``[El, 2N]`` (gated,
    W13's columns) or ``[El, N]``, added to each expert's rows before the activation.
    ``rows``: the gated GEMM reads A through an index (a gathered dispatch; only a
    tile's own rows with ``tile.variant.layer0_live_rows``); one-dot items only."""
    el, h, n = w.shape[0], a0.shape[1], out.shape[1]
    bk = tile.gemm.k_step(h)
    if gated:
        block_n = tile.gemm.block_n0
        one_dot = one_dot_tiles(block_n, n)
        if rows is not None:
            check_gather(block_n, n)
        half_tail = one_dot and n % GATE_UP_BLOCK == GATE_UP_BLOCK // 2
        b = descriptor(w.view(el * h, 2 * n), [bk, block_n * (2 if one_dot else 1)])
    else:
        if rows is not None:
            raise ValueError("only layer0's gated GEMM reads A through an index")
        block_n, one_dot, half_tail = tile.gemm.block_n1, False, False
        b = (descriptor(w.view(el * n, h), [block_n, bk]) if transposed
             else descriptor(w.view(el * h, n), [bk, block_n]))
    gemm = Gemm(descriptor(a0, [tile.gemm.block_m, bk]), b, out, h, n, bias, rows)
    return gemm, GemmTile(*(constexpr(v) for v in (
        tile.gemm.block_m, block_n, bk, gated, one_dot, transposed, GATE_UP_BLOCK, half_tail,
        dot_precision(a0.dtype))), act_tile(activation), constexpr(bias is not None),
        constexpr(rows is not None), constexpr(rows is not None and tile.variant.layer0_live_rows),
        constexpr(rows is not None and rows.own is not None))


def launch_layer0(grid: int, *, dispatch: Dispatch, gemm: Gemm, item: GemmTile,
                  tiles: Tiles, segments: Segments, work: Work, sync: Sync,
                  split: torch.Tensor, trace: Trace, shape: Shape, tile: TileConfig,
                  role: int, wait: bool = True, cooperative: bool = False) -> None:
    """Dispatch + GroupGEMM for one rank on ``grid`` programs (``role``: fused -- the
    first ``split[0]`` programs dispatch, then join the GEMM --, comm or compute);
    ``work``: the GEMM's work queue and stream-K scratch. ``cooperative``: launch so that
    every program is co-resident or the launch fails (a fused launch on a GPU of its
    own); ``wait=False``: the GEMM assumes the rows are in place."""
    extra = {"launch_cooperative_grid": True} if cooperative else {}
    layer0_kernel[(grid,)](
        dispatch=dispatch, **gemm.kernel_args(), tiles=tiles, segments=segments, work=work,
        sync=sync, split=split, trace=trace, shape=shape,
        comm=dispatch_tile(tile, dispatch.homes is not None, dispatch.gather is not None,
                           bool(item.A_OWN)),
        item=item,
        lanes=lanes(tile), ROLE=role, WAIT=wait, num_warps=tile.gemm.num_warps,
        num_stages=tile.gemm.num_stages, **extra)


@triton.jit
def _push_rows(x_ptr, dst, send, dst_home, dst_weight, home_base, start, end, H,
               TOPK: tl.constexpr, comm):
    """Copy the token rows of pairs ``send.pair[start:end]`` of x into rows
    ``send.row[...]`` of dst, ``COPY_ROWS`` x ``BLOCK_H`` at a time. With ``ROW_HOME``,
    also tell the destination where each row's layer1 output goes and with what weight:
    ``dst_home[row] = home_base + pair`` (this rank's slot in every rank's ``pair_out``
    numbering) and ``dst_weight[row]`` -- a few bytes per row, published by the same
    chunk flag as the row itself."""
    for r0 in range(start, end, comm.COPY_ROWS):
        i = r0 + tl.arange(0, comm.COPY_ROWS)
        live = i < end
        pair = tl.load(send.pair + i, mask=live, other=0)
        tok = (pair // TOPK).to(tl.int64)
        row = tl.load(send.row + i, mask=live, other=0).to(tl.int64)
        if comm.ROW_HOME:
            tl.store(dst_home + row, home_base + pair, mask=live)
            tl.store(dst_weight + row, tl.load(send.weight + i, mask=live), mask=live)
        for h0 in range(0, H, comm.BLOCK_H):
            cols = h0 + tl.arange(0, comm.BLOCK_H)
            mask = live[:, None] & (cols[None, :] < H)
            v = tl.load(x_ptr + tok[:, None] * H + cols[None, :], mask=mask)
            tl.store(dst + row[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _push_gathered(x_ptr, gather, d, send, dst_home, dst_weight, home_base, token_base,
                   start, end, H, TOPK: tl.constexpr, comm, in_place):
    """A gathered dispatch's chunk of pairs ``send[start:end]`` (``ROWS`` at most) to
    destination ``d``: every pair as the index entry ``src[row] = token_base + t`` (with
    its home and weight under ``ROW_HOME``), and the rows of the tokens whose first pair
    to ``d`` is in the chunk (``send.first``) into ``tokens[token_base + t]``,
    ``COPY_ROWS`` at a time (the chunk's firsts picked out in order: a full copy tile
    even where a token has all its pairs on ``d``) -- unless ``in_place`` (``d`` is this
    rank) with ``OWN_IN_PLACE``: its GEMM reads its own rows from x. Every
    later pair of a token sits in the same or a later chunk, and a tile waits for all
    chunks up to its last row's."""
    i = start + tl.arange(0, comm.ROWS)
    live = i < end
    pair = tl.load(send.pair + i, mask=live, other=0)
    tok = pair // TOPK
    row = tl.load(send.row + i, mask=live, other=0).to(tl.int64)
    tl.store(peer(gather.src, d) + row, token_base + tok, mask=live)
    if comm.ROW_HOME:
        tl.store(dst_home + row, home_base + pair, mask=live)
        tl.store(dst_weight + row, tl.load(send.weight + i, mask=live), mask=live)
    first = (tl.load(send.first + i, mask=live, other=0) != 0) & live
    nth = tl.cumsum(first.to(tl.int32), axis=0) - 1
    firsts = tl.sum(first.to(tl.int32), axis=0)
    if comm.OWN_IN_PLACE:
        firsts = tl.where(in_place, 0, firsts)
    dst = peer(gather.tokens, d)
    for c0 in range(0, firsts, comm.COPY_ROWS):
        slot = c0 + tl.arange(0, comm.COPY_ROWS)
        pick = first[None, :] & (nth[None, :] == slot[:, None])
        t = tl.sum(tl.where(pick, tok[None, :], 0), axis=1).to(tl.int64)
        has = slot < firsts
        for h0 in range(0, H, comm.BLOCK_H):
            cols = h0 + tl.arange(0, comm.BLOCK_H)
            mask = has[:, None] & (cols[None, :] < H)
            v = tl.load(x_ptr + t[:, None] * H + cols[None, :], mask=mask)
            tl.store(dst + (token_base + t)[:, None] * H + cols[None, :], v, mask=mask)


@triton.jit
def _push_entries(src_token, src_rows, src_weight, dst_token, dst_rows, dst_weight,
                  start, end, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  ENTRY_TILE: tl.constexpr):
    """Copy return entries ``[start, end)`` (same indices on both sides)."""
    for q0 in range(start, end, ENTRY_TILE):
        q = q0 + tl.arange(0, ENTRY_TILE)
        live = q < end
        tl.store(dst_token + q, tl.load(src_token + q, mask=live), mask=live)
        j = tl.arange(0, TOPK_P2)
        idx = q[:, None] * TOPK + j[None, :]
        mask = live[:, None] & (j[None, :] < TOPK)
        tl.store(dst_rows + idx, tl.load(src_rows + idx, mask=mask), mask=mask)
        tl.store(dst_weight + idx, tl.load(src_weight + idx, mask=mask), mask=mask)


@triton.jit
def _chunks_to(d, dispatch, ROWS: tl.constexpr, ENTRIES: tl.constexpr):
    """``(row chunks, all chunks)`` this rank sends destination ``d``: its rows, then
    its return entries."""
    off = dispatch.send.off
    rows = tl.cdiv(tl.load(off + d + 1) - tl.load(off + d), ROWS)
    return rows, rows + tl.cdiv(tl.load(dispatch.entry_count + d), ENTRIES)


@triton.jit
def _parts_per_chunk(units, rows, n_comm, comm):
    """How many parts each chunk's copy is cut into this call (``units`` chunks, the
    largest holding ``rows`` rows): 1 while the chunks keep every comm program busy,
    else as many as give each program a part, up to ``PARTS`` and to one copy tile of
    rows per part. A small call's rows to one destination are a single chunk (256
    rows), which one program alone copied while every GEMM tile waited for it; a
    1-token call's chunks are a row or two, whose empty parts would only cost arrivals
    (docs/notebook.md, "Small calls": `54103ff`, `60ab0ad`). The sender's choice alone: a
    destination waits for the same chunks either way."""
    parts = 1
    if comm.PARTS > 1:
        parts = tl.minimum(tl.maximum(n_comm // tl.maximum(units, 1), 1), comm.PARTS)
        parts = tl.minimum(parts, tl.maximum(tl.cdiv(rows, comm.COPY_ROWS), 1))
        parts = tl.where(units <= DISPATCH_PART_SLOTS, parts, 1)
    return parts


@triton.jit
def _publish(flag, epoch, parts, part_counts, u, skipped, sync, PARTS: tl.constexpr):
    """Publish chunk ``u`` when its copy -- or, with ``parts`` > 1, this program's part
    of it -- is done: ``flag = epoch``, unless the group failed. With parts, the chunk's
    last part to arrive (``part_counts[u]``) publishes, after every part's stores (the
    arrivals' acq_rel chain orders them before its release), and not at all if any part
    skipped its copy."""
    if PARTS > 1:   # a constexpr: without parts the kernel compiles as before them
        if parts > 1:
            mine = 1 + skipped * PART_SKIPPED
            before = arrive(part_counts + u, "sys", mine)
            if before % PART_SKIPPED == parts - 1:
                if (before + mine < PART_SKIPPED) & healthy(sync):
                    release(flag, epoch, "sys")
        else:
            _release_if_healthy(flag, epoch, sync)
    else:
        _release_if_healthy(flag, epoch, sync)


@triton.jit
def _release_if_healthy(flag, epoch, sync):
    # Never publish after a failure: a chunk skipped because the group failed must not
    # look delivered. (The vote is also the barrier the release needs.)
    if healthy(sync):
        release(flag, epoch, "sys")


@triton.jit
def dispatch_role(dispatch, H, epoch, sync, trace, events, shape, comm, n_comm):
    """Push this rank's rows, then its return entries, to every destination, in chunks
    the ``n_comm`` comm programs take from the dispatch queue: unit ``u`` is chunk ``u //
    W`` of the destination at ring offset ``u % W`` (all destinations abreast, see the
    module doc; a queue rather than a fixed stride, so that when destinations have
    unequal chunk counts every program still shares the work of the longest); after a
    chunk is copied the destination's ``flag0[rank, c] = epoch``. A call with fewer
    chunks than comm programs cuts each row chunk's copy into parts
    (:func:`_parts_per_chunk`), taken from the queue like chunks; the last part to finish
    publishes. No chunk waits for another to publish: an in-order chain (each chunk
    published after the previous one) cost one system-scope release round trip per
    chunk in series, whatever the number of comm blocks (docs/design.md). Returns the
    trace events recorded so far."""
    WORLD: tl.constexpr = shape.WORLD
    TOPK: tl.constexpr = shape.TOPK
    rank = sync.rank
    max_tokens = dispatch.max_tokens
    x_ptr = pointer_at(dispatch.x_addr, 0, dispatch.a0.local)
    chunk_slots = dispatch.chunk_slots
    # This rank's region in a destination's return-entry tables.
    region = rank * max_tokens
    rounds = 0
    rows = 0     # of the largest row chunk
    for d in range(WORLD):
        rounds = tl.maximum(rounds, _chunks_to(d, dispatch, comm.ROWS, comm.ENTRIES)[1])
        rows = tl.maximum(rows, tl.minimum(tl.load(dispatch.send.off + d + 1)
                                           - tl.load(dispatch.send.off + d), comm.ROWS))
    parts = _parts_per_chunk(rounds * WORLD, rows, n_comm, comm)
    g = take(dispatch.queue)
    while g < rounds * WORLD * parts:
        u = g // parts
        part = g % parts
        c = u // WORLD
        d = (rank - u % WORLD + WORLD) % WORLD
        lo = tl.load(dispatch.send.off + d)
        hi = tl.load(dispatch.send.off + d + 1)
        n_ent = tl.load(dispatch.entry_count + d)
        row_chunks, chunks = _chunks_to(d, dispatch, comm.ROWS, comm.ENTRIES)
        if c < chunks:
            src = d * max_tokens
            flags = peer(dispatch.flag0, d) + rank * chunk_slots
            if trace.ON:
                start = clock_ns()
            ok = healthy(sync)
            if ok:
                if c < row_chunks:
                    first = lo + c * comm.ROWS
                    last = tl.minimum(lo + (c + 1) * comm.ROWS, hi)
                    if parts > 1:   # this part's rows: whole copy tiles, the last short
                        size = (tl.cdiv(tl.cdiv(last - first, parts), comm.COPY_ROWS)
                                * comm.COPY_ROWS)
                        first = tl.minimum(first + part * size, last)
                        last = tl.minimum(first + size, last)
                    if comm.GATHER:
                        in_place = d == rank
                        if comm.ROW_HOME:
                            _push_gathered(x_ptr, dispatch.gather, d, dispatch.send,
                                           peer(dispatch.homes.home, d),
                                           peer(dispatch.homes.weight, d),
                                           rank * max_tokens * TOPK, rank * max_tokens,
                                           first, last, H, TOPK, comm, in_place)
                        else:
                            _push_gathered(x_ptr, dispatch.gather, d, dispatch.send, None,
                                           None, 0, rank * max_tokens, first, last, H, TOPK,
                                           comm, in_place)
                    elif comm.ROW_HOME:
                        _push_rows(x_ptr, peer(dispatch.a0, d), dispatch.send,
                                   peer(dispatch.homes.home, d), peer(dispatch.homes.weight, d),
                                   rank * max_tokens * TOPK, first, last, H, TOPK, comm)
                    else:
                        _push_rows(x_ptr, peer(dispatch.a0, d), dispatch.send, None, None,
                                   0, first, last, H, TOPK, comm)
                elif part == 0:   # return entries: one part copies the chunk
                    e0 = (c - row_chunks) * comm.ENTRIES
                    _push_entries(dispatch.entries.token + src,
                                  dispatch.entries.rows + src * TOPK,
                                  dispatch.entries.weight + src * TOPK,
                                  peer(dispatch.recv.token, d) + region,
                                  peer(dispatch.recv.rows, d) + region * TOPK,
                                  peer(dispatch.recv.weight, d) + region * TOPK,
                                  e0, tl.minimum(e0 + comm.ENTRIES, n_ent), TOPK,
                                  shape.TOPK_P2, comm.ENTRY_TILE)
            _publish(flags + c, epoch, parts, dispatch.parts, u, (ok == 0).to(tl.int32), sync,
                     comm.PARTS)
            if trace.ON:
                events = stamp(trace, events, d, c, start)
        g = take(dispatch.queue)
    return events


@triton.jit
def _await_rows(flags, chunk_slots, segments, wait, expert, r0, r1, seen, epoch, sync,
                shape, ROWS: tl.constexpr):
    """Wait until every source in ``wait`` has published its chunks up to the one holding
    its last row in ``[r0, r1)``; returns ``(seen, ok)``. ``seen[s]`` caches how many
    leading chunks of ``s`` are known published, so most tiles cost no flag load at all
    (waiting for the whole prefix rather than the tile's own chunks keeps that cache a
    single number; chunks land roughly in order anyway). It only ever holds waited-for
    counts, never a raw flag value: every warp must agree on it, or warps would disagree
    on which tiles wait (see comet.kernels.sync on uniform control flow). ``ok`` is 0
    once a wait gave up."""
    WORLD: tl.constexpr = shape.WORLD
    LOCAL_EXPERTS: tl.constexpr = shape.LOCAL_EXPERTS
    rank = sync.rank
    ranks = tl.arange(0, shape.W_P2)
    ok = tl.full([], 1, tl.int32)
    for s in range(WORLD):
        if ((wait >> s) & 1) != 0:
            o = (s - rank + WORLD) % WORLD
            seg0 = tl.load(segments.start + o * LOCAL_EXPERTS + expert)
            seg1 = seg0 + tl.load(segments.rows + o * LOCAL_EXPERTS + expert)
            last = tl.minimum(r1, seg1) - 1 - seg0
            need = (tl.load(segments.pre + s * LOCAL_EXPERTS + expert) + last) // ROWS + 1
            have = tl.sum(tl.where(ranks == s, seen, 0), axis=0)
            if need > have:
                got = wait_chunks(flags + s * chunk_slots, have, need, epoch, sync,
                                  SITE_DISPATCH, s, "sys", CHUNK_SCAN)
                ok = ok & got
                seen = tl.where((ranks == s) & (got != 0), need, seen)
    return seen, ok


@triton.jit
def tail_split(tiles, total, SPLIT: tl.constexpr):
    """``(whole, splits)``: layer0's queue hands out items ``[0, whole)`` whole and each
    of the others -- its last partial round, when that fills at most half the programs
    -- as ``splits`` K splits (up to ``SPLIT``, as many as give each a program), so that
    the round's weights stream on every SM, not on the few the round fills
    (docs/notebook.md, "Small calls": `f2f736c`, `4fbc64f`). Only calls whose m-tiles
    have at most ``TAIL_ROWS`` rows (a split keeps its box in the scratch) and at least
    one whole round. Read from the plan's tables, so every program gets the same answer."""
    programs = tl.num_programs(0)
    tail = total % programs
    splits = tl.minimum(programs // tl.maximum(tail, 1), SPLIT)
    cut = ((total > programs) & (tail > 0) & (splits >= 2)
           & (programs <= STREAM_K_PROGRAMS))
    if cut:     # the tile table is read only where the round shape allows a cut
        num_tiles = tl.load(tiles.num)
        cut = _rows_fit(tiles, num_tiles, TAIL_ROWS) & (num_tiles <= 2 * STREAM_K_PROGRAMS)
    return tl.where(cut, total - tail, total), tl.where(cut, splits, 1)


@triton.jit
def _part_box(a_desc, b_desc, gemm, item, expert, row_start, row_end, n0, k0, k1):
    """K steps ``[k0, k1)`` of a gated item, fp32 ``[BLOCK_M, 2 * BLOCK_N]`` before the
    epilogue: a one-dot box, or an FP8 item's gate and up tiles (two dots on the
    block-scaled K loop) side by side, column ``2 c`` gate and ``2 c + 1`` up -- a join,
    which costs no data movement -- so that a part of either kind keeps one box in the
    scratch."""
    if item.FP8:
        gate, up = block_scaled_k_loop(a_desc, b_desc, gemm, item, expert, row_start,
                                       row_end, n0, k0, k1)
        box = tl.reshape(tl.join(gate, up), (item.BLOCK_M, 2 * item.BLOCK_N))
    else:
        box = one_dot_acc(a_desc, b_desc, gemm, item, expert, row_start, row_end, n0, k0,
                          k1)
    return box


@triton.jit
def _store_box(box, gemm, item, expert, row_start, row_end, n0, ROWS: tl.constexpr):
    """The epilogue of a gated item's box ``[ROWS, 2 * BLOCK_N]`` summed over all of K
    (:func:`_part_box`), stored: bias and activation, or for an FP8 item the activation
    and h in FP8 groups."""
    if item.FP8:
        gate, up = tl.split(tl.reshape(box, (ROWS, item.BLOCK_N, 2)))
        store_fp8_groups(gated(gate, up, item.ACT), gemm, item, row_start, row_end, n0,
                         ROWS)
    else:
        store_tile(one_dot_epilogue(box, gemm, item, expert, n0, ROWS), gemm, row_start,
                   row_end, n0, ROWS, item.BLOCK_N)


@triton.jit
def _tail_part(a_desc, b_desc, gemm, item, work, u, splits, j, expert, row_start, row_end,
               n0):
    """Unit ``u`` of a tail split: K split ``u % splits`` of the round's item ``j``, its
    fp32 box before the activation into scratch slot ``u``; the item's last split to
    arrive sums the boxes in split order -- the same bits whoever is last -- and runs the
    epilogue (bias, activation) and the store."""
    BOX: tl.constexpr = 2 * item.BLOCK_N
    SLOT: tl.constexpr = TAIL_ROWS * BOX     # the scratch (< 2^31 elements) needs no int64
    per = tl.cdiv(tl.cdiv(gemm.K, item.BLOCK_K), splits) * item.BLOCK_K
    k0 = (u % splits) * per
    both = _part_box(a_desc, b_desc, gemm, item, expert, row_start, row_end, n0, k0,
                     tl.minimum(k0 + per, gemm.K))
    n_rows = row_end - row_start
    rb = tl.arange(0, item.BLOCK_M)[:, None]
    c = tl.arange(0, BOX)[None, :]
    tl.store(work.partial + u * SLOT + rb * BOX + c, both,
             mask=(rb < tl.minimum(n_rows, TAIL_ROWS)) & (c < BOX))
    if arrive(work.arrived + j, "gpu") == splits - 1:
        r = tl.arange(0, TAIL_ROWS)[:, None]
        keep = (r < n_rows) & (c < BOX)
        box = tl.zeros((TAIL_ROWS, BOX), dtype=tl.float32)
        for q in range(splits):
            box += tl.load(work.partial + (j * splits + q) * SLOT + r * BOX + c, mask=keep,
                           other=0.0)
        _store_box(box, gemm, item, expert, row_start, row_end, n0, TAIL_ROWS)


@triton.jit
def layer0_compute_role(a_desc, b_desc, gemm, item, lanes, tiles, segments, work, dispatch,
                        epoch, sync, trace, events, shape, WAIT: tl.constexpr,
                        ROWS: tl.constexpr):
    """GroupGEMM ``out = silu(a0 @ W13_gate) * (a0 @ W13_up)`` (``GATED``; ``N`` = F) --
    or, for the backward, a plain ``out = a0 @ W`` or ``a0 @ W^T`` (``TRANS_B``) with
    ``N`` output columns -- over the tiles in the table's order (comet.scheduler.plan),
    taken from the work queue ``work.queue`` (a counter every GEMM block of this rank
    bumps) a lane at a time (:func:`strided_take`; ``HEAD_ROUNDS`` and ``TAIL_ROUNDS``
    rounds of single items at its ends, :func:`comet.kernels.group_gemm.lane_shape`):
    blocks take work in the scheduler's order whenever they are free, so a block that
    joins late (a comm block done dispatching) takes the next lane, not a fixed share. A
    lane's rows are all waited for before its flattened loop starts: the pipeliner
    issues a tile's loads while the previous tile still runs, so no wait may sit between
    them. With ``work.TAIL_SPLIT`` the queue's last partial round may follow as K splits
    of its items (:func:`tail_split`), taken one per take after the whole items
    (:func:`_tail_part`)."""
    num_tiles = tl.load(tiles.num)
    n_blocks = tl.cdiv(gemm.N, item.BLOCK_N)
    total = num_tiles * n_blocks
    programs = tl.num_programs(0)
    # The forward's gated items only, one-dot or FP8: a split keeps their box.
    TAIL: tl.constexpr = (work.TAIL_SPLIT > 1) and item.GATED and (item.ONE_DOT or item.FP8)
    whole = total
    splits = 1
    if TAIL:
        whole, splits = tail_split(tiles, total, work.TAIL_SPLIT)
    units = whole + (total - whole) * splits
    items, head, lanes_end = lane_shape(whole, programs, LANE_ITEMS, lanes.HEAD_ROUNDS,
                                        lanes.TAIL_ROUNDS)
    seen = tl.zeros([shape.W_P2], dtype=tl.int32)
    first, end = strided_take(work.queue, programs, items, head, lanes_end)
    while first < whole:
        end = tl.minimum(end, whole)
        ready = 1
        if WAIT:
            for w in range(first, end, programs):
                tile, nb = grouped_work(w, num_tiles, n_blocks, lanes.GROUP_M)
                seen, ok = _await_rows(dispatch.flag0.local, dispatch.chunk_slots, segments,
                                       tl.load(tiles.wait + tile), tl.load(tiles.expert + tile),
                                       tl.load(tiles.row_start + tile),
                                       tl.load(tiles.row_end + tile), seen, epoch, sync, shape,
                                       ROWS)
                ready = ready & ok
            fence_async_proxy()
        if ready:   # after a failure the call's output is void: skip the GEMMs
            for w in tl.range(first, end, programs, flatten=True):
                if trace.ON:
                    start = clock_ns()
                tile, nb = grouped_work(w, num_tiles, n_blocks, lanes.GROUP_M)
                expert = tl.load(tiles.expert + tile)
                if item.FP8:
                    fp8_item(a_desc, b_desc, gemm, item, expert,
                             tl.load(tiles.row_start + tile), tl.load(tiles.row_end + tile),
                             nb * item.BLOCK_N)
                else:
                    gemm_tile(a_desc, b_desc, gemm, item, expert,
                              tl.load(tiles.row_start + tile), tl.load(tiles.row_end + tile),
                              nb * item.BLOCK_N)
                if trace.ON:
                    events = stamp(trace, events, shape.WORLD + expert, tile, start)
        first, end = strided_take(work.queue, programs, items, head, lanes_end)
    if TAIL:    # a constexpr: without it the kernel compiles as before
        # The takes past the whole items are the last round's K splits, one per take.
        while first < units:
            u = first - whole
            j = u // splits
            tile, nb = grouped_work(whole + j, num_tiles, n_blocks, lanes.GROUP_M)
            expert, row_start, row_end, seen, ready = _item_ready(
                tiles, tile, dispatch, segments, seen, epoch, sync, shape, WAIT, ROWS)
            if ready:
                if trace.ON:
                    start = clock_ns()
                _tail_part(a_desc, b_desc, gemm, item, work, u, splits, j, expert, row_start,
                           row_end, nb * item.BLOCK_N)
                if trace.ON:
                    events = stamp(trace, events, shape.WORLD + expert, tile, start)
            first, end = strided_take(work.queue, programs, items, head, lanes_end)


@triton.jit
def _item_ready(tiles, tile, dispatch, segments, seen, epoch, sync, shape,
                WAIT: tl.constexpr, ROWS: tl.constexpr):
    """``(expert, row_start, row_end, seen, ready)`` of m-tile ``tile``, once its rows
    have landed (``WAIT``; ``ready`` is 0 if the wait gave up): a work item cut in parts
    (stream-K, a tail split) waits for each part as the queue waits for a lane."""
    expert = tl.load(tiles.expert + tile)
    row_start = tl.load(tiles.row_start + tile)
    row_end = tl.load(tiles.row_end + tile)
    ready = 1
    if WAIT:
        seen, ready = _await_rows(dispatch.flag0.local, dispatch.chunk_slots, segments,
                                  tl.load(tiles.wait + tile), expert, row_start, row_end,
                                  seen, epoch, sync, shape, ROWS)
        fence_async_proxy()
    return expert, row_start, row_end, seen, ready


@triton.jit
def stream_k_pays(tiles, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Whether this call's GEMM runs stream-K: its whole work items would leave at least
    ``STREAM_K_IDLE_PCT`` percent of the programs' rounds idle, there are fewer than two
    rounds of them but at least a K step per program (so that every run has one, and
    consecutive programs own distinct steps), and no m-tile has more rows than a partial
    tile keeps. Read from the plan's tables, so every program of the launch gets the same
    answer."""
    num_tiles = tl.load(tiles.num)
    items = num_tiles * tl.cdiv(N, BLOCK_N)
    programs = tl.num_programs(0)
    slots = tl.cdiv(items, programs) * programs
    pays = ((items * tl.cdiv(K, BLOCK_K) >= programs) & (items < STREAM_K_ROUNDS * programs)
            & (programs <= STREAM_K_PROGRAMS)
            & ((slots - items) * 100 >= STREAM_K_IDLE_PCT * slots))
    if pays:    # the tile table is read only for calls small enough
        pays = _rows_fit(tiles, num_tiles, STREAM_K_ROWS)
    return pays


@triton.jit
def _rows_fit(tiles, num_tiles, MAX_ROWS: tl.constexpr):
    """Whether no m-tile among the table's first ``2 * STREAM_K_PROGRAMS`` has more than
    ``MAX_ROWS`` rows (what a partial box of stream-K or a tail split keeps)."""
    t = tl.arange(0, 2 * STREAM_K_PROGRAMS)
    live = t < num_tiles
    rows = (tl.load(tiles.row_end + t, mask=live, other=0)
            - tl.load(tiles.row_start + t, mask=live, other=0))
    return tl.max(rows, axis=0) <= MAX_ROWS


@triton.jit
def _stream_k_owner(step, total, programs):
    """The program whose run of K steps holds step ``step`` (runs: ``[p * total //
    programs, (p + 1) * total // programs)``)."""
    return ((step + 1) * programs - 1) // total


@triton.jit
def stream_k_role(a_desc, b_desc, gemm, item, tiles, segments, work, dispatch, epoch, sync,
                  trace, events, shape, WAIT: tl.constexpr, ROWS: tl.constexpr):
    """The gated GroupGEMM of a small call as stream-K: the call's ``items x K / BLOCK_K``
    K steps cut into one equal run per program (item ``i``: m-tile ``i // n_blocks``,
    column block ``i % n_blocks``), so every program streams weights whatever the number
    of items -- 44 items of a 1-token qwen2-moe call at EP=2 would leave 88 of 132 SMs
    idle. A run covers the end of one item, whole items and the start of another: a
    whole item is stored as in the queue's GEMM; a part goes, as its fp32 box before the
    activation, to the scratch (the run's first part to slot ``2p``, its last to ``2p +
    1``), and the item's last part to arrive sums the parts in program order -- the same
    bits whoever is last -- and runs the epilogue (bias, activation). Each part waits for
    its item's rows first, as the queue's GEMM does. Returns the trace events."""
    BLOCK_N: tl.constexpr = item.BLOCK_N
    BOX: tl.constexpr = 2 * BLOCK_N
    SLOT: tl.constexpr = STREAM_K_ROWS * BOX   # the scratch (< 2^31 elements) needs no int64
    num_tiles = tl.load(tiles.num)
    n_blocks = tl.cdiv(gemm.N, BLOCK_N)
    steps = tl.cdiv(gemm.K, item.BLOCK_K)
    total = num_tiles * n_blocks * steps
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    lo = p * total // programs
    hi = (p + 1) * total // programs
    seen = tl.zeros([shape.W_P2], dtype=tl.int32)
    r = tl.arange(0, STREAM_K_ROWS)[:, None]     # a summed part's rows ...
    rb = tl.arange(0, item.BLOCK_M)[:, None]     # ... and a computed part's
    c = tl.arange(0, BOX)[None, :]
    s = lo
    while s < hi:
        i = s // steps
        first = i * steps
        end = tl.minimum(hi, first + steps)
        t = i // n_blocks
        n0 = (i % n_blocks) * BLOCK_N
        expert, row_start, row_end, seen, ready = _item_ready(tiles, t, dispatch, segments,
                                                              seen, epoch, sync, shape,
                                                              WAIT, ROWS)
        if ready:   # after a failure the call's output is void: skip the GEMMs
            if trace.ON:
                start = clock_ns()
            both = _part_box(a_desc, b_desc, gemm, item, expert, row_start, row_end, n0,
                             (s - first) * item.BLOCK_K,
                             tl.minimum((end - first) * item.BLOCK_K, gemm.K))
            if (s == first) & (end == first + steps):
                _store_box(both, gemm, item, expert, row_start, row_end, n0, item.BLOCK_M)
            else:
                slot = 2 * p + (s != lo).to(tl.int32)
                tl.store(work.partial + slot * SLOT + rb * BOX + c, both,
                         mask=(rb < tl.minimum(row_end - row_start, STREAM_K_ROWS))
                         & (c < BOX))
                p0 = _stream_k_owner(first, total, programs)
                p1 = _stream_k_owner(first + steps - 1, total, programs)
                if arrive(work.arrived + i, "gpu") == p1 - p0:
                    keep = (r < row_end - row_start) & (c < BOX)
                    # p0's part of item i is its run's last (slot 2 p0 + 1) unless its run
                    # starts inside item i; every later program's is its run's first.
                    head = 2 * p0 + (p0 * total // programs < first).to(tl.int32)
                    box = tl.load(work.partial + head * SLOT + r * BOX + c,
                                  mask=keep, other=0.0)
                    for q in range(p0 + 1, p1 + 1):
                        box += tl.load(work.partial + 2 * q * SLOT + r * BOX + c,
                                       mask=keep, other=0.0)
                    _store_box(box, gemm, item, expert, row_start, row_end, n0,
                               STREAM_K_ROWS)
            if trace.ON:
                events = stamp(trace, events, shape.WORLD + expert, t, start)
        s = end
    return events


@triton.jit
def layer0_kernel(a_desc, b_desc, dispatch, gemm, tiles, segments, work, sync, split, trace,
                  shape, comm, item, lanes, ROLE: tl.constexpr, WAIT: tl.constexpr):
    """layer0 of one rank: the comm role (:func:`dispatch_role`, programs below
    ``split[0]`` when ``ROLE`` is fused) pushes this rank's rows into every
    destination's shared tensor, then joins the compute role
    (:func:`layer0_compute_role`), the GroupGEMM over ``tiles`` that waits for exactly
    the rows each tile reads (``WAIT``).

    a_desc, b_desc, gemm: the TMA descriptors of A (the shared tensor) and B (the
    weights) and the :class:`~comet.kernels.group_gemm.GemmOut` (K = H; N = F when gated);
    dispatch: :class:`Dispatch`; tiles, segments: the plan's; work: :class:`Work`, the
    GEMM's queue (and stream-K scratch); sync: :class:`~comet.kernels.sync.Sync`; split:
    int64 [1], the comm programs (read on the device, so one captured launch serves every
    split); trace: :class:`~comet.kernels.sync.Trace`; shape: :class:`~comet.kernels.shape.Shape`;
    comm, item, lanes: constexpr :class:`DispatchTile`,
    :class:`~comet.kernels.group_gemm.GemmTile` (a GEMM work item), :class:`Lanes`."""
    if trace.ON:
        entered = clock_ns()
    epoch = tl.load(sync.epoch)
    comm_role, n_role, _ = assign_role(split, ROLE)
    events = tl.full([], 0, tl.int32)
    if ROLE != ROLE_COMPUTE:
        if comm_role:
            if item.FP8:    # a row crosses as its FP8 values and scales, packed in bytes
                events = dispatch_role(dispatch, dispatch.row_bytes, epoch, sync, trace,
                                       events, shape, comm, n_role)
            else:
                events = dispatch_role(dispatch, gemm.K, epoch, sync, trace, events, shape,
                                       comm, n_role)
    # Fused: a comm block that has pushed its chunks joins the GEMM (no SM idles for the
    # rest of the call); it never holds a tile while a peer waits on its pushes.
    if ROLE != ROLE_COMM:
        # The outer test is a constexpr (without STREAM_K the kernel compiles as it did
        # before stream-K existed), the inner one a run-time choice.
        if work.STREAM_K and item.GATED and (item.ONE_DOT or item.FP8):
            if stream_k_pays(tiles, gemm.N, gemm.K, item.BLOCK_N, item.BLOCK_K):
                stream_k_role(a_desc, b_desc, gemm, item, tiles, segments, work, dispatch,
                              epoch, sync, trace, events, shape, WAIT, comm.ROWS)
            else:
                layer0_compute_role(a_desc, b_desc, gemm, item, lanes, tiles, segments,
                                    work, dispatch, epoch, sync, trace, events, shape,
                                    WAIT, comm.ROWS)
        else:
            layer0_compute_role(a_desc, b_desc, gemm, item, lanes, tiles, segments,
                                work, dispatch, epoch, sync, trace, events, shape,
                                WAIT, comm.ROWS)
    if trace.ON:
        stamp_program(trace, entered)
