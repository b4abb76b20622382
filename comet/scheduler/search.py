"""How ``comet tune`` explores the block split of one token bucket.

Timing a split is a full fused call per candidate (both layers at once: each layer is its
own kernel with its own split, so one call times a candidate for both). Over a split the
layer time is close to unimodal -- too few comm blocks and the GEMM waits for rows, too
many and SMs are lost -- so a hill climb from a good start finds the best split after a
handful of calls instead of one per candidate. Starts: the analytic model's pick (its
neighbourhood is where the best usually is) and 0 (comm, then compute: the best of
layer1 on the machines measured so far, and far from the analytic pick when the model
is wrong). ``--search exhaustive`` and ``--check`` time every candidate instead.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

#: Layer times of one split: (layer0 us, layer1 us).
Times = tuple[float, float]


def nearest(candidates: Sequence[int], n: int) -> int:
    """Index of the candidate closest to ``n`` (``candidates`` sorted; ties go down)."""
    i = bisect_left(candidates, n)
    if i == len(candidates):
        return i - 1
    if i > 0 and n - candidates[i - 1] <= candidates[i] - n:
        return i - 1
    return i


def climb(evaluate: Callable[[int], Times], candidates: Sequence[int],
          starts: Sequence[Sequence[int]]) -> dict[int, Times]:
    """Hill-climb each layer over the sorted ``candidates`` from each of its ``starts``
    (``starts[layer]``: splits, snapped to the nearest candidate), stepping to the faster
    neighbour until neither is faster. ``evaluate(n)`` times split ``n`` for both layers
    and is called once per split whatever the layer or start; returns every split timed.

    With several ranks ``evaluate`` must return the same numbers on every rank (the
    slowest rank's), so that all ranks climb through the same splits in the same order.
    """
    cands = sorted(set(candidates))
    if not cands:
        raise ValueError("no candidates to search")
    timed: dict[int, Times] = {}

    def t(i: int, layer: int) -> float:
        n = cands[i]
        if n not in timed:
            timed[n] = evaluate(n)
        return timed[n][layer]

    for layer, layer_starts in enumerate(starts):
        for start in layer_starts:
            i = nearest(cands, start)
            while True:
                steps = [j for j in (i - 1, i + 1) if 0 <= j < len(cands)]
                best = min(steps, key=lambda j: t(j, layer), default=i)
                if t(best, layer) >= t(i, layer):
                    break
                i = best
    return timed


def best_splits(timed: dict[int, Times]) -> tuple[int, int]:
    """The fastest timed split of each layer."""
    return (min(timed, key=lambda n: timed[n][0]), min(timed, key=lambda n: timed[n][1]))
