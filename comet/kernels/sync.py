"""Synchronisation primitives shared by every comet kernel (the only module that spins).

Rules they implement (shared/DESIGN.md, "Rules for kernels that talk across blocks"):

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

``USE_ASM`` selects inline PTX (``ld.acquire``, ``%globaltimer``, ``barrier.red``) on a
GPU and plain atomics plus a spin counter under ``TRITON_INTERPRET=1``, where inline
assembly cannot run, where a block is one thread of control (so every value is uniform)
and where a wait that is not satisfied at once never will be (programs run one by one).
"""

import triton
import triton.language as tl

# Fatal error word (int32 x 4, symmetric: peers write it too), see comet.runtime.errors.
ERR_CODE = tl.constexpr(0)
ERR_SITE = tl.constexpr(1)      # which wait: see comet.runtime.errors.SITES
ERR_INDEX = tl.constexpr(2)     # flag index (usually the peer rank)
ERR_RANK = tl.constexpr(3)      # rank that gave up
ERR_TIMEOUT = tl.constexpr(1)

# Input error word (int32 x 4, local): bad routing found by the plan kernels. It does not
# stop the call (bad slots count as "no expert" on every rank alike), so the workspace
# stays usable; the host raises it once.
INPUT_CODE = tl.constexpr(0)
INPUT_TOKEN = tl.constexpr(1)   # first offending token of the block that reported
INPUT_SLOT = tl.constexpr(2)    # its top-k slot
INPUT_EPOCH = tl.constexpr(3)   # the call (epoch) it came from
INPUT_BAD_EXPERT = tl.constexpr(1)   # an id outside [-1, E)
INPUT_BAD_WEIGHT = tl.constexpr(2)   # a NaN or infinite routing weight

# Interpreter: spins before a wait counts as failed (programs run sequentially there).
INTERPRETER_SPINS = tl.constexpr(64)


@triton.jit
def _ld_acquire(ptr, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
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
def _now(spins, USE_ASM: tl.constexpr):
    """Nanoseconds on a GPU; the spin count under the interpreter."""
    if USE_ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [spins],
                                      dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = spins.to(tl.int64)
    return t


@triton.jit
def clock_ns(USE_ASM: tl.constexpr):
    """The global timer in ns (0 under the interpreter): timeline stamps."""
    return _now(tl.full([], 0, tl.int32), USE_ASM) * USE_ASM


@triton.jit
def stamp(trace_ptr, n, kind, unit, start, MAX_EVENTS: tl.constexpr, USE_ASM: tl.constexpr):
    """Record one unit of work ``(kind, unit, start, now)`` as event ``n`` of this
    program's trace row; returns ``n + 1`` (events past ``MAX_EVENTS`` are dropped)."""
    if n < MAX_EVENTS:
        ev = trace_ptr + n * 4
        wide = tl.zeros([], dtype=tl.int64)     # kind/unit may be plain ints (interpreter)
        tl.store(ev, kind + wide)
        tl.store(ev + 1, unit + wide)
        tl.store(ev + 2, start)
        tl.store(ev + 3, clock_ns(USE_ASM))
    return n + 1


@triton.jit
def barrier():
    """Block-wide barrier (``bar.sync``)."""
    tl.debug_barrier()


@triton.jit
def vote_all(pred, USE_ASM: tl.constexpr):
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
def error_word(err_table, rank):
    """``rank``'s fatal error word (``err_table``: the int64 peer table of ``error``)."""
    return tl.load(err_table + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _failed_here(err_table, rank):
    """This thread's view: has any wait of the group given up? (not uniform)"""
    return tl.load(error_word(err_table, rank) + ERR_CODE, volatile=True) != 0


@triton.jit
def healthy(err_table, rank, USE_ASM: tl.constexpr):
    """1 (in every thread) while no wait of this call, on any rank, has given up: work
    after a failure is skipped and nothing more is published. A block barrier."""
    return vote_all(_failed_here(err_table, rank) == 0, USE_ASM)


@triton.jit
def record_error(err_table, site, index, rank, WORLD: tl.constexpr):
    """Record a failed wait: first error wins in this rank's word, and the rank that wins
    also writes it into every peer's word, so the whole group gives up within one spin
    instead of each rank waiting out its own timeout. Call from block-uniform code."""
    if _claim(error_word(err_table, rank), site, index, rank):
        for o in range(1, WORLD):
            _claim(error_word(err_table, (rank + o) % WORLD), site, index, rank)


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
def wait_at_least(flag_ptr, target, err_table, site, index, rank, timeout,
                  SCOPE: tl.constexpr, WORLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Spin until ``*flag_ptr >= target``. Returns 1 in every thread when the wait was
    satisfied, 0 in every thread when it gave up (its timeout, in ns on a GPU, expired --
    then it records the error -- or a wait elsewhere in the group failed). Ends with a
    block barrier, so the caller may publish or read what the flag guards right after.
    The interpreter bounds the spin by :data:`INTERPRETER_SPINS` instead of a clock."""
    spins = 0
    start = _now(spins, USE_ASM)
    v = _ld_acquire(flag_ptr, SCOPE, USE_ASM)
    waiting = v < target
    while waiting:
        spins += 1
        v = _ld_acquire(flag_ptr, SCOPE, USE_ASM)
        if USE_ASM:
            expired = _now(spins, USE_ASM) - start > timeout
        else:
            expired = spins > INTERPRETER_SPINS
        waiting = (v < target) & (expired == 0) & (_failed_here(err_table, rank) == 0)
    ok = vote_all(v >= target, USE_ASM)
    if ok == 0:
        record_error(err_table, site, index, rank, WORLD)
    return ok


@triton.jit
def wait_chunks(flags, lo, hi, target, err_table, site, index, rank, timeout,
                SCOPE: tl.constexpr, WORLD: tl.constexpr, SCAN: tl.constexpr,
                USE_ASM: tl.constexpr):
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
            v = _ld_acquire(flags + tl.where(live, idx, lo), SCOPE, USE_ASM)
            mine = tl.min(((v >= target) | (live == 0)).to(tl.int32), axis=0)
            if vote_all(mine, USE_ASM) == 0:
                for c in range(c0, tl.minimum(c0 + SCAN, hi)):
                    if ok != 0:
                        ok = wait_at_least(flags + c, target, err_table, site, index, rank,
                                           timeout, SCOPE, WORLD, USE_ASM)
    if hi <= lo:
        barrier()
    return ok


@triton.jit
def fence_async_proxy(USE_ASM: tl.constexpr):
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
