"""The kernels' layout of the experts' first projection, ``W13``.

Models store ``W13 [..., H, 2F]`` as all gate columns, then all up columns ("gate-up"
layout, what :mod:`comet.reference` and the baselines take). The layer0 kernel computes
``silu(x @ gate) * (x @ up)`` for the same output columns; with gate and up ``F`` columns
apart that is two dots per K step, and Triton's pipeliner then cannot load the next tile
under this tile's epilogue (docs/design.md).

The *interleaved* layout puts them side by side in blocks of :data:`GATE_UP_BLOCK`
columns: ``[gate 0 | up 0 | gate 1 | up 1 | ...]``, block ``j`` being columns
``[j*B, (j+1)*B)`` of the gate (then of the up) projection; when ``B`` does not divide
``F`` the last block holds the remaining ``r`` gate columns, then ``r`` up columns. A
``[BLOCK_K, 2B]`` box of it is one dot's operand (for a last block of ``B/2`` columns
too: the box runs past the last column, read as zeros, and layer0's half-tail epilogue
unpacks it; other partial widths take two dots). :class:`comet.moe.LocalExperts` keeps
its ``w13`` in this layout; checkpoints keep the models' own.
"""

from __future__ import annotations

import torch

#: Columns of one gate (and one up) block of the interleaved layout: the layer0 kernel's
#: tile width (``GemmConfig.block_n0``), so one box covers a tile's gate and up columns.
GATE_UP_BLOCK = 128


def _split(f: int, block: int) -> tuple[int, int]:
    """(full blocks, columns of the last partial block) of ``f`` columns."""
    return f // block, f % block


def interleave_gate_up(w13: torch.Tensor, block: int = GATE_UP_BLOCK) -> torch.Tensor:
    """Gate-up ``[..., 2F]`` -> interleaved ``[..., 2F]`` (a new contiguous tensor)."""
    f = w13.shape[-1] // 2
    q, r = _split(f, block)
    gate, up = w13[..., :f], w13[..., f:]
    full = torch.stack([gate[..., :q * block].unflatten(-1, (q, block)),
                        up[..., :q * block].unflatten(-1, (q, block))], dim=-2)
    parts = [full.flatten(-3)]
    if r:
        parts += [gate[..., q * block:], up[..., q * block:]]
    return torch.cat(parts, dim=-1).contiguous()


def gate_up_views(w13: torch.Tensor, block: int = GATE_UP_BLOCK
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gate, up) views of interleaved ``[..., 2F]``, in column order: the full blocks as
    ``[..., q, block]`` (when there are any), then the partial last block as ``[..., r]``
    (when ``block`` does not divide ``F``). Writing through them fills the layout."""
    f = w13.shape[-1] // 2
    q, r = _split(f, block)
    views = []
    if q:
        full = w13[..., :2 * q * block].unflatten(-1, (q, 2, block))
        views.append((full[..., 0, :], full[..., 1, :]))
    if r:
        tail = w13[..., 2 * q * block:]
        views.append((tail[..., :r], tail[..., r:]))
    return views


def gate_up_first(w13: torch.Tensor, block: int = GATE_UP_BLOCK) -> torch.Tensor:
    """Interleaved ``[..., 2F]`` -> gate-up ``[..., 2F]`` (a new contiguous tensor)."""
    last = w13.dim() - 1      # flattening from here merges a full block's two last dims
    views = gate_up_views(w13, block)
    gate = torch.cat([g.flatten(last) for g, _ in views], dim=-1)
    up = torch.cat([u.flatten(last) for _, u in views], dim=-1)
    return torch.cat([gate, up], dim=-1).contiguous()


def interleave_gate_up_(w13: torch.Tensor, block: int = GATE_UP_BLOCK) -> torch.Tensor:
    """In place, one expert at a time (the scratch is one expert's ``[H, 2F]``, not all
    of ``W13``); returns ``w13``."""
    with torch.no_grad():
        for e in range(w13.shape[0]):
            w13[e].copy_(interleave_gate_up(w13[e], block))
    return w13
