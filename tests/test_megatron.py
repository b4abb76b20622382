"""comet inside Megatron-Core: CometMoELayer against Megatron's own MoE layer, on the CPU.

Two forked CPU ranks over gloo run tiny GPT models with MoE layers built twice from the
same weights: Megatron's (all-gather dispatcher, SequentialMLP experts) and comet's
(``use_comet`` of the same layer spec). Per scenario -- expert parallelism 1 (data parallel
2) and 2, and per router/expert variant -- they compare the per-token loss, the MoE layers'
input gradients, the router and expert gradients and the aux losses (fp32, relative to
Megatron's largest value: within 1e-5, observed <= 1e-6); the MoE layer alone is compared
the same way under tensor parallelism 2 with sequence parallelism. Each model is then
saved with Megatron's distributed checkpointing and loaded into the other (exact). Expert
tensor parallelism 2 runs forward only (checked against Megatron, and training refused).

Megatron-Core on a CPU-only torch needs five shims, in the forked ranks only
(:func:`_cpu_megatron`): its CUDA device and synchronize calls go to the CPU, its CUDA RNG
tracker forks are no-ops (no dropout here), and megatron-core 0.16 without
TransformerEngine needs ``moe_utils.te_general_gemm = None`` (a name it forgets to define;
0.17+ defines it), and torch.compile is off (Megatron compiles its fused activations;
Inductor's compile workers deadlock in a forked process). Attention masks are passed explicitly (Megatron's default one is made
on CUDA).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gloo_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -e '.[megatron]')")

from megatron.core import activations as mcore_activations  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, import_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from comet.activation import GatedActivation  # noqa: E402
from comet.integrations.megatron import (CometExperts, CometMoELayer, fc1_of,  # noqa: E402
                                         fc2_of, gated_activation, refusals, routing_slots,
                                         use_comet, w2_of, w13_of)

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

#: FFN spans more than one of the kernels' 128-column gate/up blocks (comet.weights).
E, K, H, FFN, SEQ, BATCH, VOCAB = 4, 2, 32, 160, 8, 2, 64
#: Relative tolerance (max |difference| over max |Megatron's|) in fp32.
RTOL = 1e-5


def _config(**overrides) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3)
    settings.update(overrides)
    return TransformerConfig(**settings)


#: Router and expert variants: softmax top-k with aux and z losses and capacity drops,
#: SwiGLU; sigmoid group-limited top-k with expert bias, tanh-GELU experts, gated shared
#: experts.
VARIANTS = {
    "softmax-swiglu-capacity": dict(moe_expert_capacity_factor=1.0),
    "sigmoid-grouped-gelu-shared": dict(
        moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.0,
        activation_func=mcore_activations.fast_gelu, moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True, moe_router_load_balancing_type="seq_aux_loss"),
}


# --------------------------------------------------------------------------- no ranks needed
def test_routing_slots_take_routes_by_probability():
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0], [0.0, 0.7, 0.0, 0.0]],
                         requires_grad=True)
    routing_map = torch.tensor([[False, True, True, False],   # two routes
                                [True, False, False, False],  # one dropped by capacity
                                [True, True, False, True]])   # padded to capacity: extra
    ids, weights = routing_slots(probs, routing_map, 2)
    assert ids.tolist() == [[1, 2], [0, -1], [1, 0]] or ids.tolist() == [[1, 2], [0, -1], [1, 3]]
    assert torch.equal(weights.detach(), torch.tensor([[0.6, 0.3], [0.5, 0.0], [0.7, 0.0]]))
    weights.sum().backward()
    assert probs.grad[0].tolist() == [0, 1, 1, 0] and probs.grad[1].tolist() == [1, 0, 0, 0]


def test_gated_activation_of_megatron_settings():
    assert gated_activation(_config()) == GatedActivation()
    assert gated_activation(_config(activation_func=mcore_activations.fast_gelu)) == \
        GatedActivation(kind="gelu_tanh")
    gpt_oss = gated_activation(_config(activation_func=mcore_activations.quick_gelu,
                                       activation_func_clamp_value=7.0, glu_linear_offset=1.0))
    assert gpt_oss == GatedActivation(kind="silu", alpha=1.702, limit=7.0, up_offset=1.0)
    with pytest.raises(NotImplementedError, match="erf GELU"):
        gated_activation(_config(activation_func=F.gelu))
    with pytest.raises(NotImplementedError, match="gated_linear_unit=False"):
        gated_activation(_config(gated_linear_unit=False))


@pytest.mark.parametrize("setting, match", [
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
     "moe_apply_probs_on_input"),
    (dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
          moe_token_dispatcher_type="alltoall"), "moe_shared_expert_overlap"),
    (dict(moe_token_dispatcher_type="flex"), "flex"),
    (dict(activation_func=F.gelu), "erf GELU"),
    (dict(gated_linear_unit=False), "gated_linear_unit=False"),
])
def test_unsupported_settings_are_refused_before_anything_is_built(setting, match):
    try:
        config = _config(**setting)
    except (AssertionError, ValueError) as err:   # a Megatron version that checks it first
        pytest.skip(f"this megatron-core rejects {setting} itself: {err}")
    assert any(match in why for why in refusals(config))
    with pytest.raises(NotImplementedError, match=match):
        CometMoELayer(config)   # before any process group is touched


def test_overlap_and_quantization_flags_are_refused():
    config = _config()
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        patched = copy.copy(config)
        setattr(patched, name, True)
        assert any(name in why for why in refusals(patched)), name
    graphs = copy.copy(config)
    graphs.cuda_graph_impl = "local"
    assert any("cuda_graph_impl" in why for why in refusals(graphs))
    # Set after construction: Megatron checks these only with TransformerEngine present.
    for name, value in (("moe_router_padding_for_quantization", True), ("fp8", "e4m3")):
        patched = copy.copy(config)
        setattr(patched, name, value)
        assert any(name.split("_for")[0] in why for why in refusals(patched)), name
    assert refusals(config) == []


def test_checkpoint_layout_round_trips():
    w13, w2 = torch.randn(3, H, 2 * 160), torch.randn(3, 160, H)
    fc1, fc2 = fc1_of(w13), fc2_of(w2)
    assert fc1.shape == (3, 320, H) and fc2.shape == (3, H, 160)
    assert torch.equal(w13_of(fc1), w13) and torch.equal(w2_of(fc2), w2)
    # fc1's first F rows are the gate: the columns comet's kernels activate.
    from comet.weights import gate_up_first
    assert torch.equal(fc1[:, :160].transpose(1, 2), gate_up_first(w13)[..., :160])


def test_specs_put_comet_in_megatron_specs():
    spec = use_comet(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False),
                     max_tokens=64)
    mlp = spec.submodules.mlp
    assert isinstance(mlp, ModuleSpec) and mlp.module is CometMoELayer
    assert mlp.submodules.experts.module is CometExperts
    assert mlp.submodules.experts.params["max_tokens"] == 64
    dense_layer = get_gpt_layer_local_spec(num_experts=None)
    dense = dense_layer.submodules.mlp   # kept as it was
    built = use_comet(dense)
    assert getattr(built, "module", getattr(built, "func", None)) == getattr(
        dense, "module", getattr(dense, "func", None))
    # A block of dense and MoE layers: only the MoE layers change.
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    moe_layer = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    block = use_comet(TransformerBlockSubmodules(layer_specs=[moe_layer, dense_layer]))
    assert block.layer_specs[0].submodules.mlp.module is CometMoELayer
    assert block.layer_specs[1].submodules.mlp == dense_layer.submodules.mlp
    kept = moe_layer.submodules.mlp    # the input is not modified
    assert getattr(kept, "module", getattr(kept, "func", None)) is MoELayer
    # Megatron-LM's --spec loads a module attribute.
    loaded = import_module(("comet.integrations.megatron.specs", "gpt_layer_spec"))
    assert loaded.submodules.mlp.module is CometMoELayer


# --------------------------------------------------------------------------- two ranks
def _cpu_megatron():
    """Megatron-Core on a CPU-only torch (module doc); call in a forked rank only."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # Megatron's fused activations go through torch.compile; Inductor's compile workers
    # deadlock in a forked rank (and a CPU test has nothing to gain from them).
    torch._dynamo.config.disable = True
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _parallel(tp=1, ep=1, etp=1):
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)


def _gpt(config, spec, seed):
    from megatron.core.models.gpt import GPTModel
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ * 2)


def _moe_layers(model):
    return [layer.mlp for layer in model.decoder.layers]


def _megatron_experts(mlp) -> tuple[torch.Tensor, torch.Tensor]:
    """A Megatron MoE layer's local experts as ``(fc1 [El, 2Ft, H], fc2 [El, H, Ft])``."""
    experts = mlp.experts
    if hasattr(experts, "local_experts"):           # SequentialMLP
        return (torch.stack([e.linear_fc1.weight for e in experts.local_experts]),
                torch.stack([e.linear_fc2.weight for e in experts.local_experts]))
    el = experts.num_local_experts                  # legacy GroupedMLP: [El, H, 2F] views
    return (experts.weight1.view(el, H, -1).transpose(1, 2),
            experts.weight2.view(el, -1, H).transpose(1, 2))


def _megatron_expert_grads(mlp):
    return (torch.stack([e.linear_fc1.weight.grad for e in mlp.experts.local_experts]),
            torch.stack([e.linear_fc2.weight.grad for e in mlp.experts.local_experts]))


@torch.no_grad()
def _copy_weights(src, dst):
    """Megatron's model ``src`` into comet's ``dst``: the same parameters by name, the
    experts converted."""
    theirs = src.state_dict()
    for name, tensor in dst.state_dict().items():
        if ".experts." not in name and isinstance(tensor, torch.Tensor):
            tensor.copy_(theirs[name])
    for mine, their in zip(_moe_layers(dst), _moe_layers(src)):
        mine.experts.load_megatron_weights(*_megatron_experts(their))


def _batch(rank, tp_rank=0):
    g = torch.Generator().manual_seed(100 + rank - tp_rank)   # a TP group shares its batch
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool().view(1, 1, SEQ, SEQ)
    return tokens, position, mask


def _aux_losses() -> dict:
    """Megatron's logged aux losses per layer (then cleared)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker)
        out = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        clear_aux_losses_tracker()
        return out
    tracker = get_moe_metrics_tracker()
    out = {k: v.values.clone() for k, v in tracker.metrics.items()}
    tracker.clear()
    return out


def _train_step(model, batch):
    """Loss, MoE-input gradients, router and expert gradients, aux losses of one step."""
    inputs = []

    def keep(module, args, kwargs):
        args[0].register_hook(lambda g: inputs.append(g.clone()))

    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in _moe_layers(model)]
    model.zero_grad()
    tokens, position, mask = batch
    loss = model(tokens, position, mask, labels=tokens)
    loss.sum().backward()
    for h in hooks:
        h.remove()
    routers = [m.router.weight.grad.clone() for m in _moe_layers(model)]
    return loss.detach(), inputs[::-1], routers, _aux_losses()


def _diff(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _rel(a, b) -> float:
    """``max |a - b|`` over ``max |b|`` (b the reference; inf where b is all zeros and a
    is not: a test of nothing must not pass)."""
    scale = b.abs().max().item()
    err = _diff(a, b)
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def _compare(variant: dict, ep: int, rank: int) -> dict:
    """Megatron's and comet's tiny GPT on one batch: the largest differences."""
    config = _config(expert_model_parallel_size=ep, **variant)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    theirs = _gpt(config, spec, seed=1)
    ours = _gpt(config, use_comet(spec), seed=2)
    _copy_weights(theirs, ours)
    batch = _batch(rank)
    loss_t, dx_t, router_t, aux_t = _train_step(theirs, batch)
    loss_o, dx_o, router_o, aux_o = _train_step(ours, batch)
    expert_grads = []
    for mine, their in zip(_moe_layers(ours), _moe_layers(theirs)):
        fc1_grad, fc2_grad = _megatron_expert_grads(their)
        expert_grads += [_rel(fc1_of(mine.experts.w13.grad), fc1_grad),
                         _rel(fc2_of(mine.experts.w2.grad), fc2_grad)]
    assert aux_t.keys() == aux_o.keys() and aux_t, (aux_t, aux_o)
    return {
        "output": _rel(loss_o, loss_t),
        "moe_input_grad": max(_rel(a, b) for a, b in zip(dx_o, dx_t)),
        "router_grad": max(_rel(a, b) for a, b in zip(router_o, router_t)),
        "expert_grad": max(expert_grads),
        "aux_loss": max(_rel(aux_o[k], aux_t[k]) for k in aux_t),
    }


def _build(spec, **kwargs):
    """A module from a spec: newer Megatron's specs are callables, 0.16's ModuleSpecs not."""
    from megatron.core.transformer.spec_utils import build_module
    return spec(**kwargs) if callable(spec) else build_module(spec, **kwargs)


def _compare_layer(variant: dict, tp: int, ep: int, rank: int) -> dict:
    """Megatron's and comet's MoE layer alone under tensor and sequence parallelism (the
    local spec's torch norms refuse sequence parallelism, so no GPT around them): each
    rank passes its sequence shard ``[S/tp, B, H]``."""
    config = _config(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                     expert_tensor_parallel_size=1, sequence_parallel=True, **variant)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
    torch.manual_seed(1)
    theirs = _build(spec, config=config)
    ours = _build(use_comet(spec), config=config)
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
    ours.experts.load_megatron_weights(*_megatron_experts(theirs))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(SEQ // tp, BATCH, H, generator=g)
    dy = torch.randn(SEQ // tp, BATCH, H, generator=g)
    got = []
    for layer in (theirs, ours):
        layer.set_layer_number(1)
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        (out * dy).sum().backward()
        got.append((out.detach(), xi.grad, layer.router.weight.grad, _aux_losses()))
    (out_t, dx_t, router_t, aux_t), (out_o, dx_o, router_o, aux_o) = got
    fc1_grad, fc2_grad = _megatron_expert_grads(theirs)
    assert aux_t.keys() == aux_o.keys() and aux_t, (aux_t, aux_o)
    return {
        "output": _rel(out_o, out_t),
        "moe_input_grad": _rel(dx_o, dx_t), "router_grad": _rel(router_o, router_t),
        "expert_grad": max(_rel(fc1_of(ours.experts.w13.grad), fc1_grad),
                           _rel(fc2_of(ours.experts.w2.grad), fc2_grad)),
        "aux_loss": max(_rel(aux_o[k], aux_t[k]) for k in aux_t),
    }


def _experts_of(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every MoE layer's local experts in Megatron's layout (copies)."""
    out = []
    for m in _moe_layers(model):
        if isinstance(m.experts, CometExperts):
            out.append(m.experts.megatron_weights())
        else:
            out.append(tuple(t.detach().clone() for t in _megatron_experts(m)))
    return out


def _weights_diff(a, b) -> float:
    return max(max(_diff(x1, y1), _diff(x2, y2)) for (x1, x2), (y1, y2) in zip(a, b))


def _save(model, path):
    from megatron.core import dist_checkpointing
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load(model, path):
    from megatron.core import dist_checkpointing
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


def _checkpoints(tmp, ep: int) -> dict:
    """Save comet's model and load it into Megatron's SequentialMLP model (and legacy
    GroupedMLP, where there is one), and back: the largest difference between the
    experts put in and those read back (and the routers, which are Megatron's)."""
    config = _config(expert_model_parallel_size=ep)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    ours, theirs = _gpt(config, use_comet(spec), seed=3), _gpt(config, spec, seed=4)
    saved = _experts_of(ours)
    path = f"{tmp}/ep{ep}"
    _save(ours, f"{path}-comet")
    out = {"before": _weights_diff(_experts_of(theirs), saved)}   # > 0: a load changes it
    _load(theirs, f"{path}-comet")
    out.update({"comet->sequential": _weights_diff(_experts_of(theirs), saved),
           "router": max(_diff(m.router.weight, t.router.weight)
                         for m, t in zip(_moe_layers(ours), _moe_layers(theirs)))})
    fresh = _gpt(config, spec, seed=5)
    _save(fresh, f"{path}-sequential")
    _load(ours, f"{path}-sequential")
    out["sequential->comet"] = _weights_diff(_experts_of(ours), _experts_of(fresh))
    grouped = _grouped_spec()
    if grouped is not None:
        gmodel = _gpt(config, grouped, seed=6)
        _load(gmodel, f"{path}-comet")
        out["comet->grouped"] = _weights_diff(_experts_of(gmodel), saved)
        _save(gmodel, f"{path}-grouped")
        _load(ours, f"{path}-grouped")
        out["grouped->comet"] = _weights_diff(_experts_of(ours), _experts_of(gmodel))
    return out


def _grouped_spec():
    """A local spec with Megatron's legacy GroupedMLP (megatron-core < 0.17), whose
    checkpoint code runs without the grouped_gemm package; None where it is gone."""
    from megatron.core.transformer.moe import experts
    if not hasattr(experts, "GroupedMLP"):
        return None
    from megatron.core.transformer.moe import grouped_gemm_util
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True,
                                    moe_use_legacy_grouped_gemm=True)
    return spec if spec.submodules.mlp.submodules.experts.module is experts.GroupedMLP else None


def _fusion(rank: int) -> dict:
    """Gradient-accumulation fusion: the expert gradients land in ``main_grad``."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    config = _config(expert_model_parallel_size=dist.get_world_size())
    fused = copy.copy(config)
    fused.gradient_accumulation_fusion = True
    pg = get_default_pg_collection()
    plain, fusing = CometExperts(E // 2, config, pg), CometExperts(E // 2, fused, pg)
    with torch.no_grad():
        fusing.w13.copy_(plain.w13)
        fusing.w2.copy_(plain.w2)
    for p in fusing.parameters():
        p.main_grad = torch.zeros_like(p)       # Megatron DDP's buffer
        p.grad_added_to_main_grad = False
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, H, generator=g)
    ids = torch.randint(0, E, (6, K), generator=g)
    weights = torch.rand(6, K, generator=g)
    plain(x, ids, weights).square().sum().backward()
    for _ in range(2):      # two micro-batches accumulate
        fusing(x, ids, weights).square().sum().backward()
    return {"main_grad": max(_rel(f.main_grad, 2 * p.grad)
                             for f, p in zip(fusing.parameters(), plain.parameters())),
            "flagged": all(p.grad_added_to_main_grad for p in fusing.parameters()),
            "allreduce": [p.allreduce for p in plain.parameters()]}


def _expert_tp(rank: int) -> dict:
    """Expert TP 2 (TP 2, sequence parallel): forward against Megatron's layer, training
    refused."""
    config = _config(tensor_model_parallel_size=2, expert_tensor_parallel_size=2,
                     sequence_parallel=True)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
    torch.manual_seed(1)
    theirs = _build(spec, config=config)
    ours = _build(use_comet(spec), config=config)
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
    ours.experts.load_megatron_weights(*_megatron_experts(theirs))
    x = torch.randn(SEQ // 2, BATCH, H, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = {"forward": _rel(ours(x)[0], theirs(x)[0])}
    try:
        ours(x.clone().requires_grad_())[0].sum().backward()
        out["training"] = "ran"
    except NotImplementedError as err:
        out["training"] = str(err)
    return out


def _world_worker(rank, world, store, tmp, results):
    torch.set_num_threads(1)
    with gloo_ranks.group(rank, world, store, results):
        _cpu_megatron()
        for name, variant in VARIANTS.items():
            for ep in (1, 2):
                _parallel(ep=ep)
                results.put((rank, f"ep{ep}/{name}", _compare(variant, ep, rank)))
        _parallel(tp=2, ep=2, etp=1)
        results.put((rank, "tp2-sp-ep2", _compare_layer(VARIANTS["softmax-swiglu-capacity"], 2,
                                                        2, rank)))
        for ep in (1, 2):
            _parallel(ep=ep)
            results.put((rank, f"checkpoint-ep{ep}", _checkpoints(tmp, ep)))
        results.put((rank, "fusion", _fusion(rank)))
        _parallel(tp=2, ep=1, etp=2)
        results.put((rank, "expert-tp", _expert_tp(rank)))
        results.put((rank, "done", None))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every two-rank scenario, run once: ``{scenario: [rank 0's result, rank 1's]}``."""
    tmp = tmp_path_factory.mktemp("megatron")
    codes, items = gloo_ranks.fork(_world_worker, 2, tmp / "store", (str(tmp),),
                                   expected=2 * (2 * len(VARIANTS) + 6), timeout=300)
    errors = [i for i in items if i[1] == "error"]
    assert not errors and codes == [0, 0], (codes, errors)
    out: dict = {}
    for rank, name, value in sorted(items, key=lambda i: i[0]):
        out.setdefault(name, []).append(value)
    return out


SCENARIOS = [f"ep{ep}/{name}" for name in VARIANTS for ep in (1, 2)] + ["tp2-sp-ep2"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_comet_layer_trains_like_megatrons(world, scenario):
    """Loss, MoE-input, router and expert gradients and aux losses match Megatron's MoE
    layer (all-gather dispatcher, SequentialMLP) fed the same weights, on both ranks."""
    for got in world[scenario]:
        assert max(got.values()) <= RTOL, got


@pytest.mark.parametrize("ep", [1, 2])
def test_checkpoints_load_both_ways(world, ep):
    """A checkpoint saved with comet loads into Megatron's SequentialMLP (and legacy
    GroupedMLP, where the installed megatron-core has it) and back, weights exact."""
    for got in world[f"checkpoint-ep{ep}"]:
        assert got["comet->sequential"] == 0 and got["sequential->comet"] == 0, got
        assert got["router"] == 0 and got["before"] > 0, got
        if "comet->grouped" in got:
            assert got["comet->grouped"] == 0 and got["grouped->comet"] == 0, got


def test_expert_gradients_fuse_into_main_grad(world):
    for got in world["fusion"]:
        assert got["flagged"] and got["main_grad"] <= RTOL, got
        assert got["allreduce"] == [False, False], got    # EP 2: expert-data-parallel


def test_expert_tensor_parallel_runs_forward_and_refuses_training(world):
    for got in world["expert-tp"]:
        assert got["forward"] <= RTOL, got
        assert "expert_tensor_parallel_size=2" in got["training"], got
