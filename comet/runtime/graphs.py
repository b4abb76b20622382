"""CUDA graphs of a layer's calls: each variant's device-only work captured once and
replayed (the host then issues a few small operations per call instead of ~60 launches).

A call is a list of *segments* ``(device_only, phases)``. Device-only segments read and
write fixed addresses only (the inputs are staged, comet.runtime.staging), so a graph can
replay them; the others make tensors handed to the caller (the backward's weight
gradients) and always run eagerly. A variant's first call runs eagerly (it compiles and
loads the kernels); its second is captured, then replayed; every later one replays.
"""

from __future__ import annotations

import gc
import warnings
from typing import Callable, Hashable, Sequence

import torch

from comet.runtime.streams import PrivateStream

Segment = tuple[bool, Sequence[Callable[[], None]]]


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


class CallGraphs:
    """The graphs of one layer, by variant key. ``enabled``: use graphs at all (on a
    CUDA device)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Hashable, list | None] = {}
        self._compiled: set[Hashable] = set()
        self._capture_stream: PrivateStream | None = None   # on first capture

    def run(self, key: Hashable, segments: list[Segment], graphable: bool = True,
            capturing: bool | None = None) -> None:
        """Issue one call of variant ``key``: replayed from its graphs once captured,
        else eagerly (``graphable=False``: eagerly, e.g. a timed or traced call, or one
        inside a user's own capture; ``capturing``: whether the current stream is
        capturing, if the caller knows)."""
        graphable = graphable and self.enabled and not (
            torch.cuda.is_current_stream_capturing() if capturing is None else capturing)
        graphs = self._graphs.get(key) if graphable else None
        if graphs is not None:
            for (device_only, phases), graph in zip(segments, graphs):
                if device_only:
                    graph.replay()
                else:
                    for phase in phases:
                        phase()
            return
        if graphable and key in self._compiled and key not in self._graphs:
            graphs = self._graphs[key] = self._capture(segments, key)
        for i, (device_only, phases) in enumerate(segments):
            if device_only and graphs is not None:
                graphs[i].replay()
            else:
                for phase in phases:
                    phase()
        if graphable:
            self._compiled.add(key)

    def _capture(self, segments: list[Segment], key: Hashable) -> list | None:
        """One graph per device-only segment (None in the others' places); None if any
        capture failed."""
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

    def _record(self, body: Callable[[], object], key: Hashable
                ) -> torch.cuda.CUDAGraph | None:
        """Record ``body`` -- one call's launches on the static buffers -- into a graph
        (records; executes nothing, so every rank still makes exactly one real call per
        user call). Not through ``torch.cuda.graph``, whose entry synchronises the
        device: calls in flight wait for peers' next calls, which a host blocked here
        would never make (virtual ranks sharing a device), and a hidden host sync does not
        belong in a forward anyway.

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
                          f"runs without a graph{rng}", RuntimeWarning, stacklevel=4)
            return None
        finally:
            if gc_was_on:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph
