"""Lower bounds a layer's time is held against, besides the GEMM floor of the records,
and what its dispatch must move.

The *HBM floor*: a call must read the weights of every local expert that received a row
at least once from HBM -- at small token counts (decode) nothing else bounds it. Its time
is those bytes over the device's HBM read bandwidth, measured in the same run
(:func:`hbm_read_gbps`), per rank; the layer's floor is the slowest rank's, since the
layer ends with its last rank.

For an FP8 layer (``comet bench --dtype fp8``) the floor's bytes are those of the
FP8 experts it touches -- e4m3 weights and their fp32 block scales
(:func:`fp8_expert_bytes`) -- plus the activations its GEMMs read, a packed FP8 row of
values and group scales per (token, expert) row (:func:`fp8_row_bytes`): at decode sizes
the weights no longer dwarf them as they do in bf16.

The *dispatch bytes* (:func:`dispatch_rows` times the bytes of a row as it crosses):
what one call's dispatch writes into the ranks' expert inputs -- bf16 rows, or the FP8
layer's packed rows (``comet.kernels.fp8_roles.packed_row_bytes``: 0.52x at H = 7168).

The *link rows* (:func:`link_rows`): the token rows a rank's dispatch sends to other
ranks, once per (token, expert) as the push sends them, and once per (token, rank) --
their ratio is what sending a row once per (token, rank) would save on the link.
"""

from __future__ import annotations

import statistics

import torch

from comet.bench.timing import Clock
from comet.kernels.fp8_roles import packed_row_bytes
from comet.quant import GROUP, Fp8Weight

#: Bytes the bandwidth probe reads per pass: far beyond any L2, so HBM serves them.
PROBE_BYTES = 1 << 30
PROBE_PASSES = 10


def hbm_read_gbps(device: torch.device) -> float | None:
    """HBM read bandwidth (GB/s) of ``device``: the median of :data:`PROBE_PASSES`
    reductions over :data:`PROBE_BYTES` (a read-only stream; what a weight-bound GEMM
    can at best achieve). None off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    buf = torch.ones(PROBE_BYTES // 2, dtype=torch.bfloat16, device=device)
    clock, marks = Clock(device), []
    for i in range(PROBE_PASSES + 2):
        start = clock.mark()
        buf.sum(dtype=torch.float32)
        if i >= 2:     # two warm-up passes
            marks.append((start, clock.mark()))
    torch.cuda.synchronize(device)
    del buf
    return PROBE_BYTES / (statistics.median(Clock.us(a, b) for a, b in marks) * 1e3)


def expert_bytes(hidden: int, ffn: int, element_size: int) -> dict[str, int]:
    """Weight bytes of one expert per layer (``W13 [H, 2F]``, ``W2 [F, H]``) and both."""
    l0, l1 = hidden * 2 * ffn * element_size, ffn * hidden * element_size
    return {"layer0": l0, "layer1": l1, "moe": l0 + l1}


def fp8_expert_bytes(gate_up: Fp8Weight, down: Fp8Weight) -> dict[str, int]:
    """:func:`expert_bytes` of one FP8 expert: its e4m3 weights and fp32 block scales."""
    def one(w: Fp8Weight) -> int:
        return (w.weight.numel() * w.weight.element_size()
                + w.scale_inv.numel() * w.scale_inv.element_size()) // w.experts
    l0, l1 = one(gate_up), one(down)
    return {"layer0": l0, "layer1": l1, "moe": l0 + l1}


def fp8_row_bytes(hidden: int, ffn: int) -> dict[str, int]:
    """Per layer, the activation bytes an FP8 layer's GEMM reads per (token, expert) row:
    layer0 the packed dispatched row, layer1 h (e4m3 values and one fp32 scale per group
    of :data:`comet.quant.GROUP`)."""
    l0 = packed_row_bytes(hidden)
    l1 = ffn + 4 * -(-ffn // GROUP)
    return {"layer0": l0, "layer1": l1, "moe": l0 + l1}


def hbm_floor_us(expert_rows: list[int], per_expert: dict[str, int],
                 gbps: float | None, per_row: dict[str, int] | None = None
                 ) -> dict[str, float | None]:
    """Per layer, the microseconds this rank needs to read the weights of its experts
    that got rows (``expert_rows``: rows per local expert) at ``gbps``, and ``per_row``
    bytes for each row (None: the weights alone, the bf16 floor)."""
    touched = sum(1 for r in expert_rows if r > 0)
    rows = sum(expert_rows)
    return {layer: ((touched * b + rows * (per_row or {}).get(layer, 0)) / (gbps * 1e9)
                    * 1e6 if gbps else None)
            for layer, b in per_expert.items()}


def dispatch_rows(topk_ids: torch.Tensor, local_experts: int, world: int, gathered: bool
                  ) -> int:
    """Rows the dispatch of ``topk_ids [M, k]`` writes, local ones included: one per
    (token, expert), or with ``gathered`` (``Variant.layer0_gather``) one per (token,
    rank)."""
    valid = (topk_ids >= 0) & (topk_ids < local_experts * world)
    if not gathered:
        return int(valid.sum())
    dest = torch.where(valid, topk_ids // local_experts, world)
    hit = torch.zeros(topk_ids.shape[0], world + 1, dtype=torch.bool, device=topk_ids.device)
    hit.scatter_(1, dest, True)
    return int(hit[:, :world].sum())


def link_rows(topk_ids: torch.Tensor, local_experts: int, rank: int, world: int
              ) -> tuple[int, int]:
    """``(pairs, tokens)``: rows of ``topk_ids [M, k]`` (ids outside ``[0, local_experts
    * world)``: no expert) that rank ``rank`` of ``world`` sends other ranks -- once per
    (token, expert there), and once per (token, rank there). A (tp, ep) layout passes
    its shard-slot ids (:meth:`comet.mesh.MeshLayout.shard_routing`)."""
    valid = (topk_ids >= 0) & (topk_ids < local_experts * world)
    dest = torch.where(valid, topk_ids // local_experts, -1)
    remote = (dest >= 0) & (dest != rank)
    hit = torch.zeros(topk_ids.shape[0], world, dtype=torch.bool, device=topk_ids.device)
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None].expand_as(dest)
    hit[rows[remote], dest[remote]] = True
    return int(remote.sum()), int(hit.sum())
