"""``CometMoE``: the MoE block users put in their model.

It holds the router, this rank's share of the routed experts and the optional shared
expert, and runs the layer one of three ways:

* fused (CUDA, Triton): :class:`comet.runtime.layer.FusedMoE` -- dispatch and layer0
  GroupGEMM in one persistent kernel, layer1 GroupGEMM sending its rows home in another,
  then the combine;
* unfused over a process group on the CPU: :mod:`comet.baseline` (all_to_all + torch;
  :func:`comet.baseline.mesh_moe_forward` for a tensor-parallel layout);
* single process on the CPU: :mod:`comet.reference`, the spec itself.

All three compute the same function; tests hold them to it.

The experts are split over the ranks by expert parallelism, or by a (tp, ep) layout
(:class:`comet.mesh.MeshLayout`): experts over ``ep``, each expert's FFN width over
``tp``. The router and the shared expert are replicated either way. Tensor-parallel
layouts run inference only (a call that needs gradients raises NotImplementedError).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn

from comet import custom_op, reference
from comet.baseline import MeshGroups, ep_moe_forward, mesh_moe_forward
from comet.baseline_backward import routed_experts_backward
from comet.config import MoEConfig, ParallelConfig, TileConfig, check_layout
from comet.eplb import ExpertReplicas, physical_config
from comet.mesh import CONVENTIONS, Convention, MeshLayout
from comet.placement import Placement, PlacementConfig
from comet.quant import (Fp8, Fp8Weight, ScaleBlocks, device_only, is_ue8m0,
                         quantize_weight, ue8m0_to_fp32)
from comet.runtime.inputs import check_inputs
from comet.runtime.layer import FusedMoE
from comet.weights import gate_up_first


class TopKRouter(nn.Module):
    """Linear router scores ``[M, H] -> [M, E]`` plus the top-k selection of ``cfg``.

    Parameter names follow transformers (``weight``; ``e_score_correction_bias`` for
    DeepSeek-V3) so checkpoints load unchanged.
    """

    def __init__(self, cfg: MoEConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size,
                                               dtype=cfg.dtype, device=device))
        if cfg.score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32, device=device),
                requires_grad=False)
        else:
            self.e_score_correction_bias = None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [M, H]`` -> ``(logits [M, E], topk_weights [M, k] fp32, topk_ids [M, k])``."""
        logits = x @ self.weight.t()
        weights, ids = reference.route(logits, self.cfg, self.e_score_correction_bias)
        return logits, weights, ids


class GatedMLP(nn.Module):
    """SiLU-gated MLP with transformers' names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [H, 2F], w2 [F, H])`` in the kernels' layout."""
        w13 = torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0).t()
        return w13, self.down_proj.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalExperts(nn.Module):
    """This rank's routed experts in the kernels' layout: under a (tp, ep) layout, its F
    shard of each (``Ft = F / tp`` columns of gate and of up, the same rows of W2;
    ``Ft = F`` under expert parallelism).

    w13: ``[El, H, 2Ft]``, gate and up columns interleaved by blocks
    (:mod:`comet.weights`; :meth:`gate_up` gives the models' gate-then-up layout);
    w2: ``[El, Ft, H]``.
    With ``cfg.expert_bias``, also b13: ``[El, 2Ft]`` (columns as ``w13``'s) and
    b2: ``[El, H]`` (zeros at first); else both are None. ``b2`` is held on every rank,
    but a TP layout's partial sums must add it once: only TP rank 0 passes it to the
    kernels (:attr:`added_b2`; ``adds_b2=False`` elsewhere). The other TP ranks keep the
    same values, replicated like the router, so that every rank's state dict has the
    layer's keys and loads a checkpoint the same way.
    """

    #: The Parameters that are the experts (by expert, dim 0; biases None without
    #: ``expert_bias``): what redundant experts' slots hold, copy and move (comet.eplb).
    SLOT_NAMES = ("w13", "w2", "b13", "b2")

    def __init__(self, cfg: MoEConfig, local_experts: int, device=None,
                 ffn_shard: int | None = None, adds_b2: bool = True):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size if ffn_shard is None else ffn_shard
        self.adds_b2 = adds_b2
        self.w13 = nn.Parameter(torch.empty(local_experts, h, 2 * f, dtype=cfg.dtype,
                                            device=device))
        self.w2 = nn.Parameter(torch.empty(local_experts, f, h, dtype=cfg.dtype, device=device))
        # Scaled by the full F: a shard starts as its part of an unsharded layer would.
        nn.init.normal_(self.w13, std=h ** -0.5)
        nn.init.normal_(self.w2, std=cfg.intermediate_size ** -0.5)
        if cfg.expert_bias:
            self.b13 = nn.Parameter(torch.zeros(local_experts, 2 * f, dtype=cfg.dtype,
                                                device=device))
            self.b2 = nn.Parameter(torch.zeros(local_experts, h, dtype=cfg.dtype, device=device))
        else:
            self.b13 = self.b2 = None

    @property
    def added_b2(self) -> torch.Tensor | None:
        """The output bias this rank's (partial) outputs add: ``b2``, or None without
        biases and on the TP ranks past the first of a layout."""
        return self.b2 if self.adds_b2 else None

    def biases(self) -> dict[str, torch.Tensor]:
        """``{"b13": ..., "b2": ...}`` in the gate-then-up layout (as :meth:`gate_up`),
        ``b2`` as :attr:`added_b2`, or ``{}`` without expert biases: keyword arguments of
        the CPU paths."""
        if self.b13 is None:
            return {}
        return {"b13": gate_up_first(self.b13), "b2": self.added_b2}

    def gate_up(self) -> torch.Tensor:
        """``w13`` as ``[El, H, 2F]`` with all gate columns first (a copy), the layout
        :mod:`comet.reference` and :mod:`comet.baseline` take. Not cached: edits through
        ``w13.data`` leave no trace (no version bump) a cache could check, and the CPU
        paths that call it are the spec, not the fast path. Differentiable: gradients of
        the CPU paths reach ``w13``."""
        return gate_up_first(self.w13)


class Fp8LocalExperts(nn.Module):
    """This rank's routed experts in W8A8 FP8, held as FP8 checkpoints hold them and
    nothing else (no bf16 copy): ``w13`` e4m3 ``[El, 2Ft, H]`` (gate rows, then up rows,
    a block grid each), ``w2`` e4m3 ``[El, H, Ft]``, and ``w13_scale_inv`` /
    ``w2_scale_inv`` fp32 in ``blocks`` (:class:`comet.quant.ScaleBlocks`, 128 x 128 by
    default) -- parameters without gradients (the layer runs the forward only), which the
    state dict holds under those keys, and which ``.to(dtype)`` moves but never casts. So
    a checkpoint's FP8 tensors load as they are (this rank's experts; a TP layout's shard:
    :meth:`comet.mesh.MeshLayout.shard_fp8`), and a bf16 :class:`LocalExperts`' state
    dict loads too, quantized with :mod:`comet.quant`'s recipe on the way in
    (:func:`quantize_local`).
    """

    b13 = b2 = added_b2 = None      # FP8 experts have no biases
    SLOT_NAMES = ("w13", "w13_scale_inv", "w2", "w2_scale_inv")   # as LocalExperts'

    def __init__(self, source: LocalExperts, blocks: ScaleBlocks):
        super().__init__()
        self.blocks = blocks
        for name, w in zip(("w13", "w2"), quantize_local(source.w13, source.w2, blocks)):
            self.register_parameter(name, nn.Parameter(w.weight, requires_grad=False))
            self.register_parameter(f"{name}_scale_inv",
                                    nn.Parameter(w.scale_inv, requires_grad=False))
        self.register_load_state_dict_pre_hook(_quantize_bf16_on_load)

    def _apply(self, fn, recurse=True):
        return super()._apply(device_only(fn), recurse)   # .to(dtype) keeps them FP8

    def fp8_weights(self) -> tuple[Fp8Weight, Fp8Weight]:
        """``(gate_up, down)`` as the FP8 layer takes them."""
        return (Fp8Weight(self.w13, self.w13_scale_inv, self.blocks, parts=2),
                Fp8Weight(self.w2, self.w2_scale_inv, self.blocks))

    def extra_repr(self) -> str:
        return f"{self.w13.shape[0]} experts, FP8 {self.blocks.n}x{self.blocks.k} blocks"


def quantize_local(w13: torch.Tensor, w2: torch.Tensor, blocks: ScaleBlocks
                   ) -> tuple[Fp8Weight, Fp8Weight]:
    """A :class:`LocalExperts`' ``w13 [El, H, 2Ft]`` (interleaved) and ``w2 [El, Ft, H]``
    as FP8 in the checkpoints' layout: ``[El, 2Ft, H]`` (gate rows, then up rows, a block
    grid each) and ``[El, H, Ft]``."""
    with torch.no_grad():
        return (quantize_weight(gate_up_first(w13).transpose(1, 2), blocks, parts=2),
                quantize_weight(w2.transpose(1, 2), blocks))


def _quantize_bf16_on_load(module: Fp8LocalExperts, state_dict, prefix, *args) -> None:
    """What a state dict that loads into FP8 experts holds, made what they hold, in place
    in ``state_dict``: UE8M0 scales (exponent bytes, which a load would copy as integers)
    as fp32, exactly; a bf16 :class:`LocalExperts`' ``w13`` / ``w2`` quantized, with
    their scales. Any other tensor is left for the load to take or refuse."""
    for name in ("w13_scale_inv", "w2_scale_inv"):
        scale = state_dict.get(prefix + name)
        if scale is not None and is_ue8m0(scale):
            state_dict[prefix + name] = ue8m0_to_fp32(scale)
    w13, w2 = state_dict.get(prefix + "w13"), state_dict.get(prefix + "w2")
    el, n2, h = module.w13.shape
    if (w13 is None or w2 is None or w13.dtype == module.w13.dtype
            or tuple(w13.shape) != (el, h, n2) or tuple(w2.shape) != (el, n2 // 2, h)):
        return
    for name, w in zip(("w13", "w2"), quantize_local(w13, w2, module.blocks)):
        state_dict[prefix + name] = w.weight
        state_dict[prefix + name + "_scale_inv"] = w.scale_inv


#: The unfused TP path's process groups per layout, with the world they were made in:
#: every layer of a layout shares them (see :func:`_mesh_groups`).
_MESH_GROUPS: dict[MeshLayout, tuple[object, MeshGroups]] = {}


def parallel_layout(group=None, mesh=None, tp_group=None, ep_group=None
                    ) -> tuple[object, MeshLayout | None]:
    """``(group, layout)`` of a layer's parallel arguments (see :class:`CometMoE`):
    ``mesh`` a :class:`~comet.mesh.MeshLayout` over ``group``'s ranks; a 2-D torch
    ``DeviceMesh`` with dims named ``"ep"`` and ``"tp"``
    (:meth:`~comet.mesh.MeshLayout.from_device_mesh`, which makes a process group when the
    mesh does not span the world: resolve a DeviceMesh once per model, not per layer); or
    this rank's ``tp_group`` and ``ep_group`` (:meth:`~comet.mesh.MeshLayout.from_groups`).
    ``layout`` None: expert parallelism over ``group``. ValueError for arguments that
    contradict each other, TypeError for a ``mesh`` of another type."""
    if tp_group is not None or ep_group is not None:
        if tp_group is None or ep_group is None or mesh is not None or group is not None:
            raise ValueError("pass tp_group and ep_group together, and neither group nor "
                             "mesh with them")
        layout, group = MeshLayout.from_groups(tp_group, ep_group)
        return group, layout
    if mesh is None or isinstance(mesh, MeshLayout):
        return group, mesh
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a comet.mesh.MeshLayout or a torch DeviceMesh, got "
                        f"{type(mesh).__name__}")
    if group is not None:
        raise ValueError("a DeviceMesh names its ranks itself: pass mesh or group, not both")
    layout, group = MeshLayout.from_device_mesh(mesh)
    return group, layout


def _layer_mesh(cfg: MoEConfig, par: ParallelConfig, mesh: MeshLayout | None,
                convention: str) -> MeshLayout:
    """The layout of a layer over ``par``'s ranks (expert parallelism where ``mesh`` is
    None), checked against the layer: ValueError naming what does not fit."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if mesh is None:
        check_layout(cfg, par)
        return MeshLayout(tp=1, ep=par.world_size)
    if mesh.world != par.world_size:
        alone = not (dist.is_available() and dist.is_initialized())
        raise ValueError(f"a {mesh} layout has tp * ep = {mesh.world} ranks, but the "
                         f"process group has {par.world_size}"
                         + (" (torch.distributed is not initialised)" if alone else ""))
    mesh.check(cfg.num_experts, cfg.intermediate_size)
    return mesh


def _mesh_groups(mesh: MeshLayout) -> MeshGroups | None:
    """The TP and EP process groups the unfused path of a TP layout runs on
    (:class:`comet.baseline.MeshGroups`), made once per layout and world and shared by its
    layers (kept here, not on a layer, which copies then need not copy). Making them is
    collective over the world: the constructor of a layer not on CUDA makes them, as every
    rank builds the same layers in the same order; a call finds them (or, for a layer
    built on CUDA or in a world made since, makes them: every rank makes that call too).
    None without torch.distributed, and where the layout does not span the world
    (MeshGroups number ranks as the world does): such a layer runs on CUDA only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != mesh.world:
        return None
    world = dist.group.WORLD
    made = _MESH_GROUPS.get(mesh)
    if made is None or made[0] is not world:    # none yet, or from a destroyed world
        made = _MESH_GROUPS[mesh] = (world, MeshGroups.new(mesh))
    return made[1]


def redundant_placement(num_experts: int, world_size: int, mesh: MeshLayout, redundant: int,
                        nodes: int = 1, n_group: int = 1) -> PlacementConfig | None:
    """The placement of ``num_experts`` logical experts with ``redundant`` more slots
    over a group of ``world_size`` ranks in ``mesh``'s layout (None for ``redundant=0``):
    TypeError for a non-int, ValueError for a count the layout cannot hold. From plain
    numbers, so that :func:`comet.integrations.patch_model` checks every block before it
    converts one."""
    _check_int("redundant_experts", redundant)
    _check_int("placement_nodes", nodes)
    if redundant < 0:
        raise ValueError(f"redundant_experts must be >= 0, got {redundant}")
    if redundant == 0:
        return None
    if mesh.tp > 1:
        raise ValueError(f"redundant experts need an expert-parallel layout; this layer is "
                         f"a {mesh} layout")
    physical = num_experts + redundant
    if physical % world_size:
        raise ValueError(f"num_experts + redundant_experts = {num_experts} + {redundant} "
                         f"must be divisible by the group's {world_size} ranks (every "
                         f"rank holds the same number of physical experts)")
    groups = n_group if n_group % nodes == 0 else 1
    return PlacementConfig(num_experts, redundant, world_size, num_nodes=nodes,
                           num_groups=groups)


def rebalance_knobs(interval: int | None, window: int | None, redundant: int
                    ) -> tuple[int | None, int | None]:
    """``(interval, window)`` of a layer's automatic rebalancing, normalised: ``(None,
    None)`` when off (``interval`` None or 0), else ``window`` defaulting to
    ``interval``. TypeError for a non-int; ValueError for a negative interval, a window
    outside ``[1, interval]`` or without an interval, or an interval on a layer without
    redundant experts (there is nothing to re-place)."""
    for name, value in (("rebalance_interval", interval), ("rebalance_window", window)):
        if value is not None:
            _check_int(name, value)
    if interval is not None and interval < 0:
        raise ValueError(f"rebalance_interval must be a positive number of calls (None or 0: "
                         f"off), got {interval}")
    if not interval:
        if window is not None:
            raise ValueError("rebalance_window needs rebalance_interval (the window is the "
                             "last calls before each automatic rebalance)")
        return None, None
    if redundant <= 0:
        raise ValueError(f"rebalance_interval={interval} needs redundant_experts > 0: a "
                         f"layer without redundant experts has nothing to re-place")
    if window is None:
        return interval, interval
    if not 1 <= window <= interval:
        raise ValueError(f"rebalance_window must be in [1, rebalance_interval={interval}] "
                         f"calls, got {window}")
    return interval, window


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")




def _logical_view(module: "CometMoE", *args) -> None:
    """``state_dict`` pre-hook of a layer with replicas: the experts module holds, while
    it saves, this rank's logical experts gathered from their owner slots (collective),
    so its keys, shapes and format are those of the layer without replicas."""
    module._swap_experts(module.replicas.logical(module._slots(), module.group))


def _physical_view(module: "CometMoE", *args) -> None:
    """``state_dict`` post-hook: the slots back in place of the logical view."""
    module._restore_slots()


def _logical_targets(module: "CometMoE", *args) -> None:
    """``load_state_dict`` pre-hook: the experts module loads into this rank's logical
    experts (gathered, collective: keys the state dict lacks keep their values), with its
    own loading code whatever its checkpoint format; the post-hook spreads them over the
    slots."""
    module._swap_experts(module.replicas.logical(module._slots(), module.group))


def _fill_slots(module: "CometMoE", incompatible_keys) -> None:
    """``load_state_dict`` post-hook: the loaded logical experts into every slot
    (collective), the slots back in place."""
    logical = {n: t for n, t in module._expert_tensors().items() if t is not None}
    module._restore_slots()
    module.replicas.load_logical(logical, module._slots(), module.group)


class CometMoE(nn.Module):
    """An expert-parallel (or tensor- and expert-parallel) MoE block with communication
    hidden inside the expert GEMMs.

    Args:
        num_experts, top_k, hidden_size, intermediate_size: see :class:`MoEConfig`.
        group: the process group of the layer's ranks (default: the world when
            torch.distributed is initialised, else a single rank). Without ``mesh`` it is
            the expert-parallel group: experts are split evenly, rank ``r`` owns
            ``[r * El, (r + 1) * El)``.
        mesh: a (tp, ep) layout of ``group``'s ranks (:class:`comet.mesh.MeshLayout`,
            whose ``tp * ep`` must be the group's size), or a 2-D torch ``DeviceMesh``
            with dims named ``"ep"`` and ``"tp"``, numbered TP-major (then ``group`` is
            the mesh's and must not be given). Rank ``ep_rank * tp + tp_rank`` holds
            experts ``[ep_rank * El, (ep_rank + 1) * El)`` with ``El = E / ep``, of each
            its F shard: columns ``[tp_rank * F/tp, (tp_rank + 1) * F/tp)`` of gate and
            of up and those rows of W2. Inference only: a call that needs gradients
            raises NotImplementedError when ``tp > 1``.
        convention: how the ranks of a TP group pass tokens (:data:`comet.mesh.CONVENTIONS`):
            ``"sequence"``, each its own (sequence parallel); ``"replicated"``, all the
            same ones. Either way each rank gets its own tokens' full outputs.
        tp_group, ep_group: the layout given as this rank's TP and EP process groups,
            spanning the world (:meth:`comet.mesh.MeshLayout.from_groups`), instead of
            ``group`` and ``mesh``.
        device: where parameters live.
        comm_blocks: expert override of the block split, ``(layer0, layer1)`` comm
            blocks or one int for both; ``None`` selects per call (tuned table, else
            the analytic model).
        tuned_config_folder: extra folder of ``comet tune`` tables (wins over the
            shipped ones and ``COMET_TUNED_CONFIG_FOLDER``).
        fused_backward: on CUDA, train through the fused kernels' backward
            (:mod:`comet.runtime.backward`: exchanges overlapped with the GEMMs, no host
            sync; the default); False: the unfused one (:mod:`comet.baseline_backward`, NCCL
            all_to_alls and torch's grouped GEMMs), which is also the CPU path.
        check_replicated: with ``convention="replicated"``, check before every call that
            the ranks of this rank's TP group passed the same tokens and routing (a
            fingerprint of each, all-gathered over the TP group, and a host sync: for
            debugging); a mismatch raises ValueError on every rank of the group. Off, such
            a mismatch gives wrong outputs silently: the kernels trust the convention.
        redundant_experts: ``R`` extra physical experts (EPLB, docs/eplb.md; 0: none,
            the layer as without the argument). The routed experts then run on ``E + R``
            physical experts, ``(E + R) / W`` per rank, copies of logical experts placed
            by :meth:`rebalance` (at first each rank holds its own logical experts and
            copies of them); ``(E + R)`` must be divisible by the group's size, and the
            layout expert-parallel (``tp == 1``). The slots are the storage:
            ``experts.w13`` ... are ``[(E + R) / W, ...]`` Parameters, no logical copy
            beside them. The state dict has the logical keys and shapes (gathered from
            each expert's owner slot: collective, as is loading, which fills every
            slot); training sums each replica's gradient into its expert's owner slot
            (the other slots' gradients are zero), and a call after the slots changed
            in place (an optimizer step) copies each owner into its replicas first
            (collective).
        placement_nodes: nodes of the group for the hierarchical placement (ranks
            numbered node-major; with ``n_group`` divisible by it, expert groups are
            packed onto nodes first).
        rebalance_interval: ``N``: every ``N`` calls the layer runs :meth:`rebalance`
            itself, planning from the load of the calls since the last rebalance (None
            or 0: never, the default; needs ``redundant_experts > 0``). The calls are
            counted on the host (no device read but the rebalance's own), so every rank
            of the group, calling the layer as often as the others, rebalances at the
            same call: the rebalance is collective. It runs at the end of the ``N``-th
            call, after its outputs are computed; a backward after it translates its ids
            with the new placement, whose slots hold the same logical weights, so the
            gradients do not change. A call made under ``torch.compile`` (the compiled
            graph runs the experts as one op, without this Python) or recorded in a CUDA
            graph (a replay runs no Python) is not counted, though its pairs are (the
            device count is part of the graph): there, call :meth:`rebalance` yourself,
            between replays. A recomputed forward (activation checkpointing) counts as
            a call, on every rank alike. A manual :meth:`rebalance` restarts the count.
        rebalance_window: ``W <= N``: plan from the last ``W`` calls before each
            automatic rebalance only (the load is reset after call ``N - W``); default
            ``N``, every call since the last rebalance.
        tile: the fused kernels' :class:`~comet.config.TileConfig` (default: the
            layout's, :func:`comet.runtime.layer.default_tile`: layer1's scatter
            epilogue, except the column-split reduce in a ``(tp, 1)`` replicated
            layout). E.g. ``TileConfig(variant=Variant(layer1_scatter=False))`` runs the
            reduce elsewhere too; tuned tables of the default tile then do not apply
            (docs/tuning.md).
        **kwargs: the remaining :class:`MoEConfig` fields (router, renormalize,
            n_group, topk_group, routed_scaling_factor, score_correction_bias,
            num_shared_experts, shared_intermediate_size, shared_expert_gate, dtype,
            max_tokens, fp8). ``fp8=comet.quant.Fp8()`` runs the routed experts in W8A8
            FP8, forward only, holding them in FP8 only (:class:`Fp8LocalExperts`: the
            state dict has FP8 checkpoints' tensors, ``experts.w13`` e4m3 ``[El, 2F,
            H]`` and its ``w13_scale_inv``, ...; a bf16 block's loads too, quantized);
            :func:`quantize_experts` turns a built block FP8.

    The router and the shared expert are replicated: every rank must hold the same ones.

    Shapes: ``forward`` takes ``[tokens, H]`` or ``[batch, seq, H]`` and returns the same
    shape; each rank passes its own tokens (at most ``max_tokens``; under the
    ``"replicated"`` convention the same as the rest of its TP group).

    Raises:
        ValueError: before anything runs, for a layout that cannot shard the layer (a
            group size other than ``tp * ep``, ``ep`` not dividing E, ``F / tp`` not a
            multiple of 16, an unknown convention) or a bad config field.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, *, group=None, mesh=None,
                 convention: Convention = "sequence", tp_group=None, ep_group=None,
                 device=None, comm_blocks: int | tuple[int, int] | None = None,
                 tuned_config_folder: str | None = None,
                 fused_backward: bool = True, check_replicated: bool = False,
                 tile: TileConfig | None = None, redundant_experts: int = 0,
                 placement_nodes: int = 1, rebalance_interval: int | None = None,
                 rebalance_window: int | None = None, **kwargs):
        super().__init__()
        if tile is not None and not isinstance(tile, TileConfig):
            raise TypeError(f"tile must be a comet.config.TileConfig, got {type(tile).__name__}")
        _check_int("redundant_experts", redundant_experts)
        _check_int("placement_nodes", placement_nodes)
        interval, window = rebalance_knobs(rebalance_interval, rebalance_window,
                                           redundant_experts)
        cfg = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                        intermediate_size=intermediate_size, **kwargs)
        group, mesh = parallel_layout(group, mesh, tp_group, ep_group)
        par = ParallelConfig.from_group(group)
        mesh = _layer_mesh(cfg, par, mesh, convention)
        placement = redundant_placement(cfg.num_experts, par.world_size, mesh, redundant_experts,
                                        placement_nodes, cfg.n_group)
        self.cfg, self.par, self.group = cfg, par, group
        self.mesh, self.convention = mesh, convention
        if check_replicated and (mesh.tp == 1 or convention != "replicated"):
            raise ValueError(f"check_replicated checks the inputs of the replicated "
                             f"convention of a layout with tp > 1; this layer is a {mesh} "
                             f"layout in the {convention!r} convention")
        self.check_replicated, self.tile = check_replicated, tile
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if mesh.tp > 1 and (check_replicated or not on_cuda):
            # The TP groups of the CPU path and of the input check, made now while every
            # rank is constructing layers; a CUDA layer's fused path needs none.
            if _mesh_groups(mesh) is None and check_replicated:
                raise ValueError(f"check_replicated compares the inputs over the TP groups "
                                 f"of the world of torch.distributed; this {mesh} layout "
                                 "does not span it")
        self.comm_blocks = comm_blocks
        self.tuned_config_folder = tuned_config_folder
        self.fused_backward = fused_backward
        self.gate = TopKRouter(cfg, device=device)
        self.experts = LocalExperts(cfg, cfg.num_experts // mesh.ep, device=device,
                                    ffn_shard=cfg.intermediate_size // mesh.tp,
                                    adds_b2=mesh.coords(par.rank)[1] == 0)
        if cfg.num_shared_experts:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_size, cfg.dtype, device)
            self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False,
                                                 dtype=cfg.dtype, device=device)
                                       if cfg.shared_expert_gate else None)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.replicas = None
        if placement is not None:
            self._build_replicas(placement, device)
            self.register_state_dict_pre_hook(_logical_view)
            self.register_state_dict_post_hook(_physical_view)
            self.register_load_state_dict_pre_hook(_logical_targets)
            self.register_load_state_dict_post_hook(_fill_slots)
        self.rebalance_interval, self.rebalance_window = interval, window
        self._rebalance_calls = 0       # counted calls since the last rebalance (host)
        self._optimizer = None          # weakref to what automatic rebalances move
        self._warned_optimizer = False
        self._fused = None
        self._op_key = custom_op.register(self)
        if cfg.fp8 is not None:
            self._start_fp8(cfg.fp8)

    def _start_fp8(self, fp8: Fp8) -> None:
        """Run the routed experts in FP8 from now on (:func:`quantize_experts`). With
        redundant experts each slot is quantized where it is: the copies of an expert are
        equal, so their FP8 ones are too (no exchange)."""
        if self.cfg.expert_bias:
            raise NotImplementedError("FP8 experts with biases (expert_bias) are not "
                                      "supported yet")
        self.cfg = self.cfg.replace(fp8=fp8)
        self.experts = Fp8LocalExperts(self.experts, fp8.blocks)   # the bf16 ones go
        if self.replicas is not None:
            self.replicas.consistent(self._slots())
        self._fused = None

    def __setstate__(self, state):
        # A copy (copy.deepcopy, unpickling) is a layer of its own: give it its own key,
        # or a graph compiled from the copy would run the original.
        super().__setstate__(state)
        self._op_key = custom_op.register(self)

    @classmethod
    def from_config(cls, cfg: MoEConfig, **kwargs) -> "CometMoE":
        """Build from a :class:`MoEConfig`; ``kwargs`` are the non-config arguments. (A
        transformers MoE block converts with :func:`comet.integrations.from_module`.)"""
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        return cls(**fields, **kwargs)

    @property
    def local_experts(self) -> int:
        """This rank's logical experts (``E / ep``; with replicas it holds ``(E + R) / W``
        physical slots, ``experts.w13.shape[0]``)."""
        return self.cfg.num_experts // self.mesh.ep

    @property
    def expert_offset(self) -> int:
        """The global id of this rank's first expert."""
        return self.mesh.expert_range(self.cfg.num_experts, self.par.rank).start

    @property
    def ffn_range(self) -> range:
        """The F columns (of gate and of up) and W2 rows this rank holds of each of its
        experts: all of them under expert parallelism."""
        return self.mesh.ffn_range(self.cfg.intermediate_size, self.par.rank)

    def extra_repr(self) -> str:
        c, mesh = self.cfg, self.mesh
        ffn, layout = f"ffn={c.intermediate_size}", f"ep={mesh.ep}, rank={self.par.rank}"
        if mesh.tp > 1:
            f = self.ffn_range
            ffn += f" (local {f.start}:{f.stop})"
            layout = f"tp={mesh.tp}, {layout}, convention={self.convention}"
        extra = ("" if self.replicas is None else
                 f", redundant={self.replicas.placement_config.redundant_experts}")
        return (f"experts={c.num_experts} (local {self.local_experts}){extra}, "
                f"top_k={c.top_k}, hidden={c.hidden_size}, {ffn}, {layout}, router={c.router}")

    # ------------------------------------------------------------------ redundant experts
    def _expert_tensors(self) -> dict[str, torch.Tensor | None]:
        return {n: self.experts._parameters.get(n) for n in self.experts.SLOT_NAMES}

    def _slots(self) -> dict[str, torch.Tensor]:
        """The physical slots (the experts' Parameters, ``[P/W, ...]``) by name, the
        biases only with ``expert_bias``."""
        return {n: t for n, t in self._expert_tensors().items() if t is not None}

    def _swap_experts(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put ``tensors`` in place of the experts' Parameters of the same names,
        keeping the ones taken out in ``_held_slots`` (the state-dict hooks' views)."""
        self._held_slots = {n: self.experts._parameters[n] for n in tensors}
        for n, t in tensors.items():
            self.experts._parameters[n] = nn.Parameter(t, requires_grad=False)

    def _restore_slots(self) -> None:
        self.experts._parameters.update(self._held_slots)
        del self._held_slots

    def _build_replicas(self, placement: PlacementConfig, device) -> None:
        """The experts' Parameters become this rank's physical slots, filled from its
        logical experts on the layout without replicas (each rank its own experts and
        copies of them, so a constructor needs no collective); the logical tensors are
        dropped."""
        self.replicas = ExpertReplicas(self.cfg, placement, self.par, device=device)
        logical = self._expert_tensors()
        for n, t in self.replicas.expand(logical).items():
            if t is not None:
                self.experts._parameters[n] = nn.Parameter(
                    t, requires_grad=logical[n].requires_grad)
        self.replicas.refresh(self._slots())      # the new Parameters' version counters

    def logical_experts(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """This rank's ``E / ep`` logical experts by name (``w13``, ``w2``, the biases with
        ``expert_bias``), or with ``grad`` their gradients (names without one left out),
        as the layer without replicas holds them. With replicas: gathered from each
        expert's owner slot (new tensors; collective over the group); without: the
        Parameters (or ``.grad``) themselves."""
        slots = self._slots()
        if grad:
            slots = {n: t.grad for n, t in slots.items() if t.grad is not None}
        if self.replicas is None:
            return slots
        return self.replicas.logical(slots, self.group)

    def _require_replicas(self) -> ExpertReplicas:
        if self.replicas is None:
            raise ValueError("this layer has no redundant experts (build it with "
                             "redundant_experts=R > 0)")
        return self.replicas

    def expert_load(self) -> torch.Tensor:
        """``[E]`` int64 on the layer's device: the (token, slot) pairs this rank routed
        to each logical expert since the last :meth:`reset_expert_load` or
        :meth:`rebalance`. Counted on the device by every call (no host sync);
        :meth:`rebalance` sums it over the group."""
        return self._require_replicas().expert_load()

    def reset_expert_load(self) -> None:
        self._require_replicas().reset_load()

    @torch.no_grad()
    def rebalance(self, plan: Placement | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> Placement:
        """Re-place the physical experts: by ``plan`` (one layer of
        :func:`comet.placement.plan_placement`), or by a plan made from every rank's
        :meth:`expert_load` (a host sync and an all-reduce of ``[W, E]``).
        Copies the weights in place -- only the slots whose expert changes, each expert
        a rank lacks sent point to point from one rank holding it -- with pending
        gradients (``.grad``) following their owners, and the translation tables, then
        resets the load count. Given ``optimizer``, its per-slot state (tensors shaped
        like the slots: Adam's moments) follows the owners too; without one it stays with
        the slot, now another expert's (an automatic rebalance moves the state of the
        optimizer :meth:`track_optimizer` names). Collective: every rank
        calls it with the same plan, between calls. The fused layer and any CUDA graph
        holding it stay valid: no address changes. Returns the plan."""
        replicas = self._require_replicas()
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if plan is None:
            # Each rank's load in its row (an all-reduce of [W, E]): the plan's dispatch
            # shares keep pairs on their own rank where the balance allows.
            load = replicas.expert_load()
            rank_load = torch.zeros(self.par.world_size, load.shape[0], dtype=load.dtype,
                                    device=load.device)
            rank_load[self.par.rank] = load
            if self.par.world_size > 1:
                dist.all_reduce(rank_load, group=self.group)
            plan = replicas.plan(rank_load=rank_load)
        replicas.place(plan, self._slots(), self.group, optimizer)
        replicas.reset_load()
        self._rebalance_calls = 0
        return plan

    def track_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimizer whose per-slot state an automatic rebalance
        (``rebalance_interval``) moves with the experts, as :meth:`rebalance`'s
        ``optimizer`` does; None forgets it. Held by a weak reference (the module does
        not keep an optimizer alive)."""
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self._require_replicas()
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)

    def _auto_rebalance(self) -> None:
        optimizer = self._optimizer() if self._optimizer is not None else None
        if (optimizer is None and self.training and torch.is_grad_enabled()
                and not self._warned_optimizer
                and any(p.requires_grad for p in self.experts.parameters())):
            # Moved slots would step with another expert's optimizer state.
            warnings.warn("comet: an automatic rebalance moved experts of a layer in "
                          "training, but no optimizer is tracked: its per-slot state "
                          "(Adam's moments) stays with the slots; call "
                          "CometMoE.track_optimizer(optimizer)", stacklevel=4)
            self._warned_optimizer = True
        self.rebalance(optimizer=optimizer)

    def _count_call(self, x: torch.Tensor) -> None:
        """``rebalance_interval``: count one eager call and rebalance at the interval's
        last (collective: every rank counts the same calls). Compiled and captured calls
        are not counted: their Python does not run on a replay, so counting the traced
        or captured call would count one call of many."""
        interval = self.rebalance_interval
        if interval is None or torch.compiler.is_compiling():
            return
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._rebalance_calls += 1
        if self._rebalance_calls >= interval:
            self._auto_rebalance()
        elif self._rebalance_calls == interval - self.rebalance_window:
            # The window starts after this call: drop the older calls' load.
            self.reset_expert_load()

    def refresh_replicas(self) -> None:
        """Copy each logical expert's owner slot into its other slots (after the slots
        were changed through ``.data``, which leaves no version trace; an optimizer step
        or ``copy_`` is found by the next call, ``load_state_dict`` fills every slot).
        Collective."""
        replicas = self._require_replicas()
        replicas._versions = ()
        replicas.refresh(self._slots(), self.group)

    # ------------------------------------------------------------------ validation
    def check_inputs(self, x: torch.Tensor, topk_ids=None, topk_weights=None) -> None:
        """Raise on inputs :meth:`forward` cannot take (before any kernel runs; reads no
        tensor's values on a GPU: there the kernels check the expert ids, and a bad one
        raises :class:`~comet.runtime.errors.CometInputError`; CPU ids are
        range-checked here)."""
        check_inputs(self.cfg, x, topk_ids, topk_weights, dtype=self.rows_dtype,
                     device=self.experts.w13.device, rank=self.par.rank, batched=True,
                     host_ids=True)

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype of the rows the experts take: their weights', or for FP8 experts the
        layer's (bf16)."""
        return self.cfg.dtype if self.cfg.fp8 is not None else self.experts.w13.dtype

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, output_router_logits: bool = False):
        """Args:
            hidden_states: ``[tokens, H]`` or ``[batch, seq, H]``.
            topk_ids, topk_weights: optional precomputed routing ``[tokens, k]``
                (global expert ids, ``-1`` = no expert); the router is skipped.
            output_router_logits: also return ``[tokens, E]`` router logits (None
                when routing was passed in).

        Returns:
            Output of the input's shape, or ``(output, router_logits)``.
        """
        self.check_inputs(hidden_states, topk_ids, topk_weights)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        logits = None
        if topk_ids is None:
            logits, topk_weights, topk_ids = self.gate(x)
        y = self.experts_forward(x, topk_ids, topk_weights, checked=True)
        if self.shared_expert is not None:
            y = y + self.shared_forward(x)
        y = y.to(hidden_states.dtype).view(shape)
        return (y, logits) if output_router_logits else y

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared-expert block on ``x [M, H]`` (gated where configured), fp32."""
        s = self.shared_expert(x).float()
        if self.shared_expert_gate is not None:
            s = s * torch.sigmoid(self.shared_expert_gate(x).float())
        return s

    def experts_forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """Routed experts of ``x [M, H]`` (contiguous) for routing the caller vouches for:
        no host check of the ids (ids outside ``[0, E)`` count as "no expert").
        ``checked``: the inputs passed :meth:`check_inputs` in this call (:meth:`forward`),
        so the fused layer does not check them again. Returns ``[M, H]``.

        Inference calls run :meth:`eager_experts_forward` directly, or under
        ``torch.compile`` as one opaque op (:mod:`comet.custom_op`). A call that needs
        gradients on the fused CUDA path or over several ranks goes through that op in
        eager mode too: its backward (:meth:`experts_backward`) gives ``x``, the routing
        weights (so the router) and this rank's expert weights their gradients. On a
        single CPU rank the reference is differentiable as written. A tensor-parallel
        layout runs inference only: a call that needs gradients raises
        NotImplementedError (on every rank alike, before any exchange). With
        ``rebalance_interval``, an eager call is counted once its output is computed, and
        the interval's last runs :meth:`rebalance` (collective) before returning."""
        if self.check_replicated:
            self._check_replicated(x, topk_ids, topk_weights)
        needs_grad = self._needs_grad(x, topk_weights)
        if needs_grad and self.cfg.fp8 is not None:
            raise NotImplementedError(
                "FP8 experts run the forward only, and this call needs gradients (grad "
                "mode is on and x or the routing weights require them). Run it under "
                "torch.no_grad() or torch.inference_mode()")
        if needs_grad and self.mesh.tp > 1:
            raise NotImplementedError(
                f"training in tensor-parallel layouts is not supported: this layer is a "
                f"{self.mesh} layout, and this call needs gradients (grad mode is on and "
                f"x, the routing weights or the experts require them). Run it under "
                f"torch.no_grad() or torch.inference_mode(), or train with tp=1")
        # With replicas every path that trains goes through the op: its backward sums the
        # replicas' gradients into their experts' owner slots (ExpertReplicas.fold).
        if ((needs_grad and (x.is_cuda or self.par.world_size > 1 or self.replicas is not None))
                or (torch.compiler.is_compiling() and not needs_grad)):
            y = custom_op.routed_experts(x, topk_ids, topk_weights, self.experts.w13,
                                         self.experts.w2, self._op_key, self.experts.b13,
                                         self.experts.b2)
        else:
            y = self.eager_experts_forward(x, topk_ids, topk_weights, checked)
        self._count_call(x)
        return y

    def _check_replicated(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> None:
        """``check_replicated``: every rank of this rank's TP group compares the group's
        fingerprints of ``(x, topk_ids, topk_weights)`` -- token count, fp64 sums (NaN
        as 0) -- and raises the same ValueError where any differs. Replicated inputs come
        from one all-reduce or broadcast, bit-identical, so equal sums are expected
        exactly."""
        groups = _mesh_groups(self.mesh)
        if groups is None:
            raise RuntimeError("check_replicated: the TP groups of this layout are gone "
                               "(torch.distributed was re-initialised with another world)")
        parts = ("tokens", "x", "topk_ids", "topk_weights")
        mine = torch.stack([torch.tensor(float(x.shape[0]), dtype=torch.float64,
                                         device=x.device)]
                           + [t.detach().double().nan_to_num().sum()
                              for t in (x, topk_ids, topk_weights)])
        every = [torch.empty_like(mine) for _ in range(self.mesh.tp)]
        dist.all_gather(every, mine, group=groups.tp)
        rows = [e.tolist() for e in every]
        differ = [p for i, p in enumerate(parts) if len({r[i] for r in rows}) > 1]
        if differ:
            ranks = self.mesh.tp_group(self.par.rank)
            raise ValueError(
                f"check_replicated: the TP group (ranks {list(ranks)}) of this "
                f"{self.mesh} layout passed different {', '.join(differ)} (token counts "
                f"{[int(r[0]) for r in rows]}); the replicated convention needs the same "
                "tokens and routing on every rank of a TP group")

    def _needs_grad(self, x: torch.Tensor, topk_weights: torch.Tensor) -> bool:
        params = (self.experts.w13, self.experts.w2, self.experts.b13, self.experts.b2)
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, topk_weights, *params))

    def eager_experts_forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                              topk_weights: torch.Tensor, checked: bool = False
                              ) -> torch.Tensor:
        """:meth:`experts_forward` itself, without autograd: the fused layer on CUDA, the
        unfused baseline (:func:`comet.baseline.mesh_moe_forward` for a TP layout) or the
        reference on the CPU."""
        experts = self.experts
        if self.replicas is not None:
            self.replicas.refresh(self._slots(), self.group)   # after an optimizer step
            topk_ids = self.replicas.route(topk_ids)
        if x.is_cuda:
            return self.fused_layer()(x, topk_ids, topk_weights, comm_blocks=self.comm_blocks,
                                      checked=checked)
        if self.cfg.fp8 is not None:
            if self.par.world_size > 1:
                raise NotImplementedError("FP8 experts over several ranks run on CUDA only "
                                          "(the fused kernels)")
            return reference.moe_forward_fp8(x.float(), topk_ids, topk_weights,
                                             *experts.fp8_weights(),
                                             activation=self.cfg.activation).to(x.dtype)
        biases = experts.biases()
        if self.mesh.tp > 1:
            groups = _mesh_groups(self.mesh)
            if groups is None:
                raise NotImplementedError(
                    f"the CPU path of a {self.mesh} layout needs the layout to span the "
                    "world of torch.distributed (comet.baseline.MeshGroups); this one "
                    "runs on CUDA only")
            shard = dict(w13=self.experts.gate_up(), w2=self.experts.w2, **biases)
            return mesh_moe_forward(x, topk_ids, topk_weights, shard, groups,
                                    self.convention, self.cfg.activation)
        variant = dict(activation=self.cfg.activation, **biases)
        if self.par.world_size > 1:
            return ep_moe_forward(x, topk_ids, topk_weights, experts.gate_up(),
                                  experts.w2, group=self.group, **variant)
        return reference.moe_forward(x, topk_ids, topk_weights, experts.gate_up(),
                                     experts.w2, round_to=x.dtype, **variant)

    def experts_backward(self, dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, weight_grads: bool) -> tuple:
        """Gradients of :meth:`eager_experts_forward`: ``(dx, d topk_weights, dW13, dW2,
        db13, db2)``, W13 and b13 in the experts' interleaved layout; the expert
        parameters' gradients are None without ``weight_grads``, the biases' also without
        biases. The fused backward on CUDA where ``fused_backward`` says so, else the
        unfused one over the layer's group. Collective, like the forward."""
        if self.replicas is not None:
            return self._replicated_backward(dy, x, topk_ids, topk_weights, weight_grads)
        biases = None if self.experts.b13 is None else (self.experts.b13, self.experts.b2)
        if x.is_cuda and self.fused_backward:
            grads = self.fused_layer().backward(dy, x, topk_ids, topk_weights,
                                                weight_grads=weight_grads,
                                                comm_blocks=self.comm_blocks)
        else:
            grads = routed_experts_backward(dy, x, topk_ids, topk_weights, self.experts.w13,
                                            self.experts.w2, self.group, layout="interleaved",
                                            weight_grads=weight_grads,
                                            activation=self.cfg.activation, biases=biases)
        return (*grads, None, None) if biases is None else grads

    def _replicated_backward(self, dy, x, topk_ids, topk_weights, weight_grads: bool) -> tuple:
        """:meth:`experts_backward` on the physical experts (the forward's translation
        again, not counted), the weight gradients folded into the owner slots."""
        r = self.replicas
        ids = r.route(topk_ids, count=False)
        e = self.experts
        biases = None if e.b13 is None else (e.b13, e.b2)
        if x.is_cuda and self.fused_backward:
            grads = self.fused_layer().backward(dy, x, ids, topk_weights,
                                                weight_grads=weight_grads,
                                                comm_blocks=self.comm_blocks)
        else:
            grads = routed_experts_backward(dy, x, ids, topk_weights, e.w13, e.w2, self.group,
                                            layout="interleaved", weight_grads=weight_grads,
                                            activation=self.cfg.activation, biases=biases)
        grads = (*grads, None, None) if len(grads) == 4 else grads
        if not weight_grads:
            return (*grads[:2], None, None, None, None)
        folded = r.fold(dict(zip(LocalExperts.SLOT_NAMES, grads[2:])), self.group)
        return (*grads[:2], *folded.values())

    def fused_layer(self) -> FusedMoE:
        """The :class:`comet.runtime.layer.FusedMoE` of this block (built on first use)."""
        if self._fused is None and self.replicas is not None:
            r, e = self.replicas, self.experts
            cfg = physical_config(self.cfg, r.placement_config.redundant_experts)
            kw = dict(group=self.group, tuned_config_folder=self.tuned_config_folder,
                      mesh=self.mesh, convention=self.convention, tile=self.tile)
            self._fused = (FusedMoE(cfg, *e.fp8_weights(), **kw) if self.cfg.fp8 is not None
                           else FusedMoE(cfg, e.w13, e.w2, b13=e.b13, b2=e.b2,
                                         w13_layout="interleaved", **kw))
        if self._fused is None and self.cfg.fp8 is not None:
            self._fused = FusedMoE(self.cfg, *self.experts.fp8_weights(), group=self.group,
                                   tuned_config_folder=self.tuned_config_folder,
                                   mesh=self.mesh, convention=self.convention, tile=self.tile)
        if self._fused is None:
            self._fused = FusedMoE(self.cfg, self.experts.w13, self.experts.w2,
                                   b13=self.experts.b13, b2=self.experts.added_b2,
                                   group=self.group, w13_layout="interleaved",
                                   tuned_config_folder=self.tuned_config_folder,
                                   mesh=self.mesh, convention=self.convention, tile=self.tile)
        return self._fused


def quantize_experts(module: CometMoE, fp8: Fp8 = Fp8()) -> CometMoE:
    """Run a bf16 :class:`CometMoE`'s routed experts in W8A8 FP8 from now on, in one call:
    its experts quantized with :mod:`comet.quant`'s recipe (``fp8.blocks``, 128 x 128 by
    default) into :class:`Fp8LocalExperts`, which replace the bf16 ones (their memory
    is freed once nothing else holds them: an optimizer's state would), its config's
    ``fp8`` set, its fused layer rebuilt on first use. Each rank quantizes its own experts
    (its TP shard's, with block grids of their own). Forward only: a call that needs
    gradients then raises NotImplementedError. Returns ``module``."""
    if not isinstance(module, CometMoE):
        raise TypeError(f"quantize_experts takes a CometMoE, got {type(module).__name__}")
    if not isinstance(fp8, Fp8):
        raise TypeError(f"fp8 must be a comet.quant.Fp8, got {type(fp8).__name__}")
    if module.cfg.fp8 is not None:
        raise ValueError("this layer's experts are FP8 already")
    if type(module.experts) is not LocalExperts:
        raise TypeError(
            f"quantize_experts quantizes a CometMoE's own experts; this block runs "
            f"{type(module.experts).__name__} (a patched transformers model's, kept under "
            "its keys). Load the model in FP8 instead (transformers' FineGrainedFP8Config) "
            "and patch that: patch_model keeps FP8Experts in FP8")
    module._start_fp8(fp8)
    return module
