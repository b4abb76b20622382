"""The (tp, ep) layout of a tensor- and expert-parallel MoE layer over ``tp * ep`` ranks.

The experts are split over the EP dimension (as in the expert-parallel layout of
:class:`comet.config.ParallelConfig`), and each expert's FFN dimension ``F`` over the TP
dimension: TP rank ``t`` holds columns ``[t * F/tp, (t + 1) * F/tp)`` of the gate and of
the up projection (W13) and the same rows of W2. Because the gated activation is
elementwise over ``F``, an expert's output is the sum over the TP shards of each shard's
``act(x @ W13_t) @ W2_t`` -- the partial sums a TP layout reduces (with the output bias
``b2`` added by TP rank 0 alone).

Ranks are numbered TP-major: ``rank = ep_rank * tp + tp_rank``, so a TP group is ``tp``
consecutive ranks (one node's NVLink domain first, as Megatron-Core orders them).

Two input conventions (``Convention``), each returning every rank's own tokens' full
outputs:

* ``"sequence"`` (sequence parallel: Megatron, flux): each rank passes its own tokens;
* ``"replicated"`` (vLLM/SGLang TP): the ranks of a TP group pass the same tokens.

:func:`comet.reference.mesh_forward` states what each rank returns; this module only
describes the layout (who holds what). The fused kernels run ``tp == 1`` today.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Convention = Literal["sequence", "replicated"]
CONVENTIONS = ("sequence", "replicated")

#: F / tp must be a multiple of this (the kernels' size alignment, comet.config).
SHARD_ALIGNMENT = 16


@dataclass(frozen=True)
class MeshLayout:
    """``tp * ep`` ranks: experts split over ``ep``, each expert's F over ``tp``."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world(self) -> int:
        return self.tp * self.ep

    def coords(self, rank: int) -> tuple[int, int]:
        """``(ep_rank, tp_rank)`` of ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        return divmod(rank, self.tp)

    def rank(self, ep_rank: int, tp_rank: int) -> int:
        return ep_rank * self.tp + tp_rank

    def tp_group(self, rank: int) -> list[int]:
        """The ranks sharing ``rank``'s experts (its F shards' owners), in TP order."""
        e, _ = self.coords(rank)
        return [self.rank(e, t) for t in range(self.tp)]

    def ep_group(self, rank: int) -> list[int]:
        """The ranks holding ``rank``'s F shard of every expert, in EP order."""
        _, t = self.coords(rank)
        return [self.rank(e, t) for e in range(self.ep)]

    def check(self, num_experts: int, ffn: int) -> None:
        """Raise ValueError, naming the field, if this layout cannot shard the layer."""
        if num_experts % self.ep:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep ({self.ep})")
        if ffn % self.tp or (ffn // self.tp) % SHARD_ALIGNMENT:
            raise ValueError(f"intermediate_size ({ffn}) must split over tp ({self.tp}) into "
                             f"shards that are multiples of {SHARD_ALIGNMENT}")

    def expert_range(self, num_experts: int, rank: int) -> range:
        """Global expert ids ``rank`` holds (a shard of each)."""
        el = num_experts // self.ep
        e, _ = self.coords(rank)
        return range(e * el, (e + 1) * el)

    def ffn_range(self, ffn: int, rank: int) -> range:
        """The F columns (of gate and of up) and W2 rows ``rank`` holds."""
        ft = ffn // self.tp
        _, t = self.coords(rank)
        return range(t * ft, (t + 1) * ft)

    def shard(self, rank: int, w13: torch.Tensor, w2: torch.Tensor,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> dict:
        """``rank``'s part of the full expert weights (``w13 [E, H, 2F]`` gate then up,
        ``w2 [E, F, H]``, biases ``b13 [E, 2F]``, ``b2 [E, H]``): ``{"w13": [El, H, 2Ft],
        "w2": [El, Ft, H], "b13": [El, 2Ft], "b2": [El, H] or None}`` -- gate then up again
        inside the shard; ``b2`` only on TP rank 0 (the partial sums add it once)."""
        e, f = w13.shape[0], w2.shape[1]
        self.check(e, f)
        experts, cols = self.expert_range(e, rank), self.ffn_range(f, rank)
        sel = slice(experts.start, experts.stop)
        gate_up = torch.cat([torch.arange(cols.start, cols.stop),
                             f + torch.arange(cols.start, cols.stop)]).to(w13.device)
        out = {"w13": w13[sel].index_select(-1, gate_up),
               "w2": w2[sel, cols.start:cols.stop], "b13": None, "b2": None}
        if b13 is not None:
            out["b13"] = b13[sel].index_select(-1, gate_up)
        if b2 is not None and self.coords(rank)[1] == 0:
            out["b2"] = b2[sel]
        return out
