"""The checks every call's inputs pass before any kernel runs (one place for the module
and the fused layer): a bad shape, dtype, device or token count is a clear Python
exception, never a kernel fault or a corrupted workspace."""

from __future__ import annotations

import torch

from comet.config import MoEConfig


def check_inputs(cfg: MoEConfig, x: torch.Tensor, topk_ids: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, *, dtype: torch.dtype,
                 device: torch.device, rank: int = 0, batched: bool = False,
                 contiguous: bool = False, host_ids: bool = False) -> int:
    """Check a call's ``x`` (``[tokens, H]``, or with ``batched`` also ``[batch, seq, H]``;
    ``dtype`` and ``device``: the layer's; ``contiguous``: required) and routing
    (``[tokens, k]`` each, or both None); returns the token count. Nothing here reads a
    tensor's values, so a check never synchronises with a GPU. With ``host_ids``, a
    user's ``topk_ids`` on the CPU are also range-checked (``[-1, E)``; not while
    compiling, when they have no values yet): on a GPU the fused kernels check them on
    the device, and a bad id is raised as :class:`~comet.runtime.errors.CometInputError`
    by that call (``check_errors="sync"``) or a later one, without a host read."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a tensor, got {type(x).__name__}")
    dims = (2, 3) if batched else (2,)
    if x.dim() not in dims or x.shape[-1] != cfg.hidden_size:
        shapes = f"[tokens, {cfg.hidden_size}]" + (
            f" or [batch, seq, {cfg.hidden_size}]" if batched else "")
        raise ValueError(f"hidden_states must be {shapes}, got {list(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"hidden_states dtype {x.dtype} does not match the layer's {dtype}")
    if x.device != device:
        raise ValueError(f"hidden_states are on {x.device} but the experts on {device}")
    if contiguous and not x.is_contiguous():
        raise ValueError("hidden_states must be contiguous")
    tokens = x.numel() // cfg.hidden_size
    if tokens > cfg.max_tokens:
        raise ValueError(f"{tokens} tokens exceed max_tokens={cfg.max_tokens} on rank "
                         f"{rank}; build the layer with a larger max_tokens")
    if (topk_ids is None) != (topk_weights is None):
        raise ValueError("pass both topk_ids and topk_weights, or neither")
    if topk_ids is None:
        return tokens
    shape = (tokens, cfg.top_k)
    if tuple(topk_ids.shape) != shape or tuple(topk_weights.shape) != shape:
        raise ValueError(f"topk_ids and topk_weights must be {list(shape)}, got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError("topk_ids and topk_weights must be on the input's device")
    if host_ids and topk_ids.numel() and not topk_ids.is_cuda \
            and not torch.compiler.is_compiling():
        # CPU ids cost no device sync to read; the CPU path (the reference) has no
        # device-side check to fall back on.
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= cfg.num_experts:
            raise ValueError(f"topk_ids must be in [-1, {cfg.num_experts}), got values in "
                             f"[{lo}, {hi}]")
    return tokens

