"""Replacing every MoE block of a transformers model in place."""

from __future__ import annotations

import re

from torch import nn

from comet.config import ParallelConfig
from comet.integrations.blocks import BlockSpec, from_module, inspect_block
from comet.mesh import Convention, MeshLayout
from comet.moe import CometMoE, parallel_layout, rebalance_knobs, redundant_placement

#: Class names that say "MoE block" even without an ``experts`` child (DogeCDMoE,
#: JetMoeMoE, ...): such a block computes its experts itself and is refused with a reason.
_MOE_CLASS_NAME = re.compile(r"(MoE|Moe|MoA)$")


def looks_like_moe_block(module: nn.Module) -> bool:
    """A module comet treats as an MoE block: it has an ``experts`` child module (next to
    its router), or its class name ends in ``MoE`` / ``Moe`` / ``MoA``."""
    if isinstance(module, CometMoE):
        return False
    if isinstance(getattr(module, "_modules", {}).get("experts"), nn.Module):
        return True
    return bool(_MOE_CLASS_NAME.search(type(module).__name__))


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, block)`` of every MoE block of ``model`` not yet converted, outermost only
    (nothing inside a block, or inside a :class:`comet.CometMoE`, is looked at)."""
    found, skip = [], []
    for path, module in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, CometMoE):
            skip.append(path)
        elif looks_like_moe_block(module):
            found.append((path, module))
            skip.append(path)
    return found


def refusal(block: nn.Module) -> Exception | None:
    """Why comet would refuse ``block`` (the TypeError or NotImplementedError that
    :func:`from_module` would raise), or None when it converts it."""
    try:
        inspect_block(block)
    except (TypeError, NotImplementedError) as err:
        return err
    return None


def patch_model(model: nn.Module, group=None, mesh=None, convention: Convention = "sequence",
                *, tp_group=None, ep_group=None, redundant_experts: int = 0,
                placement_nodes: int = 1, rebalance_interval: int | None = None,
                rebalance_window: int | None = None, **kwargs) -> nn.Module:
    """Replace every MoE block of ``model`` by a :class:`CometMoEBlock`, in place.

    Blocks are recognised by structure (:func:`looks_like_moe_block`), whatever their
    class, and each is checked (:func:`comet.integrations.blocks.inspect_block`) before
    anything is replaced.

    Args:
        model: a transformers model (any ``nn.Module`` containing MoE blocks).
        group: the process group of the ranks (default: the world when torch.distributed
            is initialised, else one rank); without ``mesh``, the expert-parallel group.
            Every rank must hold the same weights before patching; afterwards each keeps
            only its experts (under a ``mesh``, its F shard of them).
        mesh: a (tp, ep) layout of the ranks (:class:`comet.mesh.MeshLayout` over
            ``group``, or a 2-D torch ``DeviceMesh`` with dims ``"ep"`` and ``"tp"``), as
            for :class:`comet.CometMoE`: every block's experts split over ``ep``, each
            expert's F over ``tp``; the rest of the model replicated. Inference only when
            ``tp > 1``.
        convention: ``"sequence"`` (each rank runs the model on its own batch; the MoE
            blocks exchange tokens inside) or ``"replicated"`` (the ranks of a TP group
            run it on the same batch).
        tp_group, ep_group: the layout as this rank's TP and EP process groups, instead
            of ``group`` and ``mesh``.
        redundant_experts: ``R`` redundant experts (EPLB, docs/eplb.md) in every block
            (default 0: none): each block's ``E + R`` must be divisible by the group's
            size, which is checked for every block before any is converted. The state
            dict keeps its keys and layout.
        placement_nodes: nodes of the group for the hierarchical placement.
        rebalance_interval, rebalance_window: every block rebalances itself every
            ``rebalance_interval`` calls, from the load of its last ``rebalance_window``
            calls (see :class:`comet.CometMoE`; default: never). Needs ``R > 0``.
        **kwargs: ``max_tokens``, ``comm_blocks``, ``tuned_config_folder``,
            ``check_replicated``, ``tile`` for every block (see :func:`from_module`).

    Returns:
        ``model`` (patched). Blocks already converted are left alone, so patching twice is
        harmless.

    Raises:
        TypeError: a block comet does not convert: its path, class and the reason (the
            unsupported variant, e.g. expert biases or a non-SiLU activation, or an
            unrecognised experts module); every such block is named. Nothing has been
            replaced when this is raised.
        ValueError: no MoE block found, or the group size does not divide the experts,
            or a layout that cannot shard a block (see :func:`from_module`), or FP8
            blocks under a layout they do not take yet (``tp > 1``, redundant experts).

    FP8 models (transformers' FineGrainedFP8 ``FP8Experts``) stay FP8: each block runs
    the checkpoint's e4m3 experts and ``*_scale_inv`` on comet's FP8 layer, and the
    state dict keeps their keys, shapes and dtypes (:mod:`comet.integrations.fp8` lists
    the variants refused).
    """
    targets = find_moe_blocks(model)
    done = sum(isinstance(m, CometMoE) for m in model.modules())
    refused, specs = {}, {}
    for path, module in targets:
        if not path:
            raise TypeError(f"{type(module).__name__} is itself an MoE block: convert it "
                            "with comet.integrations.from_module")
        try:
            specs[path] = inspect_block(module)
        except (TypeError, NotImplementedError) as err:
            refused.setdefault((type(module).__name__, str(err)), []).append(path)
    if refused:
        lines = [f"{paths[0]!r}{f' (and {len(paths) - 1} more)' if len(paths) > 1 else ''}: "
                 f"class {cls} is not supported: {why}"
                 for (cls, why), paths in refused.items()]
        raise TypeError("comet cannot convert the MoE blocks of "
                        f"{type(model).__name__}:\n  " + "\n  ".join(lines))
    if not targets and not done:
        raise ValueError(f"no MoE block found in {type(model).__name__} (a module with an "
                         "`experts` child)")
    # Once for the model: a DeviceMesh may make a process group.
    group, mesh = parallel_layout(group, mesh, tp_group, ep_group)
    eplb = dict(redundant_experts=redundant_experts, placement_nodes=placement_nodes,
                rebalance_interval=rebalance_interval, rebalance_window=rebalance_window)
    _check_eplb(specs, group, mesh, **eplb)
    _check_fp8(specs, mesh, redundant_experts)
    for path, _ in targets:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, from_module(getattr(parent, name), group, mesh=mesh,
                                          convention=convention, **eplb, **kwargs))
    return model


def _check_eplb(specs: dict[str, BlockSpec], group, mesh: MeshLayout | None,
                redundant_experts: int, placement_nodes: int, rebalance_interval: int | None,
                rebalance_window: int | None) -> None:
    """ValueError (TypeError for a non-int) naming the first block whose experts cannot
    take the redundant-expert knobs, before any block is converted: blocks may differ in
    their number of experts, and a model half converted is worse than none."""
    rebalance_knobs(rebalance_interval, rebalance_window, redundant_experts)
    if not redundant_experts:
        return
    world = ParallelConfig.from_group(group).world_size
    layout = mesh if mesh is not None else MeshLayout(tp=1, ep=world)
    for path, spec in specs.items():
        try:
            redundant_placement(spec.experts.num_experts, world, layout, redundant_experts,
                                placement_nodes)
        except ValueError as err:
            raise ValueError(f"cannot give {path!r} redundant experts: {err}") from err


def _check_fp8(specs: dict[str, BlockSpec], mesh: MeshLayout | None,
               redundant_experts: int) -> None:
    """ValueError naming the first FP8 block the layout cannot take, before any block is
    converted (:func:`comet.integrations.blocks.from_module` would refuse it midway)."""
    fp8 = [path for path, spec in specs.items() if spec.experts.fp8 is not None]
    if not fp8:
        return
    if mesh is not None and mesh.tp > 1:
        raise ValueError(f"cannot convert {fp8[0]!r}: FP8 experts under a tensor-parallel "
                         f"layout ({mesh}) are not supported yet: use expert parallelism")
    if redundant_experts:
        raise ValueError(f"cannot convert {fp8[0]!r}: FP8 experts with redundant experts "
                         "(EPLB) are not supported yet")


def count_patched(model: nn.Module) -> int:
    """How many comet MoE blocks ``model`` holds."""
    return sum(isinstance(m, CometMoE) for m in model.modules())
