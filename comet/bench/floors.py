"""Lower bounds a layer's time is held against, besides the GEMM floor of the records,
and what its dispatch must move.

The *HBM floor*: a call must read the weights of every local expert that received a row
at least once from HBM -- at small token counts (decode) nothing else bounds it. Its time
is those bytes over the device's HBM read bandwidth, measured in the same run
(:func:`hbm_read_gbps`), per rank; the layer's floor is the slowest rank's, since the
layer ends with its last rank.

The *link rows* (:func:`link_rows`): the token rows a rank's dispatch sends to other
ranks, once per (token, expert) as the push sends them, and once per (token, rank) --
their ratio is what sending a row once per (token, rank) would save on the link.
"""

from __future__ import annotations

import statistics

import torch

from comet.bench.timing import Clock

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


def hbm_floor_us(expert_rows: list[int], per_expert: dict[str, int],
                 gbps: float | None) -> dict[str, float | None]:
    """Per layer, the microseconds this rank needs to read the weights of its experts
    that got rows (``expert_rows``: rows per local expert) at ``gbps``."""
    touched = sum(1 for r in expert_rows if r > 0)
    return {layer: (touched * b / (gbps * 1e9) * 1e6 if gbps else None)
            for layer, b in per_expert.items()}


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
