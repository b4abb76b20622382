"""Which Megatron-Core MoE settings comet runs, and the experts' function they describe.

comet replaces the token dispatcher, the experts and the combine of a Megatron ``MoELayer``
(:class:`~comet.integrations.megatron.layer.CometMoELayer`); the router, the shared experts
and everything around the layer stay Megatron's. A ``TransformerConfig`` setting therefore
falls in one of three groups:

* **honoured** -- the router's settings (top-k, score functions, group-limited routing,
  aux / seq / global aux losses, z-loss, expert bias and aux-loss-free balancing, input
  jitter, capacity factor and drop policy, padding to capacity, router dtype, routing
  replay), shared experts and their gate, selective recompute of the MoE layer or of the
  shared experts, sequence parallelism, and the experts' gated activation
  (:func:`gated_activation`);
* **no-ops** -- settings of the implementation comet replaces: the dispatcher type
  (``allgather`` or ``alltoall``: neither runs), permute fusion, grouped GEMM backends,
  ``moe_act`` recompute and activation offloading of the experts (comet's backward
  recomputes the experts' activations from the layer's input anyway);
* **refused** (:func:`refusals`) -- settings whose function comet does not compute
  (non-gated or erf-GELU experts, expert biases, latent projections, probabilities applied
  on the input, padding the routing map for quantized GEMMs, FP8/FP4 experts) or whose
  schedule assumes Megatron's dispatcher (its EP-overlap and shared-expert-overlap flags,
  delayed weight gradients, CUDA graphs of the MoE layer, the flex dispatcher, the
  inference-optimized layer). comet overlaps the expert-parallel exchange inside its own
  kernels: those flags have nothing left to schedule.

Expert tensor parallelism (``expert_tensor_parallel_size > 1``) runs forward only: a call
that needs gradients raises (:class:`~comet.integrations.megatron.experts.CometExperts`).
"""

from __future__ import annotations

import torch

from comet.activation import GatedActivation, gated

#: The activations of the gate half comet's kernels compute (kind, sigmoid slope), and how
#: Megatron names them: ``F.silu`` (SwiGLU), ``quick_gelu`` (x * sigmoid(1.702 x)) and the
#: tanh form of GELU (``fast_gelu``, ``F.gelu(approximate="tanh")``).
_KNOWN = {
    "silu": GatedActivation(kind="silu"),
    "quick_gelu": GatedActivation(kind="silu", alpha=1.702),
    "gelu_tanh": GatedActivation(kind="gelu_tanh"),
}


def _probe_activation(fn) -> GatedActivation | None:
    """The kind of :data:`_KNOWN` that ``fn`` computes on values from -20 to 20 (None for
    another function, e.g. the exact erf GELU, or one that cannot be probed)."""
    probe = torch.linspace(-20.0, 20.0, 401, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = fn(probe)
    except Exception:  # noqa: BLE001 - a function we cannot probe is one we do not run
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    for act in _KNOWN.values():
        want = gated(probe, torch.ones_like(probe), act).double()
        if torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6):
            return act
    return None


def gated_activation(config) -> GatedActivation:
    """The experts' gated activation of a ``TransformerConfig`` as comet's
    :class:`~comet.activation.GatedActivation`: Megatron's GLU computes
    ``act(min(g, c)) * (clamp(u, -c, c) + offset)`` with ``act`` its ``activation_func``,
    ``c`` its ``activation_func_clamp_value`` and ``offset`` its ``glu_linear_offset``.

    Raises:
        NotImplementedError: experts that are not gated, or whose activation is none of
            SiLU, quick-GELU and tanh-GELU (the exact erf GELU among them).
    """
    if not config.gated_linear_unit:
        raise NotImplementedError(
            "comet's experts are gated MLPs (act(gate) * up); this config has "
            "gated_linear_unit=False. Set gated_linear_unit=True (--swiglu) or keep "
            "Megatron's experts")
    act = _probe_activation(config.activation_func)
    if act is None:
        name = getattr(config.activation_func, "__name__", repr(config.activation_func))
        raise NotImplementedError(
            f"comet computes SiLU, quick-GELU (x*sigmoid(1.702x)) and tanh-GELU gates; the "
            f"experts' activation_func {name} is none of them (the exact erf GELU, "
            "torch.nn.functional.gelu, is not: use approximate='tanh' or "
            "megatron.core.activations.fast_gelu)")
    limit = getattr(config, "activation_func_clamp_value", None)
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    return GatedActivation(kind=act.kind, alpha=act.alpha, limit=limit, up_offset=offset)


def _flag(config, name: str):
    return getattr(config, name, None)


def refusals(config) -> list[str]:
    """Why comet cannot run the MoE layers of ``config`` (a ``TransformerConfig``), one
    sentence per setting; empty when it can. Expert tensor parallelism is not among them
    (it runs forward only, refused where gradients are needed)."""
    why = []
    try:
        gated_activation(config)
    except NotImplementedError as err:
        why.append(str(err))
    if config.add_bias_linear:
        why.append("add_bias_linear=True: comet's Megatron experts have no biases "
                   "(--disable-bias-linear)")
    if _flag(config, "moe_latent_size"):
        why.append("moe_latent_size: latent projections around the experts are not "
                   "supported")
    if _flag(config, "moe_apply_probs_on_input"):
        why.append("moe_apply_probs_on_input=True: comet applies the routing weights to "
                   "the experts' outputs, which is another function for gated experts")
    if _flag(config, "moe_router_padding_for_quantization") or _flag(
            config, "moe_router_padding_for_fp8"):
        why.append("moe_router_padding_for_quantization/fp8 pads the routing map for "
                   "quantized grouped GEMMs, giving tokens more than top-k routes")
    if _flag(config, "fp8") or _flag(config, "fp4"):
        why.append("fp8/fp4: comet's Megatron experts run in the parameters' dtype")
    if _flag(config, "moe_mlp_glu_interleave_size") is not None:
        why.append("moe_mlp_glu_interleave_size: Megatron's interleaved GLU layout is not "
                   "mapped")
    if config.moe_token_dispatcher_type == "flex":
        why.append("moe_token_dispatcher_type='flex' (DeepEP/HybridEP): comet replaces the "
                   "dispatcher; set 'alltoall'")
    if _flag(config, "moe_shared_expert_overlap"):
        why.append("moe_shared_expert_overlap=True overlaps the shared experts with "
                   "Megatron's dispatcher, which comet replaces: turn it off (comet runs the "
                   "shared experts beside its layer)")
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                 "overlap_dispatch_backward_with_experts_wgrad"):
        if _flag(config, name):
            why.append(f"{name}=True schedules Megatron's dispatcher and expert weight "
                       "gradients; comet overlaps the expert-parallel exchange inside its "
                       "fused kernels: turn it off")
    if (_flag(config, "cuda_graph_impl") or "none") != "none":
        why.append(f"cuda_graph_impl={config.cuda_graph_impl!r}: Megatron's CUDA graphs of "
                   "MoE layers are not supported with comet")
    if _flag(config, "transformer_impl") == "inference_optimized":
        why.append("transformer_impl='inference_optimized' uses Megatron's inference "
                   "dispatchers")
    return why


def check_config(config) -> None:
    """Raise ``NotImplementedError`` listing every :func:`refusals` of ``config``."""
    why = refusals(config)
    if why:
        raise NotImplementedError("comet cannot run these MoE layers:\n  - "
                                  + "\n  - ".join(why))
