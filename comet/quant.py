"""FP8 experts: the formats, the quantizers and their checks (W8A8, e4m3).

What the FP8 checkpoints people download store (DeepSeek-V3/R1, Qwen3-*-FP8, transformers'
FineGrainedFP8 ``FP8Experts``), and what comet computes with:

* **weights** -- :class:`Fp8Weight`: e4m3 ``[E, N, K]``, the checkpoint's own layout (each
  output row's K values contiguous: a K-major B operand, what Hopper's FP8 MMA reads), with
  fp32 ``scale_inv [E, ceil(N / bn), ceil(K / bk)]``: ``w = fp8 * scale_inv`` over each
  ``bn x bk`` block (:class:`ScaleBlocks`; 128 x 128 in those checkpoints, whole rows or
  the whole matrix for per-channel and per-tensor scales). A dimension that is not a
  multiple of its block ends in a partial block. ``parts`` > 1 stacks equal row ranges
  that each have their own block grid: layer0's ``gate_up`` as ``[gate | up]`` quantized
  one projection at a time, which a width ``F`` that is not a multiple of ``bn`` needs
  (Qwen3-30B-A3B at TP=4: F = 192);
* **activations** -- :class:`Fp8Rows`: each token row quantized at run time in groups of
  :data:`GROUP` consecutive K values, one fp32 scale per (row, group);
* **UE8M0 scales** (power-of-two exponents, one byte each: DeepSeek-V4, MXFP8) are turned
  into fp32 exactly at load (:func:`ue8m0_to_fp32`).

The quantizer is the reference recipe: ``scale = max(amax, eps) * (1 / 448)`` per block
(or group), ``q = clamp(x / scale, -448, 448)`` cast to e4m3 (round to nearest even).
The scale is a multiply by fp32 ``1 / 448``, not a division, because that is what torch
computes for ``amax / 448`` on a GPU (a division by a scalar runs as a multiply by its
reciprocal) and a multiply rounds the same in torch, Triton and the interpreter. With bf16
inputs ``x / scale`` often lands exactly on an e4m3 tie, which a scale one ulp away
breaks the other way: with a division in the kernels, some of a layer's input FP8
values were one step from torch's (docs/precision.md, "The recipe"). Every check here
runs on the host before any kernel: a bad layout is a ValueError naming what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: The FP8 format of weights and activations, and its largest finite value.
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: The scale per amax of the recipe (an fp32 multiplier: see the module docstring).
SCALE_PER_AMAX = 1.0 / E4M3_MAX
#: Floor of a block's (or group's) amax: an all-zero block gets a tiny scale, not 0/0.
AMAX_EPS = 1e-10
#: Consecutive K values of an activation row sharing one scale; the weight block's side.
GROUP = 128
#: :attr:`Fp8.promotion_k`'s choices: one wgmma instruction's K, or one K step's.
PROMOTION_KS = (32, 128)

_UE8M0 = getattr(torch, "float8_e8m0fnu", None)
#: The exponent byte that means NaN in UE8M0.
_UE8M0_NAN = 255


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ScaleBlocks:
    """The region of a ``[N, K]`` weight that shares one scale: ``n`` rows by ``k``
    columns (None: the whole dimension). ``ScaleBlocks()`` is the checkpoints' 128 x 128;
    :meth:`per_channel` and :meth:`per_tensor` are the degenerate cases."""

    n: int | None = GROUP
    k: int | None = GROUP

    def __post_init__(self) -> None:
        for name in ("n", "k"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"ScaleBlocks.{name} must be a positive int or None, got {v!r}")

    @classmethod
    def per_channel(cls) -> "ScaleBlocks":
        return cls(n=1, k=None)

    @classmethod
    def per_tensor(cls) -> "ScaleBlocks":
        return cls(n=None, k=None)

    def resolve(self, n: int, k: int) -> tuple[int, int]:
        """``(bn, bk)`` for a ``[n, k]`` matrix (a whole dimension is one block)."""
        return (n if self.n is None else self.n), (k if self.k is None else self.k)


@dataclass(frozen=True)
class Fp8:
    """A layer's experts in W8A8 FP8 (:attr:`comet.config.MoEConfig.fp8`): e4m3 weights
    with fp32 ``scale_inv`` per ``blocks`` (:class:`Fp8Weight`), token rows quantized at run
    time per row in groups of :data:`GROUP` (:class:`Fp8Rows`), fp32 accumulation, output
    in the layer's dtype. ``Fp8()`` is the checkpoints' 128 x 128 recipe.

    ``promotion_k``: how many K values Hopper's FP8 tensor cores sum in their own
    accumulator (about 14 bits of mantissa) before the sum joins the fp32 accumulator:
    128, one K step (DeepSeek-V3's interval, DeepGEMM's, CUTLASS's without
    ``FP8FastAccum``), or 32, every wgmma instruction (closer to exact fp32 sums, slower
    where the tensor cores are the bottleneck). None (the default): 128 in the
    warp-specialized GEMMs, 32 in the ``tl`` kernels (:meth:`promotion`). The
    measurements behind the choice: docs/precision.md, "Accumulation". Neither is "fast
    accumulation" in cuBLAS's or CUTLASS's sense (never promoted): comet has none."""

    blocks: ScaleBlocks = ScaleBlocks()
    promotion_k: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, ScaleBlocks):
            raise ValueError(f"Fp8.blocks must be a ScaleBlocks, got {self.blocks!r}")
        if self.promotion_k is not None and (type(self.promotion_k) is not int
                                             or self.promotion_k not in PROMOTION_KS):
            raise ValueError(f"Fp8.promotion_k must be None or one of {PROMOTION_KS}, got "
                             f"{self.promotion_k!r}")

    def promotion(self, warp_specialized: bool) -> int:
        """K values per fp32 promotion in the warp-specialized GEMMs or the ``tl``
        kernels: :attr:`promotion_k`, or by default a K step's in the first and one
        instruction's in the second."""
        if self.promotion_k is not None:
            return self.promotion_k
        return PROMOTION_KS[1] if warp_specialized else PROMOTION_KS[0]


def _block_expand(scale: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    """``scale [..., ceil(n/bn), ceil(k/bk)]`` broadcast to one value per element
    ``[..., n, k]`` (partial last blocks cut)."""
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


@dataclass(frozen=True)
class Fp8Weight:
    """Block-scaled FP8 weights of a layer's experts: ``w[e] ~ weight[e] * scale_inv[e]``
    per block (module docstring).

    Args:
        weight: e4m3 ``[E, N, K]``, K contiguous (the checkpoint's layout; no transpose).
        scale_inv: fp32 ``[E, parts * ceil(N / parts / bn), ceil(K / bk)]``.
        blocks: the block shape (:class:`ScaleBlocks`).
        parts: equal row ranges with a block grid each (2: layer0's gate and up).
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor
    blocks: ScaleBlocks = ScaleBlocks()
    parts: int = 1

    def __post_init__(self) -> None:
        w, s = self.weight, self.scale_inv
        if not isinstance(w, torch.Tensor) or w.dtype != E4M3:
            raise ValueError(f"FP8 weight must be a {E4M3} tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)}")
        if w.dim() != 3:
            raise ValueError(f"FP8 weight must be [E, N, K], got shape {tuple(w.shape)}")
        if w.stride(-1) != 1:
            raise ValueError("FP8 weight must have K contiguous (stride 1): the checkpoint's "
                             "[E, N, K] layout, read as a K-major B")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise ValueError(f"scale_inv must be fp32 (convert UE8M0 with ue8m0_to_fp32), got "
                             f"{getattr(s, 'dtype', type(s).__name__)}")
        if not isinstance(self.parts, int) or self.parts < 1 or w.shape[1] % self.parts:
            raise ValueError(f"parts must be a positive int dividing N = {w.shape[1]}, "
                             f"got {self.parts!r}")
        if s.device != w.device:
            raise ValueError(f"scale_inv is on {s.device}, the weight on {w.device}")
        want = (w.shape[0], *self.scale_grid())
        if tuple(s.shape) != want:
            bn, bk = self.block_shape()
            raise ValueError(
                f"scale_inv must be {list(want)} for weight {list(w.shape)} with {bn}x{bk} "
                f"blocks and parts={self.parts}, got {list(s.shape)}")

    # ------------------------------------------------------------------ shape
    @property
    def experts(self) -> int:
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def n(self) -> int:
        return self.weight.shape[1]

    @property
    def k(self) -> int:
        return self.weight.shape[2]

    def block_shape(self) -> tuple[int, int]:
        """``(bn, bk)`` in elements (a whole part's rows or all of K when per-tensor)."""
        return self.blocks.resolve(self.n // self.parts, self.k)

    def scale_grid(self) -> tuple[int, int]:
        """Scale rows and columns per expert."""
        bn, bk = self.block_shape()
        return self.parts * _cdiv(self.n // self.parts, bn), _cdiv(self.k, bk)

    # ------------------------------------------------------------------ values
    def scales(self) -> torch.Tensor:
        """fp32 ``[E, N, K]``: each element's scale."""
        bn, bk = self.block_shape()
        rows = self.n // self.parts
        per_part = self.scale_inv.chunk(self.parts, dim=1)
        return torch.cat([_block_expand(p, bn, bk, rows, self.k) for p in per_part], dim=1)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[E, N, K]``: ``weight * scale_inv`` block by block."""
        return self.weight.float() * self.scales()

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """Rows (``dim=1``) or K columns (``dim=2``) ``[start, start + length)``, scales
        included, exactly: a range that starts inside a block is re-blocked to the largest
        block size that keeps every new block inside one old one (``gcd``), each new block
        repeating its old block's scale. A tensor-parallel shard of F = 192 columns out of
        768 (Qwen3-30B-A3B at TP=4) keeps its scales this way, in 64-wide blocks. The
        weight is a view; ``parts`` must be 1 (narrow each part before stacking)."""
        if self.parts != 1:
            raise ValueError("narrow a weight of one part (narrow gate and up, then stack)")
        if dim not in (1, 2):
            raise ValueError(f"narrow along N (dim=1) or K (dim=2), got dim={dim}")
        size = self.weight.shape[dim]
        if not (0 <= start and length >= 1 and start + length <= size):
            raise ValueError(f"range [{start}, {start + length}) outside [0, {size})")
        side = self.blocks.n if dim == 1 else self.blocks.k
        if side is None:         # one block along ``dim``: its scales stay as they are
            scale = self.scale_inv
            blocks = self.blocks
        else:
            new = math.gcd(side, start)
            scale = self.scale_inv.repeat_interleave(side // new, dim=dim)
            scale = scale.narrow(dim, start // new, _cdiv(length, new))
            blocks = ScaleBlocks(new, self.blocks.k) if dim == 1 else \
                ScaleBlocks(self.blocks.n, new)
        return Fp8Weight(self.weight.narrow(dim, start, length), scale.contiguous(), blocks)

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, scale_inv: torch.Tensor,
                        block_size: tuple[int, int] | None = (GROUP, GROUP),
                        parts: int = 1) -> "Fp8Weight":
        """A checkpoint's ``weight`` and ``weight_scale_inv`` (fp32, or UE8M0 as
        ``torch.float8_e8m0fnu`` / uint8 exponent bytes, converted exactly), with its
        ``quantization_config.weight_block_size`` (None: one scale per tensor). A 2-D
        weight is one expert."""
        if not isinstance(weight, torch.Tensor) or not isinstance(scale_inv, torch.Tensor):
            raise ValueError("from_checkpoint takes the weight and its scale_inv as tensors")
        if weight.dim() == 2:                        # one expert
            weight = weight.unsqueeze(0)
            scale_inv = scale_inv.reshape(1, *scale_inv.shape[-2:]) if scale_inv.dim() >= 2 \
                else scale_inv.reshape(1, 1, 1)
        if block_size is None and scale_inv.dim() < 3:   # one scale per tensor: [] or [E]
            scale_inv = scale_inv.reshape(-1, 1, 1).expand(weight.shape[0], 1, 1)
        if is_ue8m0(scale_inv):
            scale_inv = ue8m0_to_fp32(scale_inv)
        elif scale_inv.dtype in (torch.float16, torch.bfloat16):   # exact in fp32
            scale_inv = scale_inv.float()
        if block_size is None:
            blocks = ScaleBlocks.per_tensor()
        else:
            if len(block_size) != 2:
                raise ValueError(f"weight_block_size must be [bn, bk], got {block_size!r}")
            blocks = ScaleBlocks(int(block_size[0]), int(block_size[1]))
        return cls(weight, scale_inv.contiguous(), blocks, parts)


def is_ue8m0(t: torch.Tensor) -> bool:
    """Whether ``t`` holds UE8M0 scales: ``torch.float8_e8m0fnu`` or exponent bytes."""
    return t.dtype == torch.uint8 or (_UE8M0 is not None and t.dtype == _UE8M0)


def ue8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (``torch.float8_e8m0fnu``, or their exponent bytes as uint8) as fp32,
    exactly: byte ``e`` is ``2 ** (e - 127)``. The NaN byte (255) is a ValueError."""
    if not is_ue8m0(scale):
        raise ValueError(f"UE8M0 scales are float8_e8m0fnu or uint8 bytes, got {scale.dtype}")
    e = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if bool((e == _UE8M0_NAN).any()):
        raise ValueError("UE8M0 scales hold the NaN byte (255)")
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device),
                       e.to(torch.int32) - 127)


def device_only(fn):
    """A module's ``_apply`` function for FP8 weights and their scales: moved between
    devices, never cast. ``model.to(torch.bfloat16)`` or ``.half()`` casts every floating
    tensor, e4m3 included: the weights would turn bf16 and the fp32 scales round, which
    no cast back recovers."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out if out.dtype == t.dtype else t.to(out.device)
    return apply


def _saturating_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _recipe_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=AMAX_EPS) * SCALE_PER_AMAX


def quantize_weight(w: torch.Tensor, blocks: ScaleBlocks = ScaleBlocks(),
                    parts: int = 1) -> Fp8Weight:
    """``w [E, N, K]`` (any float dtype) in FP8 with the reference recipe, block by block,
    in the same layout (no transpose). ``parts``: equal row ranges quantized apart (their
    own block grids), e.g. 2 for ``gate_up [E, 2F, K]``."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dtype == E4M3:
        raise ValueError(f"quantize_weight takes a float tensor, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() != 3:
        raise ValueError(f"quantize_weight takes [E, N, K], got shape {tuple(w.shape)}")
    if not isinstance(parts, int) or parts < 1 or w.shape[1] % parts:
        raise ValueError(f"parts must be a positive int dividing N = {w.shape[1]}, got {parts!r}")
    e, n, k = w.shape
    rows = n // parts
    bn, bk = blocks.resolve(rows, k)
    qs, ss = [], []
    for p in w.float().chunk(parts, dim=1):
        gn, gk = _cdiv(rows, bn), _cdiv(k, bk)
        padded = torch.zeros(e, gn * bn, gk * bk, dtype=torch.float32, device=w.device)
        padded[:, :rows, :k] = p
        amax = padded.view(e, gn, bn, gk, bk).abs().amax(dim=(2, 4))
        scale = _recipe_scale(amax)
        qs.append(_saturating_cast(p, _block_expand(scale, bn, bk, rows, k)))
        ss.append(scale)
    return Fp8Weight(torch.cat(qs, dim=1).contiguous(), torch.cat(ss, dim=1).contiguous(),
                     blocks, parts)


@dataclass(frozen=True)
class Fp8Rows:
    """Token rows in FP8 with one fp32 scale per :data:`GROUP` consecutive values:
    ``x[r, c] ~ data[r, c] * scale[r, c // group]``.

    Args:
        data: e4m3 ``[rows, K]``.
        scale: fp32 ``[rows, ceil(K / group)]`` (any strides: the kernels take them).
        group: values per scale (:data:`GROUP`).
    """

    data: torch.Tensor
    scale: torch.Tensor
    group: int = GROUP

    def __post_init__(self) -> None:
        d, s = self.data, self.scale
        if not isinstance(d, torch.Tensor) or d.dtype != E4M3 or d.dim() != 2:
            raise ValueError(f"FP8 rows must be a 2-D {E4M3} tensor, got "
                             f"{getattr(d, 'dtype', type(d).__name__)} "
                             f"{tuple(getattr(d, 'shape', ()))}")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise ValueError(f"row scales must be fp32, got {getattr(s, 'dtype', type(s))}")
        want = (d.shape[0], _cdiv(d.shape[1], self.group))
        if tuple(s.shape) != want:
            raise ValueError(f"row scales must be {list(want)} for rows {list(d.shape)} in "
                             f"groups of {self.group}, got {list(s.shape)}")

    def dequantize(self) -> torch.Tensor:
        k = self.data.shape[1]
        return self.data.float() * self.scale.repeat_interleave(self.group, dim=1)[:, :k]


def quantize_rows(x: torch.Tensor, group: int = GROUP) -> Fp8Rows:
    """``x [rows, K]`` in FP8, each row in groups of ``group`` values (the reference
    recipe; the torch spec of :mod:`comet.kernels.fp8_gemm`'s quantizers)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == E4M3:
        raise ValueError(f"quantize_rows takes a float tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [rows, K], got shape {tuple(x.shape)}")
    rows, k = x.shape
    g = _cdiv(k, group)
    padded = torch.zeros(rows, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = _recipe_scale(padded.view(rows, g, group).abs().amax(dim=2))
    data = _saturating_cast(x.float(), scale.repeat_interleave(group, dim=1)[:, :k])
    return Fp8Rows(data, scale, group)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2<x, y> / (|x|^2 + |y|^2)`` in float64: 0 for equal tensors, ~ half the
    squared relative L2 distance for close ones (DeepGEMM's accuracy measure of an FP8
    GEMM; the FP8 recipe itself costs a whole layer ~2e-3 on Gaussian data)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def _as_weight(name: str, w, scale_inv, blocks: ScaleBlocks, parts: tuple[int, ...]
               ) -> Fp8Weight:
    """``w`` as an :class:`Fp8Weight`: as given, or an e4m3 tensor with its ``scale_inv``
    in ``blocks`` (``parts``: the stackings to try, the first whose scale grid fits)."""
    if isinstance(w, Fp8Weight):
        if scale_inv is not None:
            raise ValueError(f"{name} is an Fp8Weight (it holds its scales): pass no "
                             f"{name}_scale_inv")
        return w
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"FP8 {name} must be a comet.quant.Fp8Weight or an {E4M3} tensor, "
                        f"got {type(w).__name__}")
    if w.dtype != E4M3:
        raise TypeError(f"FP8 {name} must be {E4M3}, got {w.dtype} (quantize it with "
                        "comet.quant.quantize_weight)")
    if not isinstance(scale_inv, torch.Tensor):
        raise ValueError(f"an {E4M3} {name} needs its {name}_scale_inv tensor")
    if is_ue8m0(scale_inv):       # DeepSeek-V4 / MXFP8 exponent bytes: exact in fp32
        scale_inv = ue8m0_to_fp32(scale_inv)
    for p in parts[:-1]:
        try:
            return Fp8Weight(w, scale_inv, blocks, p)
        except ValueError:
            continue
    return Fp8Weight(w, scale_inv, blocks, parts[-1])


def fp8_experts(w13, w2, experts: int, hidden: int, ffn: int, blocks: ScaleBlocks,
                w13_scale_inv: torch.Tensor | None = None,
                w2_scale_inv: torch.Tensor | None = None) -> tuple[Fp8Weight, Fp8Weight]:
    """One rank's FP8 experts, checked: ``(gate_up, down)`` with ``gate_up`` e4m3
    ``[experts, 2 * ffn, hidden]`` (all gate rows, then all up rows: the checkpoints'
    ``gate_up_proj``) and ``down`` ``[experts, hidden, ffn]``, each an
    :class:`Fp8Weight` or an e4m3 tensor with its fp32 ``*_scale_inv`` in ``blocks``
    (a ``gate_up`` scale grid per projection, ``parts=2``, or one over both). TypeError
    for a weight that is not FP8, ValueError for a shape, scale grid or device that does
    not fit -- before any kernel runs."""
    gate_up = _as_weight("w13", w13, w13_scale_inv, blocks, (2, 1))
    down = _as_weight("w2", w2, w2_scale_inv, blocks, (1,))
    for name, w, want in (("w13", gate_up, (experts, 2 * ffn, hidden)),
                          ("w2", down, (experts, hidden, ffn))):
        if tuple(w.weight.shape) != want:
            raise ValueError(f"FP8 {name} must be {list(want)} (K contiguous, the "
                             f"checkpoint's layout), got {list(w.weight.shape)}")
    if gate_up.parts not in (1, 2) or down.parts != 1:
        raise ValueError(f"FP8 w13 has parts 1 or 2 (gate, up) and w2 parts 1; got "
                         f"{gate_up.parts} and {down.parts}")
    if gate_up.weight.device != down.weight.device:
        raise ValueError(f"FP8 w13 is on {gate_up.weight.device}, w2 on "
                         f"{down.weight.device}")
    return gate_up, down
