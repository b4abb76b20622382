"""The FP8 roles around the GEMMs of the fused layer (issue 68): quantize on dispatch, and
layer0's epilogue requantization for layer1.

Both quantize in groups of :data:`comet.quant.GROUP` consecutive columns with the reference
recipe (:func:`comet.kernels.fp8_gemm.quantize_groups`, the kernel form of
:func:`comet.quant.quantize_rows`: ``scale = max(amax, eps) * (1 / 448)``, ``q =
clamp(x / scale, -448, 448)`` cast to e4m3, an IEEE division). Each role is a small ``@triton.jit``
function the persistent kernels call; the launchers here run it standalone, for tests:

* :func:`quantize_row_block` -- **quantize on dispatch**: a block of token rows ``x [T,
  H]`` (bf16 / fp16 / fp32), ``BLOCK_H`` columns at a time, into e4m3 rows and fp32 scales
  ``[T, H / GROUP]``. The dispatch runs it once per row on the row's home rank, before the
  row crosses: an FP8 row and its scales are ~0.52x the bf16 bytes at H = 7168. H must be a
  multiple of GROUP (every hidden size comet runs is), so a column block holds whole groups
  and the scales are a dense grid (:func:`quantize_dispatch`);
* :func:`requant_gated` -- **layer0's epilogue for an FP8 layer1**: the fp32 gate and up
  accumulator tiles of ``BLOCK_N`` output columns through the gated activation
  (:func:`comet.kernels.activation.gated`, every :class:`comet.activation.GatedActivation`
  variant), columns past F zeroed, then quantized in groups: layer1's
  :class:`comet.quant.Fp8Rows`. :func:`split_one_dot` first cuts layer0's one-dot box
  ``[gate | up]`` of W13's interleaved layout (:mod:`comet.weights`, blocks of
  :data:`comet.weights.GATE_UP_BLOCK`) into the two tiles, the half-tail box of an F
  that ends in half a block included.

* :func:`quantize_home_kernel` -- **the fused layer's quantize on the home rank**: the
  call's input rows, read at their staged address, into *packed rows*
  (:class:`PackedRows`, :func:`packed_row_bytes`): a row's e4m3 values, then its fp32
  scales, rounded up to 16 bytes -- one row that the dispatch role copies as bytes into
  its destinations' shared tensor, and layer0's GEMM reads through two strided views
  (:func:`packed_views`).

**Widths that are not a multiple of GROUP** (a TP shard of F = 192 = 64 x 3, Qwen3-30B-A3B
at TP=4): the last group is ragged -- 64 columns wide at F = 192 -- and its scale is the
amax of those 64 values only. That is :func:`comet.quant.quantize_rows`' ``ceil(F /
GROUP)`` scale grid (zero padding does not change an amax), what :class:`comet.quant.Fp8Rows`
and layer1's K loop read (TMA gives zeros past K): no padded columns are stored, and
nothing pads the intermediate in memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.activation import SILU, GatedActivation
from comet.constants import constexpr
from comet.kernels.activation import Act, act_tile, gated
from comet.kernels.address import pointer_at
from comet.kernels.fp8_gemm import quantize_groups
from comet.kernels.group_gemm import gate_up_columns
from comet.quant import E4M3, GROUP, Fp8Rows
from comet.weights import GATE_UP_BLOCK


class Fp8Out(NamedTuple):
    """Where a role stores FP8 rows: ``q [rows, N]`` e4m3 (contiguous) and ``scale [rows,
    ceil(N / GROUP)]`` fp32 (contiguous)."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    N: int


class QuantTile(NamedTuple):
    """Constexpr shape of :func:`quantize_row_block`."""

    BLOCK_R: tl.constexpr    # rows per block
    BLOCK_H: tl.constexpr    # columns per block: a multiple of GROUP
    GROUP: tl.constexpr      # columns per scale


class RequantTile(NamedTuple):
    """Constexpr shape and choices of :func:`requant_gated`'s standalone kernel."""

    BLOCK_R: tl.constexpr    # rows per tile
    BLOCK_N: tl.constexpr    # output columns per tile (gate and up: as many each)
    GROUP: tl.constexpr      # columns per scale; divides BLOCK_N
    GATE_UP: tl.constexpr    # W13's interleave block
    ONE_DOT: tl.constexpr    # read the tile as layer0's one-dot box [gate | up]
    HALF_TAIL: tl.constexpr  # ONE_DOT, and F ends in half an interleave block
    ACT: Act


# ------------------------------------------------------------------------------- roles
@triton.jit
def store_fp8_rows(q, scale, out, rows, c0, COLS: tl.constexpr, GROUP: tl.constexpr):
    """``q [len(rows), COLS]`` and its scales ``[len(rows), COLS // GROUP]`` into ``out``
    (:class:`Fp8Out`) at ``rows``, columns from ``c0`` (a multiple of GROUP; rows past
    ``out.rows`` and columns past ``out.N`` dropped, a group with no live column too)."""
    cols = c0 + tl.arange(0, COLS)
    live = rows[:, None] < out.rows
    n_groups = tl.cdiv(out.N, GROUP)
    tl.store(out.q + rows[:, None].to(tl.int64) * out.N + cols[None, :], q,
             mask=live & (cols[None, :] < out.N))
    groups = c0 // GROUP + tl.arange(0, COLS // GROUP)
    tl.store(out.scale + rows[:, None].to(tl.int64) * n_groups + groups[None, :], scale,
             mask=live & (groups[None, :] < n_groups))


@triton.jit
def quantize_row_block(x_ptr, out, r0, c0, t):
    """Quantize on dispatch: rows ``[r0, r0 + BLOCK_R)``, columns ``[c0, c0 + BLOCK_H)`` of
    the contiguous ``x [out.rows, out.N]`` into ``out`` (``c0`` a multiple of GROUP)."""
    rows = r0 + tl.arange(0, t.BLOCK_R)
    cols = c0 + tl.arange(0, t.BLOCK_H)
    ok = (rows < out.rows)[:, None] & (cols < out.N)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * out.N + cols[None, :], mask=ok, other=0.0)
    q, scale = quantize_groups(x.to(tl.float32), t.BLOCK_R, t.BLOCK_H, t.GROUP)
    store_fp8_rows(q, scale, out, rows, c0, t.BLOCK_H, t.GROUP)


@triton.jit
def split_one_dot(both, tail, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  HALF_TAIL: tl.constexpr):
    """``(gate, up)`` ``[ROWS, BLOCK_N]`` of layer0's one-dot box ``both [ROWS, 2 *
    BLOCK_N]`` (W13's interleaved columns of one block: ``[gate | up]``). With
    ``HALF_TAIL`` the last item's box (``tail``) is ``[gate/2 | up/2 | zeros]``: its up
    columns are where a whole block's second gate half is (as
    :func:`comet.kernels.group_gemm.half_tail_epilogue`); the second half of its output
    is past F, for the caller to drop."""
    if HALF_TAIL:
        lo, hi = both.reshape(ROWS, 2, 2, BLOCK_N // 2).permute(0, 3, 1, 2).split()
        gate_lo, up_lo = lo.split()
        gate_hi, up_hi = hi.split()
        up_lo = tl.where(tail, gate_hi, up_lo)
        gate = tl.join(gate_lo, gate_hi).permute(0, 2, 1).reshape(ROWS, BLOCK_N)
        up = tl.join(up_lo, up_hi).permute(0, 2, 1).reshape(ROWS, BLOCK_N)
    else:
        gate, up = both.reshape(ROWS, 2, BLOCK_N).permute(0, 2, 1).split()
    return gate, up


@triton.jit
def requant_gated(gate, up, act, cols, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP: tl.constexpr):
    """Layer0's FP8 epilogue: ``h = act(gate) * up`` of the fp32 tiles ``[ROWS, BLOCK_N]``
    (output columns ``cols``; from ``N`` on zeroed before a group's amax), quantized in
    groups of ``GROUP`` columns: ``(q e4m3 [ROWS, BLOCK_N], scale fp32 [ROWS, BLOCK_N //
    GROUP])`` -- layer1's rows. A tile holds whole groups (``BLOCK_N % GROUP == 0``); a
    last group cut by ``N`` is scaled by its live columns alone."""
    tl.static_assert(BLOCK_N % GROUP == 0, "a requantizing tile holds whole groups")
    h = tl.where(cols[None, :] < N, gated(gate, up, act), 0.0)
    return quantize_groups(h, ROWS, BLOCK_N, GROUP)


@triton.jit
def requant_tile(acc_ptr, out, r0, n0, t):
    """One tile of the standalone epilogue: rows ``[r0, r0 + BLOCK_R)``, output columns
    ``[n0, n0 + BLOCK_N)`` of the fp32 accumulator ``acc [out.rows, 2F]`` in W13's
    interleaved column layout, gated and requantized into ``out`` (``N`` = F)."""
    F = out.N
    rows = r0 + tl.arange(0, t.BLOCK_R)
    cols = n0 + tl.arange(0, t.BLOCK_N)
    live = (rows < out.rows)[:, None]
    base = acc_ptr + rows.to(tl.int64)[:, None] * (2 * F)
    if t.ONE_DOT:
        # The box a one-dot item's dot leaves: 2 * BLOCK_N columns from 2 * n0, zeros past
        # W13's last column (as TMA reads them).
        box = 2 * n0 + tl.arange(0, 2 * t.BLOCK_N)
        both = tl.load(base + box[None, :], mask=live & (box[None, :] < 2 * F), other=0.0)
        gate, up = split_one_dot(both, n0 + t.BLOCK_N > F, t.BLOCK_R, t.BLOCK_N, t.HALF_TAIL)
    else:
        gate_col, up_col = gate_up_columns(n0, F, t.GATE_UP)
        c = tl.arange(0, t.BLOCK_N)[None, :]
        ok = live & (cols[None, :] < F)
        gate = tl.load(base + gate_col + c, mask=ok, other=0.0)
        up = tl.load(base + up_col + c, mask=ok, other=0.0)
    q, scale = requant_gated(gate, up, t.ACT, cols, F, t.BLOCK_R, t.BLOCK_N, t.GROUP)
    store_fp8_rows(q, scale, out, rows, n0, t.BLOCK_N, t.GROUP)


@triton.jit
def quantize_dispatch_kernel(x_ptr, out, t):
    """Program ``(i, j)``: row block ``i``, column block ``j``."""
    quantize_row_block(x_ptr, out, tl.program_id(0) * t.BLOCK_R, tl.program_id(1) * t.BLOCK_H,
                       t)


@triton.jit
def requant_gated_kernel(acc_ptr, out, t):
    """Program ``(i, j)``: row block ``i``, output column block ``j``."""
    requant_tile(acc_ptr, out, tl.program_id(0) * t.BLOCK_R, tl.program_id(1) * t.BLOCK_N, t)


# ------------------------------------------------------------------------------- host
#: Rows per program of the standalone launchers.
BLOCK_ROWS = 16
#: Groups per column block of :func:`quantize_dispatch` (fewer when H has fewer).
DISPATCH_GROUPS = 4
#: Most programs of :func:`quantize_home_kernel`'s fixed grid (a few per SM): more row
#: blocks than fit are looped over.
HOME_QUANT_PROGRAMS = 512
#: Input dtypes of the dispatch quantizer: what a layer's token rows are.
DISPATCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _out_rows(out: Fp8Rows | None, rows: int, n: int, device) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """``(q, scale)`` to write: new ones, or ``out``'s (a staging buffer's FP8 rows) once
    their layout is the one the roles store -- e4m3 ``[rows, n]`` and fp32 ``[rows,
    ceil(n / GROUP)]``, both row-major contiguous (a column-major scale grid, as DeepGEMM's
    TMA-aligned one, is refused), on ``device``, in groups of :data:`GROUP`."""
    if out is None:
        return (torch.empty(rows, n, dtype=E4M3, device=device),
                torch.empty(rows, triton.cdiv(n, GROUP), dtype=torch.float32, device=device))
    if not isinstance(out, Fp8Rows):
        raise ValueError(f"out must be comet.quant.Fp8Rows, got {type(out).__name__}")
    if out.group != GROUP:
        raise ValueError(f"out's scales must be per {GROUP} columns, got groups of {out.group}")
    if tuple(out.data.shape) != (rows, n):
        raise ValueError(f"out's rows must be [{rows}, {n}], got {list(out.data.shape)}")
    for name, t in (("rows", out.data), ("scales", out.scale)):
        if not t.is_contiguous():
            raise ValueError(f"out's {name} must be row-major contiguous, got shape "
                             f"{list(t.shape)} strides {t.stride()}")
        if t.device != torch.device(device):
            raise ValueError(f"out's {name} are on {t.device}, the input on {device}")
    return out.data, out.scale


def quantize_dispatch(x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
    """Quantize on dispatch, standalone: token rows ``x [T, H]`` (bf16, fp16 or fp32,
    contiguous, ``H`` a multiple of :data:`comet.quant.GROUP`) as :class:`Fp8Rows` (e4m3
    ``[T, H]``, fp32 ``[T, H / GROUP]``), bit for bit :func:`comet.quant.quantize_rows`;
    ``out``: FP8 rows to write (a staging buffer). Every check is a ValueError before the
    launch."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DISPATCH_DTYPES:
        raise ValueError(f"quantize_dispatch takes token rows in {list(DISPATCH_DTYPES)}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"quantize_dispatch takes rows [T, H], got shape {tuple(x.shape)}")
    rows, h = x.shape
    if h == 0 or h % GROUP:
        raise ValueError(f"H = {h} must be a positive multiple of {GROUP}: each row is "
                         f"quantized in whole groups of {GROUP} with a dense scale grid "
                         f"[T, H / {GROUP}]")
    if not x.is_contiguous():
        raise ValueError("quantize_dispatch needs contiguous rows (a dispatch sends whole "
                         f"rows); got strides {x.stride()}")
    q, s = _out_rows(out, rows, h, x.device)
    groups = min(DISPATCH_GROUPS, 1 << (h // GROUP).bit_length() - 1)
    t = QuantTile(*(constexpr(v) for v in (BLOCK_ROWS, groups * GROUP, GROUP)))
    if rows:
        quantize_dispatch_kernel[(triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(h, groups * GROUP))](
            x_ptr=x, out=Fp8Out(q, s, rows, h), t=t, num_warps=4)
    return Fp8Rows(q, s, GROUP)


def requant_gated_rows(acc: torch.Tensor, activation: GatedActivation = SILU, *,
                       one_dot: bool | None = None, block_n: int = GATE_UP_BLOCK,
                       out: Fp8Rows | None = None) -> Fp8Rows:
    """Layer0's FP8 epilogue, standalone: the fp32 accumulator ``acc [T, 2F]`` of gate and
    up in W13's interleaved column layout (:func:`comet.weights.interleave_gate_up`) ->
    ``act(gate) * up`` as layer1's :class:`Fp8Rows` (e4m3 ``[T, F]``, fp32 ``[T, ceil(F /
    GROUP)]``; a ragged last group when GROUP does not divide F). ``one_dot``: read each
    tile as layer0's one-dot box (None: when layer0 would, :func:`one_dot_tiles`'s rule --
    ``block_n`` a whole interleave block and F a multiple of half of one). ``out``: FP8
    rows to write. Every check is a ValueError before the launch."""
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32:
        raise ValueError(f"the accumulator must be fp32, got "
                         f"{getattr(acc, 'dtype', type(acc).__name__)}")
    if acc.dim() != 2 or acc.shape[1] % 2 or acc.shape[1] == 0:
        raise ValueError(f"the accumulator is [T, 2F] (gate and up), got {tuple(acc.shape)}")
    if not acc.is_contiguous():
        raise ValueError(f"the accumulator must be contiguous, got strides {acc.stride()}")
    if not isinstance(activation, GatedActivation):
        raise ValueError(f"activation must be a GatedActivation, got {activation!r}")
    if block_n % GROUP or block_n & (block_n - 1) or GATE_UP_BLOCK % block_n:
        raise ValueError(f"block_n = {block_n} must be a power-of-two multiple of the group "
                         f"({GROUP}) dividing the interleave block ({GATE_UP_BLOCK})")
    rows, f = acc.shape[0], acc.shape[1] // 2
    can_one_dot = block_n == GATE_UP_BLOCK and f % (GATE_UP_BLOCK // 2) == 0
    if one_dot is None:
        one_dot = can_one_dot
    elif one_dot and not can_one_dot:
        raise ValueError(f"one-dot tiles need block_n = {GATE_UP_BLOCK} and F a multiple of "
                         f"{GATE_UP_BLOCK // 2}; got block_n {block_n}, F {f}")
    q, s = _out_rows(out, rows, f, acc.device)
    t = RequantTile(*(constexpr(v) for v in (
        BLOCK_ROWS, block_n, GROUP, GATE_UP_BLOCK, one_dot,
        one_dot and f % GATE_UP_BLOCK == GATE_UP_BLOCK // 2)), act_tile(activation))
    if rows:
        requant_gated_kernel[(triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(f, block_n))](
            acc_ptr=acc, out=Fp8Out(q, s, rows, f), t=t, num_warps=4)
    return Fp8Rows(q, s, GROUP)


# ------------------------------------------------------------------ rows as they cross
#: Bytes a packed row is rounded up to: TMA row strides and the dispatch's 16-byte copies.
PACK_ALIGN = 16


def packed_row_bytes(h: int) -> int:
    """Bytes of a token row of ``h`` values (a multiple of :data:`GROUP`) as the fused FP8
    layer sends it: ``h`` e4m3 values, then its ``h / GROUP`` fp32 scales, rounded up to
    :data:`PACK_ALIGN` -- 7392 bytes at H = 7168, 0.52x the bf16 row's 14336."""
    return -(-(h + 4 * (h // GROUP)) // PACK_ALIGN) * PACK_ALIGN


def packed_views(rows: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of packed rows ``rows`` (uint8 ``[R, packed_row_bytes(h)]``),
    as views: e4m3 ``[R, h]`` and fp32 ``[R, h / GROUP]``, both strided by the row."""
    return (rows.view(E4M3)[:, :h],
            rows.view(torch.float32)[:, h // 4:h // 4 + h // GROUP])


def pack_rows(a: Fp8Rows) -> torch.Tensor:
    """``a`` (groups of :data:`GROUP`) as packed rows: uint8 ``[rows, packed_row_bytes(H)]``
    as :func:`quantize_home_kernel` stores them (the inverse of :func:`packed_views`)."""
    rows, h = a.data.shape
    if a.group != GROUP or h % GROUP:
        raise ValueError(f"packed rows hold whole groups of {GROUP}: got H = {h} in groups "
                         f"of {a.group}")
    out = torch.zeros(rows, packed_row_bytes(h), dtype=torch.uint8, device=a.data.device)
    values, scales = packed_views(out, h)
    values.copy_(a.data)
    scales.copy_(a.scale)
    return out


class PackedRows(NamedTuple):
    """Where :func:`quantize_home_kernel` stores: row ``r``'s e4m3 values at bytes ``[r *
    row_bytes, + N)`` of ``q``, its fp32 scales right after them (``scale`` is the same
    memory viewed as fp32)."""

    q: torch.Tensor          # e4m3 [R, row_bytes]
    scale: torch.Tensor      # fp32 [R, row_bytes / 4]
    N: int                   # values per row (H)
    row_bytes: int


@triton.jit
def store_packed_rows(q, scale, out, rows, live, c0, COLS: tl.constexpr, GROUP: tl.constexpr):
    """``q [len(rows), COLS]`` (columns from ``c0``, a multiple of GROUP) and its scales
    into the packed rows ``out`` (:class:`PackedRows`), rows where ``live``."""
    cols = c0 + tl.arange(0, COLS)
    r = rows.to(tl.int64)[:, None]
    tl.store(out.q + r * out.row_bytes + cols[None, :], q,
             mask=live[:, None] & (cols[None, :] < out.N))
    groups = c0 // GROUP + tl.arange(0, COLS // GROUP)
    tl.store(out.scale + r * (out.row_bytes // 4) + out.N // 4 + groups[None, :], scale,
             mask=live[:, None] & (groups[None, :] < out.N // GROUP))


@triton.jit
def _quantize_home_rows(x_addr, like, num_tokens, out, t, row_program, row_programs,
                        col_block):
    """Row blocks ``row_program, row_program + row_programs, ...`` (``BLOCK_R`` rows each)
    of the call's input (at the address ``x_addr[0]``, ``num_tokens[0]`` rows of ``out.N``;
    ``like``: a tensor of its dtype), columns ``[col_block * BLOCK_H, + BLOCK_H)``,
    quantized into ``out``."""
    m = tl.load(num_tokens)
    x = pointer_at(x_addr, 0, like)
    cols = col_block * t.BLOCK_H + tl.arange(0, t.BLOCK_H)
    for r0 in range(row_program * t.BLOCK_R, m, row_programs * t.BLOCK_R):
        rows = r0 + tl.arange(0, t.BLOCK_R)
        live = rows < m
        v = tl.load(x + rows.to(tl.int64)[:, None] * out.N + cols[None, :],
                    mask=live[:, None] & (cols[None, :] < out.N), other=0.0)
        q, scale = quantize_groups(v.to(tl.float32), t.BLOCK_R, t.BLOCK_H, t.GROUP)
        store_packed_rows(q, scale, out, rows, live, col_block * t.BLOCK_H, t.BLOCK_H,
                          t.GROUP)


@triton.jit
def quantize_home_kernel(x_addr, like, num_tokens, out, t):
    """Quantize on the home rank, before any row crosses: program ``(i, j)`` quantizes
    the row blocks ``i, i + P, ...`` (``P`` programs along rows) of the call's input,
    column block ``j``, into ``out``. The grid is fixed, so one launch serves every call
    (a graph replays it), and bounded: a 1-token call of a layer sized for thousands of
    tokens schedules a few hundred programs, not one per row block of its capacity."""
    _quantize_home_rows(x_addr, like, num_tokens, out, t, tl.program_id(0),
                        tl.num_programs(0), tl.program_id(1))


class HomeQuant(NamedTuple):
    """:func:`quantize_home_kernel`'s launch as one argument group, for a kernel that runs
    it on programs beside its own (a small call's opening, comet.kernels.plan.open_kernel:
    one launch fewer): ``ROWS x COLS`` programs, the row programs striding over the rows."""

    x_addr: torch.Tensor
    like: torch.Tensor
    num_tokens: torch.Tensor
    out: PackedRows
    t: QuantTile
    ROWS: tl.constexpr
    COLS: tl.constexpr


@triton.jit
def quantize_home_part(q, p):
    """Program ``p`` (``0 <= p < ROWS * COLS``) of the home quantization ``q``
    (:class:`HomeQuant`)."""
    _quantize_home_rows(q.x_addr, q.like, q.num_tokens, q.out, q.t, p // q.COLS, q.ROWS,
                        p % q.COLS)


def home_quantizer(rows: torch.Tensor, h: int, programs: int = HOME_QUANT_PROGRAMS
                   ) -> tuple[PackedRows, QuantTile, tuple[int, int]]:
    """The arguments of :func:`quantize_home_kernel` into packed rows ``rows`` (uint8
    ``[max_tokens, packed_row_bytes(h)]``): ``(out, tile, grid)``, the grid of at most
    ``programs`` programs (at least one per column block)."""
    groups = min(DISPATCH_GROUPS, 1 << (h // GROUP).bit_length() - 1)
    t = QuantTile(*(constexpr(v) for v in (BLOCK_ROWS, groups * GROUP, GROUP)))
    out = PackedRows(rows.view(E4M3), rows.view(torch.float32), h, rows.shape[1])
    col_blocks = triton.cdiv(h, groups * GROUP)
    row_programs = min(triton.cdiv(rows.shape[0], BLOCK_ROWS), max(1, programs // col_blocks))
    return out, t, (row_programs, col_blocks)


def home_quant(x_addr: torch.Tensor, like: torch.Tensor, num_tokens: torch.Tensor,
               out: PackedRows, t: QuantTile, tokens: int) -> HomeQuant:
    """:class:`HomeQuant` of calls of at most ``tokens`` tokens (more still run, on row
    programs that stride further): a row program per ``BLOCK_R`` of them."""
    rows = max(1, triton.cdiv(tokens, int(t.BLOCK_R)))
    return HomeQuant(x_addr, like, num_tokens, out, t, constexpr(rows),
                     constexpr(triton.cdiv(out.N, int(t.BLOCK_H))))


def launch_quantize_home(x_addr: torch.Tensor, like: torch.Tensor, num_tokens: torch.Tensor,
                         out: PackedRows, t: QuantTile, grid: tuple[int, int]) -> None:
    """:func:`quantize_home_kernel` on :func:`home_quantizer`'s arguments."""
    quantize_home_kernel[grid](x_addr=x_addr, like=like, num_tokens=num_tokens, out=out, t=t,
                               num_warps=4)
