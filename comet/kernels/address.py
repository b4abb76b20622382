"""Typed pointers from addresses held on the device.

Kernels reach peers' symmetric buffers, and the caller's input and output, through int64
addresses loaded on the device (peer tables; staged addresses, so one captured graph
serves every call). A pointer cast from an integer carries no alignment, and Triton then
splits every row access into 2-byte loads and stores: on an H100 the dispatch moved ~15
GB/s per block that way and stalled near 200 GB/s however many blocks copied
(benchmarks/results/2026-11-23/h100-dispatch-bw-*.json). Every buffer reached this way is
:data:`ADDRESS_ALIGN`-byte aligned -- workspace buffers are carved at 256 bytes, and
:class:`comet.runtime.layer.FusedMoE` stages a misaligned input through a copy -- so the
pointer says so and row accesses become 16-byte vectors.
"""

import triton
import triton.language as tl

#: Bytes every address-held buffer is aligned to (one 16-byte vector access).
ADDRESS_ALIGN = tl.constexpr(16)


@triton.jit
def pointer_at(table, index, like_ptr):
    """Pointer with ``like_ptr``'s element type to the address ``table[index]``, known to
    be :data:`ADDRESS_ALIGN`-byte aligned."""
    ptr = tl.load(table + index).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.multiple_of(ptr, ADDRESS_ALIGN)
