"""The dispatch by copy engines (``TileConfig.copy_dispatch``): the host's half.

A pushing dispatch moves each pair's row with SM stores, whose count per destination
only the device knows. What the host knows is the input itself: ``tokens x H``. So each
rank's host copies its whole input, and its send list (pairs, their rows on each
destination, weights, per-destination offsets: ``tokens x top_k`` entries each), into
every peer's buffers with ``cudaMemcpyAsync`` -- ``copy_`` into a tensor mapping the
peer's symmetric memory; no SM runs it -- then copies the call's epoch into the peer's
``copy_flags[rank]``. The peer's comm blocks (comet.kernels.layer0.place_role) wait for
that flag and place the rows into their shared tensor with local loads and stores.

Ordering. Each destination gets its own stream, forked from the caller's stream after
the routing plan (the send list is the plan's, and the count exchange before it is the
handshake: a peer that published this call's counts has finished reading the previous
call's copies). On that stream the rows and the send list go first and the epoch last:
work in one stream runs in order, and a copy is complete -- its writes visible to the
peer -- before the next operation of the stream starts. The caller's stream joins the
copy streams after the call's kernels (the copies read the caller's input, which must
outlive them; the layer0 kernel cannot end before they land anyway).

The copies are issued by the host on every call, outside the layer's CUDA graphs (a
graph's copy has a fixed size and source; a call's token count and input address
change): a fused call in this mode is two graph replays with the copies between them.
"""

from __future__ import annotations

import torch

from comet.runtime.streams import PrivateStream
from comet.runtime.workspace import Workspace

#: The send-list tables a destination receives: ``(its buffer, this rank's plan table)``.
SENT_TABLES = (("sent_pair", "send_pair"), ("sent_row", "send_row"),
               ("sent_weight", "send_weight"))
#: A peer's buffers this rank copies into (its own row of each).
COPIED = ("x_recv", *(theirs for theirs, _ in SENT_TABLES), "sent_off", "copy_flags")


class CopySender:
    """Issues one rank's copies to its peers (``ws.peers``), one stream per peer.

    Args:
        ws: this rank's workspace, allocated with ``TileConfig.copy_dispatch``.
        top_k: slots per token (the send list has ``tokens * top_k`` entries).
        in_order: issue the copies on the caller's stream instead, between the plan and
            the layers. For virtual ranks sharing one GPU: their copies are SM kernels
            anyway (same device), and a copy stream may share one of CUDA's hardware
            work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) with a peer's
            compute stream, queueing this rank's copies behind the peer's kernel that
            waits for them (seen: a deadlock with four ranks). On the caller's stream a
            rank's copies wait only for its own plan, which needs no copy.
    """

    def __init__(self, ws: Workspace, top_k: int, in_order: bool = False):
        if "x_recv" not in ws.buffers:
            raise ValueError("the workspace has no copy-dispatch buffers (TileConfig."
                             "copy_dispatch was off when it was allocated)")
        self.ws, self.top_k = ws, top_k
        # Ring order, as the pushing dispatch: rank r's first copy goes to r - 1, so
        # every rank feeds a different peer first.
        destinations = [(ws.rank - o) % ws.world for o in range(1, ws.world)]
        #: Per destination, the rows of its buffers that belong to this rank (views made
        #: once: a call only slices them to its token count).
        r = ws.rank
        self.targets = [{name: buf[r] if buf.dim() > 1 else buf[r:r + 1]
                         for name, buf in ws.peers[d].items() if name in COPIED}
                        for d in destinations]
        device = ws.epoch.device
        self.streams = ([PrivateStream(device) for _ in destinations]
                        if device.type == "cuda" and not in_order else [])

    def send(self, x: torch.Tensor, num_tokens: int) -> None:
        """Copy ``x[:num_tokens]`` and this call's send list to every peer, then the
        epoch into each peer's flag, on the copy streams (forked from the current
        stream; :meth:`join` brings them back). ``in_order`` or on the CPU: on the
        current stream."""
        entries = num_tokens * self.top_k
        plan = self.ws.plan
        # Contiguous slices of equal dtype: each copy_ is one cudaMemcpyAsync. (A copy
        # that needed a kernel would wait for SMs the layer0 kernel holds while it waits
        # for this copy.)
        sources = [("x_recv", x[:num_tokens])] if num_tokens else []
        sources += [(theirs, plan[mine][:entries]) for theirs, mine in SENT_TABLES
                    if entries]
        sources += [("sent_off", plan["send_off"]), ("copy_flags", self.ws.epoch)]
        if not self.streams:
            for target in self.targets:
                _copy_into(target, sources)
            return
        caller = torch.cuda.current_stream(x.device)
        for target, stream in zip(self.targets, self.streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                _copy_into(target, sources)

    def join(self) -> None:
        """Make the current stream wait for every copy issued so far."""
        if self.streams:
            caller = torch.cuda.current_stream(self.streams[0].device)
            for stream in self.streams:
                caller.wait_stream(stream)


def _copy_into(target: dict[str, torch.Tensor], sources) -> None:
    """Copy each ``(buffer name, tensor)`` of ``sources`` into the head of the target's
    row of that buffer, in order (the epoch, last, says the others landed)."""
    for name, src in sources:
        target[name][:src.shape[0]].copy_(src)
