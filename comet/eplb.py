"""A layer's redundant experts (EPLB): the physical experts a rank holds, filled from the
logical ones, the device-side load count, and re-placement.

:class:`comet.moe.CometMoE` with ``redundant_experts=R`` keeps its logical experts as they
are (``experts.w13`` ..., this rank's ``E / W`` of them: the state dict, its keys and the
checkpoint layout do not change) and runs its routed experts on ``P = E + R`` physical
experts, ``P / W`` per rank, held here as non-persistent buffers: copies of logical
experts chosen by a placement (:mod:`comet.placement`). A call counts its logical pairs
(:func:`comet.replicas.count_load`), translates its ids to physical ones
(:func:`comet.replicas.translate`) and runs the layer on the physical layout.

The copies cost ``P / W`` experts of memory on each rank beside the ``E / W`` logical
ones. They are refilled after ``load_state_dict`` (a hook), by a call that finds the
logical experts changed in place (their version counters: an optimizer step), and by
:meth:`ExpertReplicas.place` (a new placement). Every copy is written in place, so the
fused layer, and any CUDA graph that captured it, keep reading the right addresses.
Training folds each replica's weight gradient back into its logical expert
(:meth:`ExpertReplicas.fold`), so optimizers and checkpoints see the logical layer only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from comet.config import MoEConfig, ParallelConfig
from comet.placement import (Placement, PlacementConfig, dispatch_shares, home_placement,
                             plan_placement)
from comet.replicas import ReplicaTables, count_load, translate
from comet.weights import gate_up_first

__all__ = ["ExpertReplicas", "physical_config"]


def physical_config(cfg: MoEConfig, redundant_experts: int) -> MoEConfig:
    """The layer the kernels run: ``E + R`` experts. The router's fields (groups) stay
    with the logical layer, which routes before translation."""
    return dataclasses.replace(cfg, num_experts=cfg.num_experts + redundant_experts,
                               n_group=1, topk_group=1)


class ExpertReplicas(nn.Module):
    """This rank's physical experts and the placement they follow.

    Args:
        cfg: the logical layer.
        placement: ``E``, ``R``, the group's ``W`` ranks and, for the hierarchical
            strategy, its nodes and expert groups.
        par: this rank in the group.
        device: where the copies live (the logical experts' device).
        bias: whether the experts have biases (``cfg.expert_bias``).
        prefer_local: split pairs by the plan's dispatch shares (own-rank replicas
            first where the balance allows); False: ``t mod c`` (:mod:`comet.replicas`).

    Buffers (not saved): ``w13 [P/W, H, 2F]`` (the kernels' interleaved columns, as
    :class:`comet.moe.LocalExperts`), ``w2 [P/W, F, H]``, ``b13``/``b2`` with biases; the
    tables of :class:`comet.replicas.ReplicaTables`; ``load [E + 1]`` int64 (entry 0:
    slots with no expert).
    """

    def __init__(self, cfg: MoEConfig, placement: PlacementConfig, par: ParallelConfig,
                 device=None, bias: bool = False, prefer_local: bool = True):
        super().__init__()
        self.placement_config, self.par, self.prefer_local = placement, par, prefer_local
        slots, h, f = placement.slots_per_gpu, cfg.hidden_size, cfg.intermediate_size
        kw = dict(dtype=cfg.dtype, device=device)
        self.register_buffer("w13", torch.zeros(slots, h, 2 * f, **kw), persistent=False)
        self.register_buffer("w2", torch.zeros(slots, f, h, **kw), persistent=False)
        self.register_buffer("b13", torch.zeros(slots, 2 * f, **kw) if bias else None,
                             persistent=False)
        self.register_buffer("b2", torch.zeros(slots, h, **kw) if bias else None,
                             persistent=False)
        tables = ReplicaTables.empty(placement.num_experts, placement.redundant_experts,
                                     placement.num_gpus, device)
        for name in ("log2phy", "replicas", "phy2log", "split"):
            self.register_buffer(name, getattr(tables, name), persistent=False)
        self.register_buffer("load", torch.zeros(placement.num_experts + 1, dtype=torch.int64,
                                                 device=device), persistent=False)
        self.placement: Placement | None = None    # the plan the copies hold (host)
        self._versions: tuple = ()                 # the logical experts' when copied

    @property
    def tables(self) -> ReplicaTables:
        return ReplicaTables(self.log2phy, self.replicas, self.phy2log,
                             self.placement_config.slots_per_gpu, self.split)

    # ------------------------------------------------------------------ per call
    def route(self, topk_ids: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Count ``topk_ids``' logical pairs (unless ``count`` is False: a backward
        re-deriving its forward's ids) and return their physical ids (device ops only)."""
        if count:
            count_load(self.load, topk_ids)
        return translate(topk_ids, self.tables, self.par.rank, self.prefer_local)

    def stale(self, logical: dict[str, torch.Tensor | None]) -> bool:
        """Whether the logical experts were changed in place (an optimizer step,
        ``copy_``) since the copies were made: their version counters moved. Edits
        through ``.data`` leave no trace; :meth:`CometMoE.refresh_replicas` then."""
        return self._versions != _versions(logical)

    def expert_load(self) -> torch.Tensor:
        """``[E]`` int64 pairs this rank routed to each logical expert since the last
        :meth:`reset_load` (a copy, on the device)."""
        return self.load[1:].clone()

    def reset_load(self) -> None:
        self.load.zero_()

    def gate_up(self) -> torch.Tensor:
        """``w13`` with all gate columns first (a copy; the CPU paths' layout)."""
        return gate_up_first(self.w13)

    def biases(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the CPU paths: ``{"b13", "b2"}`` or ``{}``."""
        if self.b13 is None:
            return {}
        return {"b13": gate_up_first(self.b13), "b2": self.b2}

    # ------------------------------------------------------------------ placement
    def plan(self, load: torch.Tensor | None = None,
             rank_load: torch.Tensor | None = None) -> Placement:
        """A placement for ``load [E]`` (every rank's, summed) and, given, each rank's
        ``rank_load [W, E]`` (dispatch shares that keep pairs on their rank where the
        balance allows), or the layout without replicas
        (:func:`comet.placement.home_placement`) for neither."""
        if load is None and rank_load is None:
            return home_placement(self.placement_config)
        if rank_load is not None:
            rank_load = rank_load.detach().double().cpu()
        if load is not None:
            load = load.detach().double().cpu()
        return plan_placement(load, self.placement_config, rank_load=rank_load)

    @torch.no_grad()
    def place(self, plan: Placement, logical: dict[str, torch.Tensor | None],
              group=None) -> None:
        """Fill this rank's slots with the logical experts ``plan`` (one layer) puts there
        and load its tables, in place. ``logical``: this rank's logical experts by name
        (``w13``, ``w2``, ``b13``, ``b2``; ``E / W`` each). Collective over ``group``
        when it has several ranks: each expert a rank needs from another is broadcast
        by its owner, one broadcast per owner and tensor. ValueError for a plan of
        another shape."""
        cfg = self.placement_config
        phy2log = plan.phy2log
        if phy2log.dim() == 2:
            if phy2log.shape[0] != 1:
                raise ValueError(f"a layer takes a one-layer plan, got {phy2log.shape[0]}")
            plan = Placement(plan.phy2log[0:1], plan.log2phy[0:1], plan.replicas[0:1],
                             plan.num_gpus,
                             None if plan.shares is None else plan.shares[0:1])
        if (plan.num_gpus != cfg.num_gpus or plan.phy2log.shape[-1] != cfg.physical_experts
                or plan.replicas.shape[-1] != cfg.num_experts):
            raise ValueError(f"the plan places {plan.replicas.shape[-1]} experts on "
                             f"{plan.phy2log.shape[-1]} slots of {plan.num_gpus} GPUs; this "
                             f"layer has {cfg.num_experts} on {cfg.physical_experts} of "
                             f"{cfg.num_gpus}")
        phy2log = plan.phy2log[0].tolist()
        own, rank, slots = cfg.num_experts // cfg.num_gpus, self.par.rank, cfg.slots_per_gpu
        names = [n for n in ("w13", "w2", "b13", "b2") if getattr(self, n) is not None]
        sources: dict[int, dict[str, torch.Tensor]] = {}   # logical expert -> its weights
        for owner in range(cfg.num_gpus):
            # The experts of ``owner`` that slots of other ranks hold, in id order.
            sent = sorted({e for s, e in enumerate(phy2log)
                           if e // own == owner and s // slots != owner})
            if not sent:
                continue
            if owner == rank or cfg.num_gpus == 1:
                bufs = {n: logical[n][[e - owner * own for e in sent]].contiguous()
                        for n in names}
            else:
                bufs = {n: torch.empty((len(sent), *logical[n].shape[1:]),
                                       dtype=logical[n].dtype, device=logical[n].device)
                        for n in names}
            if cfg.num_gpus > 1:
                src = owner if group is None else dist.get_global_rank(group, owner)
                for n in names:
                    dist.broadcast(bufs[n], src=src, group=group)
            for i, e in enumerate(sent):
                sources[e] = {n: bufs[n][i] for n in names}
        for i, e in enumerate(phy2log[rank * slots:(rank + 1) * slots]):
            for n in names:
                src = (logical[n][e - rank * own] if e // own == rank else sources[e][n])
                getattr(self, n)[i].copy_(src)
        shares = plan.shares if plan.shares is not None else dispatch_shares(plan)
        self.tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], shares[0])
        self.placement = plan
        self._versions = _versions(logical)

    @torch.no_grad()
    def fold(self, grads: dict[str, torch.Tensor | None],
             logical: dict[str, torch.Tensor | None], group=None
             ) -> dict[str, torch.Tensor | None]:
        """The gradients of this rank's logical experts from those of its physical slots
        ``grads`` (``[P/W, ...]`` by name, None where not computed): every replica's
        gradient summed into its logical expert -- on this rank with ``index_add_``, from
        other ranks by one ``reduce`` to the owner per owner and tensor (the reverse of
        :meth:`place`'s broadcasts). Collective over ``group`` when it has several
        ranks."""
        cfg = self.placement_config
        own, rank, slots = cfg.num_experts // cfg.num_gpus, self.par.rank, cfg.slots_per_gpu
        phy2log = self.placement.phy2log[0].tolist()
        mine = phy2log[rank * slots:(rank + 1) * slots]
        names = [n for n, g in grads.items() if g is not None]
        out = {n: None for n in grads}
        for n in names:
            out[n] = torch.zeros_like(logical[n], dtype=torch.float32)
            here = [i for i, e in enumerate(mine) if e // own == rank]
            if here:
                index = torch.tensor([mine[i] - rank * own for i in here], device=out[n].device)
                out[n].index_add_(0, index, grads[n][here].float())
        for owner in range(cfg.num_gpus if cfg.num_gpus > 1 else 0):
            held = sorted({e for s, e in enumerate(phy2log)
                           if e // own == owner and s // slots != owner})
            if not held:
                continue
            src = owner if group is None else dist.get_global_rank(group, owner)
            for n in names:
                buf = torch.zeros((len(held), *logical[n].shape[1:]), dtype=torch.float32,
                                  device=logical[n].device)
                if owner != rank:
                    for i, e in enumerate(mine):
                        if e in held:
                            buf[held.index(e)] += grads[n][i].float()
                dist.reduce(buf, dst=src, group=group)
                if owner == rank:
                    out[n].index_add_(0, torch.tensor([e - rank * own for e in held],
                                                      device=buf.device), buf)
        return {n: None if g is None else g.to(logical[n].dtype) for n, g in out.items()}


def _versions(logical: dict[str, torch.Tensor | None]) -> tuple:
    return tuple(None if t is None else t._version for t in logical.values())
