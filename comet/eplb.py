"""A layer's redundant experts (EPLB): the physical experts a rank holds, the device-side
load count, and re-placement.

:class:`comet.moe.CometMoE` with ``redundant_experts=R`` runs its routed experts on
``P = E + R`` physical experts, ``P / W`` per rank, chosen by a placement
(:mod:`comet.placement`): copies of logical experts. The physical slots are the layer's
storage -- its ``experts.w13`` ... Parameters are ``[P/W, ...]`` -- so a rank holds what
a layer without replicas would plus ``R / W`` slots, and no second, logical copy. A call
counts its logical pairs (:func:`comet.replicas.count_load`), translates its ids to
physical ones (:func:`comet.replicas.translate`) and runs the layer on its slots.

One slot of each logical expert is its *owner*: the first of its slots in the plan's
order. Training sums every replica's gradient into the owner (the other slots' gradients
are zero, :meth:`ExpertReplicas.fold`), so an optimizer steps each logical expert once;
the next call finds the slots changed in place (their version counters) and copies each
owner into its replicas again. The state dict is the logical one (gathered from the owner
slots; :meth:`ExpertReplicas.logical`), and loading one fills every slot
(:meth:`ExpertReplicas.load_logical`). Every exchange between ranks is point to point
(:func:`copy_experts`): each expert a rank lacks comes from one rank that holds it, as
:func:`senders` decides the same way on every rank. Every slot is written in place, so
the fused layer, and any CUDA graph that captured it, keep reading the right addresses.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from comet.config import MoEConfig, ParallelConfig
from comet.placement import (Placement, PlacementConfig, dispatch_shares, home_placement,
                             plan_placement)
from comet.replicas import ReplicaTables, count_load, translate

__all__ = ["ExpertReplicas", "copy_experts", "physical_config", "senders"]

#: ``expert -> [(rank, row), ...]``: where copies of each expert lie.
Sources = dict[int, list[tuple[int, int]]]
#: ``[(rank, row, expert), ...]``: rows to fill with an expert.
Targets = list[tuple[int, int, int]]
#: ``(rows, device) -> int64 tensor of rows on device``: how an exchange makes its indices.
Indexer = Callable[[tuple[int, ...], torch.device], torch.Tensor]


def host_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``rows`` as an index tensor on ``device``, made now (a pageable copy to a GPU, which
    waits for the device: fine once per re-placement, not once per training step)."""
    return torch.tensor(rows, dtype=torch.int64, device=device)


def physical_config(cfg: MoEConfig, redundant_experts: int) -> MoEConfig:
    """The layer the kernels run: ``E + R`` experts. The router's fields (groups) stay
    with the logical layer, which routes before translation."""
    return dataclasses.replace(cfg, num_experts=cfg.num_experts + redundant_experts,
                               n_group=1, topk_group=1)


def senders(sources: Sources, targets: Targets) -> dict[tuple[int, int], list[int]]:
    """``{(src, dst): experts}``: the experts each rank ``dst`` must receive for
    ``targets`` (those it holds no copy of in ``sources``), each once, and the rank it
    comes from: the ranks holding an expert take turns (in rank order), so the copies of a
    hot expert share its sends. A function of its arguments only: every rank computes
    the same. ValueError for a target no rank holds."""
    holders = {e: sorted({r for r, _ in rows}) for e, rows in sources.items()}
    wanted = sorted({(dst, e) for dst, _, e in targets})
    turn: dict[int, int] = {}
    out: dict[tuple[int, int], list[int]] = {}
    for dst, e in wanted:
        have = holders.get(e, [])
        if dst in have:
            continue
        if not have:
            raise ValueError(f"expert {e} is wanted on rank {dst} but no rank holds it")
        k = turn[e] = turn.get(e, -1) + 1
        out.setdefault((have[k % len(have)], dst), []).append(e)
    return out


@torch.no_grad()
def copy_experts(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                 sources: Sources, targets: Targets, rank: int, group=None,
                 index: Indexer = host_index) -> None:
    """Fill this rank's ``targets`` rows of ``dst`` (per name) with their experts' rows of
    ``src`` (per name, the same names): from a row of this rank where it holds one, else
    received from the rank :func:`senders` names, all sends and receives of the rank in
    one ``batch_isend_irecv``. Every read is done before any write, so ``src`` may be
    ``dst``. Collective over the ranks that send or receive (every rank calls it with the
    same ``sources`` and ``targets``); ``group`` None: the default group. ``index`` makes
    the row indices (a cache of them keeps a repeated exchange off the host's path)."""
    moves = senders(sources, targets)
    local = {e: row for e, rows in sources.items() for r, row in reversed(rows) if r == rank}
    mine = [(row, e) for r, row, e in targets if r == rank]
    ops, received = [], {}
    for (s, d), experts in sorted(moves.items()):
        if rank not in (s, d):
            continue
        peer = _global(group, d if s == rank else s)
        for name, t in src.items():
            if s == rank:
                rows = index(tuple(local[e] for e in experts), t.device)
                ops.append(dist.P2POp(dist.isend, _wire(t[rows]), peer, group))
            else:
                buf = t.new_empty((len(experts), *t.shape[1:]))
                ops.append(dist.P2POp(dist.irecv, _wire(buf), peer, group))
                for i, e in enumerate(experts):
                    received[name, e] = (buf, i)
    here = [(row, e) for row, e in mine if e in local]
    gathered = ({name: t[index(tuple(local[e] for _, e in here), t.device)]
                 for name, t in src.items()} if here else {})
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for name, t in dst.items():
        if here:
            t[index(tuple(row for row, _ in here), t.device)] = gathered[name].to(t.dtype)
        for row, e in mine:
            if e not in local:
                buf, i = received[name, e]
                t[row] = buf[i]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is sent: FP8 experts (e4m3, UE8M0) as their bytes, which every backend
    sends, where not every backend and version takes float8 types."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class ExpertReplicas(nn.Module):
    """The placement a layer's physical experts follow, its translation tables and its
    load count (the weights are the layer's ``experts`` Parameters).

    Args:
        cfg: the logical layer.
        placement: ``E``, ``R``, the group's ``W`` ranks and, for the hierarchical
            strategy, its nodes and expert groups.
        par: this rank in the group.
        device: where the tables live (the experts' device).
        prefer_local: split pairs by the plan's dispatch shares (own-rank replicas
            first where the balance allows); False: ``t mod c`` (:mod:`comet.replicas`).

    Buffers (not saved): the tables of :class:`comet.replicas.ReplicaTables`; ``load
    [E + 1]`` int64 (entry 0: slots with no expert).
    """

    def __init__(self, cfg: MoEConfig, placement: PlacementConfig, par: ParallelConfig,
                 device=None, prefer_local: bool = True):
        super().__init__()
        self.placement_config, self.par, self.prefer_local = placement, par, prefer_local
        tables = ReplicaTables.empty(placement.num_experts, placement.redundant_experts,
                                     placement.num_gpus, device)
        for name in ("log2phy", "replicas", "phy2log", "split"):
            self.register_buffer(name, getattr(tables, name), persistent=False)
        self.register_buffer("load", torch.zeros(placement.num_experts + 1, dtype=torch.int64,
                                                 device=device), persistent=False)
        self.placement: Placement | None = None    # the plan the slots hold (host)
        self._layout: list[int] = []               # its phy2log on the host
        self._versions: tuple = ()                 # the slots' when last made consistent
        # Row indices of this layout's repeated exchanges (refresh and fold run once per
        # training step) on the device, made once per layout.
        self._indices: dict[tuple, torch.Tensor] = {}

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

    def stale(self, slots: dict[str, torch.Tensor | None]) -> bool:
        """Whether the slots were changed in place (an optimizer step, ``copy_``) since
        they were last made consistent: their version counters moved. Edits through
        ``.data`` leave no trace; :meth:`CometMoE.refresh_replicas` then."""
        return self._versions != _versions(slots)

    def expert_load(self) -> torch.Tensor:
        """``[E]`` int64 pairs this rank routed to each logical expert since the last
        :meth:`reset_load` (a copy, on the device)."""
        return self.load[1:].clone()

    def reset_load(self) -> None:
        self.load.zero_()

    # ------------------------------------------------------------------ layouts
    def _rank_row(self, slot: int) -> tuple[int, int]:
        return divmod(slot, self.placement_config.slots_per_gpu)

    def owners(self) -> Sources:
        """Each logical expert's owner slot (its first) as ``{e: [(rank, row)]}``."""
        out: Sources = {}
        for s, e in enumerate(self._layout):
            out.setdefault(e, [self._rank_row(s)])
        return out

    def _copies(self) -> Sources:
        out: Sources = {}
        for s, e in enumerate(self._layout):
            out.setdefault(e, []).append(self._rank_row(s))
        return out

    def _home(self) -> tuple[int, int]:
        """``(E / W, this rank's first expert)``: the logical layout of the state dict."""
        own = self.placement_config.num_experts // self.placement_config.num_gpus
        return own, self.par.rank * own

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

    def _checked(self, plan: Placement) -> Placement:
        """``plan`` as one layer; ValueError for a plan of another shape."""
        cfg = self.placement_config
        if plan.phy2log.dim() == 2:
            if plan.phy2log.shape[0] != 1:
                raise ValueError(f"a layer takes a one-layer plan, got {plan.phy2log.shape[0]}")
            plan = Placement(plan.phy2log[0:1], plan.log2phy[0:1], plan.replicas[0:1],
                             plan.num_gpus,
                             None if plan.shares is None else plan.shares[0:1])
        if (plan.num_gpus != cfg.num_gpus or plan.phy2log.shape[-1] != cfg.physical_experts
                or plan.replicas.shape[-1] != cfg.num_experts):
            raise ValueError(f"the plan places {plan.replicas.shape[-1]} experts on "
                             f"{plan.phy2log.shape[-1]} slots of {plan.num_gpus} GPUs; this "
                             f"layer has {cfg.num_experts} on {cfg.physical_experts} of "
                             f"{cfg.num_gpus}")
        return plan

    def _load_tables(self, plan: Placement) -> None:
        shares = plan.shares if plan.shares is not None else dispatch_shares(plan)
        self.tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], shares[0])
        self.placement, self._layout = plan, plan.phy2log[0].tolist()
        self._indices.clear()

    def _index(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """:func:`host_index`, cached for the current layout."""
        key = (rows, device)
        if key not in self._indices:
            self._indices[key] = host_index(rows, device)
        return self._indices[key]

    @torch.no_grad()
    def expand(self, logical: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """This rank's slots of the layout without replicas, made from its ``E / W``
        logical experts ``logical`` (by name) with no exchange (each rank's slots hold its
        own experts there); loads that layout's tables. Used once, by the constructor."""
        plan = self.plan()
        self._load_tables(plan)
        own, first = self._home()
        rank, slots = self.par.rank, self.placement_config.slots_per_gpu
        rows = [e - first for e in self._layout[rank * slots:(rank + 1) * slots]]
        out = {n: None if t is None else t[rows].clone() for n, t in logical.items()}
        self._versions = _versions(out)
        return out

    @torch.no_grad()
    def place(self, plan: Placement, slots: dict[str, torch.Tensor | None], group=None,
              optimizer: torch.optim.Optimizer | None = None) -> None:
        """Re-place this rank's ``slots`` (the layer's physical Parameters by name) by
        ``plan`` (one layer) and load its tables, in place. Only slots whose expert
        changes are written, each from a slot of this rank holding that expert or
        received from one rank that does (:func:`copy_experts`). What belongs to an
        owner slot moves to the expert's new owner: pending gradients (``.grad``: a
        backward before the rebalance and one after accumulate into the same logical
        expert) and, given ``optimizer``, its per-slot state (tensors of the slot
        Parameter's shape, e.g. Adam's moments); the other slots' are zeroed.
        Collective over ``group`` when it has several ranks. ValueError for a plan of
        another shape."""
        plan = self._checked(plan)
        self.refresh(slots, group)
        old, new = self._copies(), plan.phy2log[0].tolist()
        present = _data(slots)
        targets = [(*self._rank_row(s), e) for s, e in enumerate(new) if self._layout[s] != e]
        copy_experts(present, present, old, targets, self.par.rank, group)
        owned = _owned(slots, optimizer)
        if owned:
            # Each rank keeps its old owners' rows, numbered in expert order.
            kept = {r: [] for r in range(self.placement_config.num_gpus)}
            for e, [(r, row)] in sorted(self.owners().items()):
                kept[r].append((e, row))
            rows = [row for _, row in kept[self.par.rank]]
            held = {k: t[rows] for k, t in owned.items()}
            sources = {e: [(r, i)] for r, pairs in kept.items() for i, (e, _) in enumerate(pairs)}
            for t in owned.values():
                t.zero_()
            self._load_tables(plan)
            copy_experts(held, owned, sources,
                         [(r, row, e) for e, [(r, row)] in self.owners().items()],
                         self.par.rank, group)
        else:
            self._load_tables(plan)
        self._versions = _versions(slots)

    def consistent(self, slots: dict[str, torch.Tensor | None]) -> None:
        """Take ``slots`` as consistent (each expert's copies equal) as they are now: new
        Parameters made from consistent ones (FP8 experts quantized slot by slot)."""
        self._versions = _versions(slots)

    @torch.no_grad()
    def refresh(self, slots: dict[str, torch.Tensor | None], group=None) -> None:
        """Copy each owner slot into the expert's other slots (after an optimizer step
        changed the owners) when the slots are :meth:`stale`. Collective."""
        if not self.stale(slots):
            return
        present = _data(slots)
        owners = self.owners()
        targets = [(*self._rank_row(s), e) for s, e in enumerate(self._layout)
                   if owners[e][0] != self._rank_row(s)]
        copy_experts(present, present, owners, targets, self.par.rank, group, self._index)
        self._versions = _versions(slots)

    @torch.no_grad()
    def logical(self, slots: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
        """This rank's ``E / W`` logical experts (the state dict's), gathered from their
        owner slots: new tensors. Collective."""
        own, _ = self._home()
        out = {n: t.new_empty((own, *t.shape[1:])) for n, t in slots.items()}
        copy_experts(slots, out, self.owners(),
                     [(r, i, r * own + i) for r in range(self.placement_config.num_gpus)
                      for i in range(own)],
                     self.par.rank, group)
        return out

    @torch.no_grad()
    def load_logical(self, logical: dict[str, torch.Tensor], slots: dict[str, torch.Tensor],
                     group=None) -> None:
        """Fill every slot from the ranks' ``E / W`` logical experts (each rank passes its
        own, as the state dict holds them). Collective."""
        own, _ = self._home()
        home = {e: [divmod(e, own)] for e in range(self.placement_config.num_experts)}
        copy_experts(logical, _data(slots), home,
                     [(*self._rank_row(s), e) for s, e in enumerate(self._layout)],
                     self.par.rank, group)
        self._versions = _versions(slots)

    @torch.no_grad()
    def fold(self, grads: dict[str, torch.Tensor | None], group=None
             ) -> dict[str, torch.Tensor | None]:
        """The slots' gradients with every replica's gradient summed into its expert's
        owner slot and the other slots zero (``[P/W, ...]`` by name in ``grads``' dtypes,
        summed in fp32; None where ``grads`` has None): on this rank with
        ``index_add_``, from other ranks by one ``batch_isend_irecv`` per call, each rank
        sending an owner on another rank the sum of its own replicas. Collective over
        ``group`` when it has several ranks."""
        rank = self.par.rank
        owners = {e: rows[0] for e, rows in self.owners().items()}
        slots = self.placement_config.slots_per_gpu
        mine = self._layout[rank * slots:(rank + 1) * slots]
        present = {n: g for n, g in grads.items() if g is not None}
        out = {n: torch.zeros_like(g, dtype=torch.float32) for n, g in present.items()}
        ops, received = [], []
        for peer in range(self.placement_config.num_gpus):
            if peer == rank:
                continue
            # The experts this rank holds replicas of and ``peer`` owns, in id order;
            # and the reverse: what ``peer`` sends this rank.
            out_experts = sorted({e for e in mine if owners[e][0] == peer})
            in_experts = sorted({e for s, e in enumerate(self._layout)
                                 if s // slots == peer and owners[e][0] == rank})
            for n, g in present.items():
                if out_experts:
                    buf = g.new_zeros((len(out_experts), *g.shape[1:]), dtype=torch.float32)
                    pos = {e: i for i, e in enumerate(out_experts)}
                    here = tuple(i for i, e in enumerate(mine) if e in pos)
                    buf.index_add_(0, self._index(tuple(pos[mine[i]] for i in here), g.device),
                                   g[self._index(here, g.device)].float())
                    ops.append(dist.P2POp(dist.isend, buf, _global(group, peer), group))
                if in_experts:
                    buf = g.new_empty((len(in_experts), *g.shape[1:]), dtype=torch.float32)
                    ops.append(dist.P2POp(dist.irecv, buf, _global(group, peer), group))
                    received.append((n, tuple(owners[e][1] for e in in_experts), buf))
        here = tuple(i for i, e in enumerate(mine) if owners[e][0] == rank)
        if here:
            rows = tuple(owners[mine[i]][1] for i in here)
            for n, g in present.items():
                out[n].index_add_(0, self._index(rows, g.device),
                                  g[self._index(here, g.device)].float())
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for n, rows, buf in received:
            out[n].index_add_(0, self._index(rows, buf.device), buf)
        return {n: None if g is None else out[n].to(g.dtype) for n, g in grads.items()}


def _owned(slots: dict[str, torch.Tensor | None],
           optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What an owner slot carries besides its weights, by ``name.grad`` and
    ``name.<state key>``: gradients and the optimizer's tensors shaped like the slots."""
    out = {}
    for n, p in slots.items():
        if p is None:
            continue
        if p.grad is not None:
            out[f"{n}.grad"] = p.grad
        state = {} if optimizer is None else optimizer.state.get(p, {})
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                out[f"{n}.{k}"] = v
    return out


def _data(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The tensors' ``.data``: written there, slots a pending backward saved keep their
    version (a rebalance between a forward and its backward re-places the slots with the
    same logical weights, and the backward translates by the new tables)."""
    return {n: t.data for n, t in tensors.items() if t is not None}


def _versions(tensors: dict[str, torch.Tensor | None]) -> tuple:
    return tuple(None if t is None else t._version for t in tensors.values())
