"""``FusedMoE``: one expert-parallel MoE layer on the fused kernels, for one rank.

A call (no host synchronisation anywhere):

1. ``epoch += 1`` and zero the local counters (two tiny device ops);
2. count exchange through symmetric memory (one program);
3. routing plan and tile tables (torch ops on the device, fixed capacities);
4. layer0 kernel: comm blocks push rows, compute blocks run the gated GroupGEMM; comm
   blocks done pushing take GEMM tiles from the same work queue -- or, with
   ``TileConfig.copy_dispatch``, the host copies this rank's input to every peer by copy
   engines (comet.runtime.copy_dispatch) and the comm blocks place rows from copies
   that landed;
5. layer1 kernel: compute blocks run the column-wise GroupGEMM, comm blocks reduce and
   send each token's rows home; compute blocks out of tiles join the reduce -- or, with
   ``TileConfig.layer1_scatter``, every block runs the GroupGEMM and its epilogue writes
   each weighted row straight into its token's home;
6. combine: each token's partial rows summed in rank order (slot order after a scatter).

``mode`` exists for the benchmark's decomposition: ``"sequential"`` runs each layer's
roles one after the other (0 comm blocks); ``"compute_only"`` runs the GEMMs on rows
already in place without waiting; ``"comm_only"`` moves the data without GEMMs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from comet.config import MoEConfig, ParallelConfig, check_layout
from comet.kernels import TUNABLE_TILE_FIELDS
from comet.kernels import launch as L
from comet.runtime.backward import BACKWARD_SCALARS, BackwardCall, GradBuffers
from comet.runtime.copy_dispatch import CopySender
from comet.runtime.errors import TIMEOUT_CODE, CometError, input_error, raise_if_failed
from comet.runtime.staging import StagedScalars, StaticInputs
from comet.runtime.streams import PrivateStream
from comet.runtime.workspace import (ERROR_WORD, allocate_symmetric, allocate_virtual,
                                    timeout_ns)
from comet.scheduler import tuned
from comet.scheduler.split import analytic_split, layer_work
from comet.weights import interleave_gate_up

MODES = ("fused", "sequential", "compute_only", "comm_only")


@dataclass
class PhaseTimer:
    """Times the phases of a call ("plan", "layer0", "layer1", "combine") with CUDA events
    (host clock on the CPU). Read with :meth:`elapsed_us` after a synchronize."""

    events: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.events[name] = (start, end)

    def elapsed_us(self) -> dict[str, float]:
        out = {}
        for name, (start, end) in self.events.items():
            if isinstance(start, float):
                out[name] = (end - start) * 1e6
            else:
                out[name] = start.elapsed_time(end) * 1e3
        return out


#: layer1 trace kinds at or above this are reduce items (kernels.layer1.TRACE_REDUCE).
TRACE_REDUCE = 1 << 16


def _describe(layer: str, kind: int, world: int, copy: bool = False) -> tuple[str, str]:
    """(role, label) of a trace event's ``kind`` (see the stamps in comet.kernels). Blocks
    change work during a call (comm blocks join the GEMM, GEMM blocks join the reduce),
    so the role is that of the unit of work, not of the block that started it. ``copy``:
    layer0's comm blocks placed rows the copy engines brought (kind: the source)."""
    if layer == "layer0":
        if kind < world:
            return "comm", (f"place rows of rank {kind}" if copy else f"push to rank {kind}")
        return "compute", f"expert {kind - world} tile"
    if kind >= TRACE_REDUCE:
        return "comm", f"reduce+send split {kind - TRACE_REDUCE}"
    return "compute", f"tile of split {kind}"


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (read from the device, never assumed)."""
    from comet.runtime import topology
    return topology.sm_count(device.index if device.index is not None
                             else torch.cuda.current_device())


def _end_rng_capture(device: torch.device) -> bool:
    """Take the device's default RNG out of capture mode after a failed capture; False
    if that did not work either.

    ``CUDAGraph.capture_begin`` puts the default CUDA generator in capture mode and only a
    successful ``capture_end`` takes it out: after a capture that failed, every later
    random op on the device (``torch.rand``, ``nn.init``) raises "Offset increment outside
    graph capture". One tiny capture that succeeds ends that mode."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    scratch = torch.zeros(1, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                scratch.add_(1)
            finally:
                graph.capture_end()
    except RuntimeError:
        return False
    torch.cuda.current_stream(device).wait_stream(stream)
    return True


#: SMs a virtual group dispatching by copy engines leaves free. Its ranks share one GPU,
#: so a rank's copies to its "peers" are same-device memcpys, and the driver runs those
#: on SMs (H100, scripts/device/copy_engine_check.py: a 64 MB device-to-device copy_
#: issued beside a grid holding every SM took 250 ms, the grid's whole spin; host to
#: device 3.9 ms): with every SM held by layer0 kernels spinning on those very copies,
#: they would run only after the timeout. Copies between GPUs are the copy engines'
#: (profiled as "Memcpy PtoP", docs/benchmarks.md).
VIRTUAL_COPY_SMS = 8


class FusedMoE:
    """The routed-expert part of an MoE layer on the fused kernels (one rank's view).

    Args:
        cfg: layer shape; ``cfg.max_tokens`` sizes the workspaces.
        w13: ``[El, H, 2F]`` this rank's experts, CUDA, in the layout ``w13_layout`` says.
        w2: ``[El, F, H]``.
        w13_layout: ``"gate_up"`` (all gate columns, then all up columns, as models store
            them): the layer keeps its own copy in the kernels' interleaved layout, which
            costs W13's memory again; ``"interleaved"`` (:mod:`comet.weights`, e.g. from
            :func:`comet.weights.interleave_gate_up_`): used as is, no copy -- what
            :class:`comet.moe.CometMoE` passes.
        group: expert-parallel process group (None: the world if initialised, else one
            rank). Collective: all ranks construct it together.
        tile: tile configuration (default: Hopper tiles); its ``decode_*`` fields give
            calls too small to fill the GPU their own GEMM tiles, and a tuned table may
            set its :data:`comet.kernels.TUNABLE_TILE_FIELDS` per token bucket
            (:meth:`select_tile`).
        tuned_config_folder: extra folder of ``comet tune`` tables.
        check_errors: ``"lazy"`` raise a failed call's error at a later call (no sync);
            ``"sync"`` synchronise after every call and raise at once (debugging).
        use_graphs: replay fused calls from a CUDA graph (cuts host work per call from
            ~60 launches to ~10 small ops). Inside a user's own graph capture, calls are
            recorded eagerly instead.

    Errors: a peer that does not make the call, hangs or crashes makes every rank's call
    raise :class:`~comet.runtime.errors.CometTimeoutError` within ``COMET_TIMEOUT_S``
    (default 10 s); the layer then raises :class:`~comet.runtime.errors.CometError` until
    :meth:`reset` has been called on every rank. Bad routing (an id outside ``[-1, E)``,
    a NaN or infinite weight) is checked on the device and raised as
    :class:`~comet.runtime.errors.CometInputError` by a later call (with ``"sync"``: by
    the same call) *after* that call's work was issued, so every rank still makes the
    same calls; the bad slots count as "no expert" and the layer stays usable.
    """

    def __init__(self, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor, group=None,
                 tile: L.TileConfig | None = None, tuned_config_folder: str | None = None,
                 check_errors: str = "lazy", use_graphs: bool = True,
                 w13_layout: str = "gate_up"):
        par = ParallelConfig.from_group(group)
        tile = tile or (L.TileConfig.small() if L.interpreting() else L.TileConfig())
        self._validate(cfg, par, w13, w2, check_errors, w13_layout)
        # State the calls update in place must not be inference tensors, or a layer first
        # built under torch.inference_mode() (a server's warm-up) fails every later call
        # made outside it.
        with torch.inference_mode(False):
            w13 = self._kernel_layout(w13, w13_layout)
            if par.world_size == 1:
                ws = allocate_virtual(cfg, 1, w13.device, tile)[0]
            else:
                ws = allocate_symmetric(cfg, group, w13.device, tile)
            programs = sm_count(w13.device) if w13.device.type == "cuda" else 4
            self._setup(cfg, w13, w2, group, par, ws, tile, programs, tuned_config_folder,
                        check_errors, use_graphs)

    @classmethod
    def virtual_group(cls, cfg: MoEConfig, w13_shards: list[torch.Tensor],
                      w2_shards: list[torch.Tensor], tile: L.TileConfig | None = None,
                      programs: int | None = None, tuned_config_folder: str | None = None,
                      check_errors: str = "lazy", use_graphs: bool = True,
                      w13_layout: str = "gate_up", backward: bool = False
                      ) -> list["FusedMoE"]:
        """W ranks of one expert-parallel group in this process, on one device, whose
        workspaces point at each other: call them concurrently, one CUDA stream per rank
        (:func:`comet.runtime.virtual.concurrent_forward`), to run the real cross-rank
        protocol without NVLink (tests). Each rank is :meth:`preload`-ed: one host thread
        cannot make peer calls while the device waits to load a module. ``programs``
        (default: the SM count over W; with ``tile.copy_dispatch`` the SMs but
        :data:`VIRTUAL_COPY_SMS`, over W) is each rank's grid, so every rank's spinning
        kernel fits on the GPU beside the others' (launched without the cooperative
        attribute, which would not let them share it); with ``tile.copy_dispatch`` each
        rank's copies go on its own stream, in order (:class:`CopySender` ``in_order``).
        ``backward``: preload the backward's kernels too (:meth:`backward`). Other
        arguments as for the constructor."""
        world = len(w13_shards)
        device = w13_shards[0].device
        if world > 1 and check_errors == "sync":
            raise ValueError("check_errors='sync' cannot serve virtual ranks: a rank's "
                             "synchronize waits for its call, which needs the other ranks' "
                             "calls; use 'lazy' and check_errors_now() after the calls")
        tile = tile or (L.TileConfig.small() if L.interpreting() else L.TileConfig())
        if programs is None:
            sms = sm_count(device) if device.type == "cuda" else 4 * world
            if tile.copy_dispatch and device.type == "cuda" and world > 1:
                sms -= VIRTUAL_COPY_SMS
            programs = max(1, sms // world)
        with torch.inference_mode(False):   # see __init__
            spaces = allocate_virtual(cfg, world, device, tile)
        layers = []
        for r in range(world):
            par = ParallelConfig(world, r)
            cls._validate(cfg, par, w13_shards[r], w2_shards[r], check_errors, w13_layout)
            layer = cls.__new__(cls)
            with torch.inference_mode(False):
                layer._setup(cfg, cls._kernel_layout(w13_shards[r], w13_layout),
                             w2_shards[r], None, par, spaces[r], tile, programs,
                             tuned_config_folder, check_errors, use_graphs, virtual=True)
            if device.type == "cuda":
                layer.preload(backward=backward)
            layers.append(layer)
        return layers

    @staticmethod
    def _kernel_layout(w13: torch.Tensor, layout: str) -> torch.Tensor:
        return interleave_gate_up(w13) if layout == "gate_up" else w13

    @staticmethod
    def _validate(cfg, par, w13, w2, check_errors, w13_layout) -> None:
        check_layout(cfg, par)
        if w13_layout not in ("gate_up", "interleaved"):
            raise ValueError(f"w13_layout must be 'gate_up' or 'interleaved', got "
                             f"{w13_layout!r}")
        el = cfg.num_experts // par.world_size
        h, f = cfg.hidden_size, cfg.intermediate_size
        if tuple(w13.shape) != (el, h, 2 * f) or tuple(w2.shape) != (el, f, h):
            raise ValueError(f"expected w13 [{el}, {h}, {2 * f}] and w2 [{el}, {f}, {h}], got "
                             f"{list(w13.shape)} and {list(w2.shape)}")
        if check_errors not in ("lazy", "sync"):
            raise ValueError(f"check_errors must be 'lazy' or 'sync', got {check_errors!r}")

    def _setup(self, cfg, w13, w2, group, par, ws, tile, programs, tuned_config_folder,
               check_errors, use_graphs, virtual: bool = False) -> None:
        self.cfg, self.par, self.group = cfg, par, group
        self.w13, self.w2 = w13, w2
        self.device = w13.device
        self.tile = tile
        self.check_errors = check_errors
        self.tuned_config_folder = tuned_config_folder
        self.ws = ws
        self.programs = programs
        self._virtual = virtual
        self.last_comm_blocks: tuple[int, int] | None = None
        self._variants: dict[tuple, tuple[L.TileConfig, L.TileConfig | None]] = {}
        self.last_tile: L.TileConfig | None = None
        self._small: dict[int, bool] = {}
        self._selected: dict[tuple, tuned.Choice] = {}
        # Host copy of the error words, refreshed after every call without a sync.
        self._pending = (torch.zeros(ws.error.numel(), dtype=torch.int32, pin_memory=True)
                         if self.device.type == "cuda" else None)
        self._failure: CometError | None = None   # sticky until reset()
        self._input_reported = 0                   # epoch of the last input error raised
        self._timeout: int | None = None           # last value written to ws.timeout
        self.use_graphs = use_graphs
        self._static = StaticInputs(cfg, self.device)
        # Per variant: one graph per device-only segment of a call (see _segments).
        self._graphs: dict[tuple[str, bool, L.TileConfig], list | None] = {}
        self._sender: CopySender | None = None    # the copy engines' sends, on first use
        self._capture_stream: PrivateStream | None = None   # on first capture
        self._preloading = False
        self._trace: dict[str, torch.Tensor] | None = None
        self._compiled: set[tuple[str, bool, L.TileConfig]] = set()
        self._grad: GradBuffers | None = None     # the backward's scratch, on first use
        self._backward_scalars: StagedScalars | None = None
        self._backward_calls: dict[tuple[bool, bool], BackwardCall] = {}
        self._backward_graphs: dict[tuple[bool, bool], list | None] = {}
        self._backward_compiled: set[tuple[bool, bool]] = set()

    # ------------------------------------------------------------------ split
    def select_comm_blocks(self, num_tokens: int, comm_blocks=None) -> tuple[int, int]:
        """(layer0, layer1) comm blocks for a call with ``num_tokens`` on this rank:
        an explicit override, else a tuned table, else the analytic model."""
        if comm_blocks is not None:
            n0, n1 = (comm_blocks, comm_blocks) if isinstance(comm_blocks, int) else comm_blocks
        else:
            n0, n1 = self._selection(num_tokens).splits
        for n in (n0, n1):
            if not 0 <= n < self.programs:
                raise ValueError(f"comm_blocks must be in [0, {self.programs}), got {n}")
        return int(n0), int(n1)

    def select_tile(self, num_tokens: int, decode_tile: bool | None = None,
                    tile_overrides: dict[str, int] | None = None) -> L.TileConfig:
        """The tile configuration of a call with ``num_tokens`` on this rank: the layer's
        TileConfig with the tunable fields a tuned table sets for the bucket
        (``tile_overrides`` replaces those), on the decode tile
        (:meth:`TileConfig.decode_tile`, narrower layer1 column blocks) or not --
        ``decode_tile`` forces that choice; else the table's ``decode_tile`` for the
        bucket, else :meth:`decode_by_rule`. A rank-local choice: tiles change no buffer a
        peer reads. Remembered per token count."""
        picked = self._selection(num_tokens)
        base, decode = self._variant(picked.tile if tile_overrides is None
                                     else tuple(sorted(tile_overrides.items())))
        if decode is None:
            if decode_tile:
                raise ValueError("decode_tile=True, but this layer's TileConfig has no "
                                 "decode tile (decode_block_n1 is 0 or block_n1)")
            return base
        if decode_tile is None:
            decode_tile = picked.decode_tile
        if decode_tile is None:
            decode_tile = self.decode_by_rule(num_tokens)
        return decode if decode_tile else base

    def _variant(self, overrides: tuple[tuple[str, int], ...]
                 ) -> tuple[L.TileConfig, L.TileConfig | None]:
        """(the layer's TileConfig with ``overrides``, its decode tile or None), built
        once per set of overrides (a ValueError names a field that is not tunable)."""
        if overrides not in self._variants:
            base = self.tile.with_overrides(dict(overrides))
            self._variants[overrides] = (base, base.decode_tile())
        return self._variants[overrides]

    def tile_variants(self) -> list[L.TileConfig]:
        """Every tile configuration a call may select: the layer's, the tuned table's
        per-bucket ones, and the decode tile of each."""
        table = tuned.load_table(self.cfg, self.par.world_size, self.device,
                                 self.tuned_config_folder)
        picks = {()} | {c.tile for c in (table or {}).values()}
        return [t for o in sorted(picks) for t in self._variant(o) if t is not None]

    @property
    def last_decode(self) -> bool:
        """Whether the last call's layer1 ran on the decode tile."""
        return self.last_tile is not None and self.last_tile.block_n1 != self.tile.block_n1

    @property
    def last_tile_overrides(self) -> dict[str, int]:
        """The tunable tile fields in which the last call's tile differed from the
        layer's TileConfig (a tuned bucket's choice, or the call's override)."""
        if self.last_tile is None:
            return {}
        return {k: getattr(self.last_tile, k) for k in TUNABLE_TILE_FIELDS
                if getattr(self.last_tile, k) != getattr(self.tile, k)}

    def decode_by_rule(self, num_tokens: int) -> bool:
        """Whether the untuned choice of :meth:`select_tile` is the decode tile (a layer
        with one): :meth:`TileConfig.decode_pays` with the rows spread evenly over the
        experts (every rank sending as many tokens as this one)."""
        if num_tokens not in self._small:
            c, world = self.cfg, self.par.world_size
            rows = -(-num_tokens * world * c.top_k // c.num_experts)
            self._small[num_tokens] = self.tile.decode_pays(
                rows, c.num_experts // world, c.hidden_size, self.programs)
        return self._small[num_tokens]

    def _selection(self, num_tokens: int) -> tuned.Choice:
        """The tuned table's bucket (comm blocks, decode-tile flag or None, tile fields),
        else the analytic model's split and nothing else. Remembered per token count: the
        forward path should not search folders, query the device name or run the model's
        loop on every call."""
        key = (num_tokens, os.environ.get(tuned.ENV_FOLDER))
        if key not in self._selected:
            picked = tuned.lookup(self.cfg, self.par.world_size, num_tokens, self.device,
                                  self.tuned_config_folder)
            if picked is not None and not all(0 <= n < self.programs for n in picked.splits):
                warnings.warn(f"comet: the tuned table's split {picked.splits} at "
                              f"{num_tokens} tokens does not fit this GPU's {self.programs} "
                              "programs; using the analytic model", stacklevel=4)
                picked = None
            self._selected[key] = (picked if picked is not None
                                   else tuned.Choice(*self.analytic_comm_blocks(num_tokens)))
        return self._selected[key]

    def analytic_comm_blocks(self, num_tokens: int) -> tuple[int, int]:
        """(layer0, layer1) comm blocks of the analytic model for ``num_tokens`` (layer1:
        0 with the scatter epilogue, which has no comm role)."""
        c = self.cfg
        w0, w1 = layer_work(num_tokens, self.par.world_size, c.top_k, c.hidden_size,
                            c.intermediate_size, c.dtype.itemsize,
                            self.tile.n_splits(c.hidden_size))
        n1 = 0 if self.tile.layer1_scatter else analytic_split(w1, self.programs)
        return analytic_split(w0, self.programs), n1

    # ------------------------------------------------------------------ checks
    def _check(self, x, topk_ids, topk_weights, mode):
        c = self.cfg
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if x.dim() != 2 or x.shape[1] != c.hidden_size:
            raise ValueError(f"x must be [tokens, {c.hidden_size}], got {list(x.shape)}")
        if x.dtype != c.dtype:
            raise TypeError(f"x dtype {x.dtype} does not match the layer's {c.dtype}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the layer on {self.device}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        if x.shape[0] > c.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens={c.max_tokens}")
        shape = (x.shape[0], c.top_k)
        if tuple(topk_ids.shape) != shape or tuple(topk_weights.shape) != shape:
            raise ValueError(f"topk_ids/topk_weights must be {list(shape)}, got "
                             f"{list(topk_ids.shape)} / {list(topk_weights.shape)}")
        if topk_ids.device != self.device or topk_weights.device != self.device:
            raise ValueError("topk_ids/topk_weights must be on the layer's device")

    def check_errors_now(self) -> None:
        """Synchronise and raise if any call so far failed (or had bad routing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_for(self.ws.error.tolist())

    def _raise_for(self, word: list[int]) -> None:
        """Raise what an error word (fatal, then input) reports, once."""
        try:
            raise_if_failed(word[:ERROR_WORD], self.par.rank)
        except CometError as e:
            self._failure = e
            raise
        err = input_error(word[ERROR_WORD:], self.cfg.num_experts)
        epoch = word[-1]
        if err is not None and epoch > self._input_reported:
            self._input_reported = epoch
            self.ws.input_word.zero_()   # stream-ordered: later calls may report again
            raise err

    def _after_launch(self) -> None:
        """Report errors of this call (``"sync"``) or of earlier ones (``"lazy"``: read
        the host copy an earlier call left, then refresh it without a sync)."""
        if self.check_errors == "sync" or self._pending is None:
            self.check_errors_now()
            return
        word = self._pending.tolist()
        self._pending.copy_(self.ws.error, non_blocking=True)
        self._raise_for(word)

    def reset(self) -> None:
        """Bring the layer back after a :class:`CometError`. Collective: every rank of
        the group calls it (it waits for every rank's calls in flight to end -- they end
        within the timeout, since a failed group gives up everywhere -- then zeroes flags,
        epochs and error words on every rank before any rank calls again)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._group_barrier()
        self.ws.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._group_barrier()
        self._failure = None
        self._input_reported = 0
        if self._pending is not None:
            self._pending.zero_()

    def _group_barrier(self) -> None:
        # Virtual ranks share this process and its device: the synchronize was enough.
        if self.par.world_size > 1 and not self._virtual:
            import torch.distributed as dist
            dist.barrier(group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forward
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 comm_blocks=None, mode: str = "fused", timer: PhaseTimer | None = None,
                 decode_tile: bool | None = None,
                 tile_overrides: dict[str, int] | None = None) -> torch.Tensor:
        """Routed experts of ``x [M, H]`` -> ``[M, H]`` in ``x.dtype``.

        ``comm_blocks`` (an int for both layers, or a pair), ``decode_tile`` and
        ``tile_overrides`` (values of :data:`comet.kernels.TUNABLE_TILE_FIELDS`) override
        the per-call selection (:meth:`select_comm_blocks`, :meth:`select_tile`).

        Every rank of the group must make the same sequence of calls. On a GPU, calls
        without a ``timer`` replay a CUDA graph captured on the second call of the same
        variant (mode, and which layers have comm blocks; the first compiles the kernels):
        the host then issues about ten small operations.
        """
        self._check(x, topk_ids, topk_weights, mode)
        if self._failure is not None:
            raise CometError("comet: this layer failed in an earlier call and its workspace "
                             "is unusable until reset() is called on every rank (or the "
                             f"layer is re-created): {self._failure}") from self._failure
        n0, n1 = self.select_comm_blocks(x.shape[0], comm_blocks)
        tile = self.select_tile(x.shape[0], decode_tile, tile_overrides)
        y = self._launch(x, topk_ids, topk_weights, (n0, n1), mode, timer, tile)
        self._after_launch()
        return y

    def _scatters(self, mode: str) -> bool:
        """Whether a call in ``mode`` runs layer1 with the scatter epilogue (fused calls
        only: the other modes keep the reduce, the decomposition of a call)."""
        return self.tile.layer1_scatter and mode == "fused"

    def _refresh_timeout(self) -> None:
        timeout = timeout_ns()
        if timeout != self._timeout:
            self.ws.timeout.fill_(timeout)
            self._timeout = timeout

    def _launch(self, x, topk_ids, topk_weights, split: tuple[int, int], mode: str,
                timer: PhaseTimer | None, tile: L.TileConfig) -> torch.Tensor:
        """Stage the inputs and issue one call's work (graph replay when possible) on
        ``tile``."""
        m = x.shape[0]
        n0, n1 = split
        if self._scatters(mode):
            n1 = 0      # layer1 has no comm role then: its epilogue sends
        self.last_comm_blocks = (n0, n1)
        self.last_tile = tile
        y = torch.empty_like(x)
        s = self._static
        self._refresh_timeout()
        x = L.aligned(x)
        s.stage(x.data_ptr(), y.data_ptr(), m, n0, n1)
        s.ids[:m].copy_(topk_ids)     # rows past m are never read (the plan stops at m)
        s.weights[:m].copy_(topk_weights)
        # Only layer0's split changes the launches (0: two launches); layer1 is one launch
        # for any split, which the kernel reads on the device. The tile changes them all.
        key = (mode, n0 > 0, tile)
        segments = self._segments(mode, key[1], timer or PhaseTimer(), tile, x, m)
        graphable = (self.use_graphs and x.is_cuda and timer is None
                     and not torch.cuda.is_current_stream_capturing())
        if graphable and key in self._compiled and key not in self._graphs:
            self._graphs[key] = self._capture_segments(segments, key)
        self._run_segments(segments, self._graphs.get(key) if graphable else None)
        if graphable:
            self._compiled.add(key)
        return y

    @staticmethod
    def _run_segments(segments, graphs: list | None) -> None:
        """Issue a call's segments ``(device_only, phases)``: device-only ones from their
        graphs when there are graphs, the rest (and all, without graphs) eagerly."""
        for i, (device_only, phases) in enumerate(segments):
            if device_only and graphs is not None:
                graphs[i].replay()
            else:
                for phase in phases:
                    phase()

    # ------------------------------------------------------------------ backward
    def backward(self, dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, weight_grads: bool = True, comm_blocks=None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
        """Gradients of the call ``y = self(x, topk_ids, topk_weights)`` given ``dy =
        dL/dy [M, H]``, on the fused kernels (:mod:`comet.runtime.backward`): the
        dispatches of ``x`` and ``dy`` and the return of the ``dx`` rows overlap the
        GEMMs as in the forward. Collective, like a call.

        Returns ``(dx [M, H] in x's dtype, d topk_weights [M, k] in their dtype, dW13
        [El, H, 2F] in this layer's interleaved layout, dW2 [El, F, H])``; the weight
        gradients are None without ``weight_grads`` (frozen experts: two GEMMs fewer,
        the same exchanges). ``comm_blocks`` as for a call (default: the call's own)."""
        self._check(x, topk_ids, topk_weights, "fused")
        if tuple(dy.shape) != tuple(x.shape) or dy.device != x.device:
            raise ValueError(f"dy must be {list(x.shape)} on {x.device}, got "
                             f"{list(dy.shape)} on {dy.device}")
        if self._failure is not None:
            raise CometError("comet: this layer failed in an earlier call and its workspace "
                             "is unusable until reset() is called on every rank (or the "
                             f"layer is re-created): {self._failure}") from self._failure
        split = self.select_comm_blocks(x.shape[0], comm_blocks)
        self._refresh_timeout()
        self.last_comm_blocks = split
        call = self._backward_variant(split[0] > 0, weight_grads).start(
            L.aligned(dy.to(x.dtype).contiguous()), L.aligned(x),
            topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous(), split)
        self._run_backward(call)
        self._after_launch()
        return call.results(topk_weights.dtype)

    def _backward_variant(self, layer0_comm: bool, weight_grads: bool) -> BackwardCall:
        """The backward of one launch variant, built on first use (with the backward's
        scratch): its phases read the staged scalars, so it serves every call."""
        key = (layer0_comm, weight_grads)
        if key not in self._backward_calls:
            with torch.inference_mode(False):
                if self._grad is None:
                    self._grad = GradBuffers.allocate(self.cfg, self.par.world_size,
                                                      self.device)
                if self._backward_scalars is None:
                    self._backward_scalars = StagedScalars(BACKWARD_SCALARS, self.device)
            self._backward_calls[key] = BackwardCall(
                self.ws, self.cfg, self.tile, self.w13, self.w2, self._grad,
                self._static.ids, self._static.weights, self._backward_scalars,
                self.programs, fused=not L.interpreting(), layer0_comm=layer0_comm,
                cooperative=not self._virtual, weight_grads=weight_grads)
        return self._backward_calls[key]

    def _run_backward(self, call: BackwardCall) -> None:
        """Issue a started call: its device-only segments replayed from CUDA graphs
        captured on the variant's second call (the first compiles), the rest eager --
        the weight-gradient GEMMs and the d-weights copy make the caller's tensors, which
        a graph would overwrite at its next replay."""
        key = (call.layer0_comm, call.weight_grads)
        graphable = (self.use_graphs and self.device.type == "cuda"
                     and not torch.cuda.is_current_stream_capturing())
        segments = call.segments()
        if graphable and key in self._backward_compiled and key not in self._backward_graphs:
            self._backward_graphs[key] = self._capture_segments(segments, ("backward", *key))
        self._run_segments(segments, self._backward_graphs.get(key) if graphable else None)
        if graphable:
            self._backward_compiled.add(key)

    def _capture_segments(self, segments, key: tuple) -> list | None:
        """One graph per device-only segment ``(device_only, phases)`` (None in the
        others' places); None if any capture failed."""
        graphs = []
        for device_only, phases in segments:
            graph = None
            if device_only:
                graph = self._record(lambda phases=phases: [phase() for phase in phases],
                                     key)
                if graph is None:
                    return None
            graphs.append(graph)
        return graphs

    def preload(self, mode: str = "fused", backward: bool = False) -> None:
        """Compile, load and capture the kernels of every block-split and tile variant of
        ``mode`` on this rank alone, before the first call (with ``backward``, compile
        and load the backward's too). Local -- nothing reaches a peer -- so
        it needs no barrier; but not while this layer has a call in flight.

        It runs two calls per variant (the first compiles, the second captures the graph)
        with this rank's error word set, so every wait gives up at once and nothing is
        published or sent (nor copied, with ``TileConfig.copy_dispatch``: the host skips
        the copies), then clears the word and the epoch. Why: CUDA may have to wait
        for the device to go idle to load a kernel module, and a rank's first call loads
        modules while its earlier kernels wait for peers. On W GPUs the peers get there
        anyway; virtual ranks sharing one GPU and one host thread would deadlock."""
        dev = self.device
        nothing = (torch.empty(0, self.cfg.hidden_size, dtype=self.cfg.dtype, device=dev),
                   torch.empty(0, self.cfg.top_k, dtype=torch.int64, device=dev),
                   torch.empty(0, self.cfg.top_k, dtype=torch.float32, device=dev))
        self.ws.fatal_word[0].fill_(TIMEOUT_CODE)
        self._preloading = True
        try:
            for tile in self.tile_variants():
                for split in ((1, 1), (0, 0)):
                    for _ in range(2):
                        self._launch(*nothing, split, mode, None, tile)
        finally:
            self._preloading = False
        if backward:
            for split in ((1, 1), (0, 0)):
                for _ in range(2):
                    self._run_backward(self._backward_variant(split[0] > 0, True).start(
                        nothing[0], *nothing, split))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.ws.error.zero_()
        for t in (self.ws.epoch, self.ws.counters):
            t.zero_()

    def timeline(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 comm_blocks=None) -> list[dict]:
        """One fused call with every block stamping the start and end of each unit of
        work (global timer, ns). Returns records ``{block, role, layer, unit, what,
        start_ns, end_ns}``, times relative to the earliest stamp. Collective, like any
        call (two calls, in fact: the first compiles). layer0 runs fused with at least
        one comm block (with none it is two untraced launches); layer1 keeps the chosen
        split, 0 included (every block runs the GEMM, then the reduce) -- or, with the
        scatter epilogue, has no comm role (every block runs the GEMM, which sends)."""
        n0, n1 = self.select_comm_blocks(x.shape[0], comm_blocks)
        n0 = max(n0, 1)
        shape = (self.programs, L.MAX_TRACE_EVENTS, 4)
        self._trace = {name: torch.full(shape, -1, dtype=torch.int64, device=self.device)
                       for name in ("layer0", "layer1")}
        try:
            # The first traced call compiles the traced kernels between the launches of
            # the two layers; only the second call's stamps show the layer as it runs.
            for _ in range(2):
                # Blocks take work from queues, so a block's event count differs from
                # call to call: clear the first call's stamps.
                for t in self._trace.values():
                    t.fill_(-1)
                self(x, topk_ids, topk_weights, comm_blocks=(n0, n1), timer=PhaseTimer())
            self.check_errors_now()
            raw = {k: v.cpu() for k, v in self._trace.items()}
        finally:
            self._trace = None
        world = self.par.world_size
        records = []
        for layer in ("layer0", "layer1"):
            for block in range(self.programs):
                for kind, unit, start, end in raw[layer][block].tolist():
                    if start < 0:
                        break
                    role, what = _describe(layer, kind, world, self.tile.copy_dispatch)
                    records.append({"block": block, "role": role, "layer": layer,
                                    "unit": unit, "what": what, "start_ns": start,
                                    "end_ns": end})
        t0 = min((r["start_ns"] for r in records), default=0)
        for r in records:
            r["start_ns"] -= t0
            r["end_ns"] -= t0
        return records

    def _record(self, body: Callable[[], object], key: tuple) -> torch.cuda.CUDAGraph | None:
        """Record ``body`` -- one call's launches on the static buffers -- into a graph
        (records; executes nothing, so every rank still makes exactly one real call per
        user call). Not through
        ``torch.cuda.graph``, whose entry synchronises the device: calls in flight wait
        for peers' next calls, which a host blocked here would never make (virtual ranks
        sharing a device), and a hidden host sync does not belong in a forward anyway.

        Thread-local capture: another host thread's unsafe call during the capture (a
        DataLoader's pinned allocation, a peer virtual rank loading a kernel module) would
        invalidate a global-mode one. Should the capture fail anyway, the variant runs
        eagerly from then on (None), with a warning: no call is lost, since a capture
        executes nothing.

        The garbage collector is off while recording: a collection that frees an
        unreachable object holding a CUDA graph (an earlier layer in a reference cycle)
        destroys that graph from this thread, which a capture does not permit -- the
        capture was invalidated that way, at random, inside a test run."""
        graph = torch.cuda.CUDAGraph()
        if self._capture_stream is None:
            # Its own stream, not one of the pool's 32 (see PrivateStream): one that is
            # another virtual rank's would have it wait for this rank's calls.
            self._capture_stream = PrivateStream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except RuntimeError as e:       # torch.AcceleratorError and Triton's launch error
            rng = ("" if _end_rng_capture(self.device) else "; the device's default RNG "
                   "may be left in capture mode (random ops on it raise)")
            warnings.warn(f"comet: CUDA graph capture of {key} failed ({e}); this variant "
                          f"runs without a graph{rng}", RuntimeWarning, stacklevel=3)
            return None
        finally:
            if gc_was_on:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    def _copies(self, mode: str) -> bool:
        """Whether a call in ``mode`` dispatches by copy engines (fused calls of a layer
        with ``TileConfig.copy_dispatch``; the other modes push, like the scatter)."""
        return self.tile.copy_dispatch and mode == "fused"

    def _segments(self, mode: str, layer0_comm_blocks: bool, timer: PhaseTimer,
                  tile: L.TileConfig, x: torch.Tensor, num_tokens: int) -> list:
        """One call on the staged inputs (``self._static``) as segments ``(device_only,
        phases)``: one device-only segment, or -- dispatching by copy engines -- the plan,
        the copies of this call's ``x`` (host-issued: their sizes and source are the
        call's own, so no graph may hold them), the layers, and the join of the copy
        streams."""
        plan = lambda: self._plan(timer, tile)                           # noqa: E731
        layers = lambda: self._layers(mode, layer0_comm_blocks, timer, tile)  # noqa: E731
        if not self._copies(mode):
            return [(True, [plan, layers])]
        if self._sender is None:
            self._sender = CopySender(self.ws, self.cfg.top_k, in_order=self._virtual)
        sender = self._sender
        # A preloading call sends nothing: its copies would land in peers that may be
        # in a real call (see preload()).
        send = ((lambda: None) if self._preloading
                else (lambda: sender.send(x, num_tokens)))
        return [(True, [plan]), (False, [send]), (True, [layers]), (False, [sender.join])]

    def _plan(self, timer: PhaseTimer, tile: L.TileConfig) -> None:
        """Open the call and build its routing plan (the count exchange included)."""
        ws, s = self.ws, self._static
        with timer.phase("plan", ws.epoch.device):
            ws.begin_call()
            L.launch_plan(ws, self.cfg, s.ids, s.weights, tile, s.num_tokens)

    def _layers(self, mode: str, layer0_comm_blocks: bool, timer: PhaseTimer,
                tile: L.TileConfig) -> None:
        """layer0, layer1 and the combine of a planned call; see the module docstring.
        A layer0 split with no comm blocks runs its two roles as two launches."""
        ws, cfg, s = self.ws, self.cfg, self._static
        grid = self.programs
        # The interpreter runs one program at a time: a fused launch would have its comm
        # programs wait for compute programs that have not run, so roles go one by one.
        # layer0 needs a comm block to dispatch; layer1 with none is "GEMM, then reduce on
        # every block" in one launch.
        fused = mode == "fused" and not L.interpreting()
        fused0, fused1 = fused and layer0_comm_blocks, fused
        scatter, copy = self._scatters(mode), self._copies(mode)
        x_addr, y_addr = s.addr[0:1], s.addr[1:2]
        split0, split1 = s.split[0:1], s.split[1:2]
        w13, w2 = self.w13, self.w2
        dev = ws.epoch.device
        trace = self._trace or {}
        with timer.phase("layer0", dev):
            if fused0:
                L.launch_layer0(ws, cfg, x_addr, w13, tile, L.ROLE_FUSED, split0, grid,
                                trace=trace.get("layer0"), cooperative=not self._virtual,
                                row_home=scatter, copy=copy)
            else:
                if mode != "compute_only":
                    L.launch_layer0(ws, cfg, x_addr, w13, tile, L.ROLE_COMM, split0, grid,
                                    row_home=scatter, copy=copy)
                if mode != "comm_only":
                    L.launch_layer0(ws, cfg, x_addr, w13, tile, L.ROLE_COMPUTE, split0, grid,
                                    wait=mode != "compute_only")
        with timer.phase("layer1", dev):
            if scatter:
                L.launch_layer1(ws, cfg, w2, tile, L.ROLE_COMPUTE, split1, grid,
                                trace=trace.get("layer1"), scatter=True)
            elif fused1:
                L.launch_layer1(ws, cfg, w2, tile, L.ROLE_FUSED, split1, grid,
                                trace=trace.get("layer1"), cooperative=not self._virtual)
            else:
                if mode != "comm_only":
                    L.launch_layer1(ws, cfg, w2, tile, L.ROLE_COMPUTE, split1, grid)
                if mode != "compute_only":
                    L.launch_layer1(ws, cfg, w2, tile, L.ROLE_COMM, split1, grid,
                                    wait=mode != "comm_only")
        with timer.phase("combine", dev):
            if mode != "compute_only":
                L.launch_combine(ws, cfg, y_addr, s.num_tokens, tile,
                                 grid if self._virtual else grid * L.COMBINE_PROGRAMS_PER_SM,
                                 scatter=scatter)
