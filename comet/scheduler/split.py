"""Block split: how many of a fused kernel's blocks *start* in the comm role.

Blocks change role during a call (comet.kernels): a layer0 comm block that has pushed its
rows takes GEMM tiles from the work queue, a layer1 GEMM block out of tiles takes reduce
items. So a comm block costs the GEMM only the block-time it spends communicating, and
the split trades that against how early the data moves. With ``n`` of ``P`` blocks,
``G`` the GEMM time on all ``P`` blocks and ``t_c(n)`` the time ``n`` blocks need to move
the layer's bytes:

* layer0: ``T = max(G + n * t_c(n) / P, t_c(n) + G / W)`` -- the GEMM absorbs the comm
  blocks' time, and cannot end before the last rows land plus their share of the GEMM;
  ``n = 0`` runs dispatch and GEMM one after the other: ``t_c(P) + G``.
* layer1: the first of ``S`` column splits runs on all ``P`` blocks (``G / S``: nothing
  can be reduced before it is complete), the other ``S - 1`` on ``P - n`` blocks for
  ``G (S - 1) / S * P / (P - n)``; meanwhile the ``n`` comm blocks reduce and send what
  they can of the first ``S - 1`` splits (at a fraction of their rate: they compete with
  the GEMM for memory); what is left goes at the whole GPU's rate after the GEMM.

The analytic choice minimises ``T``; ``comet tune`` measures instead and its tables win
(:mod:`comet.scheduler.tuned`). Inputs are what the host knows without a sync: the
shape, this rank's token count (from the input's shape) and an assumed uniform routing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MachineModel:
    """Rates the analytic split balances (defaults: measured or fitted over NVLink, bf16;
    docs/notebook.md, "The split's machine model").

    per_block_bw: bytes/s one layer0 comm block pushes to peers, as the fused kernel runs
        it (fitted to tune sweeps: below a bare push kernel's rate).
    reduce_block_bw: bytes/s of partial rows one layer1 comm block reduces and sends
        (fitted likewise).
    link_bw: bytes/s one rank can push to all peers together (NCCL's all_to_all rate).
    local_block_bw: bytes/s one comm block copies inside its own GPU (an assumption: about
        twice the remote rate, since a block is bound by its own loads in flight).
    hbm_bw: bytes/s of a whole-GPU copy (read + write).
    gemm_flops: bf16 GroupGEMM FLOP/s of the whole GPU (torch's rate).
    reduce_overlap: share of its rate a layer1 comm block keeps while the GEMM runs
        (fitted: the reduce competes with the GEMM for memory).
    """

    per_block_bw: float = 11e9
    reduce_block_bw: float = 2.5e9
    link_bw: float = 290e9
    local_block_bw: float = 35e9
    hbm_bw: float = 3e12
    gemm_flops: float = 650e12
    reduce_overlap: float = 0.1


@dataclass(frozen=True)
class LayerWork:
    """What one layer moves and computes on one rank.

    comm_bytes: bytes this rank's comm blocks write to other ranks.
    local_bytes: bytes they write to this rank (local copies).
    flops: GEMM FLOPs of this rank's compute blocks.
    """

    comm_bytes: float
    local_bytes: float
    flops: float
    reduce: bool = False    # layer1's reduce-and-send (slower per block than a copy)
    world: int = 1          # ranks the rows come from (layer0's last arrivals: 1/world)
    splits: int = 2         # layer1 column splits (the last one cannot overlap)


#: An FP8 GEMM's FLOPs counted at the bf16 rate of :class:`MachineModel`: Hopper's FP8
#: MMA runs at twice the bf16 rate.
FP8_FLOPS_FACTOR = 0.5


def layer_work(tokens: int, world: int, top_k: int, hidden: int, ffn: int,
               dtype_bytes: int = 2, splits: int = 2, dispatch_row_bytes: int | None = None
               ) -> tuple[LayerWork, LayerWork]:
    """Expected (layer0, layer1) work under uniform routing for ``tokens`` on this rank
    (``splits``: layer1's column splits, ``TileConfig.n_splits``).

    layer0 sends each (token, slot) row to the expert's rank; layer1 sends one pre-summed
    row per (token, destination rank), i.e. ``W * (1 - (1 - 1/W)^k)`` rows per token.
    ``dispatch_row_bytes``: an FP8 layer's dispatched row (e4m3 values and their scales,
    :func:`comet.kernels.fp8_roles.packed_row_bytes`); its GEMMs then count
    :data:`FP8_FLOPS_FACTOR` of their FLOPs. Layer1's rows are ``dtype_bytes`` either way.
    """
    remote = (world - 1) / world
    rows = tokens * top_k
    row0 = hidden * dtype_bytes if dispatch_row_bytes is None else dispatch_row_bytes
    flops = 1.0 if dispatch_row_bytes is None else FP8_FLOPS_FACTOR
    l0 = LayerWork(rows * remote * row0, rows / world * row0,
                   flops * 2.0 * rows * hidden * 2 * ffn, world=world)
    ranks_per_token = world * (1.0 - (1.0 - 1.0 / world) ** top_k)
    ret_rows = tokens * ranks_per_token
    l1 = LayerWork(ret_rows * remote * hidden * dtype_bytes,
                   ret_rows / world * hidden * dtype_bytes, flops * 2.0 * rows * ffn * hidden,
                   reduce=True, world=world, splits=splits)
    return l0, l1


def predicted_time(work: LayerWork, n_comm: int, programs: int,
                   machine: MachineModel = MachineModel()) -> float:
    """Seconds for one fused layer whose ``n_comm`` of ``programs`` blocks start in the
    comm role (module doc). ``n_comm == 0``: layer0 runs its roles one after the other,
    layer1 reduces after the GEMM on every block."""
    gemm = work.flops / machine.gemm_flops
    if n_comm >= programs or n_comm < 0:
        return float("inf")
    if n_comm == 0:
        return gemm + comm_time(work, programs, machine)
    t_comm = comm_time(work, n_comm, machine)
    if not work.reduce:
        return max(gemm + n_comm * t_comm / programs, t_comm + gemm / work.world)
    overlappable = (work.splits - 1) / work.splits
    window = gemm * overlappable * programs / (programs - n_comm)
    t_comm /= machine.reduce_overlap
    done = min(overlappable, window / t_comm) if t_comm > 0 else overlappable
    return gemm / work.splits + window + (1.0 - done) * comm_time(work, programs, machine)


def comm_time(work: LayerWork, n_comm: int, machine: MachineModel = MachineModel()) -> float:
    """Seconds for ``n_comm`` blocks to write the layer's remote and local bytes."""
    per_block = machine.reduce_block_bw if work.reduce else machine.per_block_bw
    local_per_block = per_block * machine.local_block_bw / machine.per_block_bw
    remote = work.comm_bytes / min(n_comm * per_block, machine.link_bw)
    local = work.local_bytes / min(n_comm * local_per_block, machine.hbm_bw)
    return remote + local


#: Predicted times within this fraction of the best count as ties (module doc).
TIE = 0.01


def analytic_split(work: LayerWork, programs: int,
                   machine: MachineModel = MachineModel()) -> int:
    """The ``n_comm`` in ``[0, programs / 2]`` with the smallest :func:`predicted_time`.

    Once comm blocks join the GEMM, every layer0 count between "the rows arrive before
    the GEMM needs them" and "the link is full" costs about the same block-time, and the
    model cannot tell them apart; measured, the larger counts of that range are as
    fast or faster (rows land earlier, fewer tiles wait). So among near-ties the
    count closest to the one that fills the link wins (layer1: the smallest, since its
    comm blocks leave the GEMM after its first split)."""
    times = {n: predicted_time(work, n, programs, machine) for n in range(programs // 2 + 1)}
    best = min(times.values())
    ties = [n for n, t in times.items() if t <= best * (1 + TIE)]
    if work.reduce:
        return min(ties)
    fill = machine.link_bw / machine.per_block_bw
    return min(ties, key=lambda n: (abs(n - fill), n))
