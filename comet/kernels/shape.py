"""The constexpr shape of an expert-parallel layer, as every comet kernel takes it."""

from __future__ import annotations

from typing import NamedTuple

import triton.language as tl

from comet.constants import constexpr


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (``tl.arange`` lengths)."""
    return 1 << max(0, (int(n) - 1).bit_length())


class Shape(NamedTuple):
    """Experts, top-k and ranks of one layer (the ``*_P2`` are the powers of two that
    cover them, for ``tl.arange``)."""

    NUM_EXPERTS: tl.constexpr
    LOCAL_EXPERTS: tl.constexpr
    EL_P2: tl.constexpr
    TOPK: tl.constexpr
    TOPK_P2: tl.constexpr
    WORLD: tl.constexpr
    W_P2: tl.constexpr

    @classmethod
    def of(cls, num_experts: int, top_k: int, world: int) -> "Shape":
        el = num_experts // world
        return cls(*(constexpr(v) for v in (num_experts, el, next_pow2(el), top_k,
                                                next_pow2(top_k), world, next_pow2(world))))
