"""comet inside Hugging Face transformers models.

Two ways in:

* :func:`patch_model` / :func:`from_module` replace the MoE blocks of a model (Mixtral,
  Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3; transformers 4.4x and 5.x) by
  :class:`CometMoEBlock` modules, sharding the experts over an expert-parallel group.
* With transformers 5.x, importing this package registers a ``"comet"`` experts
  implementation (``model.set_experts_implementation("comet")``) that swaps only the expert
  computation, without replacing modules and without expert parallelism.

See docs/models.md.
"""

from comet.integrations.blocks import FAMILIES, CometMoEBlock, TransformersExperts, from_module
from comet.integrations.experts_backend import (BACKEND_NAME, comet_experts_forward,
                                                register_experts_backend)
from comet.integrations.patch import count_patched, looks_like_moe_block, patch_model

#: True where the installed transformers has the experts registry and "comet" is in it.
EXPERTS_BACKEND_REGISTERED = register_experts_backend()

__all__ = [
    "BACKEND_NAME", "EXPERTS_BACKEND_REGISTERED", "FAMILIES", "CometMoEBlock",
    "TransformersExperts", "comet_experts_forward", "count_patched", "from_module",
    "looks_like_moe_block", "patch_model", "register_experts_backend",
]
