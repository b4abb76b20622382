"""CUDA streams of comet's own, outside PyTorch's stream pool."""

from __future__ import annotations

import sys

import torch

from comet.runtime import topology

#: Handles whose stream object died during a graph capture, destroyed at the next
#: stream's creation instead (a capture in global mode fails on unrelated CUDA calls).
_destroy_later: list = []


class PrivateStream(torch.cuda.ExternalStream):
    """A CUDA stream no other code is handed, destroyed when this object is.

    Not ``torch.cuda.Stream()``: that hands out one of a pool of 32 streams, round robin,
    so a process that asks for more (every graph capture asks for one) gets the same
    stream twice. A copy stream that is also a peer's compute stream -- virtual ranks
    share one process -- runs this rank's copies after that peer's layer0 kernel, which
    spins until they land: a deadlock, seen as a timeout (four virtual ranks, graphs
    on). On W GPUs the same sharing would serialise the copies with the caller's own
    kernels, losing the overlap they are for.

    The handle is destroyed in ``__del__``, never through a weak reference: torch's CUDA
    stream objects do not clear their weak references when they die (the C type's
    deallocator skips ``PyObject_ClearWeakRefs``), so a ``weakref.finalize`` on one never
    fires, and at exit its weak reference unlinks itself from freed memory -- pytest
    processes segfaulted there (benchmarks/results/2026-11-25/h100-exit-probe.log)."""

    def __new__(cls, device: torch.device | int | str | None = None) -> PrivateStream:
        """A new stream on ``device`` (the current device if None)."""
        rt = topology.cuda_runtime()
        if rt is None:
            raise RuntimeError("comet needs cuda-python (cuda-bindings) to create its CUDA "
                               "streams")
        if not torch.cuda.is_current_stream_capturing():
            for late in _destroy_later:
                rt.cudaStreamDestroy(late)
            _destroy_later.clear()
        with torch.cuda.device(device):
            handle = topology.checked(rt, "cudaStreamCreateWithFlags",
                                      rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self = super().__new__(cls, int(handle), device=device)
        self._handle = handle
        return self

    def __del__(self) -> None:
        # Destroying a stream with work pending is allowed: CUDA frees it once that is
        # done. Not while the interpreter shuts down: the context's teardown frees it, and
        # cuda-python may be half torn down by then.
        handle = self.__dict__.pop("_handle", None)
        if handle is None or sys.is_finalizing():
            return
        if torch.cuda.is_current_stream_capturing():
            _destroy_later.append(handle)
        else:
            topology.cuda_runtime().cudaStreamDestroy(handle)

