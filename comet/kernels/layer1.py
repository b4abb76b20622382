"""layer1: GroupGEMM(W2) -> weighted top-k reduce -> combine, in one persistent kernel,
followed by the final combine on each token's home rank.

Shared tensor: ``out1 [rows, H]``, the expert outputs of this rank's received rows. The
top-k reduce gathers many rows into one token, so it is *not* independent along M; it is
along N. The GroupGEMM therefore runs column-wise: column split ``s`` (``BLOCKS_PER_SPLIT``
column blocks) of every expert's tiles before split ``s + 1``, and the compute blocks count
finished tiles per split.

Two entry kernels share the GroupGEMM: :func:`layer1_reduce_kernel` (the paper's
schedule) and :func:`layer1_scatter_kernel`. Roles of the first:

* compute (:func:`layer1_compute_role`) -- the GroupGEMM, each block striding over the
  work items, counting tiles per split; a compute block out of tiles joins the reduce.
  Every block of the grid, comm blocks included, runs split 0 (nothing can be reduced
  before it is complete); the later splits run on the compute blocks alone.
* comm (:func:`reduce_send_role`) -- reduce items from a device queue (a counter zeroed
  when a call opens) in split order; an item of split ``s``
  waits until all of split ``s``'s tiles are counted, then for each of its *return
  entries* (one token of one source rank, naming the rows of its experts on this rank and
  their weights) sums ``weight * out1[row]`` in fp32 -- pre-summing the experts a token
  has on this rank, so one row per (token, rank) crosses the link -- and stores it into the
  source rank's ``comb[this rank, token]``. Inside a split, sources go in ring order from
  this rank, so at each step every rank writes to a different peer. The last block to
  finish releases ``flag1[this rank] = epoch`` on every source rank.

The comm blocks reduce the early splits while the GEMM of the later ones runs; the reduce
of the last split runs on every block. With no comm block the kernel is "GEMM, then
reduce on the whole GPU" in one launch.

:func:`layer1_scatter_kernel` (the forward's default, ``Variant.layer1_scatter``)
moves the top-k sum past the communication: ``out1`` is never stored; every block runs the
GroupGEMM and its epilogue (:func:`scatter_home`) writes each row, weighted, into
``pair_out[t, j]`` on the token's rank, which makes the shared tensor independent along M
as well (docs/shared_tensor.md). No comm role, no reduce, no wait inside the kernel; the
last block to finish releases ``flag1`` as above.

With ``Variant.layer1_split_k`` > 1 the scatter kernel on a column block of at most
``SPLIT_K_BLOCK_N`` (the decode tile) first asks, on the device, whether the call is
small enough for K splits (:func:`split_k_count`: up to ``layer1_split_k`` of them, as
many as give every split of every work item its own program). Then each program
multiplies one split of ``F`` for one item into a local fp32 scratch; the last of an
item's splits to arrive adds the partial tiles in split order and runs the scatter
epilogue (:func:`split_k_role`). A 1-token call
has too few items to keep the GPU's loads in flight (Mixtral at EP=2: 64 items for 132
SMs); splitting ``F`` multiplies the weight bytes streaming at once. The choice is the
rank's own: nothing another rank reads changes.

The backward (comet.runtime.backward) runs the reduce kernel on ``d(gate, up) @ W13^T``
(``TRANS_B``): the reduce then sums a token's rows unweighted (the routing weights are
already in ``d(gate, up)``) and, with ``pairs``, also returns each (token, slot)'s
routing-weight gradient, one fp32 per row, into the source's ``pair_grad``.

comet.kernels.combine then sums, on each token's home rank, the partial rows of the
ranks that token was sent to in a fixed order: the result does not depend on timing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.config import TileConfig
from comet.constants import (constexpr, CHUNK_SCAN, ROLE_COMM, ROLE_COMPUTE, SITE_ENTRIES, SITE_SPLIT,
                             TRACE_REDUCE)
from comet.kernels.address import PeerBuffer, peer
from comet.kernels.activation import act_tile
from comet.kernels.fp8_gemm import block_scaled_k_loop, fp8_acc, fp8_item
from comet.kernels.group_gemm import (Gemm, GemmTile, bias_row, column_work, descriptor,
                                      dot_precision, gemm_acc, gemm_acc_k, gemm_tile)
from comet.kernels.layer0 import Arrivals
from comet.kernels.plan import EntryTables, Tiles
from comet.kernels.roles import assign_role
from comet.kernels.shape import Shape
from comet.kernels.sync import (Sync, Trace, arrive, clock_ns, healthy, release, stamp,
                                stamp_program, take, wait_at_least, wait_chunks)


#: Programs a split-K call may use (one per K split of a work item): at least the SMs of
#: any GPU comet runs on (132 on an H100 or H200, 148 on a B200); sizes the scratch.
SPLIT_K_SLOTS = constexpr(256)
#: Most rows of an m-tile in a split-K call (rows a partial tile keeps): small calls only.
SPLIT_K_ROWS = constexpr(32)
#: Fewest columns of a reduce step: one with more slots than ``reduce_step_elements``
#: allows at this width loads more than the budget rather than narrower rows.
MIN_REDUCE_COLUMNS = 16
#: Widest layer1 column block that runs K splits (the decode tile's): the last split's
#: sum of two fp32 tiles of 256 columns spills registers at 8 warps (sm_90, triton 3.6).
SPLIT_K_BLOCK_N = constexpr(128)


class KSplit(NamedTuple):
    """layer1's K splits in small calls (``Variant.layer1_split_k``; off: 1, and no
    tensors)."""

    partial: torch.Tensor | None   # fp32 [SPLIT_K_SLOTS, SPLIT_K_ROWS, SPLIT_K_BLOCK_N]
    arrived: torch.Tensor | None   # int32 [SPLIT_K_SLOTS]: splits done per item (zeroed per call)
    SPLIT_K: tl.constexpr = constexpr(1)


class Splits(NamedTuple):
    """Constexpr column splits of layer1's GroupGEMM (the reduce's unit of waiting)."""

    BLOCKS_PER_SPLIT: tl.constexpr   # column blocks per split
    N_SPLITS: tl.constexpr


class Progress(NamedTuple):
    """How layer1 counts its progress and announces its end: tiles finished per column
    split (what the reduce waits for), and the last block of the launch to finish tells
    every source its rows of this call are in place (all zeroed per call but flag1)."""

    split_done: torch.Tensor  # int32 [N_SPLITS]: tiles finished per column split
    done: torch.Tensor        # int32 [1]: blocks finished
    flag1: PeerBuffer         # int64 [W]: flag1[r] on rank s = epoch: rank r's rows for s landed


class Homes(NamedTuple):
    """The scatter epilogue's destinations: each received row goes, weighted, to its
    token's slot on the token's rank."""

    home: torch.Tensor       # int32 [rows]: slot ``s * slots + t * k + j`` (pushed with the row)
    weight: torch.Tensor     # fp32 [rows]: its routing weight (likewise)
    pair_out: PeerBuffer     # [Mx, k, H]: weighted rows by (token, slot), on every rank
    slots: int               # Mx * k
    FANOUT: tl.constexpr = constexpr(1)  # a row goes to the FANOUT ranks of its home's group


class Pairs(NamedTuple):
    """The backward's per-row scalar that goes home with the reduced rows."""

    src: torch.Tensor        # fp32 [rows]: the value of each received row
    dst: PeerBuffer          # fp32 [Mx, k]: by (token, slot), on every rank


class Reduce(NamedTuple):
    """The reduce role: the return entries this rank received, and where sums go. In a
    (tp, ep) layout an entry's slot ``j * tp + t`` is shard ``t`` of choice ``j``, and a
    rank holds only its own shard ``t``: the reduce reads slots ``first_slot + j *
    SLOT_STRIDE`` (comet.mesh.MeshLayout.shard_routing)."""

    recv: EntryTables        # [W, Mx(, k)] by source: token, its rows here, their weights
    comb: PeerBuffer         # [W, Mx, H]: comb[r, t] on rank s = rank r's sum for token t
    max_tokens: int
    first_slot: int          # this rank's TP index (0 with EP)
    queue: torch.Tensor      # int32 [1]: the reduce's item queue (zeroed per call)
    pairs: Pairs | None      # with PAIRS
    FANOUT: tl.constexpr = constexpr(1)  # a sum goes to the FANOUT ranks of its source's group
    SLOT_STRIDE: tl.constexpr = constexpr(1)  # tp: a rank holds one slot in SLOT_STRIDE


class ReduceTile(NamedTuple):
    """Constexpr tiles of the reduce."""

    ENTRIES: tl.constexpr    # return entries per step
    ITEM: tl.constexpr       # return entries per queue item
    BLOCK_C: tl.constexpr    # columns per step
    WEIGHTED: tl.constexpr   # weight each row (the forward) or plain sum (the backward)
    PAIRS: tl.constexpr      # also return :class:`Pairs`
    SLOTS: tl.constexpr      # slots an entry holds here, as a power of two (a step's axis 1)


def layer1_gemm(h: torch.Tensor, w: torch.Tensor, out1: torch.Tensor, tile: TileConfig,
                transposed: bool = False, bias: torch.Tensor | None = None
                ) -> tuple[Gemm, GemmTile, Splits]:
    """Operands, work-item shape and column splits of layer1's GroupGEMM ``h @ w`` for
    ``h [rows, K]``, ``w [El, K, H]`` -- or the backward's ``h @ w^T`` for ``w [El, H,
    K]`` (``transposed``) -- into ``out1 [rows, H]``; ``bias [El, H]``: each expert's
    output bias, added before the routing weight."""
    el, k, hidden = w.shape[0], h.shape[1], out1.shape[1]
    bk = tile.gemm.k_step(k)
    b = (descriptor(w.view(el * hidden, k), [tile.gemm.block_n1, bk]) if transposed
         else descriptor(w.view(el * k, hidden), [bk, tile.gemm.block_n1]))
    item = GemmTile(*(constexpr(v) for v in (
        tile.gemm.block_m, tile.gemm.block_n1, bk, False, False, transposed, 0, False,
        dot_precision(h.dtype))),
        act_tile(), constexpr(bias is not None))
    return (Gemm(descriptor(h, [tile.gemm.block_m, bk]), b, out1, k, hidden, bias), item,
            column_splits(tile, hidden))


def column_splits(tile: TileConfig, hidden: int) -> Splits:
    """layer1's column splits over ``hidden`` output columns."""
    return Splits(constexpr(tile.blocks_per_split(hidden)), constexpr(tile.n_splits(hidden)))


@functools.lru_cache(maxsize=64)
def reduce_tile(tile: TileConfig, weighted: bool, pairs: bool, world: int,
                held_slots: int) -> ReduceTile:
    """The reduce's tile in a layer of ``world`` GPUs whose entries hold at most
    ``held_slots`` rows each (the top-k; in a (tp, ep) layout, one shard of each
    choice): a step loads ``comm_entries x slots x columns`` elements (slots:
    ``held_slots`` rounded up to a power of two), as many columns as
    ``reduce_step_elements`` allows, at most ``comm_block_c`` where its sums cross to a
    peer and ``local_comm_block_c`` alone."""
    c = tile.comm
    entries, slots = c.comm_entries, triton.next_power_of_2(held_slots)
    cap = c.comm_block_c if world > 1 else c.local_comm_block_c
    fits = c.reduce_step_elements // (entries * slots)
    block_c = min(cap, max(MIN_REDUCE_COLUMNS, 1 << max(fits.bit_length() - 1, 0)))
    item = -(-c.reduce_item // entries) * entries
    return ReduceTile(*(constexpr(v) for v in (entries, item, block_c, weighted, pairs,
                                                slots)))


def launch_layer1_reduce(grid: int, *, gemm: Gemm, item: GemmTile, splits: Splits,
                         tiles: Tiles, progress: Progress, reduce: Reduce,
                         arrivals: Arrivals, sync: Sync, split: torch.Tensor, trace: Trace,
                         shape: Shape, tile: TileConfig, role: int, wait: bool = True,
                         cooperative: bool = False) -> None:
    """The column-wise GroupGEMM and the reduce-and-send for one rank on ``grid``
    programs (``role``: fused -- the first ``split[0]`` programs reduce once split 0 is
    done --, comm or compute). ``wait=False``: the reduce assumes the GEMM is done."""
    extra = {"launch_cooperative_grid": True} if cooperative else {}
    layer1_reduce_kernel[(grid,)](
        **gemm.kernel_args(), item=item, splits=splits, tiles=tiles, progress=progress,
        reduce=reduce, arrivals=arrivals, sync=sync, split=split, trace=trace, shape=shape,
        rtile=reduce_tile(tile, not item.TRANS_B, reduce.pairs is not None, int(shape.WORLD),
                          int(shape.TOPK) // int(reduce.SLOT_STRIDE)),
        ROLE=role, WAIT=wait, num_warps=tile.gemm.num_warps,
        num_stages=tile.gemm.num_stages, **extra)


def launch_layer1_scatter(grid: int, *, gemm: Gemm, item: GemmTile, splits: Splits,
                          tiles: Tiles, progress: Progress, homes: Homes, sync: Sync,
                          trace: Trace, shape: Shape, tile: TileConfig,
                          ksplit: KSplit = KSplit(None, None)) -> None:
    """The GroupGEMM whose epilogue sends every row home, on ``grid`` programs (in K
    splits where ``ksplit`` has them and the call is small)."""
    layer1_scatter_kernel[(grid,)](
        **gemm.kernel_args(), item=item, splits=splits, tiles=tiles, progress=progress,
        homes=homes, ksplit=ksplit, sync=sync, trace=trace, shape=shape,
        num_warps=tile.gemm.num_warps, num_stages=tile.gemm.num_stages)


@triton.jit
def layer1_compute_role(comm, role_pid, n_role, a_desc, b_desc, gemm, item, splits, tiles,
                        split_done, homes, trace, events, SCATTER: tl.constexpr):
    """The column-wise GroupGEMM in split order; returns the trace events recorded so far.
    Split 0 runs on every block of the grid (work item ``pid + i * programs``): no reduce
    item can start before it is complete, so a comm block (``comm``) that only waited
    for it would idle for the first split's whole GEMM, and layer1 would lose the comm
    blocks' SM share over the whole call (docs/notebook.md). Later splits run on the
    compute blocks (``role_pid + i * n_role``) while the comm blocks reduce.

    A static stride, not a queue: the rows are all in place when the kernel starts and
    which blocks run a split is fixed, so nothing needs handing out at run time -- and a
    static loop can be flattened, so Triton's pipeliner loads the next tile's operands
    under this tile's epilogue (docs/notebook.md, "Kernel structure").

    ``SCATTER``: each tile goes straight to its tokens' homes (:func:`scatter_home`)
    instead of into ``gemm.out``.
    """
    BLOCK_N: tl.constexpr = item.BLOCK_N
    BLOCKS_PER_SPLIT: tl.constexpr = splits.BLOCKS_PER_SPLIT
    num_tiles = tl.load(tiles.num)
    n_blocks = tl.cdiv(gemm.N, BLOCK_N)
    total = num_tiles * n_blocks
    per_split = num_tiles * BLOCKS_PER_SPLIT
    # Unrolled over the splits: a flattened loop nested in a run-time loop is not
    # flattened by Triton (one pipeline per tile again).
    for split in tl.static_range(splits.N_SPLITS):
        if split == 0:
            me = tl.program_id(0)
            stride = tl.num_programs(0)
        else:
            me = role_pid
            stride = n_role
        if (split == 0) or (comm == 0):
            lo = split * per_split
            hi = tl.minimum(lo + per_split, total)
            first = lo + (me - lo % stride + stride) % stride
            for w in tl.range(first, hi, stride, flatten=True):
                if trace.ON:
                    start = clock_ns()
                t, nb, _ = column_work(w, num_tiles, n_blocks, BLOCKS_PER_SPLIT)
                expert = tl.load(tiles.expert + t)
                row_start = tl.load(tiles.row_start + t)
                row_end = tl.load(tiles.row_end + t)
                if SCATTER:
                    if item.FP8:
                        acc = fp8_acc(a_desc, b_desc, gemm, item, expert, row_start,
                                      row_end, nb * BLOCK_N)
                    else:
                        acc = gemm_acc(a_desc, b_desc, gemm, item, expert, row_start,
                                       row_end, nb * BLOCK_N)
                    scatter_home(acc, homes, row_start, row_end, nb * BLOCK_N, gemm.N,
                                 item.BLOCK_M, BLOCK_N)
                elif item.FP8:
                    fp8_item(a_desc, b_desc, gemm, item, expert, row_start, row_end,
                             nb * BLOCK_N)
                else:
                    gemm_tile(a_desc, b_desc, gemm, item, expert, row_start, row_end,
                              nb * BLOCK_N)
                if trace.ON:
                    events = stamp(trace, events, split, t, start)
            # Counted once per split, not per tile: an atomic inside the loop keeps Triton
            # from pipelining it (one stage of shared memory instead of three).
            arrive(split_done + split, "gpu", tl.maximum(tl.cdiv(hi - first, stride), 0))
    return events


@triton.jit
def scatter_home(acc, homes, row_start, row_end, n0, H, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The scatter epilogue: row ``r`` of the fp32 tile ``acc`` (rows ``row_start..``,
    columns ``n0..``), times its routing weight, into its token's home --
    ``pair_out[t, j]`` on rank ``s``, where ``home[r] = s * slots + t * TOPK + j``
    (pushed with the row by the dispatch), and on the other ranks of ``s``'s group of
    ``FANOUT`` (a replicated TP layout: each of them returns the token). Stores to a
    peer's memory are posted: the tile's data crosses the link while the GEMM goes on,
    with no reduce pass and no block waiting for a column split."""
    FANOUT: tl.constexpr = homes.FANOUT
    rows = row_start + tl.arange(0, BLOCK_M)
    live = rows < row_end
    home = tl.load(homes.home + rows, mask=live, other=0)
    weight = tl.load(homes.weight + rows, mask=live, other=0.0)
    pair_out = homes.pair_out.local
    value = (acc * weight[:, None]).to(pair_out.dtype.element_ty)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = live[:, None] & (cols[None, :] < H)
    rank = home // homes.slots
    offset = (home % homes.slots).to(tl.int64) * H
    for q in tl.static_range(FANOUT):
        row_ptr = peer(homes.pair_out, rank - rank % FANOUT + q) + offset
        tl.store(row_ptr[:, None] + cols[None, :], value, mask=mask)


@triton.jit
def split_k_count(tiles, N, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """K splits of this call's layer1 items: the most, up to ``SPLIT_K``, that give each
    split of each work item a program (and a scratch slot) of its own -- or 0 when that
    is fewer than 2 or an m-tile has more rows than a partial tile keeps. Read from the
    plan's tables, so every program of the launch gets the same answer."""
    num_tiles = tl.load(tiles.num)
    t = tl.arange(0, SPLIT_K_SLOTS)
    live = t < num_tiles
    rows = (tl.load(tiles.row_end + t, mask=live, other=0)
            - tl.load(tiles.row_start + t, mask=live, other=0))
    room = tl.minimum(tl.num_programs(0), SPLIT_K_SLOTS)
    k_splits = tl.minimum(room // tl.maximum(num_tiles * tl.cdiv(N, BLOCK_N), 1), SPLIT_K)
    return tl.where((k_splits >= 2) & (tl.max(rows, axis=0) <= SPLIT_K_ROWS), k_splits, 0)


@triton.jit
def split_k_role(a_desc, b_desc, gemm, item, tiles, homes, ksplit, k_splits, trace, events):
    """One K split of one work item on this program (program ``p``: item ``p // k_splits``,
    split ``p % k_splits``; item ``i``: m-tile ``i // n_blocks``, column block ``i %
    n_blocks``), its partial tile into the scratch; the item's last split to arrive sums
    the partials in split order -- the same bits whoever is last -- adds the bias and
    sends the rows home (:func:`scatter_home`). Returns the trace events."""
    BLOCK_M: tl.constexpr = item.BLOCK_M
    BLOCK_N: tl.constexpr = item.BLOCK_N
    SLOT: tl.constexpr = SPLIT_K_ROWS * BLOCK_N
    n_blocks = tl.cdiv(gemm.N, BLOCK_N)
    p = tl.program_id(0)
    unit = p // k_splits
    if unit < tl.load(tiles.num) * n_blocks:
        if trace.ON:
            start = clock_ns()
        t = unit // n_blocks
        n0 = (unit % n_blocks) * BLOCK_N
        expert = tl.load(tiles.expert + t)
        row_start = tl.load(tiles.row_start + t)
        row_end = tl.load(tiles.row_end + t)
        k_per = tl.cdiv(tl.cdiv(gemm.K, item.BLOCK_K), k_splits) * item.BLOCK_K
        k0 = (p % k_splits) * k_per
        k1 = tl.minimum(k0 + k_per, gemm.K)
        if item.FP8:
            acc, _ = block_scaled_k_loop(a_desc, b_desc, gemm, item, expert, row_start,
                                         row_end, n0, k0, k1)
        else:
            acc = gemm_acc_k(a_desc, b_desc, gemm, item, expert, row_start, n0, k0, k1)
        r = tl.arange(0, BLOCK_M)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        keep = (r < row_end - row_start) & (c < BLOCK_N)
        tl.store(ksplit.partial + p.to(tl.int64) * SLOT + r * BLOCK_N + c, acc, mask=keep)
        if arrive(ksplit.arrived + unit, "gpu") == k_splits - 1:
            first = ksplit.partial + (unit * k_splits).to(tl.int64) * SLOT
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in range(k_splits):
                total += tl.load(first + j * SLOT + r * BLOCK_N + c, mask=keep, other=0.0)
            if item.BIAS:
                total += bias_row(gemm.bias, expert, gemm.N, n0, gemm.N, BLOCK_N)
            scatter_home(total, homes, row_start, row_end, n0, gemm.N, BLOCK_M, BLOCK_N)
        if trace.ON:
            events = stamp(trace, events, 0, t, start)
    return events


@triton.jit
def _release_sources(progress, epoch, sync):
    """The last block of the launch to get here tells every source its rows of this
    call are there (``flag1[this rank] = epoch`` on each) -- unless the group failed
    meanwhile: rows skipped after a failure must not look sent."""
    if arrive(progress.done, "sys") == tl.num_programs(0) - 1:
        if healthy(sync):
            for s in range(sync.WORLD):
                release(peer(progress.flag1, s) + sync.rank, epoch, "sys")


@triton.jit
def release_sources_kernel(progress, sync):
    """layer1's end as a launch of its own, one program, after a GroupGEMM launch that
    counts no programs (comet.kernels.fp8_ws): ``flag1`` released on every source."""
    _release_sources(progress, tl.load(sync.epoch), sync)


def launch_release_sources(*, progress: Progress, sync: Sync) -> None:
    release_sources_kernel[(1, )](progress=progress, sync=sync, num_warps=1)


@triton.jit
def _return_pairs(pair_src, pair_dst, recv_rows, q, live, tok, TOPK: tl.constexpr):
    """``pair_dst[token, j] = pair_src[row_j]`` for the slots of entries ``q`` held here."""
    for j in tl.static_range(TOPK):
        row = tl.load(recv_rows + q * TOPK + j, mask=live, other=-1)
        held = row >= 0
        v = tl.load(pair_src + row.to(tl.int64), mask=held, other=0.0)
        tl.store(pair_dst + tok * TOPK + j, v, mask=held)


@triton.jit
def _sum_slots(out1_ptr, H, rows, wgts, cols, cmask, WEIGHTED: tl.constexpr):
    """``sum_j wgts[:, j] * out1[rows[:, j], cols]`` in fp32 (``WEIGHTED``, else the plain
    sum) for ``rows [ENTRIES, SLOTS]`` (-1: a slot not held here) over the columns of
    ``cmask [1, BLOCK_C]``. One load for every slot: a load per slot kept a single slot's
    rows in flight (CommConfig.reduce_step_elements)."""
    ptrs = out1_ptr + rows[:, :, None] * H + cols[None, None, :]
    v = tl.load(ptrs, mask=(rows[:, :, None] >= 0) & cmask[:, None, :],
                other=0.0).to(tl.float32)
    if WEIGHTED:
        v = v * wgts[:, :, None]
    return tl.sum(v, axis=1)


@triton.jit
def _reduce_entries(out1_ptr, H, reduce, source, rank, start, end, col0, col1, pair_src,
                    pair_dst, TOPK: tl.constexpr, rtile):
    """``dst[token] = sum_j weight_j * out1[row_j]`` (``WEIGHTED``, else the plain sum)
    over columns ``[col0, col1)`` for ``source``'s return entries ``[start, end)``,
    ``ENTRIES`` at a time, into ``comb[rank]`` on each rank of ``source``'s group of
    ``FANOUT``: one sum, stored ``FANOUT`` times (summing once per destination read the
    rows ``FANOUT`` times: at TP=4 the reduce was read-bound). Rows of ``-1`` are slots
    that live on other ranks. With ``PAIRS``, the items of the first columns also return
    each held slot's scalar (:func:`_return_pairs`)."""
    FANOUT: tl.constexpr = reduce.FANOUT
    region = source * reduce.max_tokens
    recv_token = reduce.recv.token + region
    recv_rows = reduce.recv.rows + region * TOPK
    recv_weight = reduce.recv.weight + region * TOPK
    group0 = source - source % FANOUT
    offset = rank * reduce.max_tokens * H
    ENTRIES: tl.constexpr = rtile.ENTRIES
    BLOCK_C: tl.constexpr = rtile.BLOCK_C
    # The first (with EP, the only) destination's address loaded once, out of the loops:
    # loaded per store it cost the EP reduce kernels 2-14 registers.
    dst0 = peer(reduce.comb, group0) + offset
    for e0 in range(start, end, ENTRIES):
        q = e0 + tl.arange(0, ENTRIES)
        live = q < end
        tok = tl.load(recv_token + q, mask=live, other=0).to(tl.int64)
        if rtile.PAIRS:
            if col0 == 0:
                _return_pairs(pair_src, pair_dst, recv_rows, q, live, tok, TOPK)
        # Every held slot's row index and weight once per entry block, not per column step.
        slot = reduce.first_slot + reduce.SLOT_STRIDE * tl.arange(0, rtile.SLOTS)
        smask = live[:, None] & (slot[None, :] < TOPK)
        rows = tl.load(recv_rows + q[:, None] * TOPK + slot[None, :], mask=smask,
                       other=-1).to(tl.int64)
        wgts = None
        if rtile.WEIGHTED:
            wgts = tl.load(recv_weight + q[:, None] * TOPK + slot[None, :], mask=smask,
                           other=0.0)
        for c0 in range(col0, col1, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            cmask = cols[None, :] < col1
            acc = _sum_slots(out1_ptr, H, rows, wgts, cols, cmask, rtile.WEIGHTED)
            for g in tl.static_range(FANOUT):
                dst = dst0
                if g > 0:
                    dst = peer(reduce.comb, group0 + g) + offset
                tl.store(dst + tok[:, None] * H + cols[None, :],
                         acc.to(dst.dtype.element_ty), mask=live[:, None] & cmask)


@triton.jit
def _reduce_item(i, rank, entries, WORLD: tl.constexpr, ITEM: tl.constexpr):
    """Reduce-queue item ``i`` -> ``(split, source, first entry)``. Items run split by
    split, inside a split source by source in ring order from this rank (so at each step
    every rank sends to a different peer), ``ITEM`` entries each."""
    per_split = 0
    for o in range(WORLD):
        per_split += tl.cdiv(tl.load(entries + (rank + o) % WORLD), ITEM)
    split = i // tl.maximum(per_split, 1)
    rest = i % tl.maximum(per_split, 1)
    source = rank
    first = 0
    for o in range(WORLD):
        s = (rank + o) % WORLD
        n = tl.cdiv(tl.load(entries + s), ITEM)
        here = (rest >= 0) & (rest < n)
        source = tl.where(here, s, source)
        first = tl.where(here, rest * ITEM, first)
        rest -= n
    return split, source, first, per_split


@triton.jit
def reduce_send_role(gemm, reduce, arrivals, split_done, tiles, epoch, sync, trace, events,
                     rtile, BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     TOPK: tl.constexpr, WAIT: tl.constexpr):
    """Reduce the top-k rows of every return entry into the sources' ``comb`` buffers
    (see module doc), items from the reduce queue; an item of split ``s`` waits until all
    of split ``s``'s tiles are counted. A source's return entries travel after its rows
    in layer0: all of its chunk flags set say they landed. Returns the trace events."""
    WORLD: tl.constexpr = sync.WORLD
    ITEM: tl.constexpr = rtile.ITEM
    rank = sync.rank
    H = gemm.N
    entries = arrivals.entries
    for s in range(WORLD):
        wait_chunks(arrivals.flags + s * arrivals.slots, 0, tl.load(arrivals.chunks + s),
                    epoch, sync, SITE_ENTRIES, s, "sys", CHUNK_SCAN)
    num_tiles = tl.load(tiles.num)
    n_blocks = tl.cdiv(H, BLOCK_N)
    split_cols = BLOCKS_PER_SPLIT * BLOCK_N
    n_splits = tl.cdiv(n_blocks, BLOCKS_PER_SPLIT)
    # A block takes items in increasing order, so it waits for each split at most once.
    ready_split = tl.full([], -1, tl.int32)
    ready = healthy(sync)
    i = take(reduce.queue)
    split, source, first, per_split = _reduce_item(i, rank, entries, WORLD, ITEM)
    while i < n_splits * per_split:
        if trace.ON:
            start = clock_ns()
        if split > ready_split:
            if WAIT:
                blocks = tl.minimum(n_blocks - split * BLOCKS_PER_SPLIT, BLOCKS_PER_SPLIT)
                ready = wait_at_least(split_done + split, num_tiles * blocks, sync,
                                      SITE_SPLIT, split, "gpu")
            else:
                ready = healthy(sync)
            ready_split = split
        if ready:
            col0 = split * split_cols
            pair_src, pair_dst = None, None
            if rtile.PAIRS:
                pair_src = reduce.pairs.src
                pair_dst = peer(reduce.pairs.dst, source)
            # A replicated TP layout returns the sum to every rank of the source's group:
            # the all-reduce of the partial sums, as sends.
            _reduce_entries(gemm.out, H, reduce, source, rank, first,
                            tl.minimum(first + ITEM, tl.load(entries + source)), col0,
                            tl.minimum(col0 + split_cols, H), pair_src, pair_dst, TOPK, rtile)
        if trace.ON:
            events = stamp(trace, events, split + TRACE_REDUCE, source, start)
        i = take(reduce.queue)
        split, source, first, per_split = _reduce_item(i, rank, entries, WORLD, ITEM)
    return events


@triton.jit
def layer1_reduce_kernel(a_desc, b_desc, gemm, item, splits, tiles, progress, reduce,
                         arrivals, sync, split, trace, shape, rtile, ROLE: tl.constexpr,
                         WAIT: tl.constexpr):
    """layer1 of one rank, the paper's schedule: the column-wise GroupGEMM
    (:func:`layer1_compute_role`) and, on the programs below ``split[0]`` when ``ROLE``
    is fused, the reduce-and-send (:func:`reduce_send_role`), which every program joins
    once out of GEMM work; the last to finish releases ``flag1`` on every source.

    a_desc, b_desc, gemm, item, splits: :func:`layer1_gemm`'s (descriptors of A and B,
    the :class:`~comet.kernels.group_gemm.GemmOut`, the work item, the column splits);
    tiles: the plan's; progress: :class:`Progress`; reduce: :class:`Reduce`; arrivals:
    :class:`~comet.kernels.layer0.Arrivals`; sync, trace, shape: as everywhere; split:
    int64 [1] comm programs; rtile: :class:`ReduceTile`."""
    if trace.ON:
        entered = clock_ns()
    epoch = tl.load(sync.epoch)
    events = tl.full([], 0, tl.int32)
    comm, n_role, role_pid = assign_role(split, ROLE)
    if ROLE != ROLE_COMM:
        events = layer1_compute_role(comm, role_pid, n_role, a_desc, b_desc, gemm, item,
                                     splits, tiles, progress.split_done, None, trace, events,
                                     False)
    # Fused: a comm block goes from split 0's GEMM to the reduce; a compute block out
    # of tiles joins it, so the reduce of the last split runs on the whole GPU.
    if ROLE != ROLE_COMPUTE:
        events = reduce_send_role(gemm, reduce, arrivals, progress.split_done, tiles, epoch,
                                  sync, trace, events, rtile, item.BLOCK_N,
                                  splits.BLOCKS_PER_SPLIT, shape.TOPK, WAIT)
        _release_sources(progress, epoch, sync)
    if trace.ON:
        stamp_program(trace, entered)


@triton.jit
def layer1_scatter_kernel(a_desc, b_desc, gemm, item, splits, tiles, progress, homes, ksplit,
                          sync, trace, shape):
    """layer1 of one rank with the scatter epilogue: every program runs the GroupGEMM,
    whose epilogue sends each row, weighted, to its token's home (:class:`Homes`) -- in
    K splits where :class:`KSplit` has them and :func:`split_k_count` finds room; no comm
    role. The last program to finish releases ``flag1`` on every source."""
    if trace.ON:
        entered = clock_ns()
    epoch = tl.load(sync.epoch)
    events = tl.full([], 0, tl.int32)
    # The outer test is a constexpr (with SPLIT_K = 1 the kernel compiles as it did before
    # K splits existed), the inner one a run-time choice: hence two calls of the same role.
    if (ksplit.SPLIT_K > 1) and (item.BLOCK_N <= SPLIT_K_BLOCK_N):
        k_splits = split_k_count(tiles, gemm.N, item.BLOCK_N, ksplit.SPLIT_K)
        if k_splits > 0:
            events = split_k_role(a_desc, b_desc, gemm, item, tiles, homes, ksplit, k_splits,
                                  trace, events)
        else:
            events = _scatter_items(a_desc, b_desc, gemm, item, splits, tiles, progress,
                                    homes, trace, events)
    else:
        events = _scatter_items(a_desc, b_desc, gemm, item, splits, tiles, progress, homes,
                                trace, events)
    _release_sources(progress, epoch, sync)
    if trace.ON:
        stamp_program(trace, entered)


@triton.jit
def _scatter_items(a_desc, b_desc, gemm, item, splits, tiles, progress, homes, trace, events):
    """Whole work items, every program striding over them, scattering from the epilogue."""
    return layer1_compute_role(0, tl.program_id(0), tl.num_programs(0), a_desc, b_desc, gemm,
                               item, splits, tiles, progress.split_done, homes, trace, events,
                               True)
