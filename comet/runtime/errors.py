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

#: Fatal word code of a failed wait (comet.kernels.sync.ERR_TIMEOUT).
TIMEOUT_CODE = 1

#: Wait sites (kernels/layer0.py, kernels/layer1.py, kernels/grad_rows.py): name, what was awaited.
SITES = {
    1: ("exchange", "routing counts (count_flags[{index}]) from rank {index}"),
    2: ("layer0", "dispatched rows (flag0[{index}]) from rank {index}"),
    3: ("layer1", "GroupGEMM tiles of column split {index} (local)"),
    4: ("combine", "partial outputs (flag1[{index}]) from rank {index}"),
    6: ("layer1", "return entries (flag0[{index}]) from rank {index}"),
    7: ("backward", "return entries (flag0[{index}]) from rank {index}"),
}

#: Input error codes (comet.kernels.sync.INPUT_*).
INPUT_ERRORS = {
    1: "an expert id outside [-1, {num_experts})",
    2: "a NaN or infinite routing weight",
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


def input_error(word: torch.Tensor | list[int], num_experts: int) -> CometInputError | None:
    """The :class:`CometInputError` an input word describes, or None."""
    code, token, slot, epoch = _ints(word)
    if code == 0:
        return None
    what = INPUT_ERRORS.get(code, "invalid routing").format(num_experts=num_experts)
    return CometInputError(
        f"comet: call {epoch} had {what} at token {token}, slot {slot}; that slot added "
        "nothing to the output, on every rank alike. Use -1 for a slot with no expert.")
