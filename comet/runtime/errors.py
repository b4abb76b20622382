"""Device error word -> Python exceptions.

Kernels never hang: a wait that outlives its timeout records ``(code, site, index, rank)``
in a 4-int device word and every other wait of the call gives up at once. The host turns
that word into a :class:`CometTimeoutError` naming the layer, the rank and the flag.
"""

from __future__ import annotations

import torch

#: Wait sites (kernels/layer0.py, kernels/layer1.py): name, what was awaited.
SITES = {
    1: ("exchange", "routing counts (count_flags[{index}]) from rank {index}"),
    2: ("layer0", "dispatched rows (flag0[{index}]) from rank {index}"),
    3: ("layer1", "GroupGEMM tiles of column split {index} (local)"),
    4: ("combine", "partial outputs (flag1[{index}]) from rank {index}"),
    5: ("layer0", "its own comm block publishing the previous chunk to rank {index} (local)"),
    6: ("layer1", "return entries (flag0[{index}]) from rank {index}"),
}


class CometError(RuntimeError):
    """A fused comet kernel failed; the layer's workspace is not usable afterwards."""


class CometTimeoutError(CometError):
    """A cross-rank wait timed out: a peer did not call the layer, hung, or crashed."""


def raise_if_failed(word: torch.Tensor | list[int], rank: int) -> None:
    """Raise the exception described by an error word (no-op when it is clear)."""
    code, site, index, at = (int(v) for v in (word.tolist() if isinstance(word, torch.Tensor)
                                              else word))
    if code == 0:
        return
    layer, what = SITES.get(site, (f"site {site}", "flag {index}"))
    raise CometTimeoutError(
        f"comet {layer} on rank {at} timed out waiting for {what.format(index=index)} "
        f"(observed by rank {rank}); a peer did not call the layer, hung, or crashed. "
        "Every rank of the expert-parallel group must call the layer the same number of "
        "times. Raise COMET_TIMEOUT_S if a peer is just slow.")
