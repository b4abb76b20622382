"""CUDA streams of comet's own, outside PyTorch's stream pool."""

from __future__ import annotations

import weakref

import torch

from comet.runtime import topology


def private_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A CUDA stream no other code is handed (destroyed with the returned object).

    Not ``torch.cuda.Stream()``: that hands out one of a pool of 32 streams, round robin,
    so a process that asks for more (every graph capture asks for one) gets the same
    stream twice. A copy stream that is also a peer's compute stream -- virtual ranks
    share one process -- runs this rank's copies after that peer's layer0 kernel, which
    spins until they land: a deadlock, seen as a timeout (four virtual ranks, graphs
    on). On W GPUs the same sharing would serialise the copies with the caller's own
    kernels, losing the overlap they are for."""
    rt = topology.cuda_runtime()
    if rt is None:
        raise RuntimeError("comet needs cuda-python (cuda-bindings) to create its CUDA "
                           "streams")
    with torch.cuda.device(device):
        handle = topology.checked(rt, "cudaStreamCreateWithFlags",
                                  rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    stream = torch.cuda.ExternalStream(int(handle), device=device)
    # Destroying a stream with work pending is allowed: CUDA frees it once that is done.
    weakref.finalize(stream, rt.cudaStreamDestroy, handle)
    return stream
