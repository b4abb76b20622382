"""Tiny FP8 transformers models, built the way transformers lays out a FineGrainedFP8
checkpoint (tests/test_integrations_fp8.py, tests/test_gpu_fp8_models.py).

transformers quantizes a model only while loading a checkpoint; from a config it builds
bf16 modules. So a model is built in bf16 from its config (random weights), its linears
and experts are swapped by transformers' own ``replace_with_fp8_linear`` (``FP8Linear``,
``FP8Experts``: the parameter names, shapes and dtypes of a downloaded FP8 checkpoint),
and each swapped weight gets transformers' own quantization of the bf16 one
(``Fp8Quantize``: 128 x 128 blocks, ``weight_scale_inv`` fp32 or UE8M0); a weight whose
shape the blocks do not divide stays bf16, as transformers leaves it.

transformers runs FP8 only through GPU kernels downloaded from the hub (finegrained-fp8,
DeepGEMM). :func:`emulated_fp8_linear` is its W8A8 recipe in torch -- activations
quantized per token in groups of the block's K side, block-scaled weights, fp32 sums, the
output in the input's dtype -- which :func:`emulate_fp8` installs so that an FP8 model,
patched or not, runs anywhere.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import transformers
from transformers import FineGrainedFP8Config
from transformers.integrations import finegrained_fp8
from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

from comet.integrations.tiny_models import _COMMON, TINY_MODELS
from comet.quant import Fp8Weight, quantize_rows

#: FP8 sizes: H and F multiples of the 128 x 128 blocks.
FP8_SIZES = dict(hidden_size=128, moe_intermediate_size=128)


def fp8_model(family: str, scale_fmt: str = "float", seed: int = 0, device="cpu",
              **overrides) -> torch.nn.Module:
    """A tiny ``family`` model (:data:`comet.integrations.tiny_models.TINY_MODELS`,
    ``deepseek_v3`` or ``qwen3_moe``) in FineGrainedFP8, random weights, eval mode.
    ``overrides``: config fields (real widths for the GPU test)."""
    model = bf16_model(family, seed, device, **overrides)
    quantize(model, FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt))
    # transformers' other FP8 experts paths call its hub kernels directly, not fp8_linear
    model.set_experts_implementation("eager")
    return model.eval()


def bf16_model(family: str, seed: int = 0, device="cpu", **overrides) -> torch.nn.Module:
    """The bf16 model :func:`fp8_model` quantizes (same family, seed and overrides)."""
    config_cls, model_cls, settings = TINY_MODELS[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **settings, **FP8_SIZES,
                                                  **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    return model.eval()


def quantize(model: torch.nn.Module, qcfg: FineGrainedFP8Config) -> None:
    """``model``'s linears and experts as transformers' FP8 modules, their values
    transformers' quantization of the bf16 ones."""
    device = next(model.parameters()).device
    bf16 = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}   # rotary inv_freq, ...
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qcfg)
    model.to_empty(device=device)       # the FP8 modules were built on the meta device
    with torch.no_grad():
        for key, value in model.named_buffers():
            value.copy_(buffers[key])
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=qcfg))
    state = model.state_dict()
    with torch.no_grad():
        for key, value in bf16.items():
            target = state[key]
            if target.dtype == value.dtype:
                target.copy_(value)
                continue
            out = quantizer.convert({key: value})
            if out[key].dtype == value.dtype:        # shape not in whole blocks: kept bf16
                module, _, name = key.rpartition(".")
                setattr(model.get_submodule(module), name, torch.nn.Parameter(value))
                continue
            for k, v in out.items():
                state[k].copy_(v)


def emulated_fp8_linear(input: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor, block_size=None, bias=None,
                        activation_scale=None, allow_deepgemm: bool = True) -> torch.Tensor:
    """transformers' ``fp8_linear`` (dynamic W8A8, block-scaled) in torch."""
    if activation_scale is not None or block_size is None:
        raise NotImplementedError("the emulation runs dynamic activations, block scales")
    k = input.shape[-1]
    w = Fp8Weight.from_checkpoint(weight, weight_scale_inv, tuple(block_size)).dequantize()[0]
    x = quantize_rows(input.reshape(-1, k), group=block_size[1]).dequantize()
    y = (x @ w.T).to(input.dtype).reshape(*input.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


@contextlib.contextmanager
def emulate_fp8():
    """Run transformers' FP8 linears and experts with :func:`emulated_fp8_linear`."""
    saved = finegrained_fp8.fp8_linear
    finegrained_fp8.fp8_linear = emulated_fp8_linear
    try:
        yield
    finally:
        finegrained_fp8.fp8_linear = saved
