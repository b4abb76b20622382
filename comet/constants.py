"""Numbers the host code and the Triton kernels must agree on, each defined once.

Values a kernel reads are ``tl.constexpr`` (Triton kernels may only read globals of that
type); host code uses them like ints (``int(X)`` where a plain int is needed). Nothing
here depends on the rest of comet, so every layer may import it.
"""

from __future__ import annotations

import hashlib
import operator
import os
from functools import lru_cache
from pathlib import Path

import triton.language as tl


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run on the CPU, one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _InterpretedConstexpr(tl.constexpr):
    """A ``tl.constexpr`` whose operators act on its value, for the interpreter. The
    interpreter runs a kernel as plain Python, where a constexpr carried in an argument
    group keeps its wrapper (a top-level constexpr argument arrives as a plain int); the
    wrapper's own operators would wrap tensors (``c + tensor``) and lack reflected forms
    (``2 % c``), which the compiler handles and plain Python does not."""


def _on_value(op, reflected: bool = False):
    if reflected:
        return lambda self, other: op(other, self.value)
    return lambda self, other: op(self.value, other)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "lshift", "rshift", "and",
              "or", "xor", "pow"):
    _op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(_InterpretedConstexpr, f"__{_name}__", _on_value(_op))
    setattr(_InterpretedConstexpr, f"__r{_name}__", _on_value(_op, reflected=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(_InterpretedConstexpr, f"__{_name}__", _on_value(getattr(operator, _name)))
_InterpretedConstexpr.__neg__ = lambda self: -self.value
_InterpretedConstexpr.__int__ = lambda self: int(self.value)
_InterpretedConstexpr.__hash__ = tl.constexpr.__hash__


def constexpr(value) -> tl.constexpr:
    """``value`` as a compile-time constant inside a kernel argument group."""
    return _InterpretedConstexpr(value) if interpreting() else tl.constexpr(value)


#: Inline PTX (``ld.acquire``, ``%globaltimer``, ``barrier.red``) on a GPU; plain atomics
#: and a spin counter under the interpreter, which cannot run inline assembly. Decided
#: when comet is imported, as Triton decides between compiling and interpreting.
USE_ASM = constexpr(not interpreting())

#: Where the kernels' sources are: their contents are the kernels' identity.
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"


@lru_cache(maxsize=1)
def kernel_identity() -> str:
    """``kernels-<12 hex>``: a hash of every ``comet/kernels/**/*.py`` (relative path and
    contents, sorted by path, line endings normalized), stored in every ``comet tune``
    table and every results file. Computed, not bumped by hand, so it cannot drift: the
    hand-kept revision it replaces stayed at 10 through about 80 kernel commits. Any edit
    of a kernel file (a comment too) gives a new identity; a table or result of another
    identity is reported as such when loaded (comet.scheduler.tuned)."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS_DIR.rglob("*.py"), key=lambda p: p.relative_to(KERNELS_DIR
                                                                          ).as_posix()):
        digest.update(path.relative_to(KERNELS_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return f"kernels-{digest.hexdigest()[:12]}"


def kernels_of(meta: dict) -> str:
    """The kernels a table's or result's metadata says made it: ``meta["kernels"]``, or
    for files written before identities were computed ``revision N`` (their
    ``kernel_revision``), else ``unknown``."""
    if meta.get("kernels"):
        return str(meta["kernels"])
    if meta.get("kernel_revision") is not None:
        return f"revision {meta['kernel_revision']}"
    return "unknown"

# ---------------------------------------------------------------- roles of a program
#: A layer kernel's ``ROLE``: fused (the lowest ``n_comm`` programs communicate, the
#: rest compute), or the whole grid in one role (comet.kernels.roles).
ROLE_FUSED = constexpr(0)
ROLE_COMM = constexpr(1)
ROLE_COMPUTE = constexpr(2)

# ---------------------------------------------------------------- memory
#: Bytes every address-held buffer is aligned to (one 16-byte vector access): workspace
#: buffers are carved at larger alignments, and a misaligned input is staged through a
#: copy (comet.kernels.address).
ADDRESS_ALIGN = constexpr(16)

#: Count buffers of the count exchange, used by epoch parity: a peer may be one exchange
#: ahead of this rank, never two (comet.runtime.workspace).
COUNT_BUFFERS = constexpr(2)

# ---------------------------------------------------------------- error words
#: int32 fields of each error word (a rank's workspace has a fatal and an input word).
ERROR_WORD = 4
#: Fatal word ``(code, site, index, rank)``: a failed wait, written into every peer's.
ERR_CODE = constexpr(0)
ERR_SITE = constexpr(1)      # which wait: one of the SITE_* below
ERR_INDEX = constexpr(2)     # flag index (usually the peer rank)
ERR_RANK = constexpr(3)      # rank that gave up
ERR_TIMEOUT = constexpr(1)   # the code of a wait that timed out
#: Input word ``(code, token, slot, epoch)``: bad routing found by the plan kernels (local;
#: the call still completes, the bad slots counting as "no expert").
INPUT_CODE = constexpr(0)
INPUT_TOKEN = constexpr(1)   # first offending token of the block that reported
INPUT_SLOT = constexpr(2)    # its top-k slot
INPUT_EPOCH = constexpr(3)   # the call (epoch) it came from
INPUT_BAD_EXPERT = constexpr(1)   # an id outside [-1, E)
INPUT_BAD_WEIGHT = constexpr(2)   # a NaN or infinite routing weight

#: Wait sites, recorded in the fatal word and named by comet.runtime.errors.SITES.
SITE_COUNTS = constexpr(1)        # the count exchange
SITE_DISPATCH = constexpr(2)      # layer0: a GEMM tile's rows
SITE_SPLIT = constexpr(3)         # layer1: a column split's tiles (local)
SITE_COMBINE = constexpr(4)       # the combine: partial outputs
SITE_ENTRIES = constexpr(6)       # layer1's reduce: return entries
SITE_ROW_ENTRIES = constexpr(7)   # the backward's row weights: return entries

# ---------------------------------------------------------------- waits and traces
#: Chunk flags checked per vector of acquire loads when a wait covers a run of chunks.
CHUNK_SCAN = constexpr(32)
#: Events each program may record when tracing (``comet bench --timeline``): units of
#: work, and in the last slot the program's own run (:data:`TRACE_PROGRAM`).
MAX_TRACE_EVENTS = constexpr(512)
#: Trace kind of a program's whole run in a traced launch, entry to exit (negative: never
#: a unit's kind).
TRACE_PROGRAM = constexpr(-2)
#: layer1 trace kinds: a GEMM work item stamps its split, a reduce item this + its split.
TRACE_REDUCE = constexpr(1 << 16)
