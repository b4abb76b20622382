"""FP8 experts of a transformers model: recognising them, and what comet refuses.

transformers' FineGrainedFP8 quantization (``quantization_config`` of DeepSeek-V3/R1,
Qwen3-*-FP8, GLM-4.5-FP8; ``replace_with_fp8_linear``) swaps a model's fused experts for
``FP8Experts``: ``gate_up_proj`` e4m3 ``[E, 2F, H]`` (gate rows, then up rows),
``down_proj`` e4m3 ``[E, H, F]``, each with ``*_scale_inv`` per ``weight_block_size``
block (fp32, or UE8M0 ``float8_e8m0fnu`` with ``scale_fmt="ue8m0"``), activations
quantized at run time (``activation_scheme="dynamic"``: per token in groups of the block's
K side). That is comet's FP8 layout (:class:`comet.quant.Fp8Weight`, the fused FP8 layer)
as it is, so a converted block runs on those very tensors: no dequantization, no
transpose; UE8M0 scales are turned into fp32 (one small copy) where the layer is built.

Refused, each by name (:func:`fp8_refusals`), before anything is converted: static
(per-tensor) activation scales, a ``weight_block_size`` other than 128 x 128 (comet
quantizes activations in 1x128 groups; per-tensor weight scales included), FP4-packed
experts (:func:`packed_refusal`), other FP8 formats, expert biases, alternating gate/up rows and transposed
weights (those would need a copy in another layout), and scale grids that do not fit
the weights. Per-expert ``FP8Linear`` experts (a ``ModuleList``) are refused as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from comet.quant import E4M3, GROUP, ScaleBlocks, is_ue8m0, fp8_experts

#: The scale tensors of fused FP8 experts, next to ``gate_up_proj`` / ``down_proj``.
FP8_SCALE_KEYS = ("gate_up_proj_scale_inv", "down_proj_scale_inv")
#: What a static activation scheme adds: one per-tensor activation scale per expert.
_STATIC_KEYS = ("gate_up_proj_activation_scale", "down_proj_activation_scale")
#: The state :func:`fp8_refusals` speaks for (whatever else it finds is extra state).
FP8_STATE = FP8_SCALE_KEYS + _STATIC_KEYS
#: The weight block comet's FP8 layer runs: its activations go in 1 x GROUP groups.
_BLOCK = (GROUP, GROUP)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a fused FP8 experts module stores its experts.

    Attributes:
        blocks: the weight block (128 x 128: :data:`_BLOCK`).
        scale_dtype: the dtype of its ``*_scale_inv`` (fp32 or UE8M0), which its state
            dict keeps.
    """

    blocks: ScaleBlocks
    scale_dtype: torch.dtype


def _is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def is_fp8_experts(experts: nn.Module) -> bool:
    """``experts`` holds quantized fused weights: a 1-byte ``gate_up_proj`` (or
    ``up_proj``) or any ``*_scale_inv`` of :data:`FP8_SCALE_KEYS`."""
    weight = getattr(experts, "gate_up_proj", getattr(experts, "up_proj", None))
    if isinstance(weight, torch.Tensor) and weight.dtype.itemsize == 1:
        return True
    return any(isinstance(getattr(experts, k, None), torch.Tensor) for k in FP8_SCALE_KEYS)


def has_fp8_linear(experts: nn.ModuleList) -> bool:
    """A per-expert ``ModuleList`` whose first expert holds an FP8 linear (a 1-byte
    weight or a ``weight_scale_inv``: transformers' ``FP8Linear``)."""
    return any(_is_fp8_dtype(m.weight.dtype) or hasattr(m, "weight_scale_inv")
               for m in experts[0].modules() if isinstance(m, nn.Linear))


def packed_refusal(experts: nn.Module) -> str | None:
    """The refusal of FP4-packed experts (int8 weights, K halved: their shapes are not
    an MLP's), or None."""
    weights = [getattr(experts, k, None) for k in ("gate_up_proj", "up_proj", "down_proj")]
    if getattr(experts, "expert_dtype", None) == "fp4" or any(
            isinstance(w, torch.Tensor) and w.dtype == torch.int8 for w in weights):
        return ("FP4-packed experts (int8 weights, expert_dtype='fp4') are not supported: "
                "comet runs e4m3 experts")
    return None


def fp8_refusals(experts: nn.Module, sizes: tuple[int, int, int], transposed: bool,
                 biases: frozenset[str]) -> tuple[Fp8Checkpoint | None, list[str]]:
    """``(format, reasons)`` of fused FP8 experts of ``sizes`` ``(E, H, F)``: what
    comet runs them as, and every variant it refuses (empty: none; then the format is
    set). Reads only the module's flags, dtypes and shapes."""
    reasons = []
    gate_up, down = experts.gate_up_proj, experts.down_proj
    dtypes = {gate_up.dtype, down.dtype}
    if dtypes != {E4M3}:
        reasons.append(f"FP8 experts in {', '.join(sorted(map(str, dtypes)))} are not "
                       f"supported: comet runs {E4M3}")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic" or any(hasattr(experts, k) for k in _STATIC_KEYS):
        reasons.append(f"activation_scheme={scheme!r} (per-tensor activation scales "
                       f"{' / '.join(_STATIC_KEYS)}) is not supported: comet quantizes "
                       "activations dynamically, per token in groups of 128")
    block = getattr(experts, "block_size", _BLOCK)
    if block is None or tuple(block) != _BLOCK:
        what = "None (one scale per tensor)" if block is None else list(block)
        reasons.append(f"weight_block_size {what} is not supported: comet's FP8 layer runs "
                       "128 x 128 weight blocks with 1 x 128 activation groups")
    if biases:
        reasons.append("expert biases with FP8 experts are not supported yet")
    if transposed:
        reasons.append("transposed FP8 experts ([E, H, 2F]) are not supported: comet runs "
                       "the checkpoints' [E, 2F, H] layout without a copy")
    scales = [getattr(experts, k, None) for k in FP8_SCALE_KEYS]
    if not all(isinstance(s, torch.Tensor) for s in scales):
        missing = [k for k, s in zip(FP8_SCALE_KEYS, scales) if not isinstance(s, torch.Tensor)]
        reasons.append(f"FP8 experts without {', '.join(missing)}")
    elif not all(s.dtype == torch.float32 or is_ue8m0(s) for s in scales):
        reasons.append(f"scales in {', '.join(sorted({str(s.dtype) for s in scales}))} are "
                       "not supported: comet reads fp32 or UE8M0 scales")
    if reasons:
        return None, reasons
    e, h, f = sizes
    grids = [torch.empty(s.shape, dtype=torch.float32, device="meta") for s in scales]
    try:    # the scale grids against the weights: shapes only, whatever the device
        fp8_experts(gate_up.to("meta"), down.to("meta"), e, h, f, ScaleBlocks(*_BLOCK), *grids)
    except (TypeError, ValueError) as err:
        return None, [f"FP8 scales that do not fit the weights ({err})"]
    if scales[0].dtype != scales[1].dtype:
        return None, [f"gate_up and down scales in different dtypes ({scales[0].dtype}, "
                      f"{scales[1].dtype})"]
    return Fp8Checkpoint(ScaleBlocks(*_BLOCK), scales[0].dtype), []
