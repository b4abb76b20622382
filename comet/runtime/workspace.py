"""Symmetric workspaces: the buffers peers write into, their peer pointer tables, and the
argument groups the kernels take.

A workspace is allocated once per (process group, layer shape) and reused by every call.
All symmetric buffers of a rank live in one allocation (one rendezvous), carved at the same
offsets on every rank, so a peer's buffer is ``peer_base + offset``. Kernels get, per
buffer, a :class:`~comet.kernels.address.PeerBuffer`: the local tensor and an int64 table
``[W]`` of every rank's address.

What keeps call ``N + 1`` of a fast rank from overwriting what call ``N`` of a slow rank
still reads (docs/design.md has the whole table, buffer by buffer): every call starts with
the count exchange, and a rank publishes its counts for call ``N + 1`` only after its call
``N`` finished on its stream. Everything a peer writes into this rank during call ``N + 1``
-- rows, return entries, partial outputs, flags -- is written after that peer *waited* for
this rank's counts of call ``N + 1``, so after this rank stopped reading call ``N``'s data.
The counts themselves are written before that wait, so they are double-buffered by epoch
parity: a peer can be one exchange ahead, never two.

Flags hold the *epoch* (a call counter kept on the device) of the last call that set them;
they are never reset on the hot path. Counters that are local to one GPU are zeroed by one
memset per call; the error word is sticky until :meth:`Workspace.clear` (``reset()``).

The buffers of layer1's two algorithms are declared by their strategies
(:mod:`comet.runtime.strategies`); the rest is the protocol every call runs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from comet.config import MoEConfig, TileConfig
from comet.constants import COUNT_BUFFERS, ERROR_WORD, constexpr
from comet.kernels.address import PeerBuffer
from comet.kernels.exchange import Exchange, exchange_block
from comet.kernels.fp8_roles import packed_row_bytes
from comet.kernels.group_gemm import Gathered, OwnRows
from comet.kernels.layer0 import (DISPATCH_PART_SLOTS, STREAM_K_PROGRAMS, STREAM_K_ROWS,
                                  Arrivals, GatherTargets, Work, cut_item_columns)
from comet.kernels.layer1 import SPLIT_K_BLOCK_N, SPLIT_K_ROWS, SPLIT_K_SLOTS
from comet.kernels.plan import EntryTables, Plan, allocate_plan
from comet.kernels.shape import Shape
from comet.kernels.sync import Sync
from comet.quant import E4M3, GROUP
from comet.routing import recv_capacity
from comet.runtime.strategies import BufferSpec, strategies_of

_ALIGN = 256  # bytes: keeps every buffer 16-byte vector- and TMA-aligned


TIMEOUT_ENV = "COMET_TIMEOUT_S"


def timeout_ns(setting: str | None = None) -> int:
    """Bound of every cross-rank wait, ``COMET_TIMEOUT_S`` (default 10 s; ``setting``: its
    value if the caller read it), in ns. Kernels read it from :attr:`Workspace.timeout` on
    the device, so captured graphs follow a change (the layer refreshes it before each
    call)."""
    if setting is None:
        setting = os.environ.get(TIMEOUT_ENV)
    return int(float(setting or "10") * 1e9)


def chunk_slots(cfg: MoEConfig, world: int, tile: TileConfig) -> int:
    """Dispatch chunks one source may send one destination at most (its rows, then its
    return entries; see comet.kernels.layer0.dispatch_role): the stride of ``flag0``."""
    rows_from_one = recv_capacity(world, cfg.max_tokens, cfg.slots_per_rank) // world
    comm = tile.comm
    return -(-rows_from_one // comm.comm_rows) + -(-cfg.max_tokens // comm.dispatch_entries)


def symmetric_specs(cfg: MoEConfig, world: int, tile: TileConfig) -> list[BufferSpec]:
    """The buffers peers write into (identical layout on every rank): the protocol's,
    then those of the layer1 strategies ``tile`` needs."""
    el = cfg.num_experts // world
    mx, k, h = cfg.max_tokens, cfg.top_k, cfg.hidden_size
    rows = recv_capacity(world, mx, cfg.slots_per_rank)
    protocol = [
        # [epoch parity, source s]: the source's pairs per expert and tokens per rank
        BufferSpec("counts", (COUNT_BUFFERS.value, world, world * (el + 1)), torch.int32),
        BufferSpec("count_flags", (world,), torch.int64),
        # layer0 shared tensor (FP8: each row's e4m3 values and scales, packed)
        (BufferSpec("a0", (rows, h), cfg.dtype) if cfg.fp8 is None
         else BufferSpec("a0", (rows, packed_row_bytes(h)), torch.uint8)),
        BufferSpec("recv_token", (world, mx), torch.int32),         # return entries by source
        BufferSpec("recv_rows", (world, mx, k), torch.int32),
        BufferSpec("recv_weight", (world, mx, k), torch.float32),
        # [source, chunk]: epoch of the call whose chunk landed
        BufferSpec("flag0", (world, chunk_slots(cfg, world, tile)), torch.int64),
        BufferSpec("flag1", (world,), torch.int64),                 # layer1 data done, by rank
        # the backward's per-(token, slot) scalar (routing-weight gradient), by token
        BufferSpec("pair_grad", (mx, k), torch.float32),
        # [0:4] fatal word (peers write it when they give up), [4:8] input word (local)
        BufferSpec("error", (2 * ERROR_WORD,), torch.int32),
    ]
    if tile.variant.layer0_gather:
        # the a0 row each GEMM row reads (the token rows themselves go into a0's memory)
        protocol.append(BufferSpec("a0_src", (rows,), torch.int32))
    return protocol + [s for strategy in strategies_of(tile)
                       for s in strategy.specs(cfg, world)]


def _layout(specs: list[BufferSpec]) -> tuple[dict[str, int], int]:
    offsets, total = {}, 0
    for s in specs:
        offsets[s.name] = total
        nbytes = s.dtype.itemsize * int(torch.Size(s.shape).numel())
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


#: What a :class:`SymmetricBuffers` field holds.
Buffer = torch.Tensor | PeerBuffer


@dataclass(frozen=True)
class SymmetricBuffers:
    """A rank's symmetric buffers by name, as :func:`symmetric_specs` lays them out (the
    same on every rank): the local tensors, their peer address tables (int64 ``[W]``),
    or both as the kernels take them (:class:`~comet.kernels.address.PeerBuffer`). The
    last five exist where the tile needs them (None elsewhere)."""

    # Each field: a tensor (local, or int64 [W] addresses), or a PeerBuffer of both.

    counts: Buffer
    count_flags: Any
    a0: Buffer
    recv_token: Any
    recv_rows: Buffer
    recv_weight: Any
    flag0: Buffer
    flag1: Any
    pair_grad: Buffer
    error: Any
    a0_src: Buffer | None = None         # layer0's gathered dispatch
    comb: Buffer | None = None           # layer1's column reduce
    row_home: Buffer | None = None       # layer1's scatter epilogue
    row_weight: Buffer | None = None
    pair_out: Buffer | None = None

    def names(self) -> set[str]:
        """The buffers this workspace has (the optional ones its tile needs)."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


class Counters(NamedTuple):
    """A call's local counters (views of one int32 tensor zeroed when a call opens)."""

    l0_dispatch: torch.Tensor    # [1] layer0's dispatch chunk queue
    l0_queue: torch.Tensor       # [1] layer0's GEMM work queue
    l1_reduce: torch.Tensor      # [1] layer1's reduce item queue
    l1_done: torch.Tensor        # [1] blocks finished with layer1
    scanned: torch.Tensor        # [1] plan scan programs finished (the last pushes the counts)
    l0_parts: torch.Tensor       # [DISPATCH_PART_SLOTS] parts copied per dispatch chunk
    arrived: torch.Tensor        # [SPLIT_K_SLOTS or 0] K splits finished per layer1 item
    l0_arrived: torch.Tensor     # [2 * STREAM_K_PROGRAMS or 0] stream-K parts in per layer0 item
    split: torch.Tensor          # [n_splits_max] layer1 tiles finished per column split

    @classmethod
    def of(cls, t: torch.Tensor, k_slots: int, l0_slots: int) -> "Counters":
        q = _QUEUE_COUNTERS + DISPATCH_PART_SLOTS.value
        s = q + k_slots
        return cls(t[0:1], t[1:2], t[2:3], t[3:4], t[4:5], t[_QUEUE_COUNTERS:q], t[q:s],
                   t[s:s + l0_slots], t[s + l0_slots:])


@dataclass
class Workspace:
    """One rank's view: local tensors for every symmetric buffer, peer tables, the
    local-only scratch (activations, counters, epoch), the plan's tables, and the
    argument groups built from them once."""

    rank: int
    world: int
    cfg: MoEConfig
    #: the symmetric buffers' local tensors
    local: SymmetricBuffers
    #: their peer address tables (int64 [W]: every rank's address of the buffer)
    tables: SymmetricBuffers
    h: torch.Tensor           # [rows, F] layer0 output (local; FP8 layers: e4m3)
    out1: torch.Tensor        # [rows, H] layer1 shared tensor (local)
    #: int32 [5 (+ SPLIT_K_SLOTS) (+ 2 * STREAM_K_PROGRAMS) + n_splits_max]: :class:`Counters`
    counters: torch.Tensor
    epoch: torch.Tensor       # int64 [1]
    timeout: torch.Tensor     # int64 [1] ns, see timeout_ns()
    plan: Plan
    #: fp32 [SPLIT_K_SLOTS, SPLIT_K_ROWS, SPLIT_K_BLOCK_N]: layer1's partial tiles, with
    #: ``Variant.layer1_split_k`` > 1 (comet.kernels.layer1.KSplit); else None.
    l1_partial: torch.Tensor | None = None
    #: fp32 [2 * STREAM_K_PROGRAMS, STREAM_K_ROWS, 2 * item columns]: layer0's stream-K parts,
    #: with ``Variant.layer0_stream_k`` (comet.kernels.layer0.Work); else None.
    l0_partial: torch.Tensor | None = None
    #: FP8 layers (``cfg.fp8``): fp32 [rows, ceil(F / 128)], the scales of h (then e4m3)
    h_scale: torch.Tensor | None = None
    #: FP8 layers: uint8 [max_tokens, packed_row_bytes(H)], this rank's rows quantized on
    #: their home before they cross (comet.kernels.fp8_roles.quantize_home_kernel) ...
    home_rows: torch.Tensor | None = None
    #: ... and int64 [1], their address (the dispatch reads its rows from there)
    home_addr: torch.Tensor | None = None
    _keepalive: list = field(default_factory=list, repr=False)
    #: Ranks each output row is written to: 1, or a replicated TP layout's group size
    #: (comet.mesh.MeshLayout.home_fanout); set by the layer before its first call.
    fanout: int = 1
    #: The layout's TP size: of a token's ``k * tp`` slots this rank holds every
    #: ``tp``-th, from its TP index (comet.mesh.MeshLayout.shard_routing); set likewise.
    tp: int = 1

    def __post_init__(self):
        #: the symmetric buffers as kernels take them (None where absent)
        self.peers = SymmetricBuffers(**{
            f.name: (None if getattr(self.local, f.name) is None
                     else PeerBuffer(getattr(self.local, f.name), getattr(self.tables, f.name)))
            for f in dataclasses.fields(SymmetricBuffers)})
        self.count = Counters.of(self.counters,
                                 0 if self.l1_partial is None else self.l1_partial.shape[0],
                                 0 if self.l0_partial is None else self.l0_partial.shape[0])
        self.shape = Shape.of(self.cfg.num_experts, self.cfg.top_k, self.world)
        self.sync = Sync(self.epoch, self.tables.error, self.rank, self.timeout,
                         self.shape.WORLD)
        self.chunk_slots = self.local.flag0.shape[1]
        self.arrivals = Arrivals(self.local.flag0, self.chunk_slots, self.plan.chunks,
                                 self.plan.recv_entries)
        self.recv = EntryTables(self.peers.recv_token, self.peers.recv_rows,
                                self.peers.recv_weight)

    @property
    def fatal_word(self) -> torch.Tensor:
        """int32 [4]: a failed wait of the group (comet.runtime.errors)."""
        return self.local.error[:ERROR_WORD]

    @property
    def input_word(self) -> torch.Tensor:
        """int32 [4]: bad routing seen by this rank's plan kernels."""
        return self.local.error[ERROR_WORD:]

    def layer0_work(self, stream_k: bool, tail_split: int = 1) -> Work:
        """layer0's :class:`~comet.kernels.layer0.Work`: its queue, and -- for the
        forward's gated GEMM, if this workspace has the scratch -- with ``stream_k`` its
        stream-K parts, with ``tail_split`` > 1 its last round's K splits."""
        tail_split = max(tail_split, 1)
        if not (stream_k or tail_split > 1) or self.l0_partial is None:
            return Work(self.count.l0_queue)
        return Work(self.count.l0_queue, self.l0_partial, self.count.l0_arrived,
                    constexpr(stream_k), constexpr(tail_split))

    def gather_targets(self) -> GatherTargets:
        """A gathered dispatch's destinations (``Variant.layer0_gather``): token rows
        into the first ``W * max_tokens`` rows of ``a0``'s memory, index entries into
        ``a0_src``."""
        return GatherTargets(PeerBuffer(self._gathered_tokens(), self.tables.a0),
                             self.peers.a0_src)

    def gathered_rows(self, x_addr: torch.Tensor | None = None,
                      num_tokens: torch.Tensor | None = None) -> Gathered:
        """layer0's A rows as a gathered dispatch leaves them: ``a0[a0_src[row]]``; with
        ``x_addr`` (int64 [1], the address of the call's input) and ``num_tokens`` (int64
        [1]), this rank's own tokens read in place from the input
        (``Variant.layer0_own_in_place``)."""
        src = self.local.a0_src
        if x_addr is None:
            return Gathered(self._gathered_tokens(), src, src.shape[0])
        own = OwnRows(x_addr, num_tokens, self.rank * self.cfg.max_tokens)
        return Gathered(self._gathered_tokens(), src, src.shape[0], own)

    def _gathered_tokens(self) -> torch.Tensor:
        return self.local.a0[:self.world * self.cfg.max_tokens]

    def exchange(self, in_plan: bool) -> Exchange:
        """The count exchange's buffers as the plan kernels take them; ``in_plan``: the
        scan pushes and the layout waits (comet.kernels.exchange.Exchange)."""
        return Exchange(self.peers.counts, self.peers.count_flags, self.count.scanned,
                        constexpr(exchange_block(self.shape)), constexpr(in_plan))

    def begin_call(self) -> None:
        """Device ops opening a call: next epoch, zero the local counters."""
        self.epoch.add_(1)
        self.counters.zero_()

    def clear(self) -> None:
        """Zero every flag, counter, epoch and error word (device ops on the current
        stream). Only safe while no rank of the group has a call in flight: see
        :meth:`comet.runtime.layer.FusedMoE.reset`."""
        for t in (self.local.count_flags, self.local.flag0, self.local.flag1,
                  self.local.error):
            t.zero_()
        for t in (self.epoch, self.counters):
            t.zero_()


def _carve(storage: torch.Tensor, specs, offsets) -> SymmetricBuffers:
    out = {}
    for s in specs:
        n = int(torch.Size(s.shape).numel())
        start = offsets[s.name]
        out[s.name] = storage[start:start + n * s.dtype.itemsize].view(s.dtype).view(s.shape)
    return SymmetricBuffers(**out)


def _tables(specs, offsets, bases: list[int], device) -> SymmetricBuffers:
    """Each buffer's address on every rank (``bases``: every rank's allocation)."""
    return SymmetricBuffers(**{
        s.name: torch.tensor([b + offsets[s.name] for b in bases], dtype=torch.int64,
                             device=device) for s in specs})


#: Local counters of a call before the per-split tile counts (see :class:`Counters`).
_QUEUE_COUNTERS = 5


def _local_scratch(cfg: MoEConfig, world: int, device, tile: TileConfig) -> dict:
    rows = recv_capacity(world, cfg.max_tokens, cfg.slots_per_rank)
    n_splits = tile.n_splits_max(cfg.hidden_size)
    partial, k_slots = None, 0
    if tile.variant.layer1_split_k > 1:
        k_slots = SPLIT_K_SLOTS.value
        partial = torch.empty(k_slots, SPLIT_K_ROWS.value, SPLIT_K_BLOCK_N.value,
                              dtype=torch.float32, device=device)
    l0_partial, l0_slots = None, 0
    cut = cut_item_columns(tile.gemm.block_n0, cfg.intermediate_size, cfg.fp8 is not None)
    if (tile.variant.layer0_stream_k or tile.variant.layer0_tail_split > 1) and cut:
        l0_slots = 2 * STREAM_K_PROGRAMS.value
        l0_partial = torch.empty(l0_slots, STREAM_K_ROWS.value, 2 * cut,
                                 dtype=torch.float32, device=device)
    fp8 = {}
    if cfg.fp8 is not None:
        # h in FP8 groups (layer1's A), and this rank's rows quantized before they cross
        f, h = cfg.intermediate_size, cfg.hidden_size
        home = torch.empty(cfg.max_tokens, packed_row_bytes(h), dtype=torch.uint8,
                           device=device)
        fp8 = dict(h=torch.empty(rows, f, dtype=E4M3, device=device),
                   h_scale=torch.empty(rows, -(-f // GROUP), dtype=torch.float32,
                                       device=device),
                   home_rows=home,
                   home_addr=torch.tensor([home.data_ptr()], dtype=torch.int64,
                                          device=device))
    return dict(
        h=(torch.empty(rows, cfg.intermediate_size, dtype=cfg.dtype, device=device)
           if cfg.fp8 is None else None),
        out1=torch.empty(rows, cfg.hidden_size, dtype=cfg.dtype, device=device),
        counters=torch.zeros(_QUEUE_COUNTERS + DISPATCH_PART_SLOTS.value + k_slots
                             + l0_slots + n_splits,
                             dtype=torch.int32, device=device),
        l1_partial=partial, l0_partial=l0_partial,
        epoch=torch.zeros(1, dtype=torch.int64, device=device),
        timeout=torch.full((1,), timeout_ns(), dtype=torch.int64, device=device),
        plan=allocate_plan(cfg.num_experts, cfg.top_k, cfg.max_tokens, world, device,
                           tile.plan_block_m(cfg.fp8 is not None), cfg.slots_per_rank)) | fp8


def workspace_bytes(cfg: MoEConfig, world: int, tile: TileConfig) -> int:
    """Device memory one rank's workspace takes: the symmetric allocation (peers write
    into it) and the local scratch and plan tables. Sized by ``cfg.max_tokens`` for the
    worst routing (every token of every rank on this rank's experts): a model should
    build its layers with the largest call it makes, not more."""
    _, symmetric = _layout(symmetric_specs(cfg, world, tile))
    scratch = _local_scratch(cfg, world, "meta", tile)
    plan = scratch.pop("plan")
    tensors = [t for t in scratch.values() if t is not None] + _tensors_of(plan)
    return symmetric + sum(t.nbytes for t in tensors)


def _tensors_of(group) -> list[torch.Tensor]:
    """Every tensor of a (nested) argument group."""
    if isinstance(group, torch.Tensor):
        return [group]
    return [t for g in group for t in _tensors_of(g)]


def allocate_virtual(cfg: MoEConfig, world: int, device, tile: TileConfig
                     ) -> list[Workspace]:
    """W workspaces in one process whose peer tables point at each other: for tests of the
    kernels' cross-rank logic on one device (or the CPU under the Triton interpreter).
    ``tile`` sizes the tables and says which layer1 strategies need buffers."""
    specs = symmetric_specs(cfg, world, tile)
    offsets, total = _layout(specs)
    storages = [torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [s.data_ptr() for s in storages]
    tables = _tables(specs, offsets, bases, device)
    return [Workspace(r, world, cfg, _carve(storages[r], specs, offsets), tables,
                      **_local_scratch(cfg, world, device, tile), _keepalive=storages)
            for r in range(world)]


def allocate_symmetric(cfg: MoEConfig, group, device, tile: TileConfig) -> Workspace:
    """This rank's workspace in PyTorch symmetric memory over ``group`` (collective: every
    rank of the group must call it with the same ``cfg`` and ``tile``)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    specs = symmetric_specs(cfg, world, tile)
    offsets, total = _layout(specs)
    storage = symm_mem.empty(total, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(storage, group=group)
    storage.zero_()
    bases = [int(handle.buffer_ptrs[p]) for p in range(world)]
    tables = _tables(specs, offsets, bases, device)
    # Peers must not write into this rank's flags before they were zeroed.
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return Workspace(rank, world, cfg, _carve(storage, specs, offsets), tables,
                     **_local_scratch(cfg, world, device, tile),
                     _keepalive=[storage, handle])
