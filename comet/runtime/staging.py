"""Fixed-address staging of a call's inputs, so that one captured CUDA graph serves every
call of a layer.

The kernels never take a call's sizes or addresses as launch arguments: the routing goes
into ``max_tokens``-row buffers (the plan reads the call's rows only, given the token
count on the device), and the call's scalars -- input and output addresses, token count,
block split -- into one small int64 device buffer the kernels load. The forward stages
seven scalars (:class:`StaticInputs`), the backward six (:mod:`comet.runtime.backward`).

The scalars reach the device in one copy from a pinned host ring rather than one fill per
scalar: every small device op costs the host time, and a decode-sized call is host-bound.
The copy is a plain cudaMemcpyAsync rather than ``Tensor.copy_``: for a pinned source
torch's copy also records an event into its pinned-memory allocator, which made the copy
the costliest step of a graph-replayed call (docs/notebook.md, "Host path"); the ring's
own segment events already say when a slot may be written again.
"""

from __future__ import annotations

import struct
from typing import Sequence

import torch

from comet.config import MoEConfig
from comet.constants import ADDRESS_ALIGN
from comet.runtime import topology


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its address is not ``ADDRESS_ALIGN``-byte aligned (a
    view at an odd offset): the kernels read such buffers with 16-byte vectors."""
    return t if t.data_ptr() % int(ADDRESS_ALIGN) == 0 else t.clone()


def address_of(t: torch.Tensor) -> torch.Tensor:
    """A device int64 holding ``t``'s address (kernels load it, so graphs stay valid)."""
    return torch.full((1,), t.data_ptr(), dtype=torch.int64, device=t.device)


class StagedScalars:
    """``n`` int64 scalars on the device (:attr:`values`, a fixed address), written per
    call by :meth:`stage` in one stream-ordered copy from a pinned host ring.

    The host never waits: a ring slot is written again only once the copy that read it
    last time is known done. That is checked once per :data:`SEGMENT` slots, against an
    event recorded after the segment's last copy (an event per call cost the host more
    than the copy itself); a call that finds its segment still pending -- the host
    :data:`RING` calls ahead of the device -- stages with device fills instead. A call on
    another stream than the last one first has its stream wait for the last one's work
    (a layer's calls share one workspace, so they must not overlap anyway), which keeps
    every copy of a segment ordered before its event."""

    #: Calls whose scalar copies may be pending at once.
    RING = 256
    #: Slots checked by one event.
    SEGMENT = 32

    def __init__(self, n: int, device):
        self.values = torch.zeros(n, dtype=torch.int64, device=device)
        cuda = torch.device(device).type == "cuda"
        self._ring = (torch.zeros(self.RING, n, dtype=torch.int64, pin_memory=True)
                      if cuda else None)
        self._row_bytes = n * self.values.element_size()
        # Slots are written with struct.pack_into on the ring's bytes: no tensor and no
        # numpy conversion per call (half the host time of a numpy row assignment).
        self._pack = struct.Struct(f"={n}q").pack_into
        self._ring_bytes = (memoryview(self._ring.numpy()).cast("B")
                            if cuda else None)
        self._rt = topology.cuda_runtime() if cuda else None
        if self._rt is not None:
            # Looked up once: cuda-python builds an enum or a stream object per lookup.
            self._memcpy = self._rt.cudaMemcpyAsync
            self._h2d = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._success = self._rt.cudaError_t.cudaSuccess
            self._dst, self._src = self.values.data_ptr(), self._ring.data_ptr()
        self._done: list[torch.cuda.Event | None] = [None] * (self.RING // self.SEGMENT)
        self._next = 0
        self._device = self.values.device
        self._stream: torch.cuda.Stream | None = None   # of the last copy
        self._stream_id = 0
        self._stream_arg = None                         # the same, as cuda-python takes it

    def stage(self, values: Sequence[int], capturing: bool | None = None) -> None:
        """Write ``values`` into :attr:`values` (stream-ordered; no host wait).
        ``capturing``: whether the current stream is capturing a graph, if the caller
        knows."""
        if self._ring is None:
            self.values.copy_(torch.tensor(values, dtype=torch.int64))
            return
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        slot = self._next % self.RING
        segment, first = divmod(slot, self.SEGMENT)
        # Inside a user's graph capture a copy would re-read the ring slot at every
        # replay; fills capture the values themselves.
        if capturing or (first == 0 and self._done[segment] is not None
                         and not self._done[segment].query()):
            for i, v in enumerate(values):
                self.values[i].fill_(v)
            return
        stream_id = torch._C._cuda_getCurrentRawStream(self._device.index)
        if stream_id != self._stream_id:
            self._follow(stream_id)
        self._next += 1
        self._pack(self._ring_bytes, slot * self._row_bytes, *values)
        self._copy(slot)
        if first == self.SEGMENT - 1:
            if self._done[segment] is None:
                self._done[segment] = torch.cuda.Event()
            self._done[segment].record()

    def _copy(self, slot: int) -> None:
        """Ring slot ``slot`` into :attr:`values`, ordered on the current stream."""
        if self._rt is None:    # no cuda-python: torch's copy (slower on the host, same order)
            self.values.copy_(self._ring[slot], non_blocking=True)
            return
        result = self._memcpy(self._dst, self._src + slot * self._row_bytes,
                              self._row_bytes, self._h2d, self._stream_arg)
        if result[0] != self._success:
            topology.checked(self._rt, "cudaMemcpyAsync", result)

    def _follow(self, stream_id: int) -> None:
        """Order the current stream after the last copy's stream."""
        stream = torch.cuda.current_stream(self._device)
        if self._stream is not None:
            stream.wait_stream(self._stream)
        self._stream, self._stream_id = stream, stream_id
        if self._rt is not None:
            self._stream_arg = self._rt.cudaStream_t(stream_id)


class StaticInputs:
    """A forward call's staging: routing rows (:attr:`ids`, :attr:`weights`, ``[max_tokens,
    k]``) and scalars ``(x address, y address, tokens, layer0 split, layer1 split, ids
    address, weights address)``, with the views the kernels take (:attr:`addr`,
    :attr:`num_tokens`, :attr:`split`, :attr:`routing_addr`: the call's first launch
    copies the routing into the rows, comet.kernels.stage_routing). The backward stages its
    routing into the same rows (it follows its forward)."""

    RING = StagedScalars.RING

    def __init__(self, cfg: MoEConfig, device):
        self.ids = torch.full((cfg.max_tokens, cfg.top_k), -1, dtype=torch.int64,
                              device=device)
        self.weights = torch.zeros(cfg.max_tokens, cfg.top_k, dtype=torch.float32,
                                   device=device)
        self._scalars = StagedScalars(7, device)
        s = self._scalars.values
        self.addr, self.num_tokens, self.split = s[0:2], s[2:3], s[3:5]
        self.routing_addr = s[5:7]

    def stage(self, x_addr: int, y_addr: int, num_tokens: int, n0: int, n1: int,
              ids_addr: int, weights_addr: int, capturing: bool | None = None) -> None:
        """Write the call's scalars (stream-ordered)."""
        self._scalars.stage([x_addr, y_addr, num_tokens, n0, n1, ids_addr, weights_addr],
                            capturing)
