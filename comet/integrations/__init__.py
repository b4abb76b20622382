"""comet inside Hugging Face transformers models.

Two ways in:

* :func:`patch_model` / :func:`from_module` replace the MoE blocks of a model by
  :class:`CometMoEBlock` modules, sharding the experts over an expert-parallel group. A
  block is recognised by its structure (an ``experts`` module next to its router), not its
  class: every transformers 5.x family whose experts are gated MLPs of an activation comet
  computes (SiLU, GELU-tanh, clamped SiLU, GPT-OSS's clamped SwiGLU), with or without
  biases, converts, keeping its own router and shared experts; other expert variants are
  refused with the reason (``python -m comet.integrations.coverage`` lists every family).
* With transformers 5.x, importing this package registers a ``"comet"`` experts
  implementation (``model.set_experts_implementation("comet")``) that swaps only the expert
  computation, without replacing modules and without expert parallelism.

See docs/models.md.
"""

from comet.integrations.blocks import FAMILIES, CometMoEBlock, from_module, inspect_block
from comet.integrations.experts import inspect_experts
from comet.integrations.experts_backend import (BACKEND_NAME, comet_experts_forward,
                                                register_experts_backend)
from comet.integrations.local_experts import TransformersExperts
from comet.integrations.patch import (count_patched, find_moe_blocks, looks_like_moe_block,
                                      patch_model, refusal)

#: True where the installed transformers has the experts registry and "comet" is in it.
EXPERTS_BACKEND_REGISTERED = register_experts_backend()

__all__ = [
    "BACKEND_NAME", "EXPERTS_BACKEND_REGISTERED", "FAMILIES", "CometMoEBlock",
    "TransformersExperts", "comet_experts_forward", "count_patched", "find_moe_blocks",
    "from_module", "inspect_block", "inspect_experts", "looks_like_moe_block", "patch_model",
    "refusal", "register_experts_backend",
]
