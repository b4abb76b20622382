"""Symmetric workspaces: the buffers peers write into, and their peer pointer tables.

A workspace is allocated once per (process group, layer shape) and reused by every call.
All symmetric buffers of a rank live in one allocation (one rendezvous), carved at the same
offsets on every rank, so a peer's buffer is ``peer_base + offset``. Kernels get, per
buffer, an int64 table ``[W]`` of peer addresses and cast entries to typed pointers.

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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from comet.config import MoEConfig
from comet.kernels.plan import LAYOUT_SCRATCH
from comet.routing import recv_capacity

_ALIGN = 256  # bytes: keeps every buffer 16-byte vector- and TMA-aligned

#: Count buffers, used by epoch parity (see the module docstring).
COUNT_BUFFERS = 2

#: int32 fields of an error word (comet.kernels.sync, comet.runtime.errors).
ERROR_WORD = 4


def timeout_ns() -> int:
    """Bound of every cross-rank wait, ``COMET_TIMEOUT_S`` (default 10 s), in ns. Kernels
    read it from :attr:`Workspace.timeout` on the device, so captured graphs follow a
    change (FusedMoE refreshes it before each call)."""
    return int(float(os.environ.get("COMET_TIMEOUT_S", "10")) * 1e9)


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def chunk_slots(cfg: MoEConfig, world: int, tile) -> int:
    """Dispatch chunks one source may send one destination at most (its rows, then its
    return entries; see comet.kernels.layer0.dispatch_role): the stride of ``flag0``."""
    rows_from_one = recv_capacity(world, cfg.max_tokens, cfg.top_k) // world
    return -(-rows_from_one // tile.comm_rows) + -(-cfg.max_tokens // tile.dispatch_entries)


def symmetric_specs(cfg: MoEConfig, world: int, tile) -> list[BufferSpec]:
    """The buffers peers write into (identical layout on every rank); ``tile`` sizes the
    dispatch chunk flags and says whether layer1 scatters its rows home."""
    el = cfg.num_experts // world
    mx, k, h = cfg.max_tokens, cfg.top_k, cfg.hidden_size
    rows = recv_capacity(world, mx, k)
    return [
        # [epoch parity, source s]: the source's pairs per expert and tokens per rank
        BufferSpec("counts", (COUNT_BUFFERS, world, world * (el + 1)), torch.int32),
        BufferSpec("count_flags", (world,), torch.int64),
        BufferSpec("a0", (rows, h), cfg.dtype),                         # layer0 shared tensor
        BufferSpec("ret_token", (world, mx), torch.int32),              # return entries by source
        BufferSpec("ret_rows", (world, mx, k), torch.int32),
        BufferSpec("ret_weight", (world, mx, k), torch.float32),
        # [source, chunk]: epoch of the call whose chunk landed
        BufferSpec("flag0", (world, chunk_slots(cfg, world, tile)), torch.int64),
        BufferSpec("comb", (world, mx, h), cfg.dtype),                  # partial outputs, by expert rank
        BufferSpec("flag1", (world,), torch.int64),                     # combine data done, by rank
        # the backward's per-(token, slot) scalar (routing-weight gradient), by token
        BufferSpec("pair_grad", (mx, k), torch.float32),
        *_scatter_specs(cfg, rows, tile),
        *_copy_dispatch_specs(cfg, world, tile),
        # [0:4] fatal word (peers write it when they give up), [4:8] input word (local)
        BufferSpec("error", (2 * ERROR_WORD,), torch.int32),
    ]


def _scatter_specs(cfg: MoEConfig, rows: int, tile) -> list[BufferSpec]:
    """Buffers of layer1's scatter epilogue (``tile.layer1_scatter``), else none: where
    each received row's layer1 output goes (``row_home``: its source's slot ``s * Mx * k
    + t * k + j``) and its weight, both pushed with the row; and the weighted output
    rows by (token, slot), written by the ranks that hold the slots' experts."""
    if not tile.layer1_scatter:
        return []
    mx, k, h = cfg.max_tokens, cfg.top_k, cfg.hidden_size
    return [BufferSpec("row_home", (rows,), torch.int32),
            BufferSpec("row_weight", (rows,), torch.float32),
            BufferSpec("pair_out", (mx, k, h), cfg.dtype)]


def _copy_dispatch_specs(cfg: MoEConfig, world: int, tile) -> list[BufferSpec]:
    """Buffers of the dispatch by copy engines (``tile.copy_dispatch``), else none, all
    by source rank: its input rows and its send list (pairs, their rows here, weights,
    its ``send_off``), as its host copied them, and the epoch of the call whose copies
    have landed (comet.runtime.copy_dispatch)."""
    if not tile.copy_dispatch:
        return []
    mx, k = cfg.max_tokens, cfg.top_k
    return [BufferSpec("x_recv", (world, mx, cfg.hidden_size), cfg.dtype),
            BufferSpec("sent_pair", (world, mx * k), torch.int32),
            BufferSpec("sent_row", (world, mx * k), torch.int32),
            BufferSpec("sent_weight", (world, mx * k), torch.float32),
            BufferSpec("sent_off", (world, world + 1), torch.int32),
            BufferSpec("copy_flags", (world,), torch.int64)]


def _layout(specs: list[BufferSpec]) -> tuple[dict[str, int], int]:
    offsets, total = {}, 0
    for s in specs:
        offsets[s.name] = total
        nbytes = s.dtype.itemsize * int(torch.Size(s.shape).numel())
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


#: Pairs the plan kernels handle per program (a block of whole tokens).
PLAN_BLOCK_PAIRS = 64

#: Programs that fill the tile table (comet.kernels.plan.layout_kernel), at most.
LAYOUT_PROGRAMS = 16


def plan_block_tokens(top_k: int) -> int:
    """Tokens per program of the plan kernels (``PLAN_BLOCK_PAIRS`` slots, whole tokens)."""
    slots = 1 << max(0, (top_k - 1).bit_length())
    return max(1, PLAN_BLOCK_PAIRS // slots)


def plan_buffers(cfg: MoEConfig, world: int, device, block_m: int) -> dict[str, torch.Tensor]:
    """Device tables of the per-call plan (comet.kernels.plan), allocated once.

    block_counts: ``[blocks + 1, E + W]`` per token block, then prefix-summed in place
    (row 0 stays zero; the last row ends up holding this rank's totals).
    """
    el = cfg.num_experts // world
    mx, k = cfg.max_tokens, cfg.top_k
    blocks = -(-mx // plan_block_tokens(k))
    tiles = -(-recv_capacity(world, mx, k) // block_m) + el
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "block_counts": torch.zeros(blocks + 1, cfg.num_experts + world, **i32),
        "send_base": torch.zeros(world, el, **i32),
        "dst_base": torch.zeros(world, el, **i32),
        "send_off": torch.zeros(world + 1, **i32),
        "ret_count": torch.zeros(world, **i32),
        "seg_start": torch.zeros(world, el, **i32),
        "seg_rows": torch.zeros(world, el, **i32),
        "pre": torch.zeros(world, el, **i32),
        "chunks_total": torch.zeros(world, **i32),
        "entries": torch.zeros(world, **i32),
        "tile_expert": torch.zeros(tiles, **i32),
        "tile_row_start": torch.zeros(tiles, **i32),
        "tile_row_end": torch.zeros(tiles, **i32),
        "tile_wait": torch.zeros(tiles, dtype=torch.int64, device=device),
        "tile_stage": torch.zeros(tiles, **i32),
        "num_tiles": torch.zeros(1, **i32),
        "scratch": torch.zeros(LAYOUT_PROGRAMS * LAYOUT_SCRATCH.value * world * el, **i32),
        "send_pair": torch.zeros(mx * k, **i32),
        "send_row": torch.zeros(mx * k, **i32),
        "send_weight": torch.zeros(mx * k, dtype=torch.float32, device=device),
        "ret_token": torch.zeros(world, mx, **i32),
        "ret_rows": torch.zeros(world, mx, k, **i32),
        "ret_weight": torch.zeros(world, mx, k, dtype=torch.float32, device=device),
        "dest_mask": torch.zeros(mx, world, **i32),
        "pair_live": torch.zeros(mx, k, **i32),
    }


#: Local counters of a call, one int32 each, before the per-split tile counts.
QUEUE_COUNTERS = ("l1_done", "l0_queue", "l1_reduce", "l0_dispatch")


@dataclass
class Workspace:
    """One rank's view: local tensors for every symmetric buffer, peer tables, and the
    local-only scratch (activations, counters, epoch)."""

    rank: int
    world: int
    buffers: dict[str, torch.Tensor]
    peer_ptrs: dict[str, torch.Tensor]
    h: torch.Tensor           # [rows, F] layer0 output (local)
    out1: torch.Tensor        # [rows, H] layer1 shared tensor (local)
    counters: torch.Tensor    # int32, see counter_view()
    epoch: torch.Tensor       # int64 [1]
    timeout: torch.Tensor     # int64 [1] ns, see timeout_ns()
    plan: dict                # per-call plan tables, see plan_buffers()
    n_splits_max: int
    #: Every rank's symmetric buffers as tensors this process may copy into, by rank (a
    #: peer's are mappings of its memory: ``copy_`` into them is a peer cudaMemcpyAsync).
    peers: list[dict[str, torch.Tensor]] = field(default_factory=list, repr=False)
    _keepalive: list = field(default_factory=list, repr=False)

    def __getattr__(self, name):
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(name)

    @property
    def fatal_word(self) -> torch.Tensor:
        """int32 [4]: a failed wait of the group (comet.runtime.errors)."""
        return self.buffers["error"][:ERROR_WORD]

    @property
    def input_word(self) -> torch.Tensor:
        """int32 [4]: bad routing seen by this rank's plan kernels."""
        return self.buffers["error"][ERROR_WORD:]

    def begin_call(self) -> None:
        """Device ops opening a call: next epoch, zero the local counters."""
        self.epoch.add_(1)
        self.counters.zero_()

    def clear(self) -> None:
        """Zero every flag, counter, epoch and error word (device ops on the current
        stream). Only safe while no rank of the group has a call in flight: see
        :meth:`comet.runtime.layer.FusedMoE.reset`."""
        for name in ("count_flags", "flag0", "flag1", "error", "copy_flags"):
            if name in self.buffers:
                self.buffers[name].zero_()
        for t in (self.epoch, self.counters):
            t.zero_()

    def counter_view(self) -> dict[str, torch.Tensor]:
        """Each ``[1]`` unless said: l1_done, blocks finished with layer1's reduce;
        l0_queue, layer0's GEMM work queue (layer1's GEMM needs none: its blocks stride
        over the items); l1_reduce, layer1's reduce queue; l0_dispatch, layer0's dispatch
        chunk queue; split (``[n_splits_max]``), tiles finished per column split."""
        c = self.counters
        named = {name: c[i:i + 1] for i, name in enumerate(QUEUE_COUNTERS)}
        return {**named, "split": c[len(QUEUE_COUNTERS):len(QUEUE_COUNTERS) + self.n_splits_max]}


def _carve(storage: torch.Tensor, specs, offsets) -> dict[str, torch.Tensor]:
    out = {}
    for s in specs:
        n = int(torch.Size(s.shape).numel())
        start = offsets[s.name]
        out[s.name] = storage[start:start + n * s.dtype.itemsize].view(s.dtype).view(s.shape)
    return out


def _local_scratch(cfg: MoEConfig, world: int, device, tile):
    rows = recv_capacity(world, cfg.max_tokens, cfg.top_k)
    h = torch.empty(rows, cfg.intermediate_size, dtype=cfg.dtype, device=device)
    out1 = torch.empty(rows, cfg.hidden_size, dtype=cfg.dtype, device=device)
    n_splits = tile.n_splits_max(cfg.hidden_size)
    counters = torch.zeros(len(QUEUE_COUNTERS) + n_splits, dtype=torch.int32, device=device)
    epoch = torch.zeros(1, dtype=torch.int64, device=device)
    timeout = torch.full((1,), timeout_ns(), dtype=torch.int64, device=device)
    return (h, out1, counters, epoch, timeout,
            plan_buffers(cfg, world, device, tile.block_m), n_splits)


def workspace_bytes(cfg: MoEConfig, world: int, tile) -> int:
    """Device memory one rank's workspace takes: the symmetric allocation (peers write
    into it) and the local scratch and plan tables. Sized by ``cfg.max_tokens`` for the
    worst routing (every token of every rank on this rank's experts): a model should
    build its layers with the largest call it makes, not more."""
    _, symmetric = _layout(symmetric_specs(cfg, world, tile))
    *tensors, plan, _ = _local_scratch(cfg, world, "meta", tile)
    return symmetric + sum(t.nbytes for t in (*tensors, *plan.values()))


def allocate_virtual(cfg: MoEConfig, world: int, device, tile) -> list[Workspace]:
    """W workspaces in one process whose peer tables point at each other: for tests of the
    kernels' cross-rank logic on one device (or the CPU under the Triton interpreter).
    ``tile``: the kernels' :class:`comet.kernels.launch.TileConfig` (sizes the tables)."""
    specs = symmetric_specs(cfg, world, tile)
    offsets, total = _layout(specs)
    storages = [torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [s.data_ptr() for s in storages]
    tables = {s.name: torch.tensor([b + offsets[s.name] for b in bases], dtype=torch.int64,
                                   device=device) for s in specs}
    views = [_carve(storage, specs, offsets) for storage in storages]
    return [Workspace(r, world, views[r], tables, *_local_scratch(cfg, world, device, tile),
                      peers=views, _keepalive=storages)
            for r in range(world)]


def allocate_symmetric(cfg: MoEConfig, group, device, tile) -> Workspace:
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
    tables = {s.name: torch.tensor([b + offsets[s.name] for b in bases], dtype=torch.int64,
                                   device=device) for s in specs}
    # Peers must not write into this rank's flags before they were zeroed.
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    peers = [_carve(storage if p == rank else handle.get_buffer(p, (total,), torch.uint8),
                    specs, offsets) for p in range(world)]
    return Workspace(rank, world, peers[rank], tables, *_local_scratch(cfg, world, device, tile),
                     peers=peers, _keepalive=[storage, handle])
