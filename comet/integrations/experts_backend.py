"""A ``"comet"`` backend for transformers' experts-implementation registry (5.x).

transformers 5.x dispatches the forward of its fused experts modules (``@use_experts_
implementation``) through ``transformers.integrations.moe.ExpertsInterface``; a model picks
one with ``from_pretrained(..., experts_implementation="comet")`` or
``model.set_experts_implementation("comet")``. The backend only replaces the expert
computation: routing, shared experts and module structure stay transformers', and every
rank runs its own experts (W = 1; transformers' own expert parallelism, if configured, hands
it local ids). For comet's expert parallelism use :func:`comet.patch_model`.

On a CPU the backend computes :func:`comet.reference.moe_forward` on views of the
transformers weights (autograd flows to them; alternating gate/up columns are reordered
on the fly), with the experts' gated activation and biases. On CUDA it runs comet's fused
W=1 layer, which keeps a kernel-layout copy of the experts' weights and biases, refreshed
when they change.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from comet import reference
from comet.integrations.experts import ExpertsSpec, inspect_experts
from comet.integrations.layout import (kernel_biases, kernel_weights, reference_biases,
                                       reference_weights)
from comet.moe import CometMoE

BACKEND_NAME = "comet"

_MIN_MAX_TOKENS = 4096


def register_experts_backend() -> bool:
    """Register :func:`comet_experts_forward` as ``"comet"`` in transformers' experts
    registry. Returns False (and does nothing) where the installed transformers has no
    registry (4.x)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(BACKEND_NAME, comet_experts_forward)
    return True


def _spec(experts: nn.Module) -> ExpertsSpec:
    """What comet runs for ``experts`` (:func:`inspect_experts`, once per module)."""
    spec = experts.__dict__.get("_comet_spec")
    if spec is None:
        spec = inspect_experts(experts)
        if spec.mode != "routed":
            raise NotImplementedError(f"{type(experts).__name__} is not a registry experts "
                                      "module")
        experts.__dict__["_comet_spec"] = spec
    return spec


def comet_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registry entry: ``self`` is a transformers fused experts module.

    Args:
        hidden_states: ``[tokens, H]``.
        top_k_index: ``[tokens, k]`` expert ids; ids ``>= num_experts`` (transformers'
            expert-parallel sentinels) contribute nothing.
        top_k_weights: ``[tokens, k]``.

    Returns:
        ``[tokens, H]`` in ``hidden_states``' dtype.
    """
    spec = _spec(self)
    ids = top_k_index.masked_fill(top_k_index >= self.num_experts, -1)
    if hidden_states.is_cuda:
        warn_if_experts_train(self)
        layer = _local_layer(self, spec, hidden_states.shape[0], top_k_index.shape[-1])
        out = layer.experts_forward(hidden_states.contiguous(), ids, top_k_weights.float())
    else:
        e = spec.num_experts
        w13, w2 = reference_weights(self, spec.layout, 0, e)
        b13, b2 = reference_biases(self, spec.layout, 0, e)
        out = reference.moe_forward(hidden_states, ids, top_k_weights, w13, w2,
                                    round_to=hidden_states.dtype, activation=spec.activation,
                                    b13=b13, b2=b2)
    return out.to(hidden_states.dtype)


def warn_if_experts_train(experts: nn.Module) -> None:
    """Warn (once per module) when a call would train ``experts`` through the fused layer:
    its weights are a kernel-layout copy, so x and the routing weights get gradients and
    the transformers parameters none."""
    if (torch.is_grad_enabled() and experts.gate_up_proj.requires_grad
            and "_comet_warned" not in experts.__dict__):
        experts.__dict__["_comet_warned"] = True
        warnings.warn("comet experts backend: the fused layer runs on a kernel-layout copy "
                      "of the expert weights, so they get no gradient here; to train the "
                      "experts, use comet.patch_model (docs/training.md)", stacklevel=3)


def _local_layer(experts: nn.Module, spec: ExpertsSpec, tokens: int, top_k: int) -> CometMoE:
    """A single-rank :class:`CometMoE` over all of ``experts``' weights (and biases),
    cached on the module outside its ``_modules`` (so it never shows in ``state_dict``)."""
    source = [p for _, p in experts.named_parameters()]
    key = (tuple(t._version for t in source), tuple(t.data_ptr() for t in source), top_k)
    cached = experts.__dict__.get("_comet_layer")
    if cached is not None and cached[0] == key and cached[1].cfg.max_tokens >= tokens:
        return cached[1]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "the 'comet' experts backend runs each rank's experts alone and cannot build "
            "a one-rank layer inside a multi-rank process group; use "
            "comet.patch_model(model, group=...) for expert parallelism")
    e, h, f = spec.num_experts, spec.hidden_size, spec.intermediate_size
    max_tokens = max(_MIN_MAX_TOKENS, 1 << (tokens - 1).bit_length())
    layer = CometMoE(e, top_k, h, f, dtype=experts.gate_up_proj.dtype, max_tokens=max_tokens,
                     device="meta", activation=spec.activation,
                     expert_bias=bool(spec.layout.biases))
    kernel = dict(zip(("w13", "w2"), kernel_weights(experts, spec.layout, 0, e)))
    if spec.layout.biases:
        kernel.update(zip(("b13", "b2"), kernel_biases(experts, spec.layout, 0, e)))
    for name, value in kernel.items():
        setattr(layer.experts, name, nn.Parameter(value, requires_grad=False))
    experts.__dict__["_comet_layer"] = (key, layer)
    return layer
