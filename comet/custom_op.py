"""The routed experts of a :class:`~comet.moe.CometMoE` as one opaque torch op, for
``torch.compile``.

Inside a compiled region Dynamo would otherwise trace the layer's Python: the host-side
staging of a fused call (a pinned ring written through numpy, graph replays, caches) and,
on the CPU paths, data-dependent shapes -- each a graph break, and ``fullgraph=True``
fails. As ``torch.ops.comet.routed_experts`` the whole call is one node: the compiler
sees an output shaped like the input and never looks inside, the way vLLM hands its fused
MoE to the compiler. Eager calls do not go through the op (the dispatcher costs the
host time a decode-sized call cannot spare).

A compiled graph holds a string, not the module: each layer registers under a key, kept
in a weak map so that deleting the model frees it.
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
                   layer: str) -> torch.Tensor:
    """``[M, H]`` routed-expert output of the :class:`~comet.moe.CometMoE` registered as
    ``layer`` (:meth:`~comet.moe.CometMoE.eager_experts_forward`, with the layer's own
    block-split choice). Collective like the layer: every rank of its group calls it."""
    return _module(layer).eager_experts_forward(x, topk_ids, topk_weights)


@routed_experts.register_fake
def _(x, topk_ids, topk_weights, layer):
    return torch.empty_like(x)
