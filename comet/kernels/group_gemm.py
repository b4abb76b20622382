"""The compute role: a persistent GroupGEMM over the scheduler's m-tile table.

One *work item* is one output tile: ``BLOCK_M`` rows of one local expert (an m-tile of
:class:`comet.scheduler.plan.TileTable`) times ``BLOCK_N`` columns. Operands come in
through TMA tensor descriptors (A: the rows, ``[rows, K]``; B: all local experts' weights
viewed as ``[El * K, N]``, so expert ``e``'s block starts at row ``e * K``); accumulation
is fp32; the tile is written with ``tl.store`` so that a release can publish it (a TMA
store would still be in flight). With ``BIAS`` a tile adds its expert's bias row to the
accumulator before the epilogue (expert biases, GPT-OSS).

The layer0 epilogue fuses the activation: with ``GATED``, each work item multiplies A by
the gate and the up columns of its output columns -- side by side in W13's interleaved
layout (comet.weights), so one dot computes both -- and stores ``silu(gate) * up`` (or
another gated activation, :mod:`comet.kernels.activation`): the activation never makes
its own pass over memory.

With ``TRANS_B`` (plain tiles only) B is read transposed: ``b_desc`` views the weights as
``[El * N, K]`` and a tile multiplies by ``B[expert]^T`` -- the backward's GEMMs
(``dy @ W2^T``, ``d(gate, up) @ W13^T``) on the weights as they are stored, the way
wgmma reads a K-major B tile from shared memory anyway.

The same ``gemm_tile`` runs in both fused layer kernels; only the loop around it and the
waits differ. Both loops are flattened (``tl.range(flatten=True)``):
layer1's blocks stride over the items, layer0's take strided lanes from a queue
(:func:`strided_take`) because blocks join it late and wait for rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.config import SIZE_ALIGNMENT
from comet.constants import constexpr
from comet.kernels.activation import Act, gated
from comet.kernels.address import pointer_at
from comet.kernels.sync import take


#: Offsets of a bias row load are multiples of this many elements.
BIAS_ALIGN = constexpr(SIZE_ALIGNMENT)


class GemmOut(NamedTuple):
    """Where a GroupGEMM writes, and its sizes (a kernel argument)."""

    out: torch.Tensor        # [rows, N]
    K: int
    N: int
    bias: torch.Tensor | None = None   # [El, N] (gated: [El, 2N], W13's columns); BIAS
    rows: "Gathered | None" = None     # A read through an index (A_GATHER)


class Gathered(NamedTuple):
    """A's rows read through an index (``A_GATHER``; layer0 of a gathered dispatch,
    ``Variant.layer0_gather``): row ``r`` of the shared tensor is ``tokens[src[r]]``
    -- or, with ``own`` (``A_OWN``), row ``src[r] - own.base`` of this rank's input when
    that is one of the call's tokens (:class:`OwnRows`)."""

    tokens: torch.Tensor     # [W * max_tokens, K]: every source's token rows
    src: torch.Tensor        # int32 [rows]: the token row each shared-tensor row reads
    rows: int                # rows of ``src`` (the shared tensor's capacity)
    own: "OwnRows | None" = None


class OwnRows(NamedTuple):
    """This rank's own tokens, read in place (``Variant.layer0_own_in_place``): the
    dispatch writes their index entries (``base + t``) but copies no row, so the GEMM
    reads row ``t`` of x itself."""

    x_addr: torch.Tensor     # int64 [1]: address of x [M, K], read on the device
    num_tokens: torch.Tensor  # int64 [1]: M -- entries of older calls past it stay in tokens
    base: int                # this rank's first entry: rank * max_tokens


class Gemm(NamedTuple):
    """Operands of a GroupGEMM over the m-tile table: ``out[rows] = a[rows] @ b[expert]``.
    A kernel takes the two TMA descriptors as top-level arguments (Triton 3.6's launcher
    builds descriptors only there, not inside argument groups) and the rest as a
    :class:`GemmOut`: :meth:`kernel_args`."""

    a: TensorDescriptor      # the rows [rows, K]; box [BLOCK_M, BLOCK_K]
    b: TensorDescriptor      # the local experts' weights: [El * K, N], or [El * N, K] (TRANS_B)
    out: torch.Tensor        # [rows, N]
    K: int
    N: int
    bias: torch.Tensor | None = None   # each expert's bias row, added before the epilogue
    rows: Gathered | None = None       # A through an index instead of ``a``'s boxes

    def kernel_args(self) -> dict:
        return dict(a_desc=self.a, b_desc=self.b,
                    gemm=GemmOut(self.out, self.K, self.N, self.bias, self.rows))


class GemmTile(NamedTuple):
    """Constexpr shape of one work item (one output tile) of a GroupGEMM."""

    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_K: tl.constexpr
    GATED: tl.constexpr          # silu(A @ gate) * (A @ up) over interleaved W13
    ONE_DOT: tl.constexpr        # gate and up of a tile in one dot (box of 2 * BLOCK_N)
    TRANS_B: tl.constexpr        # A @ B[expert]^T
    GATE_UP: tl.constexpr        # columns of an interleaved gate (and up) block
    HALF_TAIL: tl.constexpr      # ONE_DOT, and F ends in a half block (F % GATE_UP == GATE_UP/2)
    DOT_PRECISION: tl.constexpr
    ACT: Act                     # the gated activation (GATED)
    BIAS: tl.constexpr           # add the expert's bias row (``GemmOut.bias``)
    A_GATHER: tl.constexpr = constexpr(False)  # ONE_DOT: A's rows by index (``GemmOut.rows``)
    A_LIVE: tl.constexpr = constexpr(False)    # A_GATHER: load only a tile's own rows
    #: A_GATHER: this rank's own rows from its input (``Gathered.own``). A flag here, not
    #: in ``Gathered``: after a run-time ``if``, Triton 3.6 reads a constexpr of a group
    #: nested in one with a None field before it (``gemm.rows.X``, after ``gemm.bias``)
    #: as None (docs/design.md, "Kernel arguments").
    A_OWN: tl.constexpr = constexpr(False)
    #: The item is comet.kernels.fp8_gemm.Fp8Tile's (block-scaled FP8), never this one's.
    FP8: tl.constexpr = constexpr(False)


def descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 2-D tensor (built by Triton's launcher at launch time)."""
    return TensorDescriptor.from_tensor(t2d, block)


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the GEMMs' dots: fp32 operands must stay fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def gate_up_columns(n0, F, GATE_UP: tl.constexpr):
    """Columns of interleaved W13 (comet.weights) holding gate column ``n0`` and its up
    column: block ``j`` is ``GATE_UP`` gate columns then as many up columns (fewer in a
    last partial block)."""
    j = n0 // GATE_UP
    gate = j * GATE_UP + n0
    return gate, gate + tl.minimum(GATE_UP, F - j * GATE_UP)


@triton.jit
def gemm_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0):
    """The fp32 tile ``A[row_start:+BLOCK_M] @ B[expert][:, n0:+BLOCK_N]`` (rows from
    ``row_end`` on are the next tile's or padding: their results are dropped; ``g``: the
    :class:`GemmOut`, ``t``: the :class:`GemmTile`); with ``GATED``,
    ``silu(A @ gate) * (A @ up)`` over W13 in the interleaved layout. ``ONE_DOT`` (a tile
    is one whole interleave block, ``b``'s box ``[BLOCK_K, 2 * BLOCK_N]``): gate and up
    are one dot, split in the epilogue -- what lets the pipeliner overlap tiles (see
    comet.weights); otherwise two dots on boxes of ``BLOCK_N`` columns. ``TRANS_B``:
    ``A @ B[expert]^T`` with ``b`` over ``[El * N, K]`` (box ``[BLOCK_N, BLOCK_K]``)."""
    K = g.K
    b_row = expert * K
    if t.GATED and t.ONE_DOT:
        both = one_dot_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0, 0, K)
        acc = one_dot_epilogue(both, g, t, expert, n0, t.BLOCK_M)
    elif t.GATED:
        gate_col, up_col = gate_up_columns(n0, g.N, t.GATE_UP)
        acc = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
        for k in range(0, K, t.BLOCK_K):
            a = a_desc.load([row_start, k])
            acc = tl.dot(a, b_desc.load([b_row + k, gate_col]), acc,
                         input_precision=t.DOT_PRECISION)
            acc_up = tl.dot(a, b_desc.load([b_row + k, up_col]), acc_up,
                            input_precision=t.DOT_PRECISION)
        if t.BIAS:
            # A tile's columns lie in one interleave block: its gates and ups are runs.
            width = g.N - n0
            acc += bias_row(g.bias, expert, 2 * g.N, gate_col, gate_col + width, t.BLOCK_N)
            acc_up += bias_row(g.bias, expert, 2 * g.N, up_col, up_col + width, t.BLOCK_N)
        acc = gated(acc, acc_up, t.ACT)
    elif t.TRANS_B:
        acc = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
        for k in range(0, K, t.BLOCK_K):
            acc = tl.dot(a_desc.load([row_start, k]), b_desc.load([expert * g.N + n0, k]).T,
                         acc, input_precision=t.DOT_PRECISION)
    else:
        acc = gemm_acc_k(a_desc, b_desc, g, t, expert, row_start, n0, 0, K)
        if t.BIAS:
            acc += bias_row(g.bias, expert, g.N, n0, g.N, t.BLOCK_N)
    return acc


@triton.jit
def one_dot_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0, k0, k1):
    """The fp32 box ``A[row_start:+BLOCK_M, k0:k1] @ W13[expert][k0:k1, gate and up of
    n0:+BLOCK_N]`` (``ONE_DOT``: ``[BLOCK_M, 2 * BLOCK_N]``, before bias and activation):
    the whole K, or one stream-K segment of layer0 (comet.kernels.layer0.Work). With
    ``A_GATHER`` A's rows are ``tokens[src[row]]`` (:class:`Gathered`), loaded with
    ``tl.load`` (cp.async on Hopper) rather than a TMA box: the index is read once per
    tile. Rows past the tile's end (``row_end``: the next expert's rows, or padding)
    read whatever valid row their entry names, and the store drops them -- unless
    ``A_LIVE``: then they are zeros, loaded from nowhere. A small call's tiles are mostly
    such rows, whose loads beside the weights' slow its layer0 (the masks slow a large
    call's full tiles, so comet.runtime.selection.Selector.live_rows_by_rule compiles
    them in for small calls only; docs/design.md)."""
    b_row = expert * g.K
    both = tl.zeros((t.BLOCK_M, 2 * t.BLOCK_N), dtype=tl.float32)
    if t.A_GATHER:
        rows = row_start + tl.arange(0, t.BLOCK_M)
        if t.A_LIVE:
            read = rows < row_end           # the tile's own rows; the others are zeros
        else:
            read = rows < g.rows.rows       # every row the index holds
        src = tl.load(g.rows.src + rows, mask=read, other=0).to(tl.int64)
        cols = tl.arange(0, t.BLOCK_K)[None, :]
        a = g.rows.tokens + src[:, None] * g.K + cols
        if t.A_OWN:
            a = own_rows_in_place(a, src, g.rows, g.K, cols)
        for k in range(k0, k1, t.BLOCK_K):
            if t.A_LIVE:
                a_k = tl.load(a + k, mask=read[:, None], other=0.0)
            else:
                a_k = tl.load(a + k)
            both = tl.dot(a_k, b_desc.load([b_row + k, 2 * n0]), both,
                          input_precision=t.DOT_PRECISION)
    else:
        for k in range(k0, k1, t.BLOCK_K):
            both = tl.dot(a_desc.load([row_start, k]), b_desc.load([b_row + k, 2 * n0]),
                          both, input_precision=t.DOT_PRECISION)
    return both


@triton.jit
def own_rows_in_place(a, src, rows, K, cols):
    """``a`` (pointers to ``tokens[src]``) with this rank's own tokens pointing into x
    instead (:class:`OwnRows`). An entry past the call's tokens (left by an older call,
    in a row past the tile's end whose product the store drops) keeps its row of
    ``tokens``, which is always inside its buffer; x has only the call's rows."""
    x = pointer_at(rows.own.x_addr, 0, rows.tokens)
    t = src - rows.own.base
    mine = (t >= 0) & (t < tl.load(rows.own.num_tokens))
    return tl.where(mine[:, None], x + t[:, None] * K + cols, a)


@triton.jit
def one_dot_epilogue(both, g, t, expert, n0, ROWS: tl.constexpr):
    """``act(gate) * up`` ``[ROWS, BLOCK_N]`` of a one-dot box ``both [ROWS, 2 * BLOCK_N]``
    (:func:`one_dot_acc`, summed over all of K), after adding the expert's bias."""
    if t.BIAS:
        both += bias_row(g.bias, expert, 2 * g.N, 2 * n0, 2 * g.N, 2 * t.BLOCK_N)
    if t.HALF_TAIL:
        acc = half_tail_epilogue(both, n0 + t.BLOCK_N > g.N, t, ROWS)
    else:
        gate, up = both.reshape(ROWS, 2, t.BLOCK_N).permute(0, 2, 1).split()
        acc = gated(gate, up, t.ACT)
    return acc


@triton.jit
def gemm_acc_k(a_desc, b_desc, g, t, expert, row_start, n0, k0, k1):
    """The fp32 tile ``A[row_start:+BLOCK_M, k0:k1] @ B[expert][k0:k1, n0:+BLOCK_N]`` of a
    plain GEMM, no bias (``k0``, ``k1``: multiples of ``BLOCK_K``): the whole K, or one K
    split of layer1 (comet.kernels.layer1.KSplit)."""
    b_row = expert * g.K
    acc = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
    for k in range(k0, k1, t.BLOCK_K):
        acc = tl.dot(a_desc.load([row_start, k]), b_desc.load([b_row + k, n0]), acc,
                     input_precision=t.DOT_PRECISION)
    return acc


@triton.jit
def half_tail_epilogue(both, tail, t, ROWS: tl.constexpr):
    """``act(gate) * up`` of a one-dot box ``both [ROWS, 2 * BLOCK_N]`` when F ends in
    a half interleave block: a whole block's box is ``[gate | up]``, the last item's
    ``[gate/2 | up/2 | zeros]`` (the box runs past W13's last column, which TMA fills with
    zeros), so its up columns sit where a whole block's second gate half does. The box is
    cut in quarters (column ``a * BLOCK_N + b * BLOCK_N/2 + i``) and each half of the
    output computed from its quarters; the tail item's second half is never stored."""
    lo, hi = both.reshape(ROWS, 2, 2, t.BLOCK_N // 2).permute(0, 3, 1, 2).split()
    gate_lo, up_lo = lo.split()
    gate_hi, up_hi = hi.split()
    up_lo = tl.where(tail, gate_hi, up_lo)
    out = tl.join(gated(gate_lo, up_lo, t.ACT), gated(gate_hi, up_hi, t.ACT))
    return out.permute(0, 2, 1).reshape(ROWS, t.BLOCK_N)


@triton.jit
def bias_row(bias, expert, row_len, col0, col_end, WIDTH: tl.constexpr):
    """``bias[expert, col0:col0 + WIDTH]`` (zero from ``col_end`` on) as an fp32 ``[1,
    WIDTH]`` row, to add to a tile's accumulator. Every offset is a multiple of
    :data:`comet.config.SIZE_ALIGNMENT` elements (sizes are, and tiles start on column
    blocks), which lets the load be vectorized."""
    start = tl.multiple_of(expert.to(tl.int64) * row_len + col0, BIAS_ALIGN)
    end = tl.multiple_of(col_end - col0, BIAS_ALIGN)
    cols = tl.arange(0, WIDTH)
    row = tl.load(bias + start + cols, mask=cols < end, other=0.0)
    return row.to(tl.float32)[None, :]


@triton.jit
def gemm_tile(a_desc, b_desc, g, t, expert, row_start, row_end, n0):
    """``out[row_start:row_end, n0:n0+BLOCK_N] = A[rows] @ B[expert][:, cols]`` (+ bias,
    + the gated activation, or B transposed: see :func:`gemm_acc`)."""
    store_tile(gemm_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0), g, row_start,
               row_end, n0, t.BLOCK_M, t.BLOCK_N)


@triton.jit
def store_tile(acc, g, row_start, row_end, n0, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[row_start:row_end, n0:n0+BLOCK_N] = acc[:row_end - row_start]`` (``acc``:
    ``[ROWS, BLOCK_N]``, in the output's dtype)."""
    rows = row_start + tl.arange(0, ROWS)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < row_end) & (cols[None, :] < g.N)
    tl.store(g.out + rows[:, None].to(tl.int64) * g.N + cols[None, :],
             acc.to(g.out.dtype.element_ty), mask=mask)


@triton.jit
def grouped_work(w, num_tiles, n_blocks, GROUP_M: tl.constexpr):
    """layer0 order: groups of ``GROUP_M`` consecutive m-tiles sweep the column blocks
    together (so a weight block is read once per group from L2), groups in table order
    (the scheduler's order: a local head, then expert-major -- so a group's m-tiles are
    mostly one expert's, sharing its weight block). Returns (tile, column block)."""
    per_group = GROUP_M * n_blocks
    first = (w // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    within = w % per_group
    return first + within % size, within // size


@triton.jit
def lane_shape(total, programs, LANE_ITEMS: tl.constexpr, HEAD_ROUNDS: tl.constexpr,
               TAIL_ROUNDS: tl.constexpr):
    """How a queue of ``total`` work items is cut into takes (mirrored by
    :func:`comet.scheduler.plan.lane_shape`): ``(items, head, lanes_end)``. Items
    ``[0, head)`` and ``[lanes_end, total)`` go one per take; the rounds in between are
    lanes of ``items`` (``LANE_ITEMS`` once there is a whole round of them, else 1).

    One-item takes at the ends: the first take of every block waits for the rows of its
    whole lane, and a lane of four reaches past the first round of dispatch chunks; and
    the last lanes end up to a lane (four tiles) apart while layer1 waits for the slowest
    (docs/notebook.md, "Kernel structure")."""
    items = tl.where(total >= programs * LANE_ITEMS, LANE_ITEMS, 1)
    head = tl.minimum(HEAD_ROUNDS * programs, total)
    rounds = tl.maximum(total - head - TAIL_ROUNDS * programs, 0) // (programs * items)
    return items, head, head + rounds * programs * items


@triton.jit
def strided_take(queue, programs, items, head, lanes_end):
    """Take from the work queue: one item below ``head`` and from ``lanes_end`` on
    (:func:`lane_shape`), else one *lane*: ``items`` work items strided by ``programs``.
    Lane take ``q`` is lane ``q % programs`` of round ``q // programs``, which covers
    ``programs * items`` consecutive items. Returns ``(first, end)``: the take's items
    are ``first, first + programs, ...`` below ``end``. The items running at once stay
    one grid-wide window of the order (as with one item per take, so weight blocks are
    shared in L2), while a lane of several items can run as one flattened loop, which
    lets the pipeliner load a tile's operands under the previous tile's epilogue. Any
    block may take any lane: blocks that join late still find work."""
    q = take(queue)
    lane_takes = (lanes_end - head) // items
    r = q - head
    rnd = r // programs
    in_lanes = (r >= 0) & (r < lane_takes)
    single = tl.where(r < 0, q, lanes_end + r - lane_takes)
    first = tl.where(in_lanes, head + rnd * programs * items + r % programs, single)
    end = tl.where(in_lanes, head + (rnd + 1) * programs * items, single + 1)
    return first, end


@triton.jit
def column_work(w, num_tiles, n_blocks, BLOCKS_PER_SPLIT: tl.constexpr):
    """layer1 order: column split major (all experts' tiles of split ``s`` before split
    ``s + 1``), inside a split m-tile major. Returns (tile, column block, split)."""
    per_split = num_tiles * BLOCKS_PER_SPLIT
    split = w // per_split
    within = w % per_split
    first_block = split * BLOCKS_PER_SPLIT
    blocks = tl.minimum(n_blocks - first_block, BLOCKS_PER_SPLIT)
    return within // blocks, first_block + within % blocks, split
