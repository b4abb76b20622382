"""The executable specification of a comet MoE layer, in plain torch (CPU or GPU).

Every kernel and every scheduler table in comet is checked against these functions. They
favour clarity over speed: loops over experts and ranks, fp32 arithmetic.

Weight layout (the kernels use the same):
    w13: [E, H, 2F]  -- columns [0, F) are the gate projection, [F, 2F) the up projection
    w2:  [E, F, H]
    expert(x) = (silu(x @ w13[:, :F]) * (x @ w13[:, F:])) @ w2
    (or another gated activation, comet.activation; with expert biases b13 [E, 2F] and
    b2 [E, H]: act((x @ w13 + b13)...) @ w2 + b2)

Expert parallelism: rank r of W owns experts [r*El, (r+1)*El), El = E / W. A token routed
to expert e travels to rank e // El, is multiplied there, and the weighted result travels
back; :func:`ep_forward` states what every rank must return, :func:`ep_receive_order`
states in which order a rank stores the rows it receives (the layer0 shared tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comet.activation import SILU, GatedActivation, gated
from comet.config import MoEConfig
from comet.mesh import CONVENTIONS, Convention, MeshLayout
from comet.quant import Fp8Rows, Fp8Weight, quantize_rows


# --------------------------------------------------------------------------- router
def route(
    logits: torch.Tensor,
    cfg: MoEConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    Args:
        logits: ``[M, E]`` router logits (any float dtype).
        cfg: the layer's config (router kind, grouping, renormalisation, scaling).
        correction_bias: ``[E]`` selection-only bias (DeepSeek-V3), or None.

    Returns:
        ``(topk_weights [M, k] fp32, topk_ids [M, k] int64)``.
    """
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(
            f"router logits must be [tokens, {cfg.num_experts}], got {tuple(logits.shape)}")
    logits = logits.float()
    scores = logits.softmax(dim=-1) if cfg.router == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.n_group > 1:
        m = logits.shape[0]
        grouped = choice.view(m, cfg.n_group, -1)
        if correction_bias is not None:
            # DeepSeek-V3 ranks groups by the sum of their two best biased scores.
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(m, -1)
        # Masked experts get 0.0, as in transformers' DeepSeek-V3, so patched models match.
        choice = choice.masked_fill(expert_mask == 0, 0.0)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return weights, ids


# --------------------------------------------------------------------------- experts
def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               round_to: torch.dtype | None = None, activation: GatedActivation = SILU,
               b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
               ) -> torch.Tensor:
    """One gated MLP: ``[rows, H] -> [rows, H]`` in fp32 (``b13 [2F]``, ``b2 [H]``: the
    expert's biases, or None).

    ``round_to`` rounds the activation ``h`` to that dtype before the second GEMM, as the
    kernels do (they store ``h`` in the model dtype).
    """
    f = w2.shape[0]
    gu = x.float() @ w13.float()
    if b13 is not None:
        gu = gu + b13.float()
    h = gated(gu[:, :f], gu[:, f:], activation)
    if round_to is not None:
        h = h.to(round_to).float()
    y = h @ w2.float()
    return y if b2 is None else y + b2.float()


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_offset: int = 0,
    round_to: torch.dtype | None = None,
    activation: GatedActivation = SILU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed experts that live in ``w13``/``w2``.

    Args:
        x: ``[M, H]`` tokens.
        topk_ids: ``[M, k]`` global expert ids; ``-1`` means "no expert".
        topk_weights: ``[M, k]``.
        w13, w2: ``[n, H, 2F]`` and ``[n, F, H]``, experts ``expert_offset ..
            expert_offset + n - 1``; ids outside that range contribute nothing.

    Returns:
        ``[M, H]`` fp32.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for local in range(w13.shape[0]):
        tok, slot = (topk_ids == expert_offset + local).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_mlp(x[tok], w13[local], w2[local], round_to, activation,
                       None if b13 is None else b13[local], None if b2 is None else b2[local])
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def shared_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               gate: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert block: ``[M, H] -> [M, H]`` fp32, optionally scaled by
    ``sigmoid(x @ gate)`` with ``gate`` of shape ``[H]`` (Qwen2-MoE)."""
    y = expert_mlp(x, w13, w2)
    if gate is not None:
        y = y * torch.sigmoid(x.float() @ gate.float()).unsqueeze(1)
    return y


# --------------------------------------------------------------------------- expert parallel
def ring_order(rank: int, world_size: int) -> list[int]:
    """Source ranks in the order a rank stores (and waits for) them: own rank first."""
    return [(rank + o) % world_size for o in range(world_size)]


@dataclass
class ReceivedRows:
    """What rank ``rank`` holds in its layer0 shared tensor, in storage order.

    Rows are grouped by local expert; inside an expert by source rank in ring order
    (:func:`ring_order`); inside a source by (token, slot) ascending. Each row is one
    (token, top-k slot) pair routed to an expert of this rank.
    """

    expert: torch.Tensor   # [rows] local expert id
    source: torch.Tensor   # [rows] source rank
    token: torch.Tensor    # [rows] token index on the source rank
    slot: torch.Tensor     # [rows] top-k slot on the source rank


def ep_receive_order(topk_ids: list[torch.Tensor], rank: int, local_experts: int) -> ReceivedRows:
    """The row order of ``rank``'s layer0 shared tensor, given every rank's ``topk_ids``."""
    world = len(topk_ids)
    cols: dict[str, list[int]] = {"expert": [], "source": [], "token": [], "slot": []}
    for le in range(local_experts):
        e = rank * local_experts + le
        for src in ring_order(rank, world):
            tok, slot = (topk_ids[src].cpu() == e).nonzero(as_tuple=True)
            order = torch.argsort(tok * topk_ids[src].shape[1] + slot)
            for t, s in zip(tok[order].tolist(), slot[order].tolist()):
                cols["expert"].append(le)
                cols["source"].append(src)
                cols["token"].append(t)
                cols["slot"].append(s)
    return ReceivedRows(**{k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()})


def ep_forward(
    xs: list[torch.Tensor],
    topk_ids: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    w13_shards: list[torch.Tensor],
    w2_shards: list[torch.Tensor],
    round_to: torch.dtype | None = None,
    activation: GatedActivation = SILU,
    b13_shards: list[torch.Tensor] | None = None,
    b2_shards: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """What each of W ranks returns from the routed experts (fp32 ``[M_r, H]`` each).

    ``xs[r]``, ``topk_ids[r]``, ``topk_weights[r]`` are rank r's tokens and routing;
    ``w13_shards[r]``/``w2_shards[r]`` its experts. Equivalent to every rank running
    :func:`moe_forward` over all experts, which is exactly the point.
    """
    world = len(xs)
    el = w13_shards[0].shape[0]
    outs = []
    for r in range(world):
        y = torch.zeros(xs[r].shape[0], xs[r].shape[1], dtype=torch.float32, device=xs[r].device)
        for d in range(world):
            y += moe_forward(xs[r], topk_ids[r], topk_weights[r], w13_shards[d], w2_shards[d],
                             expert_offset=d * el, round_to=round_to, activation=activation,
                             b13=None if b13_shards is None else b13_shards[d],
                             b2=None if b2_shards is None else b2_shards[d])
        outs.append(y)
    return outs


# --------------------------------------------------------------------------- tensor parallel
def mesh_forward(
    xs: list[torch.Tensor],
    topk_ids: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    mesh: MeshLayout,
    convention: Convention = "sequence",
    round_to: torch.dtype | None = None,
    activation: GatedActivation = SILU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """What each rank of a (tp, ep) layout (:class:`comet.mesh.MeshLayout`) returns: the
    full routed-expert output of its own tokens (fp32 ``[M_r, H]``), composed as the
    layout composes it -- every rank's shard (its experts, its F columns) adds its partial
    sum for every token routed to its experts.

    ``xs[r]``, ``topk_ids[r]``, ``topk_weights[r]``: rank r's tokens and routing; with the
    ``"replicated"`` convention the ranks of a TP group must pass the same ones
    (ValueError otherwise). ``w13 [E, H, 2F]`` (gate then up), ``w2 [E, F, H]`` and the
    biases are the full layer's. Equal to :func:`moe_forward` over the full weights for
    every rank: which is the point.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if not len(xs) == len(topk_ids) == len(topk_weights) == mesh.world:
        raise ValueError(f"a {mesh} layout has {mesh.world} ranks; got {len(xs)} inputs")
    if convention == "replicated":
        for r in range(mesh.world):
            first = mesh.token_source(r, convention)
            if not all(torch.equal(a[r], a[first]) for a in (xs, topk_ids, topk_weights)):
                raise ValueError(f"replicated convention: rank {r} passes other tokens than "
                                 f"rank {first} of its TP group")
    shards = [mesh.shard(s, w13, w2, b13, b2) for s in range(mesh.world)]
    outs = []
    for r in range(mesh.world):
        y = torch.zeros(xs[r].shape[0], xs[r].shape[1], dtype=torch.float32,
                        device=xs[r].device)
        for s, sh in enumerate(shards):
            y += moe_forward(xs[r], topk_ids[r], topk_weights[r], sh["w13"], sh["w2"],
                             expert_offset=mesh.expert_range(w13.shape[0], s).start,
                             round_to=round_to, activation=activation, b13=sh["b13"],
                             b2=sh["b2"])
        outs.append(y)
    return outs


# --------------------------------------------------------------------------- FP8 experts
def expert_mlp_fp8(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, expert: int,
                   activation: GatedActivation = SILU) -> torch.Tensor:
    """One expert in W8A8 FP8 (:mod:`comet.quant`), emulated in fp32: ``[rows, H] ->
    [rows, H]``. What the FP8 kernels compute, step by step: ``x`` quantized per row in
    groups of 128; the block-scaled layer0 GEMM against ``gate_up [E, 2F, H]`` (gate rows
    then up rows); the gated activation; ``h`` quantized per row in groups of 128; the
    block-scaled layer1 GEMM against ``down [E, H, F]``. Products of dequantized values,
    summed in fp32 -- the kernels sum each 128-wide K block's exact FP8 products first,
    then scale it: the same sum up to fp32 rounding."""
    f = down.k
    if gate_up.n != 2 * f or gate_up.k != x.shape[1] or down.n != x.shape[1]:
        raise ValueError(f"FP8 experts: gate_up {list(gate_up.weight.shape)} and down "
                         f"{list(down.weight.shape)} do not make an MLP of H = {x.shape[1]}")
    xq = quantize_rows(x).dequantize()
    gu = xq @ gate_up.dequantize()[expert].T
    h = gated(gu[:, :f], gu[:, f:], activation)
    return quantize_rows(h).dequantize() @ down.dequantize()[expert].T


def moe_forward_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up: Fp8Weight, down: Fp8Weight, expert_offset: int = 0,
                    activation: GatedActivation = SILU) -> torch.Tensor:
    """:func:`moe_forward` with FP8 experts (:func:`expert_mlp_fp8`): ``[M, H]`` fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for local in range(gate_up.experts):
        tok, slot = (topk_ids == expert_offset + local).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_mlp_fp8(x[tok], gate_up, down, local, activation)
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def grouped_gemm_fp8(a: Fp8Rows, w: Fp8Weight, expert_rows: list[int]) -> torch.Tensor:
    """One block-scaled FP8 grouped GEMM emulated in fp32: ``a``'s rows grouped by expert
    (``expert_rows[e]`` rows of expert ``e`` after those of ``e - 1``) times ``w [E, N, K]``
    transposed, each expert dequantized alone (a preset's fp32 experts would not fit):
    ``[R, N]`` fp32, the products of dequantized values summed in fp32."""
    if len(expert_rows) != w.experts or sum(expert_rows) != a.data.shape[0]:
        raise ValueError(f"{list(expert_rows)} rows per expert for {a.data.shape[0]} rows and "
                         f"{w.experts} experts")
    x = a.dequantize()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(expert_rows):
        if n:
            we = Fp8Weight(w.weight[e:e + 1], w.scale_inv[e:e + 1], w.blocks, w.parts)
            out[start:start + n] = x[start:start + n] @ we.dequantize()[0].T
        start += n
    return out
