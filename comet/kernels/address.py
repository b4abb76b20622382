"""Typed pointers from addresses held on the device, and symmetric buffers as kernels see
them.

Kernels reach peers' symmetric buffers, and the caller's input and output, through int64
addresses loaded on the device (peer tables; staged addresses, so one captured graph
serves every call). A pointer cast from an integer carries no alignment, and Triton then
splits every row access into 2-byte loads and stores, which halved the dispatch's rate
(docs/design.md, "Thread-block specialization"). Every buffer reached this way is
:data:`~comet.constants.ADDRESS_ALIGN`-byte aligned -- workspace buffers are carved at 256
bytes, and the runtime stages a misaligned input through a copy -- so the pointer says so
and row accesses become 16-byte vectors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.constants import ADDRESS_ALIGN


class PeerBuffer(NamedTuple):
    """A symmetric buffer as a kernel argument: this rank's copy (``local``, which also
    gives the element type) and the addresses of every rank's copy (``peers``, int64
    ``[W]``)."""

    local: torch.Tensor
    peers: torch.Tensor


@triton.jit
def pointer_at(table, index, like_ptr):
    """Pointer with ``like_ptr``'s element type to the address ``table[index]``, known to
    be ``ADDRESS_ALIGN``-byte aligned."""
    ptr = tl.load(table + index).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.multiple_of(ptr, ADDRESS_ALIGN)


@triton.jit
def peer(buf, rank):
    """Pointer to rank ``rank``'s copy of the :class:`PeerBuffer` ``buf``."""
    return pointer_at(buf.peers, rank, buf.local)
