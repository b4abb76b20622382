"""comet inside Megatron-Core: an MoE layer spec that trains.

Megatron-Core's ``MoELayer`` routes, dispatches tokens to their experts' ranks, runs the
experts and combines. With comet, Megatron's router and shared experts stay, and the
dispatch, the experts and the combine run as comet's fused expert-parallel layer (forward
and backward) over Megatron's expert-parallel group:

* :class:`CometMoELayer` -- a ``MoELayer`` (:mod:`.layer`);
* :class:`CometExperts` -- its experts: comet's parameters, marked for Megatron's DDP and
  distributed optimizer, saved under Megatron's checkpoint keys (:mod:`.experts`,
  :mod:`.checkpoint`);
* :func:`use_comet`, :func:`get_comet_moe_module_spec`, :func:`get_gpt_layer_comet_spec`
  -- specs, Megatron's own with comet's layer in (:mod:`.specs`);
* :func:`refusals` / :func:`check_config` -- the settings comet cannot run, and why
  (:mod:`.support`).

Needs ``megatron-core`` (``pip install -e ".[megatron]"``). See docs/megatron.md.
"""

from comet.integrations.megatron.checkpoint import fc1_of, fc2_of, w2_of, w13_of
from comet.integrations.megatron.experts import CometExperts
from comet.integrations.megatron.layer import CometMoELayer, routing_slots
from comet.integrations.megatron.specs import (get_comet_moe_module_spec,
                                               get_gpt_layer_comet_spec, use_comet)
from comet.integrations.megatron.support import check_config, gated_activation, refusals

__all__ = [
    "CometExperts", "CometMoELayer", "check_config", "fc1_of", "fc2_of", "gated_activation",
    "get_comet_moe_module_spec", "get_gpt_layer_comet_spec", "refusals", "routing_slots",
    "use_comet", "w13_of", "w2_of",
]
