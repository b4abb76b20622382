"""Expert placement with redundant experts (EPLB): which logical expert each physical
expert slot holds, so that every GPU of an expert-parallel group carries about the same
load.

Vocabulary: ``E`` logical experts (the model's), ``R`` redundant experts, ``P = E + R``
physical experts (slots), ``W`` GPUs of ``P / W`` slots each (GPU ``g`` holds slots
``[g * P/W, (g + 1) * P/W)``), ``N`` nodes of ``W / N`` GPUs, ``G`` expert groups
(DeepSeek-V3's ``n_group``: consecutive logical experts). The load of a logical expert is
the number of (token, slot) pairs routed to it over a window; a replica carries its
expert's load divided by the expert's replica count.

Two strategies, chosen by :func:`plan_placement`:

* **hierarchical** (``N`` divides ``G``): pack whole expert groups onto nodes (balanced
  node loads, and a group-limited router then keeps a token's traffic on few nodes),
  replicate inside each node, pack the node's physical experts onto its GPUs;
* **global** otherwise: replicate over all GPUs, then pack onto GPUs (the hierarchical
  strategy with one node and one group).

Replication gives each extra slot to the logical expert with the highest load per
replica; packing places items heaviest first, each on the lightest pack that still has
room (every pack takes the same number of items). A greedy packing can lose to a lucky
fixed layout, so the plan is compared with the layer without replicas (each GPU its own
contiguous experts, its extra slots holding copies of its own heaviest ones, which moves
no load) and, per layer, the one with the lower maximum GPU load is kept: a plan never
makes the busiest GPU busier than no replicas would.

Pure torch on the host (plans are made between calls, from a load the caller gathered);
nothing here runs on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["PlacementConfig", "Placement", "plan_placement", "home_placement",
           "balanced_packing", "replicate", "dispatch_shares"]


@dataclass(frozen=True)
class PlacementConfig:
    """The shape of a placement.

    Args:
        num_experts: ``E`` logical experts.
        redundant_experts: ``R`` extra physical slots (replicas), ``>= 0``.
        num_gpus: ``W`` GPUs (ranks) of the expert-parallel group; must divide ``E + R``.
        num_nodes: ``N`` nodes, dividing ``W`` (ranks numbered node-major).
        num_groups: ``G`` expert groups, dividing ``E``; the hierarchical strategy runs
            when ``N`` divides ``G``.
    """

    num_experts: int
    redundant_experts: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 1

    def __post_init__(self):
        for name in ("num_experts", "redundant_experts", "num_gpus", "num_nodes",
                     "num_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.num_experts < 1 or self.num_gpus < 1 or self.num_nodes < 1 or self.num_groups < 1:
            raise ValueError(f"num_experts, num_gpus, num_nodes and num_groups must be "
                             f">= 1, got {self}")
        if self.redundant_experts < 0:
            raise ValueError(f"redundant_experts must be >= 0, got {self.redundant_experts}")
        if self.physical_experts % self.num_gpus:
            raise ValueError(f"num_experts + redundant_experts = {self.physical_experts} "
                             f"must be divisible by num_gpus ({self.num_gpus}): every GPU "
                             f"holds the same number of physical experts")
        if self.num_gpus % self.num_nodes:
            raise ValueError(f"num_nodes ({self.num_nodes}) must divide num_gpus "
                             f"({self.num_gpus})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts "
                             f"({self.num_experts})")

    @property
    def physical_experts(self) -> int:
        """``P = E + R``."""
        return self.num_experts + self.redundant_experts

    @property
    def slots_per_gpu(self) -> int:
        """``P / W`` physical experts per GPU."""
        return self.physical_experts // self.num_gpus

    @property
    def hierarchical(self) -> bool:
        """Whether :func:`plan_placement` packs expert groups onto nodes first. Also
        needs the physical experts to split evenly over nodes and the logical ones to
        fit in a node's slots; else the global strategy runs."""
        c = self
        return (c.num_groups % c.num_nodes == 0 and c.num_experts % c.num_nodes == 0
                and c.physical_experts % c.num_nodes == 0 and c.num_nodes > 1)


@dataclass(frozen=True)
class Placement:
    """A plan for ``L`` layers (int64 tensors on the host).

    Attributes:
        phy2log: ``[L, P]`` the logical expert of each physical slot.
        log2phy: ``[L, E, X]`` the physical slots of each logical expert, ascending,
            ``-1`` padded (``X`` the largest replica count).
        replicas: ``[L, E]`` replica counts (``>= 1``).
        num_gpus: ``W``.
        shares: ``[L, W, E, X]`` float64 or None: the fraction of source rank ``w``'s
            pairs of expert ``e`` that go to each of its replicas (``log2phy``'s columns;
            rows sum to 1), from :func:`dispatch_shares`; the translation realizes it
            (:mod:`comet.replicas`). None: :func:`dispatch_shares` without per-rank
            loads (each replica ``1 / c`` of every rank's pairs) where a layer loads it.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    replicas: torch.Tensor
    num_gpus: int
    shares: torch.Tensor | None = None

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log.shape[-1] // self.num_gpus

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int, num_gpus: int
                     ) -> "Placement":
        """The plan of a ``phy2log [L, P]`` (or ``[P]``): ValueError where a slot holds
        no expert in ``[0, E)``, a logical expert has no slot, or ``W`` does not divide
        ``P``."""
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        if phy2log.dim() == 1:
            phy2log = phy2log[None]
        if phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [L, P] or [P], got {list(phy2log.shape)}")
        layers, phys = phy2log.shape
        if phys % num_gpus:
            raise ValueError(f"{phys} physical experts do not split over {num_gpus} GPUs")
        if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= num_experts):
            raise ValueError(f"phy2log holds ids outside [0, {num_experts})")
        replicas = torch.zeros(layers, num_experts, dtype=torch.int64)
        replicas.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (replicas == 0).any():
            missing = (replicas == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {missing[1]} of layer {missing[0]} has no "
                             "physical slot")
        width = int(replicas.max())
        log2phy = torch.full((layers, num_experts, width), -1, dtype=torch.int64)
        # Slots in ascending order: a stable sort by expert keeps them ascending inside it.
        order = torch.sort(phy2log, dim=1, stable=True).indices
        experts = phy2log.gather(1, order)
        starts = torch.cumsum(replicas, 1) - replicas
        nth = torch.arange(phys).expand(layers, phys) - starts.gather(1, experts)
        log2phy[torch.arange(layers)[:, None].expand(layers, phys), experts, nth] = order
        return cls(phy2log, log2phy, replicas, num_gpus)

    def gpu_loads(self, load: torch.Tensor) -> torch.Tensor:
        """``[L, W]`` load of each GPU for a per-logical-expert ``load [L, E]``, each
        replica carrying its expert's load over its replica count."""
        load = _as_layers(load).double()
        per_slot = (load / self.replicas).gather(1, self.phy2log)
        return per_slot.view(per_slot.shape[0], self.num_gpus, -1).sum(-1)


def _as_layers(load: torch.Tensor) -> torch.Tensor:
    load = torch.as_tensor(load).detach().cpu()
    return load[None] if load.dim() == 1 else load


def balanced_packing(weight: torch.Tensor, num_packs: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` items per layer (``weight [L, n]``) into ``num_packs`` packs of exactly
    ``n / num_packs`` items: heaviest first, each onto the lightest pack with room (the
    lowest index on ties, so plans are reproducible). Returns ``(pack [L, n], position
    in its pack [L, n])``."""
    layers, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    pack = torch.empty(layers, n, dtype=torch.int64)
    position = torch.empty(layers, n, dtype=torch.int64)
    order = torch.sort(weight.double(), dim=1, descending=True, stable=True).indices
    for layer in range(layers):
        totals = [0.0] * num_packs
        sizes = [0] * num_packs
        row = weight[layer].double().tolist()
        for item in order[layer].tolist():
            best = min((p for p in range(num_packs) if sizes[p] < per_pack),
                       key=lambda p: (totals[p], p))
            pack[layer, item] = best
            position[layer, item] = sizes[best]
            sizes[best] += 1
            totals[best] += row[item]
    return pack, position


def replicate(weight: torch.Tensor, num_physical: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_physical - n`` extra slots of each layer (``weight [L, n]``) one by one
    to the item with the highest load per replica. Returns ``(phy2item [L, num_physical]``
    -- the first ``n`` slots are the items themselves --, ``replica index of each slot
    [L, num_physical]``, ``replica counts [L, n])``."""
    layers, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} items")
    phy2item = torch.arange(num_physical).repeat(layers, 1)
    nth = torch.zeros(layers, num_physical, dtype=torch.int64)
    counts = torch.ones(layers, n, dtype=torch.int64)
    rows = torch.arange(layers)
    weight = weight.double()
    for slot in range(n, num_physical):
        # argmax returns the first maximum: ties go to the lower id, reproducibly.
        item = (weight / counts).argmax(dim=1)
        phy2item[:, slot] = item
        nth[:, slot] = counts[rows, item]
        counts[rows, item] += 1
    return phy2item, nth, counts


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations ``perm [L, n]``."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def _hierarchical(load: torch.Tensor, cfg: PlacementConfig, nodes: int, groups: int
                  ) -> torch.Tensor:
    """``phy2log [L, P]`` of the hierarchical strategy over ``nodes`` nodes and
    ``groups`` expert groups (``nodes = groups = 1``: the global strategy)."""
    layers, experts = load.shape
    group_size = experts // groups
    node_experts = experts // nodes
    node_slots = cfg.physical_experts // nodes
    gpus_per_node = cfg.num_gpus // nodes

    # 1. Expert groups onto nodes. "Node-major" ids: a node's experts are contiguous.
    group_load = load.view(layers, groups, group_size).sum(-1)
    group_node, group_pos = balanced_packing(group_load, nodes)
    first = (group_node * (groups // nodes) + group_pos) * group_size
    log2nm = (first[:, :, None] + torch.arange(group_size)).flatten(1)
    nm2log = _inverse(log2nm)

    # 2. Replicas inside each node (its experts and slots as one more "layer").
    nm_load = load.gather(1, nm2log).view(layers * nodes, node_experts)
    phy2nm, _, nm_count = replicate(nm_load, node_slots)

    # 3. A node's physical experts onto its GPUs.
    phy_load = (nm_load / nm_count).gather(1, phy2nm)
    gpu, pos = balanced_packing(phy_load, gpus_per_node)
    slot = gpu * cfg.slots_per_gpu + pos             # the slot each one takes
    slot2nm = phy2nm.gather(1, _inverse(slot))
    offsets = (torch.arange(nodes) * node_experts).repeat(layers)[:, None]
    slot2nm = (slot2nm + offsets).view(layers, cfg.physical_experts)
    return nm2log.gather(1, slot2nm)


def home_placement(cfg: PlacementConfig, load: torch.Tensor | None = None) -> Placement:
    """The layout of the layer without replicas: GPU ``g`` holds logical experts
    ``[g * E/W, (g + 1) * E/W)`` first; its remaining ``R / W`` slots hold copies of its
    own heaviest experts (by ``load [L, E]``, or the lowest ids without one), each
    expert once before any twice. Copies on the same GPU move no load between GPUs, so
    its GPU loads are those of no replicas. Needs ``W`` to divide ``E``."""
    e, w = cfg.num_experts, cfg.num_gpus
    if e % w:
        raise ValueError(f"the layout without replicas needs num_gpus ({w}) to divide "
                         f"num_experts ({e})")
    load = torch.ones(1, e) if load is None else _as_layers(load).double()
    layers, own, extra = load.shape[0], e // w, cfg.slots_per_gpu - e // w
    phy2log = torch.empty(layers, cfg.physical_experts, dtype=torch.int64)
    for g in range(w):
        experts = torch.arange(g * own, (g + 1) * own)
        local, _, _ = replicate(load[:, experts], own + extra)
        phy2log[:, g * cfg.slots_per_gpu:(g + 1) * cfg.slots_per_gpu] = experts[local]
    return Placement.from_phy2log(phy2log, e, w)


def dispatch_shares(plan: Placement, rank_load: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``[L, W, E, X]`` float64: which share of source rank ``w``'s pairs of logical
    expert ``e`` each replica (column of ``plan.log2phy``) takes, so that every replica
    receives its planned ``1 / c`` of the expert's pairs -- the load the planner packed
    -- while as many pairs as possible stay on their own rank.

    Without ``rank_load`` (or for a rank with no pair of ``e``): ``1 / c`` to each
    replica, from every rank; it realizes the plan whatever each rank routes. With
    ``rank_load [L, W, E]`` (or ``[W, E]``: each rank's pairs per logical expert over
    the window the plan was made from): each rank first keeps its pairs on its own
    replicas of ``e``, up to their capacity (``1 / c`` of the expert's total each,
    shared evenly between them), and sends the rest to the capacity the other replicas
    have left, in proportion to it (a transportation plan whose local flow is the most
    possible). A rank's replicas of one expert are then merged into its lowest slot
    (the rows a rank computes are what balance; one GEMM beats several smaller ones).
    Deterministic: every rank computes the same shares from the same loads."""
    log2phy = plan.log2phy
    layers, experts, width = log2phy.shape
    w, spg = plan.num_gpus, plan.slots_per_gpu
    valid = log2phy >= 0
    count = plan.replicas.double()
    uniform = (valid / count[..., None]).double()[:, None].expand(layers, w, experts, width)
    owner = torch.where(valid, log2phy // spg, torch.full_like(log2phy, -1))
    if rank_load is None:
        return _first_on_rank(uniform, owner)
    n = torch.as_tensor(rank_load).detach().cpu().double()
    n = n[None] if n.dim() == 2 else n
    if tuple(n.shape) != (layers, w, experts):
        raise ValueError(f"rank_load must be [{layers}, {w}, {experts}] or [{w}, "
                         f"{experts}], got {list(n.shape)}")
    if not torch.isfinite(n).all() or (n < 0).any():
        raise ValueError("rank_load must be finite and non-negative")
    cap = n.sum(1) / count                                          # [L, E] per replica
    local = owner[:, None] == torch.arange(w)[None, :, None, None]  # [L, W, E, X]
    mine = local.sum(-1)                                            # [L, W, E]
    keep = torch.minimum(n, mine * cap[:, None])
    flow = local * (keep / mine.clamp(min=1))[..., None]
    room = (cap[..., None] * valid - flow.sum(1)).clamp(min=0)      # [L, E, X]
    rest = n - keep                                                 # [L, W, E]
    total_room = room.sum(-1)
    spread = torch.where(total_room[..., None] > 0,
                         room / total_room.clamp(min=1e-300)[..., None],
                         torch.zeros_like(room))
    flow = flow + rest[..., None] * spread[:, None]
    shares = flow / n.clamp(min=1e-300)[..., None]
    return _first_on_rank(torch.where((n > 0)[..., None], shares, uniform), owner)


def _first_on_rank(shares: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``shares [L, W, E, X]`` with each rank's replicas of an expert merged into its
    lowest slot: what counts is the rows a rank computes, and one slot's GEMM of all
    of them beats several smaller ones (and at one rank the layer computes exactly the
    rows it did without replicas, on the same slots)."""
    valid = owner >= 0
    same = (owner[..., :, None] == owner[..., None, :]) & valid[..., None] & valid[..., None, :]
    first = torch.where(valid, same.to(torch.uint8).argmax(-1),
                        torch.arange(owner.shape[-1]).expand_as(owner))   # [L, E, X]
    merged = torch.zeros_like(shares)
    return merged.scatter_add_(-1, first[:, None].expand_as(shares).contiguous(), shares)


def plan_placement(load: torch.Tensor | None, cfg: PlacementConfig,
                   rank_load: torch.Tensor | None = None) -> Placement:
    """The plan for per-logical-expert loads ``load [L, E]`` (or ``[E]``; any
    non-negative numbers, e.g. token counts over a window): the hierarchical strategy
    where ``cfg.hierarchical``, else the global one; per layer, the layout without
    replicas instead where the plan's busiest GPU would be busier (when ``W`` divides
    ``E``). ValueError for a load of the wrong shape, negative or not finite.

    ``rank_load [L, W, E]`` (or ``[W, E]``): each rank's share of the load (``load``
    may then be None: their sum); the plan's :attr:`Placement.shares` then keep pairs
    on their own rank where that leaves every replica its planned load
    (:func:`dispatch_shares`), else each replica takes ``1 / c`` of every rank's."""
    if load is None:
        if rank_load is None:
            raise ValueError("plan_placement needs load or rank_load")
        load = torch.as_tensor(rank_load).detach().cpu()
        load = load.sum(-2)
    plan = _plan(load, cfg)
    return dataclasses.replace(plan, shares=dispatch_shares(plan, rank_load))


def _plan(load: torch.Tensor, cfg: PlacementConfig) -> Placement:
    load = _as_layers(load)
    if load.dim() != 2 or load.shape[1] != cfg.num_experts:
        raise ValueError(f"load must be [L, {cfg.num_experts}] or [{cfg.num_experts}], "
                         f"got {list(load.shape)}")
    load = load.double()
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    if cfg.hierarchical:
        phy2log = _hierarchical(load, cfg, cfg.num_nodes, cfg.num_groups)
    else:
        phy2log = _hierarchical(load, cfg, 1, 1)
    plan = Placement.from_phy2log(phy2log, cfg.num_experts, cfg.num_gpus)
    if cfg.num_experts % cfg.num_gpus:
        return plan
    home = home_placement(cfg, load)
    # A small tolerance: float sums of the same loads in another order are not "worse".
    worse = plan.gpu_loads(load).amax(1) > home.gpu_loads(load).amax(1) * (1 + 1e-12)
    if not worse.any():
        return plan
    return Placement.from_phy2log(torch.where(worse[:, None], home.phy2log, plan.phy2log),
                                  cfg.num_experts, cfg.num_gpus)
