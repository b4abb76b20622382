"""The block-scaled FP8 GroupGEMM (W8A8 e4m3) and the per-row FP8 quantizer.

``out[rows of expert e] = A[rows] @ B[e]^T`` with A a layer's FP8 token rows (one fp32
scale per row and :data:`comet.quant.GROUP` K values, :class:`comet.quant.Fp8Rows`) and B
its FP8 experts in the checkpoint's ``[E, N, K]`` layout (block scales,
:class:`comet.quant.Fp8Weight`). B's ``[BLOCK_N, BLOCK_K]`` boxes are K-contiguous, so
``b.T`` is the K-major operand Hopper's FP8 MMA reads: no transpose at load, none in
the kernel.

The roles, each a small ``@triton.jit`` function, as comet's persistent fused kernels use
them (:mod:`comet.kernels.group_gemm`: the same m-tile table, work order and store):

* :func:`block_scaled_k_loop` -- the K loop. Each step's product ``dot(a, b.T)`` of exact
  FP8 values is promoted into the fp32 accumulator with its scales, ``acc += d * sa[:,
  None] * sb``: the tensor core's own (limited-precision) accumulation never spans more
  than one ``BLOCK_K`` step (DeepGEMM promotes every 128 K too). B's scale is one value per
  step (``SCALAR_B``: the tile's columns lie in one scale block) or one per column;
* :func:`store_fp8_groups` -- layer0's epilogue for an FP8 layer1: the tile (after the
  gated activation, :mod:`comet.kernels.activation`) quantized per row in groups of
  ``A_GROUP`` columns, stored as FP8 rows and their fp32 scales;
* :func:`quantize_groups` -- the recipe itself (:func:`comet.quant.quantize_rows`), shared
  by that epilogue and :func:`quantize_rows_kernel` (a layer's input rows, before the
  dispatch).

N or K that are not multiples of the blocks work: TMA reads zeros past K and past the
last expert; a partial column tile reads the next expert's rows, whose products the store
drops (their scales load as zeros), and the quantizing epilogue masks them before a
group's amax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from comet.activation import GatedActivation
from comet.constants import constexpr
from comet.kernels.activation import Act, act_tile, gated
from comet.kernels.group_gemm import grouped_work, store_tile
from comet.quant import AMAX_EPS as _EPS
from comet.quant import E4M3, E4M3_MAX as _MAX
from comet.quant import SCALE_PER_AMAX as _PER_AMAX
from comet.quant import GROUP, Fp8Rows, Fp8Weight

#: The recipe's numbers, as the kernels read them.
E4M3_MAX = constexpr(_MAX)
AMAX_EPS = constexpr(_EPS)
SCALE_PER_AMAX = constexpr(_PER_AMAX)


class MTiles(NamedTuple):
    """The m-tile table (the fields of :class:`comet.kernels.plan.Tiles` a GEMM reads):
    tile ``i`` is rows ``[row_start[i], row_end[i])`` of local expert ``expert[i]``."""

    expert: torch.Tensor     # int32 [T]
    row_start: torch.Tensor  # int32 [T]
    row_end: torch.Tensor    # int32 [T]
    num: torch.Tensor        # int32 [1]: live tiles


class Fp8Gemm(NamedTuple):
    """Run-time operands of an FP8 GroupGEMM besides the two TMA descriptors (A: the rows
    ``[rows, K]``; B: the experts ``[E * NB, K]``)."""

    a_scale: torch.Tensor    # fp32 [rows, ceil(K / A_GROUP)], strides below
    sa_row: int              # a_scale's stride between rows (elements)
    sa_group: int            # ... and between groups
    rows: int                # rows of A: scale loads stop there
    b_scale: torch.Tensor    # fp32 [E, SN, SK] (contiguous)
    NB: int                  # rows of B per expert (gated: 2F)
    part_rows: int           # rows of one part of B (gate, up), each its own block grid
    part_blocks: int         # scale rows of one part: ceil(part_rows / SCALE_N)
    out: torch.Tensor        # [rows, N]: bf16, or e4m3 (REQUANT)
    out_scale: torch.Tensor  # fp32 [rows, ceil(N / A_GROUP)] (REQUANT; else unused)
    K: int
    N: int                   # output columns (gated: F)
    gather: "Fp8Gather | None" = None   # A's rows read through an index (A_GATHER)


class Fp8Gather(NamedTuple):
    """A's rows read through an index (``A_GATHER``; layer0 of a gathered dispatch,
    ``Variant.layer0_gather``): row ``r`` is the packed row ``tokens[src[r]]`` (its K e4m3
    values, then its fp32 group scales: :class:`comet.kernels.fp8_roles.PackedRows`) --
    or, with ``own`` (``A_OWN``), this rank's own packed row where the entry is one of
    its tokens, so that no row of its own is copied (as bf16's
    :class:`comet.kernels.group_gemm.Gathered`)."""

    src: torch.Tensor        # int32 [rows]: the token row each row of A reads
    tokens: torch.Tensor     # uint8 [W * max_tokens, row_bytes]: every source's rows
    row_bytes: int           # bytes of a packed row (both buffers' row stride)
    own: "Fp8OwnRows | None" = None


class Fp8OwnRows(NamedTuple):
    """This rank's own rows, read where its home rank packed them (``A_OWN``,
    ``Variant.layer0_own_in_place``)."""

    #: bytes from where an own row's entry points in ``tokens`` (``src * row_bytes``) to
    #: the row in this rank's home rows. A row's address stays ``tokens`` plus an offset,
    #: this one added where the row is its own: a select between two addresses kept
    #: Triton from pipelining the K loop's loads (tests/sm90_compile.py).
    delta: int
    base: int                # this rank's first index entry: rank * max_tokens
    max_tokens: int          # entries per source (a tile reads only its own rows' entries,
                             # all of this call: no stale one past the call's tokens)


class Fp8Tile(NamedTuple):
    """Constexpr shape and choices of one work item."""

    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_K: tl.constexpr
    GROUP_M: tl.constexpr    # m-tiles sweeping the column blocks together (L2 reuse)
    A_GROUP: tl.constexpr    # K values per activation scale (and per output scale)
    SCALE_N: tl.constexpr    # B's scale block: rows
    SCALE_K: tl.constexpr    # ... and K columns
    SCALAR_B: tl.constexpr   # a tile's B columns lie in one scale block
    GATED: tl.constexpr      # out = act(A @ gate^T) * (A @ up^T): B is [gate | up]
    ACT: Act
    REQUANT: tl.constexpr    # out in FP8 groups of A_GROUP columns, with out_scale
    IMPRECISE_ACC: tl.constexpr  # K values an MMA sums before fp32 promotion (imprecise_acc)
    # As a work item of the fused layer kernels, whose code around the GEMM reads these
    # of any item (comet.kernels.group_gemm.GemmTile): none of those choices is FP8's.
    ONE_DOT: tl.constexpr = constexpr(False)
    TRANS_B: tl.constexpr = constexpr(False)
    BIAS: tl.constexpr = constexpr(False)
    A_OWN: tl.constexpr = constexpr(False)     # A_GATHER: own rows in place (Fp8Gather.own)
    FP8: tl.constexpr = constexpr(True)
    A_GATHER: tl.constexpr = constexpr(False)  # A's rows through an index (Fp8Gemm.gather)


# ------------------------------------------------------------------------------- roles
@triton.jit
def a_scales(g, t, rows, k):
    """A's scales of rows ``rows`` for K step ``k``: fp32 ``[BLOCK_M]`` (zeros past A)."""
    at = rows.to(tl.int64) * g.sa_row + (k // t.A_GROUP) * g.sa_group
    return tl.load(g.a_scale + at, mask=rows < g.rows, other=0.0)


@triton.jit
def b_scale_rows(r, g, t):
    """Scale row of B rows ``r`` (within one expert): their part's block grid."""
    part = r // g.part_rows
    return part * g.part_blocks + (r - part * g.part_rows) // t.SCALE_N


@triton.jit
def b_scales(g, t, expert, r0, r_end, k):
    """B's scales of rows ``[r0, r0 + BLOCK_N)`` of ``expert`` for K step ``k``: one
    scalar (``SCALAR_B``) or fp32 ``[BLOCK_N]`` (zeros from ``r_end`` on)."""
    sn = g.part_blocks * (g.NB // g.part_rows)
    sk = tl.cdiv(g.K, t.SCALE_K)
    base = g.b_scale + expert.to(tl.int64) * sn * sk + k // t.SCALE_K
    if t.SCALAR_B:
        sb = tl.load(base + b_scale_rows(r0, g, t) * sk)
    else:
        r = r0 + tl.arange(0, t.BLOCK_N)
        sb = tl.load(base + b_scale_rows(r, g, t) * sk, mask=r < r_end, other=0.0)
    return sb


@triton.jit
def promote(acc, d, sa, sb, t):
    """``acc + d * sa * sb``: one K step's exact FP8 products ``d`` into fp32."""
    if t.SCALAR_B:
        acc += d * (sa * sb)[:, None]
    else:
        acc += d * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def gathered_rows(gather, t, rows, row_end):
    """``(base, read)``: byte pointers to the packed rows that A's rows ``rows`` read
    (``A_GATHER``), and which rows to read (the tile's own: the others load as zeros)."""
    read = rows < row_end
    src = tl.load(gather.src + rows, mask=read, other=0).to(tl.int64)
    at = src * gather.row_bytes
    if t.A_OWN:
        own = src - gather.own.base
        mine = (own >= 0) & (own < gather.own.max_tokens)
        at += mine.to(tl.int64) * gather.own.delta
    return gather.tokens + at, read


@triton.jit
def gathered_a(base, read, g, t, k):
    """K step ``k`` of gathered rows (:func:`gathered_rows`): the e4m3 values ``[BLOCK_M,
    BLOCK_K]`` and their scales ``[BLOCK_M]`` (a packed row's scales follow its K values)."""
    cols = k + tl.arange(0, t.BLOCK_K)
    values = (base[:, None] + cols[None, :]).to(tl.pointer_type(tl.float8e4nv))
    a = tl.load(values, mask=read[:, None] & (cols[None, :] < g.K), other=0.0)
    scales = (base + g.K + 4 * (k // t.A_GROUP)).to(tl.pointer_type(tl.float32))
    return a, tl.load(scales, mask=read, other=0.0)


@triton.jit
def block_scaled_k_loop(a_desc, b_desc, g, t, expert, row_start, row_end, n0, k0, k1):
    """The fp32 tile ``A[row_start:+BLOCK_M, k0:k1] @ B[expert][n0:+BLOCK_N, k0:k1]^T``,
    block-scaled (``k0`` a multiple of ``BLOCK_K``, which divides a scale block: each
    step has one scale of A and of B); with ``GATED`` also the up tile (B rows ``N +
    n0``), from the same A loads. A's rows come through TMA boxes, or with ``A_GATHER``
    through the index (rows from ``row_end`` on as zeros). Returns ``(acc, acc_up)``
    (``acc_up`` unused without ``GATED``)."""
    rows = row_start + tl.arange(0, t.BLOCK_M)
    b_row = expert * g.NB + n0
    acc = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((t.BLOCK_M, t.BLOCK_N), dtype=tl.float32)
    gate_end = g.N if t.GATED else g.NB
    if t.A_GATHER:
        base, read = gathered_rows(g.gather, t, rows, row_end)
    for k in range(k0, k1, t.BLOCK_K):
        if t.A_GATHER:
            a, sa = gathered_a(base, read, g, t, k)
        else:
            a = a_desc.load([row_start, k])
            sa = a_scales(g, t, rows, k)
        d = tl.dot(a, b_desc.load([b_row, k]).T, max_num_imprecise_acc=t.IMPRECISE_ACC)
        acc = promote(acc, d, sa, b_scales(g, t, expert, n0, gate_end, k), t)
        if t.GATED:
            d_up = tl.dot(a, b_desc.load([b_row + g.N, k]).T,
                          max_num_imprecise_acc=t.IMPRECISE_ACC)
            acc_up = promote(acc_up, d_up, sa, b_scales(g, t, expert, g.N + n0, g.NB, k), t)
    return acc, acc_up


@triton.jit
def quantize_groups(x, ROWS: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """``x [ROWS, COLS]`` (fp32; columns to leave out already zero) in FP8 groups of
    ``GROUP`` columns: ``(q [ROWS, COLS] e4m3, scale [ROWS, COLS // GROUP] fp32)``, the
    recipe of :func:`comet.quant.quantize_rows` (its scale multiply and IEEE division
    round as torch's)."""
    xg = tl.reshape(x, (ROWS, COLS // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(xg), axis=2), AMAX_EPS) * SCALE_PER_AMAX
    q = tl.div_rn(xg, tl.broadcast_to(scale[:, :, None], (ROWS, COLS // GROUP, GROUP)))
    q = tl.clamp(q, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    return tl.reshape(q, (ROWS, COLS)), scale


@triton.jit
def store_fp8_groups(h, g, t, row_start, row_end, n0, ROWS: tl.constexpr):
    """Rows ``[row_start, row_end)``, columns ``n0:+BLOCK_N`` of ``h [ROWS, BLOCK_N]`` as
    FP8 groups: ``out`` gets the e4m3 values, ``out_scale`` one scale per row and group (a
    tile holds whole groups: ``BLOCK_N`` is a multiple of ``A_GROUP``)."""
    GROUPS: tl.constexpr = t.BLOCK_N // t.A_GROUP
    rows = row_start + tl.arange(0, ROWS)
    cols = n0 + tl.arange(0, t.BLOCK_N)
    h = tl.where(cols[None, :] < g.N, h, 0.0)
    q, scale = quantize_groups(h, ROWS, t.BLOCK_N, t.A_GROUP)
    live = rows[:, None] < row_end
    tl.store(g.out + rows[:, None].to(tl.int64) * g.N + cols[None, :], q,
             mask=live & (cols[None, :] < g.N))
    groups = n0 // t.A_GROUP + tl.arange(0, GROUPS)
    tl.store(g.out_scale + rows[:, None].to(tl.int64) * tl.cdiv(g.N, t.A_GROUP) + groups[None, :],
             scale, mask=live & (groups[None, :] < tl.cdiv(g.N, t.A_GROUP)))


@triton.jit
def fp8_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0):
    """The fp32 tile of rows ``row_start:+BLOCK_M`` of ``expert`` (those up to
    ``row_end`` its own) times columns ``n0:+BLOCK_N``, through the gated activation with
    ``GATED`` (layer1's scatter epilogue takes it as it is)."""
    acc, acc_up = block_scaled_k_loop(a_desc, b_desc, g, t, expert, row_start, row_end, n0,
                                      0, g.K)
    if t.GATED:
        acc = gated(acc, acc_up, t.ACT)
    return acc


@triton.jit
def fp8_item(a_desc, b_desc, g, t, expert, row_start, row_end, n0):
    """One work item of ``expert``'s rows ``[row_start, row_end)``, columns
    ``n0:+BLOCK_N``, stored: as FP8 groups (``REQUANT``) or in ``out``'s dtype."""
    acc = fp8_acc(a_desc, b_desc, g, t, expert, row_start, row_end, n0)
    if t.REQUANT:
        store_fp8_groups(acc, g, t, row_start, row_end, n0, t.BLOCK_M)
    else:
        store_tile(acc, g, row_start, row_end, n0, t.BLOCK_M, t.BLOCK_N)


@triton.jit
def fp8_gemm_tile(a_desc, b_desc, g, t, tiles, tile, n0):
    """One work item: m-tile ``tile`` times columns ``n0:+BLOCK_N``, stored."""
    fp8_item(a_desc, b_desc, g, t, tl.load(tiles.expert + tile),
             tl.load(tiles.row_start + tile), tl.load(tiles.row_end + tile), n0)


@triton.jit
def fp8_group_gemm_kernel(a_desc, b_desc, gemm, tiles, tile):
    """Every program strides over the work items (m-tile x column block), in layer0's
    grouped order (:func:`comet.kernels.group_gemm.grouped_work`)."""
    num_tiles = tl.load(tiles.num)
    n_blocks = tl.cdiv(gemm.N, tile.BLOCK_N)
    for w in tl.range(tl.program_id(0), num_tiles * n_blocks, tl.num_programs(0)):
        m_tile, nb = grouped_work(w, num_tiles, n_blocks, tile.GROUP_M)
        fp8_gemm_tile(a_desc, b_desc, gemm, tile, tiles, m_tile, nb * tile.BLOCK_N)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, rows, K, stride_x,
                         BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """Program ``(i, j)``: rows ``[i*BLOCK_R, ...)``, group ``j`` of each: FP8 values into
    ``q [rows, K]``, the scale into ``s [rows, ceil(K / GROUP)]``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = (r < rows)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :], mask=ok, other=0.0)
    q, scale = quantize_groups(x.to(tl.float32), BLOCK_R, GROUP, GROUP)
    tl.store(q_ptr + r.to(tl.int64)[:, None] * K + c[None, :], q, mask=ok)
    tl.store(s_ptr + r.to(tl.int64) * tl.cdiv(K, GROUP) + tl.program_id(1),
             tl.reshape(scale, (BLOCK_R, )), mask=r < rows)


# ------------------------------------------------------------------------------- host
#: Rows per program of :func:`quantize_rows_kernel`.
QUANT_BLOCK_ROWS = 16


def quantize_rows_triton(x: torch.Tensor, group: int = GROUP) -> Fp8Rows:
    """:func:`comet.quant.quantize_rows` as one kernel launch (``x [rows, K]``, unit
    column stride; ``group`` a power of two >= 16)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() \
            or x.dtype == E4M3:
        raise ValueError(f"quantize_rows_triton takes float [rows, K], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if x.stride(1) != 1:
        raise ValueError("quantize_rows_triton needs a unit column stride")
    if group < 16 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 16, got {group}")
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=E4M3, device=x.device)
    s = torch.empty(rows, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    if rows and k:
        quantize_rows_kernel[(triton.cdiv(rows, QUANT_BLOCK_ROWS), triton.cdiv(k, group))](
            x_ptr=x, q_ptr=q, s_ptr=s, rows=rows, K=k, stride_x=x.stride(0),
            BLOCK_R=QUANT_BLOCK_ROWS, GROUP=group, num_warps=4)
    return Fp8Rows(q, s, group)


#: Most K values per step of the fused layers' FP8 K loop: one activation group.
FUSED_BLOCK_K = GROUP
#: Columns of a layer0 FP8 work item: one activation group, which its epilogue quantizes
#: whole (the gate and up tiles are two dots of this width).
LAYER0_BLOCK_N = GROUP
#: Fewest K values of an FP8 dot (and those of one Hopper FP8 MMA instruction).
MIN_BLOCK_K = 32


def imprecise_acc(promotion_k: int, block_k: int) -> int:
    """``max_num_imprecise_acc`` of the K loop's dots: :attr:`comet.quant.Fp8.promotion_k`
    values, or the whole K step when it is shorter (each step's sum is promoted anyway:
    it is scaled into the fp32 accumulator)."""
    return min(block_k, promotion_k)


class Fp8Operands(NamedTuple):
    """A fused layer's FP8 GroupGEMM as its kernel takes it: the two TMA descriptors
    (top-level arguments, as :class:`comet.kernels.group_gemm.Gemm`'s) and the rest."""

    a: TensorDescriptor      # the FP8 rows [rows, K]; box [BLOCK_M, BLOCK_K]
    b: TensorDescriptor      # the experts [El * NB, K]; box [BLOCK_N, BLOCK_K]
    gemm: Fp8Gemm

    def kernel_args(self) -> dict:
        return dict(a_desc=self.a, b_desc=self.b, gemm=self.gemm)


def fused_k_step(w: Fp8Weight) -> int:
    """K step of the fused layers' K loop on ``w``: the largest power of two up to
    :data:`FUSED_BLOCK_K` inside one of its K blocks (64 for a TP shard re-blocked by
    :meth:`comet.quant.Fp8Weight.narrow`); every step then has one scale of A and of B."""
    return math.gcd(FUSED_BLOCK_K, w.block_shape()[1])


def fused_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: Fp8Weight, out: torch.Tensor,
                   out_scale: torch.Tensor | None, *, block_m: int, block_n: int,
                   group_m: int, activation: GatedActivation | None = None,
                   promotion_k: int = MIN_BLOCK_K, gather: Fp8Gather | None = None
                   ) -> tuple[Fp8Operands, Fp8Tile]:
    """Operands and work item of a fused layer's FP8 GroupGEMM: the e4m3 rows ``a [rows,
    K]`` (any row stride: layer0 reads them where the dispatch packed them with their
    scales) with fp32 ``a_scale [rows, ceil(K / GROUP)]`` (any strides) times ``w``. With
    ``activation`` (layer0), ``act(gate) * up`` over ``w = [gate | up]`` quantized into
    ``out`` (e4m3 ``[rows, F]``) and ``out_scale``; else (layer1) ``out`` in its dtype.
    ``gather`` (layer0 of a gathered dispatch): A's rows through its index instead of
    ``a`` (this rank's own in place with ``gather.own``)."""
    rows, k = a.shape
    nb = w.n
    n = nb // 2 if activation is not None else nb
    bn, bk = w.block_shape()
    block_k = fused_k_step(w)
    aligned_up = activation is None or w.parts == 2 or n % bn == 0
    gemm = Fp8Gemm(a_scale, a_scale.stride(0), a_scale.stride(1), rows, w.scale_inv, nb,
                   nb // w.parts, w.scale_grid()[0] // w.parts,
                   out, out if out_scale is None else out_scale, k, n, gather)
    tile = Fp8Tile(*(constexpr(v) for v in (
        block_m, block_n, block_k, group_m, GROUP, bn, bk, bn % block_n == 0 and aligned_up,
        activation is not None)),
        act_tile(activation) if activation is not None else act_tile(),
        constexpr(activation is not None),
        constexpr(imprecise_acc(promotion_k, block_k)),
        A_OWN=constexpr(gather is not None and gather.own is not None),
        A_GATHER=constexpr(gather is not None))
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(w.weight.view(w.experts * nb, k),
                                          [block_n, block_k])
    return Fp8Operands(a_desc, b_desc, gemm), tile


def m_tiles(expert_rows: list[int], block_m: int, device: torch.device | str = "cpu"
            ) -> MTiles:
    """The m-tile table of rows laid out expert by expert (``expert_rows[e]`` rows of
    expert ``e``, contiguous), ``block_m`` rows a tile."""
    expert, start, end, base = [], [], [], 0
    for e, n in enumerate(expert_rows):
        for s in range(base, base + n, block_m):
            expert.append(e)
            start.append(s)
            end.append(min(s + block_m, base + n))
        base += n
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return MTiles(t(expert), t(start), t(end), t([len(expert)]))


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile and launch of :func:`fp8_group_gemm` (``programs``: None launches one program
    per work item; else that many persistent programs; ``promotion_k``: as
    :class:`comet.quant.Fp8`)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    programs: int | None = None
    promotion_k: int = MIN_BLOCK_K


def fp8_group_gemm(a: Fp8Rows, w: Fp8Weight, tiles: MTiles, *,
                   activation: GatedActivation | None = None, requant: bool = False,
                   config: Fp8GemmConfig = Fp8GemmConfig(), out: torch.Tensor | None = None
                   ) -> torch.Tensor | Fp8Rows:
    """``a`` (rows of every expert, as ``tiles`` says) times ``w``: bf16 ``[rows, N]``;
    with ``activation``, ``act(gate) * up`` over ``w = [gate | up]`` (``[E, 2F, K]``),
    ``[rows, F]``; with ``requant``, that output as :class:`comet.quant.Fp8Rows` (groups of
    ``a.group``), layer1's input. ``out``: the bf16 output to write (not with ``requant``)."""
    check_group_gemm(a, w, tiles, activation, requant, config)
    c = config
    rows, k = a.data.shape
    nb = w.n
    n = nb // 2 if activation is not None else nb
    bn, bk = w.block_shape()
    part_rows = nb // w.parts
    part_blocks = w.scale_grid()[0] // w.parts
    aligned_up = activation is None or w.parts == 2 or n % bn == 0
    scalar_b = bn % c.block_n == 0 and aligned_up
    if requant:
        out = torch.empty(rows, n, dtype=E4M3, device=a.data.device)
        out_scale = torch.empty(rows, triton.cdiv(n, a.group), dtype=torch.float32,
                                device=a.data.device)
    else:
        out = bf16_out(out, rows, n, a.data.device)
        out_scale = out                        # never read
    gemm = Fp8Gemm(a.scale, a.scale.stride(0), a.scale.stride(1), rows, w.scale_inv, nb,
                   part_rows, part_blocks, out, out_scale, k, n)
    tile = Fp8Tile(*(constexpr(v) for v in (
        c.block_m, c.block_n, c.block_k, c.group_m, a.group, bn, bk, scalar_b, activation is not None)),
        act_tile(activation) if activation is not None else act_tile(),
        constexpr(requant), constexpr(imprecise_acc(c.promotion_k, c.block_k)))
    a_desc = TensorDescriptor.from_tensor(a.data, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(w.weight.view(w.experts * nb, k),
                                          [c.block_n, c.block_k])
    items = tiles.expert.shape[0] * triton.cdiv(n, c.block_n)
    grid = (max(1, min(items, c.programs or items)), )
    if items:
        fp8_group_gemm_kernel[grid](a_desc=a_desc, b_desc=b_desc, gemm=gemm, tiles=tiles,
                                    tile=tile, num_warps=c.num_warps,
                                    num_stages=c.num_stages)
    return Fp8Rows(out, out_scale, a.group) if requant else out


def bf16_out(out: torch.Tensor | None, rows: int, n: int, device) -> torch.Tensor:
    """A GroupGEMM's bf16 output ``[rows, n]``: ``out`` if it is one (ValueError if not),
    else a new one."""
    if out is None:
        return torch.empty(rows, n, dtype=torch.bfloat16, device=device)
    if out.shape != (rows, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{rows}, {n}], got "
                         f"{out.dtype} {list(out.shape)}")
    return out


def check_group_gemm(a: Fp8Rows, w: Fp8Weight, tiles: MTiles, activation, requant: bool,
                     c: Fp8GemmConfig) -> None:
    """Every condition a standalone FP8 GroupGEMM of tile ``c`` relies on (this module's
    and comet.kernels.fp8_ws's), as a ValueError before the launch."""
    if not isinstance(a, Fp8Rows) or not isinstance(w, Fp8Weight):
        raise ValueError("fp8_group_gemm takes Fp8Rows and an Fp8Weight (comet.quant)")
    rows, k = a.data.shape
    if w.k != k:
        raise ValueError(f"rows have K = {k}, the weight K = {w.k}")
    if k % 16:
        raise ValueError(f"K = {k} must be a multiple of 16 (TMA rows are 16-byte aligned)")
    ws = w.weight.stride()
    if a.data.stride(1) != 1 or a.data.stride(0) % 16:
        raise ValueError("FP8 rows need a unit column stride and 16-byte aligned rows")
    if ws[0] != w.n * ws[1] or ws[1] % 16:
        raise ValueError(f"the FP8 weight must be experts of whole rows, each row 16-byte "
                         f"aligned (a view narrowed along K is fine; along N, make it "
                         f"contiguous), got strides {ws}")
    if a.data.device != w.weight.device:
        raise ValueError(f"rows on {a.data.device}, weight on {w.weight.device}")
    bn, bk = w.block_shape()
    for name, block in (("weight K block", bk), ("row group", a.group)):
        if block % c.block_k and block < k:
            raise ValueError(f"block_k = {c.block_k} must divide the {name} ({block}): one "
                             f"scale per K step")
    if activation is not None and w.n % 2:
        raise ValueError(f"a gated weight is [gate | up]: N = {w.n} must be even")
    if activation is not None and w.parts not in (1, 2):
        raise ValueError(f"a gated weight has parts 1 or 2, got {w.parts}")
    if requant and c.block_n % a.group:
        raise ValueError(f"requant: block_n = {c.block_n} must be a multiple of the group "
                         f"({a.group}): a tile quantizes whole groups")
    for name, v in (("block_m", c.block_m), ("block_n", c.block_n), ("block_k", c.block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    check_m_tiles(tiles, c.block_m)


def check_m_tiles(tiles: MTiles, block_m: int) -> None:
    """The m-tile table a standalone GroupGEMM walks, as a ValueError before the launch."""
    if not all(isinstance(x, torch.Tensor) and x.dtype == torch.int32 for x in tiles):
        raise ValueError("the m-tile table is int32 tensors (m_tiles builds one)")
    if bool((tiles.row_end - tiles.row_start > block_m).any()):
        raise ValueError(f"an m-tile is longer than block_m = {block_m}")
