"""Synchronisation primitives shared by every comet kernel (the only module that spins).

Rules they implement (docs/design.md, "Cross-GPU rules"):

* publish: every thread stores its data with ``tl.store``; a block barrier; then one
  release atomic on the flag (scope ``"sys"`` when a peer GPU reads it, ``"gpu"`` inside
  one GPU). The barrier makes all threads' stores part of what the release publishes.
* wait: spin on an acquire load, bounded by a timeout; then a block-wide *vote* on the
  outcome; loads of the published data are made to depend on the waited value so the
  compiler cannot hoist them above the wait.
* a failed wait never hangs: it records an error (first error wins) in this rank's error
  word *and in every peer's*, and every later wait anywhere in the group sees the error
  and gives up at once, so every rank's host raises a clear exception instead of hanging.

Block-uniform control flow. Every thread of a block runs the spin on its own and may see
a different value (warps read a flag that peers keep advancing at different moments; a
timer may expire in one warp and not in another). Anything decided from memory that other
blocks or GPUs change -- a flag, the error word -- therefore goes through :func:`vote_all`
(``barrier.red.and``) before it steers control flow: a branch that only some warps take
would leave the block's barriers (``bar.sync`` in Triton's TMA pipelines, broadcasts of
scalar atomics) matched across different code, a hang no timeout can catch. Callers only
branch on the values these functions return, never on raw flag loads.

:data:`~comet.constants.USE_ASM` selects inline PTX on a GPU and plain atomics plus a
spin counter under ``TRITON_INTERPRET=1``, where inline assembly cannot run, where a block
is one thread of control (so every value is uniform) and where a wait that is not
satisfied at once never will be (programs run one by one).

Every waiting kernel takes a :class:`Sync` group; tracing kernels a :class:`Trace`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comet.constants import (ERR_CODE, ERR_INDEX, ERR_RANK, ERR_SITE, ERR_TIMEOUT,
                             INPUT_CODE, INPUT_EPOCH, INPUT_SLOT, INPUT_TOKEN,
                             MAX_TRACE_EVENTS, TRACE_PROGRAM, USE_ASM, constexpr)

#: Interpreter: spins before a wait counts as failed (programs run sequentially there).
INTERPRETER_SPINS = constexpr(64)


class Sync(NamedTuple):
    """What every kernel that waits on, or publishes to, peers needs."""

    epoch: torch.Tensor      # int64 [1]: this rank's call counter; flags of call n hold n
    errors: torch.Tensor     # int64 [W]: every rank's error words (comet.runtime.errors)
    rank: int                # this rank in the group
    timeout: torch.Tensor    # int64 [1]: bound of every wait, ns
    WORLD: tl.constexpr      # ranks in the group


class Trace(NamedTuple):
    """Per-program event records of a traced launch (``comet bench --timeline``):
    ``events [programs, MAX_TRACE_EVENTS, 4]`` int64 ``(kind, unit, start_ns, end_ns)``;
    with ``ON`` false nothing is recorded (and ``events`` is None)."""

    events: torch.Tensor | None
    ON: tl.constexpr

    @classmethod
    def on(cls, events: torch.Tensor) -> "Trace":
        return cls(events, constexpr(True))

    @classmethod
    def off(cls) -> "Trace":
        return cls(None, constexpr(False))


@triton.jit
def _ld_acquire(ptr, SCOPE: tl.constexpr):
    """Acquire load of a 32- or 64-bit flag (the width follows the pointer)."""
    if USE_ASM:
        if ptr.dtype.element_ty.primitive_bitwidth == 64:
            if SCOPE == "sys":
                v = tl.inline_asm_elementwise("ld.global.acquire.sys.b64 $0, [$1];", "=l,l",
                                              [ptr], dtype=tl.int64, is_pure=False, pack=1)
            else:
                v = tl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l",
                                              [ptr], dtype=tl.int64, is_pure=False, pack=1)
        else:
            if SCOPE == "sys":
                v = tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l",
                                              [ptr], dtype=tl.int32, is_pure=False, pack=1)
            else:
                v = tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l",
                                              [ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    return v


@triton.jit
def _now(spins):
    """Nanoseconds on a GPU; the spin count under the interpreter."""
    if USE_ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [spins],
                                      dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = spins.to(tl.int64)
    return t


@triton.jit
def clock_ns():
    """The global timer in ns (0 under the interpreter): timeline stamps."""
    if USE_ASM:
        t = _now(tl.full([], 0, tl.int32))
    else:
        t = tl.zeros([], dtype=tl.int64)
    return t


@triton.jit
def stamp(trace, n, kind, unit, start):
    """Record one unit of work ``(kind, unit, start, now)`` as event ``n`` of this
    program's row of ``trace``; returns ``n + 1`` (events past the row's last slot but
    one are dropped: the last is the program's, :func:`stamp_program`)."""
    if n < MAX_TRACE_EVENTS - 1:
        _record(trace, n, kind, unit, start)
    return n + 1


@triton.jit
def stamp_program(trace, entered):
    """Record this program's whole run in the launch, ``(TRACE_PROGRAM, 0, entered,
    now)``, in the last slot of its row: from its first instruction to its last, so a
    timeline shows the set-up before its first unit and the waits after its last."""
    _record(trace, MAX_TRACE_EVENTS - 1, TRACE_PROGRAM, 0, entered)


@triton.jit
def _record(trace, n, kind, unit, start):
    ev = trace.events + (tl.program_id(0) * MAX_TRACE_EVENTS + n) * 4
    wide = tl.zeros([], dtype=tl.int64)     # kind/unit may be plain ints (interpreter)
    tl.store(ev, kind + wide)
    tl.store(ev + 1, unit + wide)
    tl.store(ev + 2, start)
    tl.store(ev + 3, clock_ns())


@triton.jit
def barrier():
    """Block-wide barrier (``bar.sync``)."""
    tl.debug_barrier()


@triton.jit
def vote_all(pred):
    """1 in every thread of the block if ``pred`` holds in every thread, else 0; also a
    block barrier. The one way a per-thread observation may steer control flow."""
    if USE_ASM:
        out = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; "
            "barrier.red.and.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        out = pred.to(tl.int32)
    return out


@triton.jit
def error_word(sync, rank):
    """``rank``'s fatal error word (int32 x 4)."""
    return tl.load(sync.errors + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _failed_here(sync):
    """This thread's view: has any wait of the group given up? (not uniform)"""
    return tl.load(error_word(sync, sync.rank) + ERR_CODE, volatile=True) != 0


@triton.jit
def healthy(sync):
    """1 (in every thread) while no wait of this call, on any rank, has given up: work
    after a failure is skipped and nothing more is published. A block barrier."""
    return vote_all(_failed_here(sync) == 0)


@triton.jit
def record_error(sync, site, index):
    """Record a failed wait: first error wins in this rank's word, and the rank that wins
    also writes it into every peer's word, so the whole group gives up within one spin
    instead of each rank waiting out its own timeout. Call from block-uniform code."""
    if _claim(error_word(sync, sync.rank), site, index, sync.rank):
        for o in range(1, sync.WORLD):
            _claim(error_word(sync, (sync.rank + o) % sync.WORLD), site, index, sync.rank)


@triton.jit
def _claim(word, site, index, rank):
    """Write the error into ``word`` unless it already holds one; True if it did."""
    won = tl.atomic_cas(word + ERR_CODE, 0, ERR_TIMEOUT, sem="relaxed", scope="sys") == 0
    if won:
        tl.store(word + ERR_SITE, site)
        tl.store(word + ERR_INDEX, index)
        tl.store(word + ERR_RANK, rank)
    return won


@triton.jit
def record_input_error(input_err, code, token, slot, epoch):
    """Report bad routing of this call (first report of a call wins; no effect on the
    call itself, which treats the bad slots as "no expert")."""
    old = tl.atomic_cas(input_err + INPUT_CODE, 0, code, sem="relaxed", scope="gpu")
    if old == 0:
        tl.store(input_err + INPUT_TOKEN, token)
        tl.store(input_err + INPUT_SLOT, slot)
        tl.store(input_err + INPUT_EPOCH, epoch.to(tl.int32))


@triton.jit
def wait_at_least(flag_ptr, target, sync, site, index, SCOPE: tl.constexpr):
    """Spin until ``*flag_ptr >= target``. Returns 1 in every thread when the wait was
    satisfied, 0 in every thread when it gave up (``sync.timeout`` ns expired -- then it
    records the error -- or a wait elsewhere in the group failed). Ends with a block
    barrier, so the caller may publish or read what the flag guards right after. The
    interpreter bounds the spin by :data:`INTERPRETER_SPINS` instead of a clock."""
    timeout = tl.load(sync.timeout)
    spins = 0
    start = _now(spins)
    v = _ld_acquire(flag_ptr, SCOPE)
    waiting = v < target
    while waiting:
        spins += 1
        v = _ld_acquire(flag_ptr, SCOPE)
        if USE_ASM:
            expired = _now(spins) - start > timeout
        else:
            expired = spins > INTERPRETER_SPINS
        waiting = (v < target) & (expired == 0) & (_failed_here(sync) == 0)
    ok = vote_all(v >= target)
    if ok == 0:
        record_error(sync, site, index)
    return ok


@triton.jit
def wait_chunks(flags, lo, hi, target, sync, site, index, SCOPE: tl.constexpr,
                SCAN: tl.constexpr):
    """Spin until ``flags[c] >= target`` for every ``c`` in ``[lo, hi)`` (per-chunk
    flags, each published on its own). Checks ``SCAN`` flags with one vector of acquire
    loads, so flags that are already set cost one round trip per ``SCAN``; a flag not yet
    set is waited for with :func:`wait_at_least`. Returns 1 or 0 in every thread, as
    :func:`wait_at_least` does, and ends with a block barrier."""
    ok = tl.full([], 1, tl.int32)
    for c0 in range(lo, hi, SCAN):
        if ok != 0:
            idx = c0 + tl.arange(0, SCAN)
            live = idx < hi
            v = _ld_acquire(flags + tl.where(live, idx, lo), SCOPE)
            mine = tl.min(((v >= target) | (live == 0)).to(tl.int32), axis=0)
            if vote_all(mine) == 0:
                for c in range(c0, tl.minimum(c0 + SCAN, hi)):
                    if ok != 0:
                        ok = wait_at_least(flags + c, target, sync, site, index, SCOPE)
    if hi <= lo:
        barrier()
    return ok


@triton.jit
def fence_async_proxy():
    """Order this thread's generic-proxy view (the acquire that saw a flag) before the
    async-proxy (TMA) loads that follow: peers wrote the rows with ordinary stores."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.proxy.async.global; // $1", "=r,r", [0],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release(flag_ptr, value, SCOPE: tl.constexpr):
    """Publish ``value`` into ``*flag_ptr``: one thread's release, after the block barrier
    that ended the work it covers (a vote, a wait or :func:`barrier`)."""
    tl.atomic_xchg(flag_ptr, value, sem="release", scope=SCOPE)


@triton.jit
def arrive(counter_ptr, SCOPE: tl.constexpr, units=1):
    """Count ``units`` finished units of work after this block's stores; returns the
    count before this arrival (acq_rel, so the last arriver sees everyone's stores). The
    returned value is the same in every thread (a scalar atomic is broadcast)."""
    barrier()
    return tl.atomic_add(counter_ptr, units, sem="acq_rel", scope=SCOPE)


@triton.jit
def take(queue_ptr):
    """Next work item of a device work queue (a counter the blocks of one kernel bump;
    zeroed when a call opens). The same value in every thread: a scalar atomic is done
    by one thread and broadcast through shared memory, so loops over it stay uniform."""
    return tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
