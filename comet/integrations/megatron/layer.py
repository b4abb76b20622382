"""``CometMoELayer``: Megatron-Core's ``MoELayer`` with comet in place of its dispatcher,
experts and combine.

Megatron's MoE layer routes (its ``TopKRouter``), permutes and sends the tokens to their
experts' ranks (a token dispatcher: all-gather, all-to-all or DeepEP), runs the experts, and
sends the outputs back. :class:`CometMoELayer` keeps the first step and the shared experts
as Megatron runs them and replaces the rest by one comet call
(:class:`~comet.integrations.megatron.experts.CometExperts`), which overlaps the
expert-parallel exchange with the expert GEMMs inside its kernels:

    shared experts (Megatron's, recompute as configured)
    router: probs [T, E], routing_map [T, E]     (Megatron's: aux losses, bias, drops)
      -> routing slots: topk_ids [T, k], topk_weights [T, k]      (:func:`routing_slots`)
      -> comet: dispatch + experts + combine, fused                       [T, H]
    output = routed + shared

Each rank passes its own tokens, as Megatron's all-to-all dispatcher has them: with
sequence parallelism, the rank's sequence shard (comet's expert-parallel group is
Megatron's EP group, and the router reduces its aux-loss statistics over the TP group as
it always does). The layer is an ``MoELayer`` (Megatron checks ``isinstance``), built from
a spec like Megatron's own (:mod:`~comet.integrations.megatron.specs`).
"""

from __future__ import annotations

import inspect

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer

from comet.integrations.megatron.experts import CometExperts
from comet.integrations.megatron.support import check_config

#: The keyword arguments of the installed Megatron's ``MoELayer`` (``is_mtp_layer`` and
#: ``name`` are newer than 0.16).
_MOE_LAYER_ARGS = frozenset(inspect.signature(MoELayer.__init__).parameters)


def routing_slots(probs: torch.Tensor, routing_map: torch.Tensor, top_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing ``(probs [T, E], routing_map [T, E] bool)`` as comet's slots
    ``(topk_ids [T, k] int64, topk_weights [T, k] fp32)``.

    A token's slots are its routed experts by decreasing probability; a token routed to
    fewer than ``k`` experts (dropped over an expert's capacity) fills the rest with id -1
    and weight 0. Where the map routes a token to more than ``k`` experts -- padding to
    capacity adds routes of probability 0 -- the ``k`` most probable are kept: the others
    add nothing to the output and take no gradient. ``topk_weights`` is differentiable in
    ``probs``: the router's gradients, and the aux losses attached to ``probs``, flow back
    through it."""
    score = probs.detach().float().masked_fill(~routing_map, -1.0)
    ids = score.topk(top_k, dim=1).indices
    taken = routing_map.gather(1, ids)
    weights = probs.gather(1, ids).float() * taken
    return ids.masked_fill(~taken, -1), weights


class CometMoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose routed experts run on comet.

    Built like Megatron's ``MoELayer`` (``config``, ``submodules``, ``layer_number``,
    ``pg_collection``, and on newer Megatron ``is_mtp_layer``, ``name``); the
    ``submodules.experts`` entry must build a
    :class:`~comet.integrations.megatron.experts.CometExperts` (the spec functions of
    :mod:`~comet.integrations.megatron.specs` do). The router, the shared experts and
    Megatron's selective recompute (``recompute_modules`` ``"moe"`` and
    ``"shared_experts"``) work as in ``MoELayer``; the token dispatcher Megatron builds is
    kept as an attribute and never runs.

    Raises:
        NotImplementedError: at construction, for the settings of
            :func:`~comet.integrations.megatron.support.refusals`.
        TypeError: experts other than ``CometExperts``.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 **kwargs):
        check_config(config)
        kwargs = {k: v for k, v in kwargs.items() if k in _MOE_LAYER_ARGS}
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        if not isinstance(self.experts, CometExperts):
            raise TypeError(f"CometMoELayer runs comet's experts; its spec built "
                            f"{type(self.experts).__name__} (use "
                            "comet.integrations.megatron.get_comet_moe_module_spec)")

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: torch.Tensor | None = None):
        """``hidden_states [S, B, H]`` (this rank's tokens) -> ``(output [S, B, H], None)``,
        as ``MoELayer.forward``. ``padding_mask [B, S]`` (True for padding, as Megatron
        passes it) keeps padding out of the router's aux losses and expert-bias counts.
        ``intermediate_tensors`` (Megatron's partial CUDA-graph and EP-overlap schedules)
        is refused."""
        if intermediate_tensors is not None:
            raise NotImplementedError("comet's MoE layer runs whole: Megatron's partial "
                                      "CUDA-graph and EP-overlap schedules are refused")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("training an MoE layer with tensor parallelism needs sequence "
                             "parallelism (as Megatron's MoELayer requires)")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute and self.training and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(self._forward, False, hidden_states,
                                              padding_mask)
        return self._forward(hidden_states, padding_mask)

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None):
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        topk_ids, topk_weights = routing_slots(probs, routing_map, self.config.moe_router_topk)
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        output = self.experts(x, topk_ids, topk_weights).view(hidden_states.shape)
        if shared is not None:
            output = output + shared
        return output, None
