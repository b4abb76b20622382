"""The unfused expert-parallel MoE pipeline: what comet's speedups are measured against.

One call on rank ``r`` of ``W`` (every step a separate torch op, as in the MoE layers of
Megatron, Tutel or a plain vLLM EP setup)::

    sort (token, slot) pairs by expert -> all_to_all of the per-expert counts
    -> host sync for the split sizes -> all_to_all dispatch of the pair rows
    -> permute the received rows so each local expert's rows are contiguous
    -> grouped GEMM with W13 -> SiLU(gate) * up -> grouped GEMM with W2
    -> un-permute -> all_to_all combine -> weighted top-k reduce

It is written as a careful torch user writes it: the grouped GEMM is torch's own
(``torch._grouped_mm``, CUTLASS on Hopper) wherever it runs, the gated activation is one
fused pass on a GPU (:mod:`comet.kernels.act_forward`; torch's ops on the CPU), the
exchange is NCCL's ``all_to_all_single``, and nothing is done twice. The host sync for the split sizes is inherent to this design (NCCL needs them on
the host) and is part of what the fused layer removes.

:func:`chunked_ep_moe_forward` is the coarse-grained pipelined variant (Tutel/FasterMoE):
the tokens go in 2-4 chunks and the all_to_all of one chunk runs on a second stream while
another chunk computes.

Both run on the CPU over gloo (and with no process group at all for a single rank) and
return what :func:`comet.reference.ep_forward` specifies.

:func:`mesh_moe_forward` is the unfused layer of a (tp, ep) layout (:mod:`comet.mesh`):
all_gather of the TP group's tokens, the expert-parallel pipeline on this rank's F shard,
and the partial sums reduce-scattered (or, with replicated inputs, all-reduced) over the
TP group -- :func:`comet.reference.mesh_forward`'s answer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comet.activation import SILU, GatedActivation, gated
from comet.grouped import grouped_mm
from comet.kernels.act_forward import gated_rows
from comet.mesh import CONVENTIONS, Convention, MeshLayout

__all__ = ["DispatchPlan", "plan_dispatch", "all_to_all_rows", "ep_moe_forward",
           "chunked_ep_moe_forward", "MeshGroups", "mesh_moe_forward"]


#: What each unfused pipeline runs, in words: ``comet bench`` writes the ones it times into
#: its results' metadata (``baselines``), so a column's baseline is never guessed.
BASELINE_NOTES = {
    "baseline": "comet.baseline.ep_moe_forward: expert sort, count all_to_all and one host "
                "sync for NCCL's split sizes, all_to_all_single dispatch, torch._grouped_mm, "
                "one fused Triton activation pass, torch._grouped_mm, all_to_all_single "
                "combine, weighted top-k sum (fp32 accumulation)",
    "chunked": "comet.baseline.chunked_ep_moe_forward: the same in 2-4 token chunks, each "
               "chunk's all_to_alls on a side stream while another chunk computes",
    "mesh": "comet.baseline.mesh_moe_forward: NCCL all_gather of the TP group's tokens "
            "(sequence convention), the expert pipeline on this rank's F shard "
            "(torch._grouped_mm, one fused Triton activation pass), partial sums "
            "reduce-scattered (sequence) or all-reduced (replicated) in the model dtype",
}


def _world(group) -> tuple[int, int]:
    """(world size, rank) of ``group``; a single rank when torch.distributed is not set up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise ValueError("a process group was passed but torch.distributed is not initialised")
    return 1, 0


def _phase(timer, name: str):
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


# --------------------------------------------------------------------------- routing plan
@dataclass
class DispatchPlan:
    """Where this rank's (token, slot) pairs go and what it receives (one chunk of tokens).

    order:        ``[P]`` flat pair indices ``token * k + slot`` of the valid pairs, sorted
                  by global expert (so by destination rank), ``(token, slot)`` ascending
                  inside an expert. Row ``i`` of the dispatch buffer is pair ``order[i]``.
    send_splits:  rows sent to each rank (host ints, ``[W]``).
    recv_splits:  rows received from each rank (host ints, ``[W]``).
    expert_rows:  received rows per local expert (host ints, ``[El]``).
    offs:         ``[El]`` int32 end offsets of the experts' row groups (device), the
                  ``offs`` argument of ``torch._grouped_mm``.
    perm:         ``[R]`` received-row index of each expert-grouped row: grouped rows are
                  ``recv[perm]``; rows are ordered by (local expert, source rank, token, slot).
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    expert_rows: list[int]
    offs: torch.Tensor
    perm: torch.Tensor

    @property
    def rows(self) -> int:
        """R, rows this rank's experts process."""
        return sum(self.recv_splits)


def _sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [M*k], counts [E])``: pairs sorted by expert, invalid ids (``-1``) last."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    # Not torch.bincount: on CUDA it reads the input's max on the host (a second sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order, counts[:num_experts]


def _exchange_counts(send: torch.Tensor, world: int, group) -> torch.Tensor:
    """``send [W, n]`` int64 (row ``d`` for destination ``d``) -> ``[W, n]`` (row ``s``
    from source ``s``)."""
    if world == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def _build_plan(order: torch.Tensor, send_counts: list[list[int]], recv_counts: list[list[int]],
                recv_dev: torch.Tensor) -> DispatchPlan:
    """Plan from the host copies of ``send_counts [W, El]`` and ``recv_counts [W, El]``
    (``recv_dev``: the same received counts, still on the device)."""
    world, el = len(recv_counts), len(recv_counts[0])
    send_splits = [sum(c) for c in send_counts]
    recv_splits = [sum(c) for c in recv_counts]
    expert_rows = [sum(recv_counts[s][e] for s in range(world)) for e in range(el)]
    dev = recv_dev.device
    # Received rows come as (source, expert) blocks; a stable sort by expert keeps the
    # (source, token, slot) order inside each expert, which keeps the result deterministic.
    label = torch.arange(el, device=dev).repeat(world).repeat_interleave(
        recv_dev.reshape(-1), output_size=sum(recv_splits))
    perm = torch.sort(label, stable=True).indices
    offs = recv_dev.sum(dim=0).cumsum(0).to(torch.int32)
    return DispatchPlan(order[:sum(send_splits)], send_splits, recv_splits, expert_rows,
                        offs, perm)


def plan_dispatch(topk_ids: torch.Tensor, local_experts: int, group=None) -> DispatchPlan:
    """Exchange the per-expert counts of ``topk_ids [M, k]`` and plan the dispatch.

    Collective over ``group``; one host sync (the split sizes). ``-1`` ids are dropped.
    """
    world, _ = _world(group)
    order, counts = _sort_pairs(topk_ids, world * local_experts)
    send = counts.view(world, local_experts)
    recv = _exchange_counts(send, world, group)
    host = torch.stack([send, recv]).tolist()   # the host sync NCCL's split sizes need
    return _build_plan(order, host[0], host[1], recv)


def _activate(gu: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """``h [R, F] = act(gate) * up`` of ``gu [R, 2F]`` in ``gu``'s dtype: one Triton pass on a
    GPU (:func:`comet.kernels.act_forward.gated_rows`, the fused activation a careful torch
    user runs), torch's ops elsewhere -- and wherever autograd records ``gu``, which the
    Triton pass would cut off from the gradients (a training step's reference)."""
    if gu.is_cuda and not (gu.requires_grad and torch.is_grad_enabled()):
        return gated_rows(gu, activation)
    f = gu.shape[1] // 2
    if activation.is_default:
        return torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    return gated(gu[:, :f], gu[:, f:], activation).to(gu.dtype)


def _experts(rows: torch.Tensor, plan: DispatchPlan, w13: torch.Tensor, w2: torch.Tensor,
             timer=None, activation: GatedActivation = SILU, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None) -> torch.Tensor:
    """Received rows ``[R, H]`` (source order) -> expert outputs ``[R, H]`` (source order)."""
    with _phase(timer, "permute"):
        grouped = rows.index_select(0, plan.perm)
    with _phase(timer, "gemm0"):
        gu = grouped_mm(grouped, w13, plan.expert_rows, plan.offs)
    if b13 is not None or b2 is not None:
        counts = torch.tensor(plan.expert_rows, device=rows.device)
    if b13 is not None:
        gu = gu + b13.repeat_interleave(counts, dim=0, output_size=plan.rows)
    with _phase(timer, "act"):
        h = _activate(gu, activation)
    with _phase(timer, "gemm1"):
        out = grouped_mm(h, w2, plan.expert_rows, plan.offs)
    if b2 is not None:
        out = out + b2.repeat_interleave(counts, dim=0, output_size=plan.rows)
    with _phase(timer, "unpermute"):
        return torch.empty_like(out).index_copy_(0, plan.perm, out)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], world: int,
                    group) -> torch.Tensor:
    """NCCL/gloo ``all_to_all_single`` of the rows (dim 0) of ``x``: ``in_splits[d]`` rows
    go to rank ``d``, ``out_splits[s]`` come from rank ``s``; ``x`` itself with one rank."""
    if world == 1:
        return x
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _topk_reduce(back: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                 computed: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs of the pairs in ``order`` -> ``[M, H]`` fp32 weighted sums.

    The pair rows go back to their (token, slot) places (dropped slots stay zero) and one
    batched ``[1, k] @ [k, H]`` product per token sums them, in the model dtype with fp32
    accumulation, as vLLM's moe_sum does: no fp32 copy of the rows (at 16384 tokens/rank
    and TP=4, top-8, that copy alone was 14 GiB). ``computed``: a device scalar, when
    rows from it on were never computed (pairs of no expert sorted last): their places
    go to a spare row, dropped, so no uninitialised value reaches a sum.
    """
    m, k = topk_weights.shape
    h = back.shape[1]
    if computed is not None:
        order = order.masked_fill(torch.arange(order.numel(), device=order.device) >= computed,
                                  m * k)
    buf = back.new_zeros(m * k + 1, h).index_copy_(0, order, back)
    w = topk_weights.to(back.dtype).view(m, 1, k)
    return torch.bmm(w, buf[:m * k].view(m, k, h)).view(m, h).float()


# --------------------------------------------------------------------------- pipelines
def ep_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13_local: torch.Tensor, w2_local: torch.Tensor, group=None, *,
                   timer=None, activation: GatedActivation = SILU,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The unfused expert-parallel MoE layer on this rank (collective over ``group``).

    Args:
        x: ``[M, H]`` this rank's tokens (``M`` may be 0 and may differ between ranks).
        topk_ids: ``[M, k]`` global expert ids (``-1``: no expert).
        topk_weights: ``[M, k]`` routing weights.
        w13_local: ``[El, H, 2F]`` this rank's experts ``[r * El, (r + 1) * El)``.
        w2_local: ``[El, F, H]``.
        group: expert-parallel process group (default: the world if torch.distributed is
            initialised, else a single rank).
        timer: optional object with a ``phase(name)`` context manager (e.g.
            :class:`comet.bench.timing.PhaseClock`); phases recorded: ``route``,
            ``counts`` (count exchange + host sync), ``gather`` (pair rows in send order),
            ``dispatch``, ``permute``, ``gemm0``, ``act``, ``gemm1``, ``unpermute``,
            ``combine``, ``reduce``.
        activation: the experts' gated activation (:mod:`comet.activation`).
        b13, b2: ``[El, 2F]`` (gate-then-up) and ``[El, H]`` expert biases, or None.

    Returns:
        ``[M, H]`` fp32 routed-expert output.
    """
    world, _ = _world(group)
    el = w13_local.shape[0]
    with _phase(timer, "route"):
        order, counts = _sort_pairs(topk_ids, world * el)
    with _phase(timer, "counts"):
        send = counts.view(world, el)
        recv = _exchange_counts(send, world, group)
        host = torch.stack([send, recv]).tolist()
        plan = _build_plan(order, host[0], host[1], recv)
    k = topk_ids.shape[1]
    with _phase(timer, "gather"):
        rows = x.index_select(0, torch.div(plan.order, k, rounding_mode="floor"))
    with _phase(timer, "dispatch"):
        recv_rows = all_to_all_rows(rows, plan.recv_splits, plan.send_splits, world, group)
    out = _experts(recv_rows, plan, w13_local, w2_local, timer, activation, b13, b2)
    with _phase(timer, "combine"):
        back = all_to_all_rows(out, plan.send_splits, plan.recv_splits, world, group)
    with _phase(timer, "reduce"):
        return _topk_reduce(back, plan.order, topk_weights)


def chunked_ep_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, w13_local: torch.Tensor,
                           w2_local: torch.Tensor, group=None, *, chunks: int = 2
                           ) -> torch.Tensor:
    """Coarse-grained pipelined EP MoE (Tutel/FasterMoE): same arguments and result as
    :func:`ep_moe_forward`.

    The tokens are split into ``chunks`` contiguous chunks (the same count on every rank;
    a chunk may be empty). One all_to_all exchanges every chunk's counts (one host sync);
    then on CUDA the dispatch of chunk ``i + 1`` and the combine of chunk ``i - 1`` run on a
    second stream while chunk ``i`` computes. On the CPU the same steps run in order.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    world, _ = _world(group)
    el = w13_local.shape[0]
    m, k = topk_ids.shape
    bounds = [m * c // chunks for c in range(chunks + 1)]
    sorted_pairs = [_sort_pairs(topk_ids[bounds[c]:bounds[c + 1]], world * el)
                    for c in range(chunks)]
    send = torch.stack([cnt.view(world, el) for _, cnt in sorted_pairs], dim=1)  # [W, C, El]
    recv = _exchange_counts(send.reshape(world, -1), world, group).view(world, chunks, el)
    host = torch.stack([send, recv]).tolist()
    plans = [_build_plan(sorted_pairs[c][0], [row[c] for row in host[0]],
                         [row[c] for row in host[1]], recv[:, c]) for c in range(chunks)]
    # Every chunk's rows are gathered up front so the side stream never waits for compute
    # to issue a dispatch.
    rows = [x[bounds[c]:bounds[c + 1]].index_select(
        0, torch.div(plans[c].order, k, rounding_mode="floor")) for c in range(chunks)]
    if world == 1:
        # Nothing to exchange: the pipeline degenerates to the plain layer per chunk.
        backs = [_experts(rows[c], plans[c], w13_local, w2_local) for c in range(chunks)]
    elif x.is_cuda:
        backs = _overlapped(rows, plans, w13_local, w2_local, group)
    else:
        backs = []
        for c, p in enumerate(plans):
            recv_rows = all_to_all_rows(rows[c], p.recv_splits, p.send_splits, world, group)
            out = _experts(recv_rows, p, w13_local, w2_local)
            backs.append(all_to_all_rows(out, p.send_splits, p.recv_splits, world, group))
    y = torch.empty(m, x.shape[1], dtype=torch.float32, device=x.device)
    for c in range(chunks):
        y[bounds[c]:bounds[c + 1]] = _topk_reduce(backs[c], plans[c].order,
                                                  topk_weights[bounds[c]:bounds[c + 1]])
    return y


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _overlapped(rows: list[torch.Tensor], plans: list[DispatchPlan], w13: torch.Tensor,
                w2: torch.Tensor, group) -> list[torch.Tensor]:
    """CUDA schedule of :func:`chunked_ep_moe_forward`: the all_to_alls run on a side
    stream in the order D0 D1 C0 D2 C1 ... (D: dispatch, C: combine), each chunk's compute
    on the main stream between its dispatch and its combine."""
    device = rows[0].device
    main = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(main)      # the gathered rows

    def a2a(inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        out = inp.new_empty(sum(out_splits), inp.shape[1])
        # Made on the main stream, used on the side one: the caching allocator must not
        # hand these blocks out again before the side stream is done with them.
        inp.record_stream(side)
        out.record_stream(side)
        with torch.cuda.stream(side):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
            done = torch.cuda.Event()
            done.record(side)
        return out, done

    received = [a2a(rows[0], plans[0].recv_splits, plans[0].send_splits)]
    backs = []
    for c, p in enumerate(plans):
        if c + 1 < len(plans):
            q = plans[c + 1]
            received.append(a2a(rows[c + 1], q.recv_splits, q.send_splits))
        recv_rows, arrived = received[c]
        main.wait_event(arrived)
        out = _experts(recv_rows, p, w13, w2)
        computed = torch.cuda.Event()
        computed.record(main)
        side.wait_event(computed)
        backs.append(a2a(out, p.send_splits, p.recv_splits)[0])
    main.wait_stream(side)
    return backs


# --------------------------------------------------------------------------- tensor parallel
@dataclass
class MeshGroups:
    """This rank's process groups of a (tp, ep) layout (:class:`comet.mesh.MeshLayout`):
    ``tp``, the ranks sharing its experts; ``ep``, the ranks holding its F shard."""

    mesh: MeshLayout
    tp: object
    ep: object

    @classmethod
    def new(cls, mesh: MeshLayout) -> "MeshGroups":
        """Every TP and EP group of ``mesh`` (collective: every rank of the world calls
        it, as ``dist.new_group`` must be); returns this rank's."""
        rank = dist.get_rank()
        mine = {}
        for kind, groups in (("tp", [mesh.tp_group(mesh.rank(e, 0)) for e in range(mesh.ep)]),
                             ("ep", [mesh.ep_group(t) for t in range(mesh.tp)])):
            for ranks in groups:
                g = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = g
        return cls(mesh, mine["tp"], mine["ep"])


def _token_counts(x: torch.Tensor, group) -> list[int]:
    """Every group rank's row count of ``x`` (an all_gather on ``x``'s device: NCCL
    takes no host tensors; then a host sync)."""
    world = dist.get_world_size(group)
    counts = torch.zeros(world, dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(counts, torch.tensor([x.shape[0]], device=x.device),
                                group=group)
    return counts.tolist()


def _gather_rows(x: torch.Tensor, group, sizes: list[int] | None = None
                 ) -> tuple[torch.Tensor, list[int]]:
    """Every group rank's rows of ``x``, concatenated in group order (``sizes``: each
    rank's count, exchanged first when not given; rows padded to the largest)."""
    world = dist.get_world_size(group)
    sizes = _token_counts(x, group) if sizes is None else list(sizes)
    if len(set(sizes)) == 1:
        out = x.new_empty(world * sizes[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out, sizes
    pad = x.new_zeros(max(sizes), *x.shape[1:])
    pad[:x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]), sizes


def tp_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   shard: dict, tp_group, convention: Convention = "sequence", *,
                   timer=None, activation: GatedActivation = SILU,
                   token_counts: list[int] | None = None) -> torch.Tensor:
    """The unfused tensor-parallel MoE layer (``ep == 1``: every rank holds an F shard
    of every expert) as a careful torch user writes it: no host sync when the TP ranks'
    token counts are known (``token_counts``, as under Megatron's sequence parallelism,
    where they are equal; else they are exchanged), every step one torch op or NCCL
    collective. Collective over ``tp_group``; returns this rank's tokens' outputs, fp32
    ``[M, H]``.

    ``"sequence"``: all_gather of the TP group's tokens (``gather``), then on all of
    them: sort the (token, slot) pairs by expert (``route``), gather their rows
    (``permute``), grouped GEMM with W13 (``gemm0``), the gated activation (``act``),
    grouped GEMM with W2 (``gemm1``), the weighted sum of each token's rows (``unpermute``,
    as :func:`ep_moe_forward`'s: fp32 accumulation), and the partial sums reduce-scattered
    in the model dtype (``reduce``; all_reduce where the backend has no reduce_scatter,
    e.g. gloo).
    ``"replicated"``: no gather; the partial sums are all-reduced. ``shard``: this rank's
    part (:meth:`comet.mesh.MeshLayout.shard`); ``timer`` as for :func:`ep_moe_forward`.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    with _phase(timer, "gather"):
        x, topk_ids, topk_weights, sizes = _gather_tokens(x, topk_ids, topk_weights, tp_group,
                                                          convention, token_counts)
    w13, w2 = shard["w13"], shard["w2"]
    el, k = w13.shape[0], topk_ids.shape[1]
    with _phase(timer, "route"):
        order, counts = _sort_pairs(topk_ids, el)
        offs = torch.cumsum(counts, 0).to(torch.int32)
    with _phase(timer, "permute"):
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    with _phase(timer, "gemm0"):
        gu = grouped_mm(rows, w13, None, offs)
    if shard.get("b13") is not None:
        gu = gu + _per_row(shard["b13"], counts, gu.shape[0])
    with _phase(timer, "act"):
        h = _activate(gu, activation)
    with _phase(timer, "gemm1"):
        out = grouped_mm(h, w2, None, offs)
    if shard.get("b2") is not None:
        out = out + _per_row(shard["b2"], counts, out.shape[0])
    with _phase(timer, "unpermute"):
        y = _topk_reduce(out, order, topk_weights, computed=offs[-1]).to(x.dtype)
    with _phase(timer, "reduce"):
        return _tp_sum(y, sizes, tp_group, convention)


def _gather_tokens(x, topk_ids, topk_weights, tp_group, convention: Convention,
                   token_counts: list[int] | None):
    """``(x, topk_ids, topk_weights, sizes)`` of the TP group's tokens: all_gathered
    under ``"sequence"`` (``sizes``: each rank's count), this rank's own otherwise."""
    if convention != "sequence" or _world(tp_group)[0] == 1:
        return x, topk_ids, topk_weights, [x.shape[0]]
    x, sizes = _gather_rows(x, tp_group, token_counts)
    topk_ids, _ = _gather_rows(topk_ids, tp_group, sizes)
    topk_weights, _ = _gather_rows(topk_weights, tp_group, sizes)
    return x, topk_ids, topk_weights, sizes


def _tp_sum(y: torch.Tensor, sizes: list[int], tp_group, convention: Convention
            ) -> torch.Tensor:
    """The TP group's sum of the partial outputs ``y`` (model dtype, the rows of
    :func:`_gather_tokens`), fp32: this rank's rows of it (reduce_scatter, under
    ``"sequence"``) or all of them (all_reduce, under ``"replicated"``)."""
    tp, rank = _world(tp_group)
    if tp == 1:
        return y.float()
    if convention == "replicated":
        dist.all_reduce(y, group=tp_group)
        return y.float()
    return _reduce_scatter_rows(y, sizes, rank, tp_group).float()


def _per_row(bias: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``bias [El, N]`` repeated for each expert's rows (``counts [El]``, device), and
    zeros for the rows of pairs of no expert after them (``rows`` in all)."""
    bias = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    counts = torch.cat([counts, (rows - counts.sum()).view(1)])
    return bias.repeat_interleave(counts, dim=0, output_size=rows)


def _reduce_scatter_rows(y: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """The sum over the group of ``y`` (every rank's rows, ``sizes`` each, in group
    order), of which this rank keeps its own rows: reduce_scatter on NCCL (padded to the
    largest count), all_reduce on backends without it (gloo)."""
    start = sum(sizes[:rank])
    if dist.get_backend(group) != "nccl":
        dist.all_reduce(y, group=group)
        return y[start:start + sizes[rank]]
    rows = max(sizes)
    if len(set(sizes)) == 1:
        padded = y
    else:
        padded = y.new_zeros(len(sizes) * rows, y.shape[1])
        for i, (s, n) in enumerate(zip(torch.tensor([0] + sizes).cumsum(0).tolist(), sizes)):
            padded[i * rows:i * rows + n] = y[s:s + n]
    out = y.new_empty(rows, y.shape[1])
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[rank]]


def mesh_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     shard: dict, groups: MeshGroups, convention: Convention = "sequence",
                     activation: GatedActivation = SILU, *, timer=None,
                     token_counts: list[int] | None = None) -> torch.Tensor:
    """The unfused MoE layer of a (tp, ep) layout on this rank (collective over the
    world): the answer of :func:`comet.reference.mesh_forward` for its tokens.

    ``shard``: this rank's part of the experts (:meth:`comet.mesh.MeshLayout.shard`:
    ``w13 [El, H, 2F/tp]`` gate then up, ``w2 [El, F/tp, H]``, ``b13``, ``b2``).

    ``"sequence"``: all_gather of the TP group's tokens, the expert-parallel pipeline
    (:func:`ep_moe_forward`) over the EP group on this F shard -- partial sums of every
    TP-group token --, then their sum over the TP group, of which this rank keeps its own
    rows (reduce_scatter on NCCL; all_reduce elsewhere, e.g. gloo, which has no
    reduce_scatter). ``"replicated"``: the TP group's tokens are already the same on every
    rank; the partial sums are all-reduced.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    variant = dict(activation=activation, b13=shard.get("b13"), b2=shard.get("b2"))
    if groups.mesh.ep == 1:
        return tp_moe_forward(x, topk_ids, topk_weights, shard, groups.tp, convention,
                              timer=timer, activation=activation, token_counts=token_counts)
    with _phase(timer, "gather"):
        xs, ids, wts, sizes = _gather_tokens(x, topk_ids, topk_weights, groups.tp,
                                             convention, token_counts)
    y = ep_moe_forward(xs, ids, wts, shard["w13"], shard["w2"], groups.ep, timer=timer,
                       **variant)
    with _phase(timer, "reduce"):
        return _tp_sum(y.to(x.dtype), sizes, groups.tp, convention)
