"""Timing on the device's own timeline, and the cross-rank aggregation of timings.

Protocol (docs/benchmarks.md): CUDA events, warm-up, median of >= 20 iterations, inputs
rotated and L2 flushed so no iteration reads another's data from cache. Ranks are aligned
on the device (a one-element all_reduce right before the start event) so launch skew
between processes is not charged to the layer. Each iteration's time, and its phases, are
the slowest rank's; the reported number is the median over iterations.

Phases are timed on eager calls (events between launches), and an eager launch of a
Triton kernel costs the host ~200 us (measured on an H100: dispatch alone, 113 us of kernel
in a 333 us phase). So a phase-timed iteration first parks the GPU in a sleep long enough
for the host to enqueue the whole call: the phases then measure the device's work, not
the host's launches. Whole-call times come from calls without phases (comet replays its
CUDA graph there, as a user's call does), which keep whatever host cost they have: the
start event is on the GPU as soon as the ranks are aligned, and the call's first kernel
only when the host has staged it, so a call whose GPU work is not much longer than the
host's issue time (~90-200 us) is timed partly as host time. ``lead_us`` (``comet bench
--lead-us``) parks the GPU that long before a whole call's start event instead, so the
host issues the call ahead and the time is the device's; long enough to cover the host,
short against the power cap's clock changes (the phases' 10 ms rest is not).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class Clock:
    """Timestamps on ``device``'s timeline: CUDA events on a GPU, ``perf_counter`` on a CPU.

    CUDA event times are read only after a synchronize (see :meth:`us`).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def us(start, end) -> float:
        """Microseconds between two marks."""
        if isinstance(start, float):
            return (end - start) * 1e6
        return start.elapsed_time(end) * 1e3


class PhaseClock:
    """Times named phases of one call: ``with clock.phase("gemm0"): ...``.

    Has the interface of :class:`comet.runtime.layer.PhaseTimer` that the benchmark relies
    on (``elapsed_us()`` after a synchronize); used for the baselines.
    """

    def __init__(self, device: torch.device):
        self._clock = Clock(device)
        self._marks: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        start = self._clock.mark()
        yield
        self._marks.append((name, start, self._clock.mark()))

    def elapsed_us(self) -> dict[str, float]:
        """Phase -> microseconds (summed if a phase ran more than once)."""
        out: dict[str, float] = {}
        for name, a, b in self._marks:
            out[name] = out.get(name, 0.0) + Clock.us(a, b)
        return out


class L2Flush:
    """Overwrites a buffer twice the size of the GPU's L2 before each timed iteration."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.buf = None
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.buf = torch.empty(2 * l2, dtype=torch.int8, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def _align(group, device: torch.device) -> None:
    """Start every rank's next kernel at (nearly) the same moment."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    if device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    else:
        dist.barrier(group=group)


#: GPU cycles a phase-timed iteration sleeps before its start mark (~10 ms at ~2 GHz):
#: longer than the host takes to enqueue one eager call of any variant.
QUEUE_AHEAD_CYCLES = 20_000_000


def _queue_ahead(device: torch.device, cycles: int = QUEUE_AHEAD_CYCLES) -> None:
    """Keep the GPU busy while the host enqueues the next call (see the module doc)."""
    if device.type == "cuda" and cycles > 0:
        torch.cuda._sleep(cycles)


def park_and_align(device: torch.device, group=None,
                   cycles: int = QUEUE_AHEAD_CYCLES) -> None:
    """Park the GPU for ``cycles`` so that the host enqueues what follows ahead of it,
    then start every rank's next kernel together (:func:`_align`, after the sleep: ranks
    whose clocks differ would otherwise leave it as far apart as the clocks drift over
    the sleep)."""
    _queue_ahead(device, cycles)
    _align(group, device)


#: GPU cycles per microsecond a lead sleep counts with: H100 and H200 run at most
#: ~1.98 GHz, so ``lead_us`` microseconds of these cycles last at least that long.
LEAD_CYCLES_PER_US = 2000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[int, object], object], *, n_sets: int, iters: int, warmup: int,
               device: torch.device, group=None, make_timer: Callable[[], object] | None = None,
               flush: L2Flush | None = None, lead_us: float = 0.0) -> dict[str, list[float]]:
    """Time ``fn(set_index, timer)`` on this rank.

    Iteration ``i`` uses input set ``i % n_sets`` (warm-up iterations included, so the
    timed ones start wherever warm-up left off). ``make_timer`` builds a fresh phase timer
    per iteration (``None``: no phases); ``fn`` receives it (or None). Without one, the
    GPU first sleeps ``lead_us`` (0: not at all) so the host issues the call ahead.

    Returns:
        ``{"total": [iters] us, "host": [iters] us, "<phase>": [iters] us, ...}``, this
        rank's numbers (see :func:`reduce_over_ranks`; :func:`timed_sets` gives each
        iteration's input set); ``host``: the host's time to issue one call -- where it
        exceeds ``total``'s GPU time, the GPU waited for the host.
    """
    clock = Clock(device)
    marks, timers, hosts = [], [], []
    for i in range(warmup + iters):
        s = i % n_sets
        timed = i >= warmup
        timer = make_timer() if make_timer is not None else None
        if flush is not None:
            flush()
        park_and_align(device, group, QUEUE_AHEAD_CYCLES if make_timer is not None
                       else int(lead_us * LEAD_CYCLES_PER_US))
        start = clock.mark()
        host = time.perf_counter()
        fn(s, timer)
        host = time.perf_counter() - host
        end = clock.mark()
        if timed:
            marks.append((start, end))
            timers.append(timer)
            hosts.append(host * 1e6)
    _sync(device)
    series: dict[str, list[float]] = {"total": [Clock.us(a, b) for a, b in marks],
                                      "host": hosts}
    if make_timer is not None:
        phases = [t.elapsed_us() for t in timers]
        for name in phases[0] if phases else ():
            series[name] = [p.get(name, 0.0) for p in phases]
    return series


def timed_sets(n_sets: int, iters: int, warmup: int) -> list[int]:
    """The input set each timed iteration of :func:`time_calls` used."""
    return [(warmup + j) % n_sets for j in range(iters)]


def reduce_over_ranks(series: dict[str, list[float]], group=None,
                      sums: Sequence[str] = ()) -> dict[str, list[float]]:
    """Per iteration, the numbers of the slowest rank.

    With a ``"total"`` series, every series of an iteration is taken from the rank whose
    total was largest in it, so phases stay consistent with the total they are part of (a
    fast rank's combine, which waits for a slow rank's GEMM, is not mixed with the slow
    rank's GEMM). Without one, each series is its own maximum over ranks. Names in
    ``sums`` are summed over ranks instead. Collective over ``group`` when
    torch.distributed is initialised; identity otherwise.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return series
    world = dist.get_world_size(group)
    if world == 1:
        return series
    gathered: list[dict[str, list[float]] | None] = [None] * world
    dist.all_gather_object(gathered, series, group=group)
    return combine_ranks(gathered, sums)


def combine_ranks(per_rank: Sequence[dict[str, list[float]]],
                  sums: Sequence[str] = ()) -> dict[str, list[float]]:
    """The reduction of :func:`reduce_over_ranks` over already gathered series."""
    out: dict[str, list[float]] = {}
    slowest = None
    if "total" in per_rank[0]:
        totals = [p["total"] for p in per_rank]
        slowest = [max(range(len(per_rank)), key=lambda r, i=i: totals[r][i])
                   for i in range(len(totals[0]))]
    for name in per_rank[0]:
        columns = list(zip(*[p[name] for p in per_rank]))   # [iteration][rank]
        if name in sums:
            out[name] = [sum(c) for c in columns]
        elif slowest is not None:
            out[name] = [c[r] for c, r in zip(columns, slowest)]
        else:
            out[name] = [max(c) for c in columns]
    return out


def median(values: Sequence[float] | None) -> float | None:
    """Median, or None for no values."""
    return statistics.median(values) if values else None
