"""Device error words -> Python exceptions.

Kernels never hang: a wait that outlives its timeout records ``(code, site, index, rank)``
in this rank's *fatal* word and in every peer's (comet.kernels.sync.record_error); every
other wait of the group then gives up at once. The host turns that word into a
:class:`CometTimeoutError` naming the layer, the site, the rank that gave up and the peer
it waited for. The word is sticky: the workspace stays failed until
:meth:`comet.runtime.layer.FusedMoE.reset` (collective) clears it.

Bad routing (an expert id outside ``[-1, E)``, a NaN or infinite weight) is found by the
plan kernels and written to a separate, local *input* word ``(code, token, slot, epoch)``.
The call still completes on every rank -- the bad slots count as "no expert" everywhere --
so the workspace stays usable; the host raises :class:`CometInputError` once for it.
"""

from __future__ import annotations

import torch

from comet.constants import (ERR_TIMEOUT, ERROR_WORD, INPUT_BAD_EXPERT, INPUT_BAD_WEIGHT,
                             SITE_COMBINE, SITE_COUNTS, SITE_DISPATCH, SITE_ENTRIES,
                             SITE_ROW_ENTRIES, SITE_SPLIT)
from comet.runtime import topology

#: Fatal word code of a failed wait.
TIMEOUT_CODE = int(ERR_TIMEOUT)

#: Wait sites (comet.constants.SITE_*): name, what was awaited.
SITES = {
    int(SITE_COUNTS): ("exchange", "routing counts (count_flags[{index}]) from rank {index}"),
    int(SITE_DISPATCH): ("layer0", "dispatched rows (flag0[{index}]) from rank {index}"),
    int(SITE_SPLIT): ("layer1", "GroupGEMM tiles of column split {index} (local)"),
    int(SITE_COMBINE): ("combine", "partial outputs (flag1[{index}]) from rank {index}"),
    int(SITE_ENTRIES): ("layer1", "return entries (flag0[{index}]) from rank {index}"),
    int(SITE_ROW_ENTRIES): ("backward", "return entries (flag0[{index}]) from rank {index}"),
}

#: Input error codes (comet.constants.INPUT_*).
INPUT_ERRORS = {
    int(INPUT_BAD_EXPERT): "an expert id outside [-1, {num_experts})",
    int(INPUT_BAD_WEIGHT): "a NaN or infinite routing weight",
}


class CometError(RuntimeError):
    """A fused comet kernel failed; the layer's workspace needs :meth:`reset` (on every
    rank) or re-creating before the next call."""


class CometTimeoutError(CometError):
    """A cross-rank wait timed out: a peer did not call the layer, hung, or crashed."""


class CometInputError(ValueError):
    """A call's routing was invalid. Reported after the fact (the check runs on the
    device, without a host sync); the layer stays usable."""


def _ints(word) -> list[int]:
    return [int(v) for v in (word.tolist() if isinstance(word, torch.Tensor) else word)]


def raise_if_failed(word: torch.Tensor | list[int], rank: int) -> None:
    """Raise the :class:`CometTimeoutError` a fatal word describes (no-op when clear)."""
    code, site, index, at = _ints(word)
    if code == 0:
        return
    if site not in SITES:
        # The code of a peer's report can land before its fields (both are remote writes).
        raise CometTimeoutError(
            f"comet: a wait on another rank timed out (observed by rank {rank}); its "
            "details had not arrived yet. Every rank of the expert-parallel group must call "
            "the layer the same number of times; call reset() on every rank to go on.")
    layer, what = SITES[site]
    raise CometTimeoutError(
        f"comet {layer} on rank {at} timed out waiting for {what.format(index=index)} "
        f"(observed by rank {rank}); a peer did not call the layer, hung, or crashed. "
        "Every rank of the expert-parallel group must call the layer the same number of "
        "times. Raise COMET_TIMEOUT_S if a peer is just slow; call reset() on every rank "
        "(or re-create the layer) to go on.")


def input_error(word: torch.Tensor | list[int], num_experts: int,
                slots_per_choice: int = 1) -> CometInputError | None:
    """The :class:`CometInputError` an input word describes, or None.
    ``slots_per_choice``: the kernels' slots per caller's top-k choice (a (tp, ep)
    layout's ``tp``, comet.mesh), so the message names the caller's slot."""
    code, token, slot, epoch = _ints(word)
    if code == 0:
        return None
    slot //= slots_per_choice
    what = INPUT_ERRORS.get(code, "invalid routing").format(num_experts=num_experts)
    return CometInputError(
        f"comet: call {epoch} had {what} at token {token}, slot {slot}; that slot added "
        "nothing to the output, on every rank alike. Use -1 for a slot with no expert.")


class ErrorReports:
    """How a layer turns its workspace's error words into exceptions, without a host sync
    on the forward path.

    ``"lazy"``: each call's device work ends with :meth:`snapshot`, a non-blocking copy
    of the words into pinned host memory (inside the call's CUDA graph when it replays
    one, so the host issues nothing for it); after each call the host raises what that
    copy says by then -- a failure surfaces at a later call, or at this one if the
    device was already done; ``"sync"``: synchronise after every call and raise at once
    (debugging). A fatal error is sticky -- :meth:`check_usable` raises until
    :meth:`clear` -- while bad routing is reported once and leaves the layer usable."""

    def __init__(self, error: torch.Tensor, rank: int, num_experts: int, mode: str,
                 slots_per_choice: int = 1):
        if mode not in ("lazy", "sync"):
            raise ValueError(f"check_errors must be 'lazy' or 'sync', got {mode!r}")
        self.error, self.rank, self.num_experts, self.mode = error, rank, num_experts, mode
        self.slots_per_choice = slots_per_choice
        self.device = error.device
        # Host copy of the error words, refreshed by every call without a sync (read
        # through numpy: no tensor op on the host's per-call path).
        self._pending = (torch.zeros(error.numel(), dtype=torch.int32, pin_memory=True)
                         if self.device.type == "cuda" else None)
        self._pending_host = self._pending.numpy() if self._pending is not None else None
        self.failure: CometError | None = None     # sticky until clear()
        self._input_reported = 0                    # epoch of the last input error raised

    def check_usable(self) -> None:
        """Raise if an earlier call failed and the workspace was not reset since."""
        if self.failure is not None:
            raise CometError("comet: this layer failed in an earlier call and its workspace "
                             "is unusable until reset() is called on every rank (or the "
                             f"layer is re-created): {self.failure}") from self.failure

    def snapshot(self) -> None:
        """Copy the error words to the host copy, stream-ordered after the call's work
        (the call's last phase; capturable).

        A plain cudaMemcpyAsync, not ``Tensor.copy_``: torch's pinned-memory allocator
        records an event per copy into a pinned block, and one recorded inside a graph
        capture crashed the process when the block was freed (docs/notebook.md, "Host
        path")."""
        if self._pending is None:
            return
        rt = topology.cuda_runtime()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        topology.checked(rt, "cudaMemcpyAsync", rt.cudaMemcpyAsync(
            self._pending.data_ptr(), self.error.data_ptr(),
            self.error.numel() * self.error.element_size(),
            rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))

    def after_launch(self) -> None:
        """Report errors of this call (``"sync"``) or of earlier ones (``"lazy"``: what
        the last :meth:`snapshot` that landed says; a word the copy is writing may be
        read half old, half new, which :meth:`_raise_for` tolerates)."""
        if self.mode == "sync" or self._pending is None:
            self.check_now()
            return
        word = self._pending_host.tolist()
        if word[0] or word[ERROR_WORD]:     # else all clear, the common case: nothing to parse
            self._raise_for(word)

    def check_now(self) -> None:
        """Synchronise and raise if any call so far failed (or had bad routing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_for(self.error.tolist())

    def _raise_for(self, word: list[int]) -> None:
        """Raise what an error word (fatal, then input) reports, once."""
        try:
            raise_if_failed(word[:ERROR_WORD], self.rank)
        except CometError as e:
            self.failure = e
            raise
        err = input_error(word[ERROR_WORD:], self.num_experts, self.slots_per_choice)
        epoch = word[-1]
        if err is not None and epoch > self._input_reported:
            self._input_reported = epoch
            self.error[ERROR_WORD:].zero_()   # stream-ordered: later calls may report again
            raise err

    def clear(self) -> None:
        """Forget past failures (after the workspace's words were zeroed)."""
        self.failure = None
        self._input_reported = 0
        if self._pending is not None:
            self._pending.zero_()
