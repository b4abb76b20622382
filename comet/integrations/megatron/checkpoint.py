"""comet's Megatron experts in Megatron's checkpoints: the weight layouts and the sharded
state dict.

comet keeps a rank's experts in its kernels' layout (:class:`comet.moe.LocalExperts`):
``w13 [El, H, 2Ft]`` with gate and up columns interleaved in blocks
(:mod:`comet.weights`) and ``w2 [El, Ft, H]`` (``Ft = F / expert_tp``). Megatron's expert
modules -- ``SequentialMLP``, ``GroupedMLP``, ``TEGroupedMLP`` -- keep different tensors
but write the same distributed checkpoint (their ``sharded_state_dict`` say so): per MoE
layer

* ``{prefix}experts.linear_fc1.weight``, global ``[E, 2F, H]``: each expert's first
  projection as a Linear weight, all gate rows (the activated half), then all up rows; an
  expert-TP rank holds rows ``[r*F/tp, (r+1)*F/tp)`` of each half;
* ``{prefix}experts.linear_fc2.weight``, global ``[E, H, F]``, F split over expert TP;
* ``{prefix}experts.linear_fc{1,2}._extra_state``, one object per expert (empty here);

with the decoder's layer axis in front. :func:`experts_sharded_state_dict` writes comet's
parameters under exactly these keys and global shapes (converted by
:class:`~megatron.core.dist_checkpointing.mapping.ShardedTensorFactory`, so on load the
merge step turns Megatron's layout back into comet's), which is what makes a checkpoint
saved with comet load into a model with Megatron's experts, and back. The per-expert
``singleton_local_shards`` format and the distributed optimizer's flattened formats are
refused (``NotImplementedError``); parameters in the module's own ``state_dict()`` keep
comet's names and layout, so a plain state dict of Megatron's experts cannot be loaded
into comet's by mistake (the keys differ).
"""

from __future__ import annotations

import re

import torch

from comet.weights import gate_up_first, interleave_gate_up

#: State-dict keys of the per-expert extra-state objects (``expert{g}.linear_fc1._extra_state``,
#: as Megatron's GroupedMLP names them): written for Megatron's modules to find, dropped
#: on load.
EXTRA_STATE_KEY = re.compile(r"expert\d+\.linear_fc[12]\._extra_state$")


def fc1_of(w13: torch.Tensor) -> torch.Tensor:
    """comet's ``w13 [El, H, 2Ft]`` (interleaved) -> Megatron's per-expert fc1 weights
    ``[El, 2Ft, H]``, gate rows then up rows (a new contiguous tensor)."""
    return gate_up_first(w13).transpose(1, 2).contiguous()


def w13_of(fc1: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`fc1_of`."""
    return interleave_gate_up(fc1.transpose(1, 2))


def fc2_of(w2: torch.Tensor) -> torch.Tensor:
    """comet's ``w2 [El, Ft, H]`` -> Megatron's per-expert fc2 weights ``[El, H, Ft]``."""
    return w2.transpose(1, 2).contiguous()


#: The inverse of :func:`fc2_of` (the same transpose).
w2_of = fc2_of


def _no_flat(flattened_range) -> None:
    if flattened_range is not None:
        raise NotImplementedError(
            "comet's Megatron experts: flattened (fully sharded) optimizer-state formats "
            "are not supported; save the model weights, or use a non-flattened format")


def experts_sharded_state_dict(w13: torch.Tensor, w2: torch.Tensor, *, prefix: str,
                               sharded_offsets: tuple, metadata: dict | None,
                               num_experts: int, ep: tuple[int, int], tp: tuple[int, int],
                               dp_rank: int) -> dict:
    """The sharded state dict of one rank's experts (see the module doc).

    Args:
        w13, w2: this rank's experts in comet's layout (parameters: the factories keep
            them and convert on save, and convert loaded tensors back on load).
        prefix: the experts module's state-dict prefix (``...mlp.experts.``).
        sharded_offsets: the offsets Megatron's parents pass down (the layer axis).
        metadata: Megatron's checkpoint metadata (``singleton_local_shards`` refused).
        num_experts: E over all ranks; ep, tp: ``(rank, size)`` in the expert-parallel
            and expert-tensor-parallel groups; dp_rank: the rank in the expert-data-
            parallel group (its replicas are not saved twice).
    """
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    if (metadata or {}).get("singleton_local_shards", False):
        raise NotImplementedError("comet's Megatron experts: the singleton_local_shards "
                                  "(per-expert keys) checkpoint format is not supported")
    (ep_rank, ep_size), (tp_rank, tp_size) = ep, tp
    local = w13.shape[0]
    axis = len(sharded_offsets)       # the experts' axis follows the parents' axes
    experts_axis = (axis, ep_rank, ep_size)

    def shard(key, data, replica_id, ffn_axis):
        return ShardedTensor.from_rank_offsets(key, data, *sharded_offsets, experts_axis,
                                               ffn_axis, replica_id=replica_id,
                                               prepend_axis_num=axis)

    @torch.no_grad()
    def build_fc1(key, t, replica_id, flattened_range):
        _no_flat(flattened_range)
        gate, up = fc1_of(t).chunk(2, dim=1)
        # Gate rows are the first half of the global 2F rows, up rows the second: this
        # rank's F/tp rows of each are fragments tp_rank and tp + tp_rank of 2*tp.
        return [shard(key, gate.contiguous(), replica_id, (axis + 1, tp_rank, 2 * tp_size)),
                shard(key, up.contiguous(), replica_id,
                      (axis + 1, tp_size + tp_rank, 2 * tp_size))]

    @torch.no_grad()
    def merge_fc1(loaded):
        return w13_of(torch.cat(loaded, dim=1))

    @torch.no_grad()
    def build_fc2(key, t, replica_id, flattened_range):
        _no_flat(flattened_range)
        return shard(key, fc2_of(t), replica_id, (axis + 2, tp_rank, tp_size))

    @torch.no_grad()
    def merge_fc2(loaded):
        return w2_of(loaded)

    replica = (0, 0, dp_rank)
    out = {
        f"{prefix}w13": ShardedTensorFactory(f"{prefix}experts.linear_fc1.weight", w13,
                                             build_fc1, merge_fc1, replica),
        f"{prefix}w2": ShardedTensorFactory(f"{prefix}experts.linear_fc2.weight", w2,
                                            build_fc2, merge_fc2, replica),
    }
    for g in range(ep_rank * local, (ep_rank + 1) * local):
        for mod in ("linear_fc1", "linear_fc2"):
            out[f"{prefix}expert{g}.{mod}._extra_state"] = make_sharded_object_for_checkpoint(
                None, f"{prefix}experts.{mod}._extra_state",
                (*sharded_offsets, (axis, g, num_experts)), (0, tp_rank, dp_rank))
    return out
