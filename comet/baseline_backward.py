"""The unfused backward of the routed experts, expert-parallel: what training through
:class:`~comet.moe.CometMoE` runs on the CPU (or with ``fused_backward=False``); the fused
one is :mod:`comet.runtime.backward`.

Neither forward keeps anything for the backward, so the backward starts from the layer's
inputs, as activation checkpointing does, and runs the unfused expert-parallel pipeline of
:mod:`comet.baseline` in reverse::

    plan the dispatch (one host sync) -> all_to_all of each pair's (x, dy) row and weight
    -> recompute gate/up = x @ W13 (the one forward GEMM the backward needs)
    -> dh = (dy @ W2^T) * weight, dW2 = h^T (weight * dy), d weight = <dy @ W2^T, h>
    -> d gate, d up through the gated activation (SiLU(gate) * up, or a variant)
    -> dx rows = d(gate, up) @ W13^T, dW13 = x^T d(gate, up)
    -> all_to_all of dx rows and d weight back -> sum each token's rows

Five GEMMs per expert (one recomputed, four of the backward), two exchanges each way,
memory for one layer's rows at a time. The layer1 output itself is never recomputed:
``<dy, h @ W2> = <dy @ W2^T, h>`` gives the routing weights' gradient from ``dy @ W2^T``,
which the backward needs anyway. Nothing here is overlapped; on a GPU the GEMMs are
``torch._grouped_mm``.

W13's columns stay in whatever layout they are in (the kernels' interleaved gate/up
blocks, :mod:`comet.weights`, or gate-then-up): d(gate, up) is written back through the
same column views, so ``dW13`` comes out in W13's own layout.
"""

from __future__ import annotations

import torch

from comet.activation import SILU, GatedActivation, gated, gated_grad
from comet.baseline import DispatchPlan, _world, all_to_all_rows, plan_dispatch
from comet.grouped import grouped_mm, grouped_weight_grad
from comet.kernels.act_backward import act_backward
from comet.weights import gate_up_views

__all__ = ["routed_experts_backward", "act_backward_torch"]

#: W13 column layouts :func:`routed_experts_backward` takes.
LAYOUTS = ("interleaved", "gate_up")


def _gate_up_views(t: torch.Tensor, layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gate, up) column views of ``t [R, 2F]`` in ``layout``, in the order of the F
    columns: concatenating the gates (or the ups) gives ``[R, F]`` in column order."""
    if layout == "gate_up":
        f = t.shape[1] // 2
        return [(t[:, :f], t[:, f:])]
    return gate_up_views(t)


def act_backward_torch(gu: torch.Tensor, dh_u: torch.Tensor, weight: torch.Tensor,
                       layout: str, activation: GatedActivation = SILU
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`comet.kernels.act_backward.act_backward` in torch ops (the CPU path, and the
    spec the kernel is tested against)."""
    dtype = gu.dtype
    dgu = torch.empty_like(gu)
    h_parts, d_weight = [], torch.zeros(gu.shape[0], dtype=torch.float32, device=gu.device)
    col = 0
    for (g, u), (dg_out, du_out) in zip(_gate_up_views(gu, layout), _gate_up_views(dgu, layout)):
        g, u = g.float(), u.float()
        width = g.shape[1:].numel()
        dhu = dh_u[:, col:col + width].float().view_as(g)
        col += width
        # h as the forward stored it: rounded to the model dtype before the second GEMM.
        h = gated(g, u, activation).to(dtype)
        h_parts.append(h.flatten(1))
        d_weight += (dhu * h.float()).flatten(1).sum(1)
        dh = dhu * weight.view(-1, *([1] * (g.dim() - 1)))
        dg, du = gated_grad(g, u, dh, activation)
        dg_out.copy_(dg)
        du_out.copy_(du)
    h = torch.cat(h_parts, dim=1) if len(h_parts) > 1 else h_parts[0]
    return dgu, h, d_weight


def _per_expert(t: torch.Tensor, expert_rows: list[int]) -> torch.Tensor:
    """``[El, ...]``: each expert's rows of ``t`` summed (fp32, in row order)."""
    return torch.stack([part.float().sum(0) for part in t.split(expert_rows)])


def _expert_backward(xg: torch.Tensor, dyg: torch.Tensor, wg: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, plan: DispatchPlan, layout: str,
                     weight_grads: bool, activation: GatedActivation = SILU,
                     biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
    """The local experts' part, rows grouped by expert: ``xg, dyg [R, H]`` (model dtype),
    ``wg [R]`` fp32 -> ``(dx rows [R, H], d weight [R] fp32, dW13, dW2, db13, db2)``; the
    expert weights' (and biases') gradients only with ``weight_grads`` (two of the five
    GEMMs). With ``biases`` ``(b13, b2)``, the recomputed gate/up includes ``b13`` and
    each row's routing weight gradient ``<dy, b2[e]>``."""
    rows, offs = plan.expert_rows, plan.offs
    gu = grouped_mm(xg, w13, rows, offs)                       # recomputed
    if biases is not None:
        counts = torch.tensor(rows, device=xg.device)
        b13_rows, b2_rows = (b.repeat_interleave(counts, 0, output_size=xg.shape[0])
                             for b in biases)
        gu = (gu.float() + b13_rows.float()).to(gu.dtype)
    dh_u = grouped_mm(dyg, w2.transpose(1, 2), rows, offs)     # dy @ W2^T, [R, F]
    if gu.is_cuda:
        dgu, h, d_weight = act_backward(gu, dh_u, wg, interleaved=layout == "interleaved",
                                        activation=activation)
    else:
        dgu, h, d_weight = act_backward_torch(gu, dh_u, wg, layout, activation)
    if biases is not None:
        d_weight = d_weight + (dyg.float() * b2_rows.float()).sum(1)
    dxg = grouped_mm(dgu, w13.transpose(1, 2), rows, offs)
    if not weight_grads:
        return dxg, d_weight, None, None, None, None
    d_out = (dyg.float() * wg.unsqueeze(1)).to(xg.dtype)
    dw2 = grouped_weight_grad(h, d_out, offs, rows)
    dw13 = grouped_weight_grad(xg, dgu, offs, rows)
    if biases is None:
        return dxg, d_weight, dw13, dw2, None, None
    return dxg, d_weight, dw13, dw2, _per_expert(dgu, rows), _per_expert(d_out, rows)


def routed_experts_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            group=None, *, layout: str = "interleaved",
                            weight_grads: bool = True, activation: GatedActivation = SILU,
                            biases: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple:
    """Gradients of the routed experts' output (collective over ``group``).

    Args:
        dy: ``[M, H]`` gradient of the output (any float dtype; sent in ``x``'s dtype).
        x: ``[M, H]`` this rank's tokens; topk_ids, topk_weights: ``[M, k]`` (ids outside
            ``[0, E)`` are "no expert" and get a zero weight gradient).
        w13: ``[El, H, 2F]`` this rank's experts, columns in ``layout``; w2: ``[El, F, H]``.
        group: the expert-parallel group (every rank calls this, as in the forward).
        weight_grads: also compute ``dW13`` and ``dW2`` (off for frozen experts; the
            exchanges are the same either way, so ranks may differ in it).
        activation: the experts' gated activation (:mod:`comet.activation`).
        biases: ``(b13 [El, 2F], b2 [El, H])``, the experts' biases (``b13`` columns in
            ``layout``), or None.

    Returns:
        ``(dx [M, H] in x's dtype, d topk_weights [M, k] in their dtype, dW13 like w13,
        dW2 like w2)``, and with ``biases`` also ``(db13 like b13, db2 like b2)``; the
        weight gradients are this rank's experts' own (None without ``weight_grads``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    world, _ = _world(group)
    m, k = topk_ids.shape
    hidden, dtype = x.shape[1], x.dtype
    plan = plan_dispatch(topk_ids, w2.shape[0], group)
    token = torch.div(plan.order, k, rounding_mode="floor")
    pair_rows = torch.cat([x, dy.to(dtype)], dim=1).index_select(0, token)
    pair_weights = topk_weights.reshape(-1).float().index_select(0, plan.order)
    recv = all_to_all_rows(pair_rows, plan.recv_splits, plan.send_splits, world, group)
    recv_w = all_to_all_rows(pair_weights, plan.recv_splits, plan.send_splits, world, group)
    grouped = recv.index_select(0, plan.perm)
    dxg, d_wg, dw13, dw2, db13, db2 = _expert_backward(
        grouped[:, :hidden], grouped[:, hidden:], recv_w.index_select(0, plan.perm), w13, w2,
        plan, layout, weight_grads, activation, biases)
    dx_recv = torch.empty_like(dxg).index_copy_(0, plan.perm, dxg)
    dw_recv = torch.empty_like(d_wg).index_copy_(0, plan.perm, d_wg)
    dx_rows = all_to_all_rows(dx_recv, plan.send_splits, plan.recv_splits, world, group)
    dw_pairs = all_to_all_rows(dw_recv, plan.send_splits, plan.recv_splits, world, group)
    dx = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    dx.index_add_(0, token, dx_rows.float())
    d_weights = torch.zeros(m * k, dtype=torch.float32, device=x.device)
    d_weights.index_copy_(0, plan.order, dw_pairs)
    if weight_grads:
        dw13, dw2 = dw13.to(w13.dtype), dw2.to(w2.dtype)
    out = (dx.to(dtype), d_weights.view(m, k).to(topk_weights.dtype), dw13, dw2)
    if biases is None:
        return out
    if weight_grads:
        db13, db2 = db13.to(biases[0].dtype), db2.to(biases[1].dtype)
    return (*out, db13, db2)
