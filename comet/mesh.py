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
describes the layout (who holds what).

**How the fused kernels run a layout: shards as experts.** The kernels are written for
expert parallelism over W ranks. A (tp, ep) layout is that, over ``E * tp`` *shard
experts*: shard ``t`` of expert ``e`` is an expert of its own (``F / tp`` wide) on rank
``(e // El, t)``, numbered so that rank ``r`` holds shard experts ``[r * El, (r + 1) *
El)`` (:meth:`MeshLayout.shard_expert`). A token's ``k`` choices become ``k * tp`` slots
(:meth:`MeshLayout.shard_routing`; slot ``j * tp + t`` is shard ``t`` of choice ``j``),
and the sum over a token's slots that the combine computes anyway adds the shards'
partial sums -- in a fixed order, so the result is deterministic.

* ``"sequence"``: every slot is live; the dispatch sends a token's row to each TP peer of
  each chosen expert (the TP all-gather and the EP dispatch in one), and every shard's
  weighted partial row comes back to the token's rank.
* ``"replicated"``: the TP ranks of a group hold the same tokens, so rank ``(i, t)``
  keeps only the slots of its own shard index ``t`` (the others are ``-1``): rows go only
  to ranks of the same TP index (none cross the TP group), and each partial row is
  written to every rank of the token's TP group (:meth:`MeshLayout.home_fanout`: the
  all-reduce, fused into layer1), whose combines all sum the same slots in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from comet.config import MoEConfig
from comet.quant import Fp8Weight

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

    @classmethod
    def from_device_mesh(cls, device_mesh) -> tuple["MeshLayout", object]:
        """``(layout, group)`` of a 2-D ``torch.distributed.DeviceMesh`` whose dims are
        named ``"ep"`` and ``"tp"`` (in either order) and whose ranks are numbered
        TP-major (``init_device_mesh("cuda", (ep, tp), mesh_dim_names=("ep", "tp"))``);
        ``group`` is the process group of all its ranks (the world when it spans it).
        ValueError for another shape, names or numbering."""
        import torch.distributed as dist
        names = tuple(device_mesh.mesh_dim_names or ())
        if device_mesh.ndim != 2 or sorted(names) != ["ep", "tp"]:
            raise ValueError(f"expected a 2-D DeviceMesh with dims named 'ep' and 'tp', got "
                             f"{device_mesh.ndim} dims named {names}")
        ranks = device_mesh.mesh
        if names == ("tp", "ep"):
            ranks = ranks.t()
        layout = cls(tp=int(ranks.shape[1]), ep=int(ranks.shape[0]))
        first = int(ranks.min())
        expected = first + torch.arange(layout.world).view(layout.ep, layout.tp)
        if not torch.equal(ranks.cpu(), expected):
            raise ValueError("the DeviceMesh's ranks must be numbered TP-major (rank = "
                             f"first + ep_rank * tp + tp_rank), got {ranks.tolist()}")
        if layout.world == dist.get_world_size():
            return layout, dist.group.WORLD
        return layout, dist.new_group(list(range(first, first + layout.world)))

    @classmethod
    def from_groups(cls, tp_group, ep_group) -> tuple["MeshLayout", object]:
        """``(layout, group)`` of a layout given as its two process groups (this rank's
        TP group and EP group), spanning the world: ValueError unless their ranks are the
        TP-major layout's (:meth:`tp_group`, :meth:`ep_group`) -- mismatched groups would
        send rows to ranks that do not hold the experts."""
        import torch.distributed as dist
        tp_ranks = dist.get_process_group_ranks(tp_group)
        ep_ranks = dist.get_process_group_ranks(ep_group)
        layout = cls(tp=len(tp_ranks), ep=len(ep_ranks))
        rank = dist.get_rank()
        if layout.world != dist.get_world_size():
            raise ValueError(f"tp ({layout.tp}) * ep ({layout.ep}) must be the world size "
                             f"({dist.get_world_size()})")
        if tp_ranks != layout.tp_group(rank) or ep_ranks != layout.ep_group(rank):
            raise ValueError(f"rank {rank}: TP group {tp_ranks} and EP group {ep_ranks} are "
                             f"not the TP-major layout's {layout.tp_group(rank)} and "
                             f"{layout.ep_group(rank)}")
        return layout, dist.group.WORLD

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

    def token_source(self, rank: int, convention: Convention) -> int:
        """The rank whose tokens ``rank`` passes: its own, or under ``"replicated"`` the
        first of its TP group's (every rank of the group passes the same ones)."""
        _check_convention(convention)
        return self.tp_group(rank)[0] if convention == "replicated" else rank

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
               "w2": w2[sel, cols.start:cols.stop].contiguous(), "b13": None, "b2": None}
        if b13 is not None:
            out["b13"] = b13[sel].index_select(-1, gate_up)
        if b2 is not None and self.coords(rank)[1] == 0:
            out["b2"] = b2[sel]
        return out

    def shard_fp8(self, rank: int, gate_up: Fp8Weight, down: Fp8Weight
                  ) -> tuple[Fp8Weight, Fp8Weight]:
        """:meth:`shard` of FP8 experts (:mod:`comet.quant`): ``gate_up [E, 2F, H]``
        (gate rows, then up rows) and ``down [E, H, F]`` -> ``rank``'s ``[El, 2Ft, H]``
        (its gate rows, then its up rows, each with its own block grid: ``parts=2``) and
        ``[El, H, Ft]``, scales included, exactly (:meth:`~comet.quant.Fp8Weight.narrow`:
        a shard that starts inside a block is re-blocked, 64 wide for Ft = 192)."""
        e, f = down.experts, down.k
        self.check(e, f)
        experts, cols = self.expert_range(e, rank), self.ffn_range(f, rank)
        halves = [h.narrow(1, cols.start, len(cols)) for h in _gate_and_up(gate_up)]
        stacked = Fp8Weight(torch.cat([h.weight for h in halves], dim=1),
                            torch.cat([h.scale_inv for h in halves], dim=1), halves[0].blocks,
                            parts=2)
        return (_experts(stacked, experts),
                _experts(down.narrow(2, cols.start, len(cols)), experts))

    # ------------------------------------------------------------------ the kernels' view
    def home_fanout(self, convention: Convention) -> int:
        """Ranks each partial output row is written to: the token's TP group under
        ``"replicated"`` (every one of them returns the token), else its rank alone."""
        _check_convention(convention)
        return self.tp if convention == "replicated" else 1

    def table_layout(self, convention: Convention) -> str | None:
        """How ``comet tune`` tables of this layout are told apart from those of the same
        kernel shape (``"tp2-sequence"``; None for expert parallelism, whose tables carry
        no layout): the two conventions move different rows through the same kernels, and
        their best block splits differ (docs/tuning.md)."""
        _check_convention(convention)
        return None if self.tp == 1 else f"tp{self.tp}-{convention}"

    def kernel_config(self, cfg: MoEConfig) -> MoEConfig:
        """The expert-parallel layer the kernels run for ``cfg`` in this layout: ``E *
        tp`` shard experts ``F / tp`` wide, ``k * tp`` slots per token of which at most
        ``k`` reach one rank (``rank_slots``: a shard expert of each choice, one TP index
        per rank), which sizes the received rows as EP's ``k`` does. The router fields do
        not reach the kernels and are reset."""
        self.check(cfg.num_experts, cfg.intermediate_size)
        if self.tp == 1:
            return cfg
        return cfg.replace(num_experts=cfg.num_experts * self.tp,
                           intermediate_size=cfg.intermediate_size // self.tp,
                           top_k=cfg.top_k * self.tp, rank_slots=cfg.top_k,
                           n_group=1, topk_group=1,
                           score_correction_bias=False, num_shared_experts=0,
                           shared_intermediate_size=None, shared_expert_gate=False)

    def shard_expert(self, expert, tp_rank, num_experts: int):
        """The shard-expert id of shard ``tp_rank`` of global ``expert`` (ints or
        tensors) in a layer of ``num_experts``: ``(expert // El * tp + tp_rank) * El +
        expert % El`` -- on rank ``(expert // El, tp_rank)``, as its local expert
        ``expert % El``."""
        el = num_experts // self.ep
        return (expert // el * self.tp + tp_rank) * el + expert % el

    def shard_routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      num_experts: int, rank: int, convention: Convention
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [M, k * tp], weights [M, k * tp])``: rank ``rank``'s routing as the
        kernels take it (slot ``j * tp + t`` = shard ``t`` of choice ``j``; see the module
        doc). The torch spec of :mod:`comet.kernels.mesh_routing`. An id that is neither
        an expert nor -1 stays invalid (``E * tp``, in the first slot the rank keeps), so
        the plan kernels report it; "no expert" (-1) stays -1."""
        _check_convention(convention)
        m, k = topk_ids.shape
        ids = topk_ids.to(torch.int64)
        valid = (ids >= 0) & (ids < num_experts)
        shard = torch.arange(self.tp, device=ids.device)
        out = self.shard_expert(ids.clamp(0, num_experts - 1)[..., None], shard, num_experts)
        out = torch.where(valid[..., None], out, -1)
        kept = self.coords(rank)[1] if convention == "replicated" else 0
        if convention == "replicated":
            out = torch.where(shard == kept, out, -1)
        bad = ~valid & (ids != -1)
        out[..., kept] = torch.where(bad, num_experts * self.tp, out[..., kept])
        weights = topk_weights.float()[..., None].expand(m, k, self.tp)
        return out.reshape(m, k * self.tp), weights.reshape(m, k * self.tp).contiguous()


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


def _gate_and_up(w: Fp8Weight) -> tuple[Fp8Weight, Fp8Weight]:
    """The gate and the up rows of ``gate_up [E, 2F, K]`` as one-part weights: its two
    parts, or halves of one part whose row blocks do not straddle them."""
    f = w.n // 2
    if w.parts == 2:
        return tuple(Fp8Weight(q, s, w.blocks) for q, s in
                     zip(w.weight.chunk(2, dim=1), w.scale_inv.chunk(2, dim=1)))
    if w.parts != 1:
        raise ValueError(f"gate_up has parts 1 or 2 (gate, up), got {w.parts}")
    if w.blocks.n is None:       # one scale row: each half keeps it
        return tuple(Fp8Weight(q, w.scale_inv, w.blocks) for q in w.weight.chunk(2, dim=1))
    bn = w.block_shape()[0]
    if f % bn:
        raise ValueError(f"gate_up's {bn}-row scale blocks straddle its gate and up rows "
                         f"(F = {f}): quantize it with parts=2")
    return tuple(Fp8Weight(q, s, w.blocks) for q, s in
                 zip(w.weight.chunk(2, dim=1), w.scale_inv.split(f // bn, dim=1)))


def _experts(w: Fp8Weight, experts: range) -> Fp8Weight:
    """Experts ``experts`` of ``w`` (contiguous copies: the kernels read whole rows)."""
    sel = slice(experts.start, experts.stop)
    return Fp8Weight(w.weight[sel].contiguous(), w.scale_inv[sel].contiguous(), w.blocks,
                     w.parts)
