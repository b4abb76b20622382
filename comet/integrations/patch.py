"""Replacing every MoE block of a transformers model in place."""

from __future__ import annotations

from torch import nn

from comet.integrations.blocks import FAMILIES, from_module
from comet.moe import CometMoE


def looks_like_moe_block(module: nn.Module) -> bool:
    """Heuristic for MoE blocks comet does not know: a router child (``gate`` or
    ``router``) next to an ``experts`` child holding several experts (a ModuleList, or
    3-D expert tensors)."""
    if not any(isinstance(getattr(module, n, None), nn.Module) for n in ("gate", "router")):
        return False
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts) > 1
    if isinstance(experts, nn.Module):
        return any(p.dim() == 3 for p in experts.parameters(recurse=False))
    return False


def patch_model(model: nn.Module, group=None, **kwargs) -> nn.Module:
    """Replace every supported MoE block of ``model`` by a :class:`CometMoEBlock`, in place.

    Args:
        model: a transformers model (any ``nn.Module`` containing MoE blocks).
        group: expert-parallel process group (default: the world when torch.distributed
            is initialised, else one rank). Every rank must hold the same weights before
            patching; afterwards each keeps only its experts.
        **kwargs: ``max_tokens``, ``comm_blocks``, ``tuned_config_folder`` for every block
            (see :func:`from_module`).

    Returns:
        ``model`` (patched). Blocks already converted are left alone, so patching twice is
        harmless.

    Raises:
        TypeError: a module looks like an MoE block (router + experts) but its class is
            not supported; the message names the class and its path. Nothing has been
            replaced when this is raised.
        ValueError: no MoE block found, or the group size does not divide the experts.
    """
    targets, done = [], 0
    for path, module in model.named_modules():
        if isinstance(module, CometMoE):
            done += 1
        elif type(module).__name__ in FAMILIES:
            if not path:
                raise TypeError(f"{type(module).__name__} is itself an MoE block: convert it "
                                "with comet.integrations.from_module")
            targets.append(path)
        elif looks_like_moe_block(module):
            raise TypeError(
                f"comet cannot convert the MoE block at {path or '<root>'!r}: class "
                f"{type(module).__module__}.{type(module).__name__} is not supported "
                f"(supported: {', '.join(FAMILIES)})")
    if not targets and not done:
        raise ValueError(f"no MoE block found in {type(model).__name__}; supported: "
                         f"{', '.join(FAMILIES)}")
    for path in targets:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, from_module(getattr(parent, name), group, **kwargs))
    return model


def count_patched(model: nn.Module) -> int:
    """How many comet MoE blocks ``model`` holds."""
    return sum(isinstance(m, CometMoE) for m in model.modules())
