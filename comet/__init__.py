"""comet: Mixture-of-Experts layers with communication hidden inside the expert GEMMs.

Public API::

    from comet import CometMoE, MeshLayout, MoEConfig, patch_model
"""

from comet.config import MoEConfig, ParallelConfig, preset
from comet.mesh import MeshLayout
from comet.moe import CometMoE

__version__ = "0.1.0"
__all__ = ["CometMoE", "MeshLayout", "MoEConfig", "ParallelConfig", "preset", "patch_model",
           "__version__"]


def __getattr__(name):
    # transformers is an optional extra: import the integration only when asked for.
    if name == "patch_model":
        from comet.integrations import patch_model
        return patch_model
    raise AttributeError(f"module 'comet' has no attribute {name!r}")
