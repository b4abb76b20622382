"""A call's routing copied into the layer's staged rows on the device, as the call's first
launch.

A layer replays one captured graph for every call, so its kernels read the routing from
fixed ``[max_tokens, k]`` rows (comet.runtime.staging). Copying the caller's routing into
them from the host costs two device operations per call, host time a decode-sized call,
host-bound already, cannot spare (docs/notebook.md, "Host path"). Instead the host
stages the routing's two addresses with the call's other scalars, and this kernel, inside
the graph, copies the call's rows (the token count is read on the device; programs past it
return at once). Routing of other dtypes (int32 ids, bf16 weights) is converted on the host
first -- one compiled variant, which ``FusedMoE.preload`` loads ahead of the first call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: (token, slot) pairs per program.
PAIRS_PER_PROGRAM = 1024


class RoutingStage(NamedTuple):
    """Where the caller's routing is (int64 ids, fp32 weights, both contiguous: the layer
    converts others on the host first) and where it goes."""

    addr: torch.Tensor           # int64 [2]: addresses of the caller's ids and weights
    num_tokens: torch.Tensor     # int64 [1]: the call's tokens
    ids: torch.Tensor            # int64 [Mx, k]: the staged rows
    weights: torch.Tensor        # fp32 [Mx, k]


def launch_stage_routing(stage: RoutingStage) -> None:
    """Copy the call's routing into the staged rows (a fixed grid for ``Mx`` tokens)."""
    pairs = stage.ids.numel()
    stage_routing_kernel[(triton.cdiv(pairs, PAIRS_PER_PROGRAM),)](
        stage=stage, K=stage.ids.shape[1], BLOCK=PAIRS_PER_PROGRAM, num_warps=4)


@triton.jit
def stage_routing_kernel(stage, K: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.load(stage.num_tokens) * K
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(0) * BLOCK < n:
        stage_pairs(stage, pairs, pairs < n)


@triton.jit
def caller_ids(stage):
    """The caller's expert ids (a pointer read from ``stage.addr``)."""
    # No alignment is claimed: a caller's routing may be a view at any element offset.
    return tl.load(stage.addr).to(tl.pointer_type(stage.ids.dtype.element_ty))


@triton.jit
def stage_pairs(stage, pairs, live):
    """Copy the caller's ids and weights of the (token, slot) pairs ``pairs`` (flat
    indices, any shape; ``live`` masks them) into the staged rows. Also run inside the
    plan's one-program opening of a small call (comet.kernels.plan.open_kernel)."""
    weights = tl.load(stage.addr + 1).to(tl.pointer_type(stage.weights.dtype.element_ty))
    tl.store(stage.ids + pairs, tl.load(caller_ids(stage) + pairs, mask=live), mask=live)
    tl.store(stage.weights + pairs, tl.load(weights + pairs, mask=live), mask=live)
