"""The routed experts of a Megatron MoE layer, run by comet: dispatch, expert GEMMs and
combine in one call.

:class:`CometExperts` is what Megatron's ``MoELayer`` builds in place of its
``SequentialMLP`` / ``GroupedMLP`` / ``TEGroupedMLP`` (the ``experts`` entry of the layer's
submodules). It holds this rank's experts in comet's layout and runs them through a
:class:`comet.CometMoE` over the expert-parallel group Megatron made (its ``pg_collection``):
on CUDA the fused kernels (dispatch inside layer0's GroupGEMM, layer1's epilogue sending
rows home) and their fused backward; on the CPU comet's unfused baseline over the group
(gloo), or the reference on a single rank. It takes tokens and their routing,
``experts(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]``: Megatron's
dispatcher never runs (:class:`~comet.integrations.megatron.layer.CometMoELayer`).

Training the way Megatron trains its own experts:

* the parameters are marked as Megatron's expert linears mark theirs: ``allreduce=False``
  where Megatron reduces expert gradients over the expert-data-parallel group (expert
  parallelism, or an expert-TP size other than the attention's), and the tensor-parallel
  attributes its gradient-norm and checkpoint code read;
* with ``gradient_accumulation_fusion``, the backward adds the expert weight gradients into
  ``param.main_grad`` (Megatron DDP's buffer) itself and hands autograd a dummy gradient,
  flagging ``grad_added_to_main_grad`` as Megatron's linears do; otherwise the gradients
  land in ``param.grad`` and DDP's hooks move them;
* expert tensor parallelism (``expert_tensor_parallel_size > 1``) runs forward only: comet
  has no tensor-parallel backward, so a call that needs gradients raises
  ``NotImplementedError`` (every rank alike, before any exchange).

The checkpoint keys and layout are Megatron's (:mod:`.checkpoint`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from comet.integrations.megatron import checkpoint
from comet.integrations.megatron.support import gated_activation
from comet.moe import CometMoE, LocalExperts


class _RoutedExperts(torch.autograd.Function):
    """comet's routed experts with comet's backward; expert weight gradients go to
    ``main_grad`` when ``fuse`` says so (gradient-accumulation fusion)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w13, w2, topk_ids, moe: CometMoE, fuse: bool):
        ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2)
        ctx.moe, ctx.fuse = moe, fuse
        return moe.eager_experts_forward(x, topk_ids, topk_weights).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
        weight_grads = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dx, d_weights, dw13, dw2 = ctx.moe.experts_backward(
            dy.contiguous(), x, topk_ids, topk_weights, weight_grads)[:4]
        if ctx.fuse and weight_grads:
            dw13, dw2 = _into_main_grad(w13, dw13), _into_main_grad(w2, dw2)
        return dx, d_weights, dw13, dw2, None, None, None


def _into_main_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """Add ``grad`` to ``param.main_grad`` and return what autograd should receive, as
    Megatron's linears do under gradient-accumulation fusion: a dummy gradient (zeros
    where DDP asks for them) that DDP's hook skips, or None without Megatron DDP."""
    param.main_grad.add_(grad)
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    if getattr(param, "zero_out_wgrad", False):
        return torch.zeros_like(param)
    return torch.empty_like(param)


class CometExperts(nn.Module):
    """This rank's routed experts of a Megatron MoE layer, run by comet.

    Built by Megatron's ``MoELayer`` from a spec
    (:func:`~comet.integrations.megatron.specs.get_comet_moe_module_spec`) as its own expert
    modules are: ``CometExperts(num_local_experts, config, pg_collection=...)``.

    Args:
        num_local_experts: ``El``, this rank's experts (``E / ep``).
        config: the ``TransformerConfig``: ``num_moe_experts``, ``moe_router_topk``,
            ``hidden_size``, ``moe_ffn_hidden_size``, ``params_dtype``, the gated activation
            (:func:`~comet.integrations.megatron.support.gated_activation`), the init
            methods and ``gradient_accumulation_fusion``.
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``, ``expt_dp``;
            default: Megatron's global ones).
        name: the module's name (Megatron passes it; unused).
        max_tokens: most tokens one rank passes to one call; sizes comet's workspaces on
            CUDA. None: the largest first call over the expert-parallel group (one
            all-reduce, at that call); a later larger call raises ``ValueError``.
        comm_blocks, tuned_config_folder, fused_backward, tile: :class:`comet.CometMoE`'s.

    Parameters: ``w13 [El, H, 2Ft]`` (gate and up columns interleaved in blocks,
    :mod:`comet.weights`) and ``w2 [El, Ft, H]``, ``Ft = F / expert_tp``. Checkpoints use
    Megatron's keys and layout (:mod:`~comet.integrations.megatron.checkpoint`).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None,
                 name: str | None = None, *, max_tokens: int | None = None,
                 comm_blocks: int | tuple[int, int] | None = None,
                 tuned_config_folder: str | None = None, fused_backward: bool = True,
                 tile=None):
        super().__init__()
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        self.config = config
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        ep, tp = self.ep_group.size(), self.tp_group.size()
        e, ffn = config.num_moe_experts, config.moe_ffn_hidden_size
        if num_local_experts * ep != e:
            raise ValueError(f"{num_local_experts} local experts on each of {ep} "
                             f"expert-parallel ranks is not num_moe_experts={e}")
        if ffn % tp:
            raise ValueError(f"moe_ffn_hidden_size={ffn} does not split over "
                             f"expert_tensor_parallel_size={tp}")
        self.num_local_experts = num_local_experts
        self.max_tokens = max_tokens
        self._settings = dict(
            num_experts=e, top_k=config.moe_router_topk, hidden_size=config.hidden_size,
            intermediate_size=ffn, dtype=config.params_dtype,
            activation=gated_activation(config), comm_blocks=comm_blocks,
            tuned_config_folder=tuned_config_folder, fused_backward=fused_backward,
            tile=tile)
        # A layer that cannot be laid out over these groups fails here, not at a call.
        # The runner is a plain attribute, not a child: its parameters are this module's.
        self.__dict__["_moe"] = self._runner(max_tokens)
        self._moe_params = None

        h = config.hidden_size
        device = ("cpu" if config.use_cpu_initialization
                  else torch.device(torch.cuda.current_device()))
        kw = dict(dtype=config.params_dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(num_local_experts, h, 2 * (ffn // tp), **kw))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, ffn // tp, h, **kw))
        if config.perform_initialization:
            self._initialize(config, ffn // tp)
        self._mark_parameters(config)

    # ------------------------------------------------------------------ construction
    def _runner(self, max_tokens: int | None) -> CometMoE:
        """A :class:`comet.CometMoE` over these groups, built on the meta device and
        without a router (Megatron's routes); its experts are this module's parameters,
        put in at a call (:meth:`_runner_for`)."""
        s = dict(self._settings)
        if max_tokens is not None:
            s["max_tokens"] = max_tokens
        if self.tp_group.size() > 1:
            layout = dict(tp_group=self.tp_group, ep_group=self.ep_group,
                          convention="sequence" if self.config.sequence_parallel
                          else "replicated")
        else:
            layout = dict(group=self.ep_group)
        try:
            moe = CometMoE(device="meta", **layout, **s)
        except ValueError as err:
            raise ValueError(f"comet cannot lay the experts out over Megatron's expert "
                             f"groups (ep={self.ep_group.size()}, "
                             f"expert_tp={self.tp_group.size()}): {err}") from err
        moe._modules.pop("gate")
        return moe

    @torch.no_grad()
    def _initialize(self, config, ffn_shard: int) -> None:
        """Megatron's init methods on each expert's fc1 ``[2Ft, H]`` and fc2 ``[H, Ft]``
        (as its expert linears do), under the expert-parallel RNG where Megatron has one,
        so that expert-parallel ranks draw different experts."""
        el, h = self.num_local_experts, config.hidden_size
        kw = dict(dtype=self.w13.dtype, device=self.w13.device)
        fc1, fc2 = torch.empty(el, 2 * ffn_shard, h, **kw), torch.empty(el, h, ffn_shard, **kw)
        with self._expert_rng():
            for i in range(el):
                config.init_method(fc1[i])
                config.output_layer_init_method(fc2[i])
        self.load_megatron_weights(fc1, fc2)

    def _expert_rng(self):
        if self.w13.device.type != "cuda":
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name)
        tracker, name = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
        if name not in tracker.get_states():
            return contextlib.nullcontext()
        return tracker.fork(name)

    def _mark_parameters(self, config) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        # Megatron reduces an expert linear's gradients over the expert-data-parallel group
        # (allreduce=False) when it uses expert process groups: EP > 1, or an expert-TP
        # size other than the attention's.
        expert_groups = (self.ep_group.size() > 1
                         or self.tp_group.size() != config.tensor_model_parallel_size)
        for param, ffn_dim in ((self.w13, 2), (self.w2, 1)):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=ffn_dim,
                                                 stride=1)
            param.allreduce = not expert_groups

    # ------------------------------------------------------------------ weights
    def megatron_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts as Megatron's per-expert Linear weights: ``(fc1 [El, 2Ft,
        H]`` gate rows then up rows, ``fc2 [El, H, Ft])`` (copies)."""
        return checkpoint.fc1_of(self.w13.detach()), checkpoint.fc2_of(self.w2.detach())

    @torch.no_grad()
    def load_megatron_weights(self, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        """Set this rank's experts from Megatron's per-expert Linear weights (as
        :meth:`megatron_weights` gives them): e.g. ``torch.stack`` of a
        ``SequentialMLP``'s ``local_experts[i].linear_fc1.weight``."""
        w13, w2 = checkpoint.w13_of(fc1), checkpoint.w2_of(fc2)
        if w13.shape != self.w13.shape or w2.shape != self.w2.shape:
            raise ValueError(f"fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)} are not this "
                             f"rank's experts ([El, 2Ft, H] = {list(self.w13.shape[::2])}"
                             f"... and [El, H, Ft])")
        self.w13.copy_(w13)
        self.w2.copy_(w2)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Megatron's distributed-checkpoint entries of these experts: the keys and global
        shapes of its own expert modules (:mod:`~comet.integrations.megatron.checkpoint`)."""
        return checkpoint.experts_sharded_state_dict(
            self.w13, self.w2, prefix=prefix, sharded_offsets=sharded_offsets,
            metadata=metadata, num_experts=self.config.num_moe_experts,
            ep=(self.ep_group.rank(), self.ep_group.size()),
            tp=(self.tp_group.rank(), self.tp_group.size()), dp_rank=self.dp_group.rank())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The extra-state objects are written for Megatron's modules; comet keeps none.
        for key in [k for k in state_dict
                    if k.startswith(prefix) and checkpoint.EXTRA_STATE_KEY.match(k[len(prefix):])]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ forward
    def _runner_for(self, x: torch.Tensor) -> CometMoE:
        """The runner holding the current parameters (built again when they were replaced,
        e.g. by a ``.to()`` that makes new ones), sized on a first CUDA call when
        ``max_tokens`` was not given: the largest token count over the EP group."""
        params = (self.w13, self.w2)
        if self._moe_params is not None and all(
                a is b for a, b in zip(self._moe_params, params)):
            return self._moe
        if x.is_cuda and self.max_tokens is None:
            tokens = torch.tensor([x.shape[0]], device=x.device)
            if self.ep_group.size() > 1:
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.ep_group)
            self.max_tokens = int(tokens.item())
        moe = self._runner(self.max_tokens)
        shell = LocalExperts(moe.cfg, self.num_local_experts, device="meta",
                             ffn_shard=self.w2.shape[1])
        shell.w13, shell.w2 = self.w13, self.w2
        moe._modules["experts"] = shell
        self.__dict__["_moe"], self._moe_params = moe, params
        return moe

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (contiguous, the parameters' dtype), ``topk_ids [T, k]`` (global
        expert ids, -1 for none), ``topk_weights [T, k]`` -> ``[T, H]`` in ``x``'s dtype.
        Collective over the expert-parallel group."""
        if x.dtype != self.w13.dtype:
            raise TypeError(f"comet's experts hold {self.w13.dtype} weights and take "
                            f"{self.w13.dtype} tokens, got {x.dtype}")
        if self.max_tokens is not None and x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens={self.max_tokens}; "
                             "build the layer with a larger max_tokens")
        moe = self._runner_for(x)
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, topk_weights, self.w13, self.w2))
        if not needs_grad:
            with torch.no_grad():
                return moe.eager_experts_forward(x, topk_ids, topk_weights).to(x.dtype)
        if moe.mesh.tp > 1:
            raise NotImplementedError(
                f"comet has no backward for expert tensor parallelism "
                f"(expert_tensor_parallel_size={moe.mesh.tp}): train with "
                "expert_tensor_parallel_size=1 (--expert-tensor-parallel-size 1), or run "
                "this layer under torch.no_grad()")
        fuse = bool(self.config.gradient_accumulation_fusion) and all(
            getattr(p, "main_grad", None) is not None for p in (self.w13, self.w2))
        return _RoutedExperts.apply(x, topk_weights, self.w13, self.w2, topk_ids, moe, fuse)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing to do, comet's backward
        computes the weight gradients with the rest (``delay_wgrad_compute`` is refused)."""

    def extra_repr(self) -> str:
        moe = self._moe
        return (f"{moe.extra_repr()}, max_tokens="
                f"{self.max_tokens if self.max_tokens is not None else 'first call'}")
