"""Synchronisation primitives shared by every comet kernel (the only module that spins).

Rules they implement (shared/DESIGN.md, "Rules for kernels that talk across blocks"):

* publish: every thread stores its data with ``tl.store``; a block barrier; then one
  release atomic on the flag (scope ``"sys"`` when a peer GPU reads it, ``"gpu"`` inside
  one GPU). The barrier makes all threads' stores part of what the release publishes.
* wait: spin on an acquire load, bounded by a timeout; then a block barrier; loads of the
  published data are made to depend on the waited value so the compiler cannot hoist them
  above the wait.
* a failed wait never hangs: it records an error (first error wins) in the device error
  word, and every later wait anywhere in the call sees the error and gives up at once, so
  the host can raise a clear exception instead of a hang.

``USE_ASM`` selects inline PTX (``ld.acquire``, ``%globaltimer``) on a GPU and plain
atomics plus a spin counter under ``TRITON_INTERPRET=1``, where inline assembly cannot run
and where a wait that is not satisfied at once never will be (programs run one by one).
"""

import triton
import triton.language as tl

# Error word layout (int32 x 4), shared with comet.runtime.errors.
ERR_CODE = tl.constexpr(0)
ERR_SITE = tl.constexpr(1)      # which wait: see comet.runtime.errors.SITES
ERR_INDEX = tl.constexpr(2)     # flag index (usually the peer rank)
ERR_RANK = tl.constexpr(3)      # rank that gave up
ERR_TIMEOUT = tl.constexpr(1)

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
        tl.store(ev, kind.to(tl.int64))
        tl.store(ev + 1, unit.to(tl.int64))
        tl.store(ev + 2, start)
        tl.store(ev + 3, clock_ns(USE_ASM))
    return n + 1


@triton.jit
def barrier():
    """Block-wide barrier (``bar.sync``)."""
    tl.debug_barrier()


@triton.jit
def record_error(err_ptr, site, index, rank):
    """First error wins: later failures only bail out."""
    old = tl.atomic_cas(err_ptr + ERR_CODE, 0, ERR_TIMEOUT, sem="relaxed", scope="sys")
    if old == 0:
        tl.store(err_ptr + ERR_SITE, site)
        tl.store(err_ptr + ERR_INDEX, index)
        tl.store(err_ptr + ERR_RANK, rank)


@triton.jit
def failed(err_ptr):
    """True once any wait of this call has given up."""
    return tl.load(err_ptr + ERR_CODE, volatile=True) != 0


@triton.jit
def healthy(err_ptr):
    """True while no wait of this call has given up (work after a failure is skipped)."""
    return tl.load(err_ptr + ERR_CODE, volatile=True) == 0


@triton.jit
def wait_at_least(flag_ptr, target, err_ptr, site, index, rank, timeout,
                  SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Spin until ``*flag_ptr >= target``; return the value seen, which is below
    ``target`` only if the wait gave up. ``timeout`` is in ns (GPU); the interpreter
    bounds the spin by :data:`INTERPRETER_SPINS` instead."""
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
        if expired:
            record_error(err_ptr, site, index, rank)
        stop = expired | failed(err_ptr)
        waiting = (v < target) & (stop == 0)
    barrier()
    return v


@triton.jit
def depend(ptr, token, USE_ASM: tl.constexpr):
    """``ptr``, made to depend on ``token`` (a waited value) so loads through it stay below
    the wait."""
    if USE_ASM:
        addr = tl.inline_asm_elementwise("mov.b64 $0, $1; // $2", "=l,l,l",
                                         [ptr.to(tl.int64, bitcast=True), token.to(tl.int64)],
                                         dtype=tl.int64, is_pure=False, pack=1)
        out = addr.to(ptr.dtype, bitcast=True)
    else:
        out = ptr
    return out


@triton.jit
def fence_async_proxy(USE_ASM: tl.constexpr):
    """Order this thread's generic-proxy view (the acquire that saw a flag) before the
    async-proxy (TMA) loads that follow: peers wrote the rows with ordinary stores."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.proxy.async.global; // $1", "=r,r", [0],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish(flag_ptr, value, SCOPE: tl.constexpr):
    """Release ``value`` into ``*flag_ptr`` after this block's stores (see module doc)."""
    barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope=SCOPE)


@triton.jit
def arrive(counter_ptr, SCOPE: tl.constexpr):
    """Count one finished unit of work after this block's stores; returns the count
    before this arrival (acq_rel, so the last arriver sees everyone's stores)."""
    barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope=SCOPE)
