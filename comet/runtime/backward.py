"""The backward of the routed experts on the fused kernels: Comet's overlap for training.

The backward has the forward's two shapes again, so it runs the forward's kernels:

* ``dy @ W2^T`` needs ``dy`` at the experts' ranks -- a dispatch followed by a GEMM,
  decomposed along M like layer0 (:func:`comet.kernels.layer0.layer0_kernel` with a
  transposed B);
* ``d(gate, up) @ W13^T`` leaves one row per (token, expert) to be summed at the token's
  home -- a GEMM followed by a reduce, decomposed along N like layer1
  (:func:`comet.kernels.layer1.layer1_kernel`, unweighted, returning each slot's
  routing-weight gradient with the rows).

Nothing is kept from the forward (its workspace is the next call's), so ``gate/up`` is
recomputed, as with activation checkpointing: a third layer0 call dispatches ``x`` and
computes ``x @ W13``. One rank's backward is two workspace *calls* (each opened by the
count exchange, the handshake that lets a call reuse buffers peers write into):

    call 1: plan -> layer0(x): gate/up = a0 @ W13 -> each row's weight, keep the x rows
    call 2: layer0(dy): dh = a0 @ W2^T -> SiLU-gate backward (dgu, w*h, d weight)
            -> dW2 = (w*h)^T dy, dW13 = x^T dgu (local grouped GEMMs)
            -> layer1(dgu @ W13^T): reduce + send dx rows and d weight home -> combine

Every exchange is inside a fused kernel, bounded and checked like the forward's, and
nothing waits on the host: the call's row counts stay on the device (the helpers of
:mod:`comet.kernels.grad_rows` and the activation kernel read them there).

Memory: the call's rows live in capacity-sized buffers (:class:`GradBuffers`, allocated at
the first backward): recomputed gate/up, then ``d(gate, up)`` in place (``[cap, 2F]``),
``w * h`` (``[cap, F]``), two fp32 scalars per row; the x rows are kept in the workspace's
layer1 buffer and ``dy @ W2^T`` goes to its layer0 output, which the backward does not
otherwise use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from comet.config import MoEConfig, TileConfig
from comet.constants import ROLE_COMM, ROLE_COMPUTE, ROLE_FUSED
from comet.grouped import grouped_weight_grad
from comet.kernels import exchange, grad_rows
from comet.kernels.act_backward import act_backward_rows
from comet.kernels.combine import COMBINE_PROGRAMS_PER_SM, combine_of
from comet.kernels.layer0 import layer0_gemm
from comet.kernels.layer1 import Pairs, layer1_gemm
from comet.kernels.plan import EntryTables, Routing
from comet.routing import recv_capacity
from comet.kernels.sync import Trace
from comet.runtime.forward import dispatch_of, plan_phases
from comet.runtime.launches import CombineLaunch, Layer0Launch, Layer1Launch
from comet.runtime.staging import StagedScalars
from comet.runtime.strategies import ColumnReduce
from comet.runtime.workspace import Workspace

#: Programs of the row helpers per SM (streams of loads, like the combine's).
ROW_PROGRAMS_PER_SM = 4
#: Rows per step of the expert biases' routing-weight term (bounds its fp32 scratch).
BIAS_ROWS = 8192
#: Width of the column of ones a bias gradient's row sum multiplies by: the narrowest
#: operand whose rows torch's grouped GEMM takes (16-byte strides).
ROW_SUM_COLUMNS = 16


@dataclass
class GradBuffers:
    """One rank's scratch of the fused backward (capacity rows, reused by every call)."""

    gu: torch.Tensor       # [cap, 2F] recomputed gate/up, then d(gate, up) in place
    hw: torch.Tensor       # [cap, F] w * h, the left operand of dW2
    w_row: torch.Tensor    # [cap] fp32 routing weight of each row
    dw_row: torch.Tensor   # [cap] fp32 its gradient

    @classmethod
    def allocate(cls, cfg: MoEConfig, world: int, device) -> "GradBuffers":
        cap = recv_capacity(world, cfg.max_tokens, cfg.slots_per_rank)
        f = cfg.intermediate_size
        return cls(torch.empty(cap, 2 * f, dtype=cfg.dtype, device=device),
                   torch.empty(cap, f, dtype=cfg.dtype, device=device),
                   torch.zeros(cap, dtype=torch.float32, device=device),
                   torch.zeros(cap, dtype=torch.float32, device=device))


def expert_ends(ws: Workspace) -> torch.Tensor:
    """int32 ``[El]``: one past each local expert's last row in the layer0 shared tensor
    (rows are grouped by expert, sources in ring order inside: the last ring segment
    ends the expert). Device ops on the plan; no sync."""
    return (ws.plan.segments.start[-1] + ws.plan.segments.rows[-1]).to(torch.int32)


#: Scalars a backward call stages (:class:`comet.runtime.staging.StagedScalars`):
#: addresses of x, dy and dx, the token count, the comm blocks of the two layer shapes.
BACKWARD_SCALARS = 6


@dataclass
class BackwardCall:
    """One rank's backward of a forward call, as phases (see the module docstring).

    Built once per variant (whether the layer0-shaped launches are fused, whether weight
    gradients are wanted) and reused: :meth:`start` stages a call's inputs at fixed
    addresses, so the device-only segments of :meth:`segments` can be captured once and
    replayed. :meth:`phases` lists every phase in order; a rank on its own GPU runs them
    back to back (or replays the captured segments), while the virtual-rank driver runs
    each phase on every rank before the next (the Triton interpreter runs one program at
    a time, so a consumer must find its producers done). The results are in :attr:`dx`,
    :attr:`d_weights`, :attr:`dw13`, :attr:`dw2` once the phases ran.
    """

    ws: Workspace
    cfg: MoEConfig
    tile: TileConfig
    w13: torch.Tensor          # [El, H, 2F] interleaved (comet.weights)
    w2: torch.Tensor           # [El, F, H]
    bufs: GradBuffers
    #: ``[max_tokens, k]`` buffers the routing is staged into for the plan (which then
    #: reads the call's rows only): the plan kernels' arguments stay the same for every
    #: token count, so a call never compiles a new specialization -- whose module load
    #: would wait for the device to go idle while this rank's kernels wait for peers.
    staged_ids: torch.Tensor
    staged_weights: torch.Tensor
    scalars: StagedScalars     # BACKWARD_SCALARS values
    grid: int                  # programs of the fused kernels
    fused: bool                # roles in one launch (False: one launch per role)
    layer0_comm: bool          # the layer0-shaped launches have comm blocks (fused)
    cooperative: bool = True
    weight_grads: bool = True
    b13: torch.Tensor | None = None   # [El, 2F] in W13's layout: expert biases, or None
    b2: torch.Tensor | None = None    # [El, H]

    def __post_init__(self):
        v = self.scalars.values
        self._addr = {"x": v[0:1], "dy": v[1:2], "dx": v[2:3]}
        self._m, self._split = v[3:4], (v[4:5], v[5:6])
        self._rows = 0
        self._inputs: tuple = ()
        self.dx = self.d_weights = self.dw13 = self.dw2 = self.db13 = self.db2 = None
        self._ends: torch.Tensor | None = None   # expert_ends(), once the plan ran
        if self.b13 is not None:
            # The biases' scratch, once per variant: row indices, and the left operands of
            # the row sums (ones; the row weights, refreshed per call).
            cap, dev = self.bufs.w_row.shape[0], self.bufs.w_row.device
            self._row_index = torch.arange(cap, dtype=torch.int32, device=dev)
            self._ones = torch.ones(cap, ROW_SUM_COLUMNS, dtype=self.cfg.dtype, device=dev)
            self._w_cols = torch.empty_like(self._ones)
        self._row_programs = max(1, self.grid * (1 if not self.cooperative
                                                 else ROW_PROGRAMS_PER_SM))
        ws = self.ws
        self._routing = Routing.of(self.staged_ids, self.staged_weights, self._m)
        self._dx_combine = combine_of(ColumnReduce.parts(ws), self._addr["dx"], self._m,
                                      self.tile)
        self._open_call, self._plan = plan_phases(ws, self._routing, self.tile)
        # The second handshake's exchange: a kernel of its own (no plan runs with it).
        self._handshake = (ws.plan.block_counts[-1], ws.exchange(in_plan=False))
        self._quiet = Trace.off()

    def start(self, dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, split: tuple[int, int]) -> "BackwardCall":
        """Stage one call: ``dy``, ``x`` ``[M, H]`` (model dtype, contiguous, aligned),
        ``topk_ids`` int64 and ``topk_weights`` fp32 ``[M, k]``; ``split`` the comm
        blocks of the two layer shapes. Allocates :attr:`dx`."""
        m = x.shape[0]
        self._rows = m
        self._inputs = (dy, x)         # alive until the call's kernels were issued
        self.dx = torch.empty_like(x)
        self.d_weights = self.dw13 = self.dw2 = self.db13 = self.db2 = None
        self.staged_ids[:m].copy_(topk_ids)
        self.staged_weights[:m].copy_(topk_weights)
        self.scalars.stage([x.data_ptr(), dy.data_ptr(), self.dx.data_ptr(), m, *split])
        return self

    def results(self, weights_dtype: torch.dtype) -> tuple:
        """``(dx, d topk_weights in weights_dtype, dW13, dW2)`` of the call that ran -- and
        ``(db13, db2)`` with expert biases --, handed over: the variant keeps no reference
        to them (a held weight gradient is as large as the experts' weights)."""
        out = (self.dx, self.d_weights.to(weights_dtype), self.dw13, self.dw2)
        if self.b13 is not None:
            out = (*out, self.db13, self.db2)
        self.dx = self.d_weights = self.dw13 = self.dw2 = self.db13 = self.db2 = None
        return out

    # ------------------------------------------------------------------ phases
    def segments(self) -> list[tuple[bool, list[Callable[[], None]]]]:
        """``(device_only, phases)`` in order. A device-only segment reads and writes
        fixed addresses only (a CUDA graph can replay it); the others make the tensors
        handed to the caller (weight gradients, routing-weight gradients)."""
        return [(True, [self._open_plan, self._plan,
                        *self._layer0("x", self.w13, self.bufs.gu, transposed=False,
                                      bias=self.b13),
                        self._keep_rows, self._open, self._wait_open,
                        *self._layer0("dy", self.w2, self.ws.h, transposed=True),
                        self._act]),
                (False, [self._weight_grads]),
                (True, [*self._layer1(), self._combine]),
                (False, [self._finish])]

    def phases(self) -> list[Callable[[], None]]:
        return [phase for _, phases in self.segments() for phase in phases]

    def _open_plan(self) -> None:
        # Slots with no expert are written by nobody: zero, before any peer may write
        # (they write after this call's handshake). All max_tokens rows (a memset of a
        # fixed size, so graphs serve every token count) -- and a memset, not an
        # elementwise kernel whose first load (on the first real call -- on an empty
        # preload call it launches nothing) would wait for an idle device.
        self.ws.local.pair_grad.zero_()
        self._open_call()

    def _layer0(self, src: str, w: torch.Tensor, out: torch.Tensor, transposed: bool,
                bias: torch.Tensor | None = None) -> list[Callable[[], None]]:
        """Dispatch ``src`` rows and GEMM them into ``out`` (+ ``bias`` per expert; a phase
        per role unless fused; a fused launch needs a comm block, as in the forward)."""
        ws = self.ws
        gemm, item = layer0_gemm(ws.local.a0, w, out, self.tile, gated=False, transposed=transposed,
                                 bias=bias)
        launch = Layer0Launch(dispatch_of(ws, self._addr[src], None), gemm, item,
                              ws.plan.tiles, ws.plan.segments, ws.layer0_work(False), ws.sync,
                              self._split[0], ws.shape, self.tile)
        return self._phases_of(launch, (ROLE_COMM, ROLE_COMPUTE),
                               fused=self.fused and self.layer0_comm)

    def _phases_of(self, launch, roles: tuple[int, int], fused: bool
                   ) -> list[Callable[[], None]]:
        """``launch`` as one fused phase, or one phase per role in ``roles``' order."""
        if fused:
            return [lambda: launch(self.grid, ROLE_FUSED, trace=self._quiet,
                                   cooperative=self.cooperative)]
        return [lambda role=role: launch(self.grid, role, trace=self._quiet)
                for role in roles]

    def _keep_rows(self) -> None:
        """Each row's routing weight (once this call's return entries landed); the x rows
        into layer1's buffer (unused until the last GEMM) before the dispatch of dy
        overwrites the shared tensor."""
        ws = self.ws
        self._ends = expert_ends(ws)
        grad_rows.launch_row_weights(
            self._row_programs // ws.world, recv=EntryTables(*(b.local for b in ws.recv)),
            arrivals=ws.arrivals, w_row=self.bufs.w_row, max_tokens=self.cfg.max_tokens,
            sync=ws.sync, shape=ws.shape)
        if self.weight_grads:
            grad_rows.launch_copy_rows(self._row_programs, ws.local.a0, ws.out1, self._ends[-1:])

    def _open(self) -> None:
        # Same routing, same plan: only the handshake (and the epoch) is new.
        ws = self.ws
        ws.begin_call()
        exchange.launch_exchange(*self._handshake, ws.sync, ws.shape, exchange.PUSH)

    def _wait_open(self) -> None:
        ws = self.ws
        exchange.launch_exchange(*self._handshake, ws.sync, ws.shape, exchange.WAIT)

    def _act(self) -> None:
        """Gated-activation backward on this rank's rows (in place: d(gate, up); w * h; d w)."""
        b = self.bufs
        act_backward_rows(b.gu, self.ws.h, b.w_row, self._ends[-1:], b.gu, b.hw, b.dw_row,
                          self._row_programs, self.cfg.activation)

    def _weight_grads(self) -> None:
        """The expert weights' gradients (rows grouped by expert: the dispatched dy rows
        are still in the shared tensor, the x rows in layer1's buffer); with biases, their
        share of the routing weights' gradients first (layer1 sends those home next)."""
        if self.b2 is not None:
            self._bias_weight_term()
        if self.weight_grads:
            self.dw2 = grouped_weight_grad(self.bufs.hw, self.ws.local.a0, self._ends)
            self.dw13 = grouped_weight_grad(self.ws.out1, self.bufs.gu, self._ends)
            if self.b13 is not None:
                self._bias_grads()

    def _bias_weight_term(self) -> None:
        """``d w += <dy, b2[e]>`` per row: the routing weight multiplies the expert's
        output bias too. Over every capacity row (the count stays on the device; rows past
        the last are given the last expert and never read), in chunks of
        :data:`BIAS_ROWS` rows (a gathered ``[rows, H]`` fp32 operand)."""
        cap = self._row_index.shape[0]
        experts = torch.searchsorted(self._ends, self._row_index, right=True)
        experts.clamp_(max=self._ends.shape[0] - 1)
        b2 = self.b2.float()
        for r0 in range(0, cap, BIAS_ROWS):
            rows = slice(r0, min(r0 + BIAS_ROWS, cap))
            self.bufs.dw_row[rows] += (self.ws.local.a0[rows].float() * b2[experts[rows]]).sum(1)

    def _bias_grads(self) -> None:
        """``db13`` = each expert's rows of d(gate, up) summed, ``db2`` = its rows of
        ``w * dy`` summed: grouped GEMMs with a column of ones (or of the row weights)
        on the left, deterministic, no sync."""
        self._w_cols.copy_(self.bufs.w_row.unsqueeze(1).expand_as(self._w_cols))
        self.db13 = grouped_weight_grad(self._ones, self.bufs.gu, self._ends)[:, 0].contiguous()
        self.db2 = grouped_weight_grad(self._w_cols, self.ws.local.a0, self._ends)[:, 0].contiguous()

    def _layer1(self) -> list[Callable[[], None]]:
        ws = self.ws
        gemm, item, splits = layer1_gemm(self.bufs.gu, self.w13, ws.out1, self.tile,
                                         transposed=True)
        pairs = Pairs(self.bufs.dw_row, ws.peers.pair_grad)

        launch = Layer1Launch(ColumnReduce, ws, gemm, item, splits, self.tile, self._split[1],
                              pairs)
        return self._phases_of(launch, (ROLE_COMPUTE, ROLE_COMM), fused=self.fused)

    def _combine(self) -> None:
        ws = self.ws
        grid = self.grid * (COMBINE_PROGRAMS_PER_SM if self.cooperative else 1)
        CombineLaunch(self._dx_combine, ws.local.flag1, self.cfg.max_tokens, ws.sync, self.tile)(grid)

    def _finish(self) -> None:
        """The routing weights' gradients; zero the weight gradients of experts that got
        no rows (on the device)."""
        self.d_weights = self.ws.local.pair_grad[:self._rows].clone()
        self._inputs = ()
        if not self.weight_grads:
            return
        for dw in (self.dw13, self.dw2, self.db13, self.db2):
            if dw is not None:
                grad_rows.launch_zero_empty(self._row_programs, dw, self._ends)

    def run(self) -> "BackwardCall":
        for phase in self.phases():
            phase()
        return self
