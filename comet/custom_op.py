"""The routed experts of a :class:`~comet.moe.CometMoE` as one opaque torch op, for
``torch.compile`` and for autograd.

Inside a compiled region Dynamo would otherwise trace the layer's Python: the host-side
staging of a fused call (a pinned ring written through numpy, graph replays, caches) and,
on the CPU paths, data-dependent shapes -- each a graph break, and ``fullgraph=True``
fails. As ``torch.ops.comet.routed_experts`` the whole call is one node: the compiler
sees an output shaped like the input and never looks inside, the way vLLM hands its fused
MoE to the compiler. Eager inference calls do not go through the op (the dispatcher
costs the host time a decode-sized call cannot spare); calls that need gradients do, in
eager mode too: the op's registered backward is another opaque op
(``torch.ops.comet.routed_experts_backward``), so that a compiled training step keeps it
whole.

A compiled graph holds a string, not the module: each layer registers under a key, kept
in a weak map so that deleting the model frees it, and the ops call back into the layer
registered under their key. This module imports nothing of comet: a layer only has to
provide ``eager_experts_forward`` and ``experts_backward`` (:class:`comet.moe.CometMoE`).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_LAYERS: "weakref.WeakValueDictionary[str, torch.nn.Module]" = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(module: torch.nn.Module) -> str:
    """A key the op resolves to ``module`` for as long as it lives."""
    key = f"{type(module).__name__}-{next(_NEXT)}"
    _LAYERS[key] = module
    return key


def _module(key: str) -> torch.nn.Module:
    try:
        return _LAYERS[key]
    except KeyError:
        raise RuntimeError(f"comet: layer {key!r} no longer exists (a compiled graph "
                           "outlived the model it was compiled from)") from None


@torch.library.custom_op("comet::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, layer: str,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``[M, H]`` routed-expert output of the :class:`~comet.moe.CometMoE` registered as
    ``layer`` (:meth:`~comet.moe.CometMoE.eager_experts_forward`, with the layer's own
    block-split choice). ``w13``, ``w2`` (and the biases ``b13``, ``b2`` of a layer that
    has them) are the layer's expert parameters, passed so the op's gradients can name
    them. Collective like the layer: every rank of its group calls it."""
    with torch.no_grad():
        # In x's dtype, as the fake says (the CPU paths return fp32; the fused one x's).
        return _module(layer).eager_experts_forward(x, topk_ids, topk_weights).to(x.dtype)


@routed_experts.register_fake
def _(x, topk_ids, topk_weights, w13, w2, layer, b13=None, b2=None):
    return torch.empty_like(x)


@torch.library.custom_op("comet::routed_experts_backward", mutates_args=())
def routed_experts_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            layer: str, weight_grads: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor, torch.Tensor]:
    """``(dx, d topk_weights, dW13, dW2, db13, db2)`` of :func:`routed_experts`, from the
    layer's ``experts_backward`` (:meth:`comet.moe.CometMoE.experts_backward`); without
    ``weight_grads`` (frozen experts) the last four are empty and not computed, and so
    are the bias gradients of a layer without biases."""
    grads = _module(layer).experts_backward(dy, x, topk_ids, topk_weights, weight_grads)
    dx, d_weights = grads[:2]
    return (dx, d_weights, *(g if g is not None else dy.new_empty(0) for g in grads[2:]))


@routed_experts_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, layer, weight_grads):
    # Shapes only: a bias gradient's true shape is the layer's, unknown here; compiled
    # graphs of layers with biases are inference graphs (no backward traced).
    empty = w13.new_empty(0)
    if weight_grads:
        return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13),
                torch.empty_like(w2), empty, empty)
    return (torch.empty_like(x), torch.empty_like(topk_weights), empty, empty, empty, empty)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, layer, b13, b2 = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2)
    ctx.layer = layer


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
    # One flag per input given: a call without biases has no entries for them.
    needs = ctx.needs_input_grad
    weight_grads = any(needs[i] for i in (3, 4, 6, 7) if i < len(needs))
    dx, d_weights, dw13, dw2, db13, db2 = routed_experts_backward(
        dy.contiguous(), x, topk_ids, topk_weights, w13, w2, ctx.layer, weight_grads)
    grads = [g if g.numel() else None for g in (dw13, dw2, db13, db2)]
    return (dx, None, d_weights, grads[0], grads[1], None, grads[2], grads[3])[:len(needs)]


routed_experts.register_autograd(_backward, setup_context=_setup_context)
