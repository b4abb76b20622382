"""patch_model on FP8 transformers models (issue 68): FineGrainedFP8 ``FP8Experts`` stay
FP8 -- the block runs the checkpoint's e4m3 tensors and ``*_scale_inv`` on comet's FP8
layer, the state dict keeps their keys, shapes, dtypes and bytes -- and every FP8 variant
comet lacks is refused by name before anything is converted.

The models (tests/fp8_models.py) are tiny DeepSeek-V3 and Qwen3-MoE built the way
transformers lays out an FP8 checkpoint, random weights. transformers runs FP8 only
through hub GPU kernels, so the unpatched model runs here on their W8A8 recipe in torch
(``emulate_fp8``); the patched one on one CPU rank runs comet's FP8 emulation
(:func:`comet.reference.moe_forward_fp8`), as :class:`comet.CometMoE` does.

Tolerances: both sides are W8A8 with 1x128 activation groups and 128x128 weight blocks,
but transformers rounds each expert's gate/up output and its activation ``h`` to bf16
before quantizing ``h``, comet quantizes the fp32 ``h``. That moves a few percent of
``h``'s e4m3 values by one step (up to 1/8 of a value): measured rel L2 1.5e-2 - 1.8e-2
per MoE layer (bound 3e-2), 1.5e-2 - 3.6e-2 on the logits after two layers (bound 6e-2).
A wrong scale, row or expert moves either by O(1) (:func:`test_the_comparison_sees_a_wrong_scale`).
Against comet's emulation on the checkpoint's own tensors the block is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from comet.integrations import count_patched, patch_model
from comet.integrations.experts import inspect_experts
from comet.integrations.local_experts import Fp8TransformersExperts
from comet.quant import E4M3, Fp8Weight, calc_diff
from comet.reference import moe_forward_fp8
from fp8_models import emulate_fp8, fp8_model

FAMILIES = ("deepseek_v3", "qwen3_moe")
#: The layer (transformers MoE block path) each tiny model has experts at.
BLOCK = "model.layers.1.mlp"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _tokens(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(3, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, comparable for any dtype (FP8 and UE8M0 included; NaN-safe)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def _routing(tokens: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_model_stays_fp8_and_matches(family, scale_fmt):
    model = fp8_model(family, scale_fmt=scale_fmt)
    original = model.get_submodule(BLOCK).experts
    tensors = {n: p for n, p in original.named_parameters()}
    ids = _tokens()
    with emulate_fp8(), torch.no_grad():
        want = model(ids).logits
        patch_model(model)
        got = model(ids).logits
    assert count_patched(model) == (1 if family == "deepseek_v3" else 2)
    experts = model.get_submodule(BLOCK).experts
    assert isinstance(experts, Fp8TransformersExperts)
    # One rank: the checkpoint's own tensors, not copies, not dequantized.
    for name, value in experts.named_parameters():
        assert value.data_ptr() == tensors[name].data_ptr(), name
        assert value.dtype == tensors[name].dtype
    assert experts.gate_up_proj.dtype == E4M3
    assert _rel(got, want) < 6e-2
    assert calc_diff(got, want) < 2e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fp8_block_runs_the_checkpoint_tensors(family):
    """The patched block's experts call is comet's FP8 emulation on the unpatched
    module's tensors (exactly), and transformers' FP8 recipe within the bf16-h gap."""
    model = fp8_model(family)
    original = copy.deepcopy(model.get_submodule(BLOCK).experts)
    patch_model(model)
    experts = model.get_submodule(BLOCK).experts
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, weights = _routing(64, 8, 2)
    gate_up = Fp8Weight.from_checkpoint(original.gate_up_proj, original.gate_up_proj_scale_inv)
    down = Fp8Weight.from_checkpoint(original.down_proj, original.down_proj_scale_inv)
    with emulate_fp8(), torch.no_grad():
        got = experts(x, ids, weights)
        transformers_fp8 = original(x, ids, weights)
    spec = moe_forward_fp8(x.float(), ids, weights, gate_up, down).to(torch.bfloat16)
    assert torch.equal(got, spec)
    assert _rel(got, transformers_fp8) < 3e-2


def test_the_comparison_sees_a_wrong_scale():
    """One expert's gate_up scales doubled: far outside the bounds above."""
    model = fp8_model("qwen3_moe")
    reference = copy.deepcopy(model)
    ids = _tokens()
    patch_model(model)
    with torch.no_grad():
        model.get_submodule(BLOCK).experts.gate_up_proj_scale_inv[:, 1] *= 2
    with emulate_fp8(), torch.no_grad():
        assert _rel(model(ids).logits, reference(ids).logits) > 1e-1


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_state_dict_is_the_fp8_checkpoint(family, scale_fmt):
    model = fp8_model(family, scale_fmt=scale_fmt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].shape == value.shape and after[key].dtype == value.dtype, key
        assert torch.equal(_bits(after[key]), _bits(value)), key
    # Another FP8 checkpoint of the same model loads (strict) into the patched one.
    other = fp8_model(family, scale_fmt=scale_fmt, seed=1).state_dict()
    model.load_state_dict(other)
    loaded = model.state_dict()
    assert all(torch.equal(_bits(loaded[k]), _bits(v)) for k, v in other.items())
    # and the patched model computes with it, as the unpatched one does
    fresh = fp8_model(family, scale_fmt=scale_fmt, seed=1)
    with emulate_fp8(), torch.no_grad():
        assert _rel(model(_tokens()).logits, fresh(_tokens()).logits) < 6e-2


def test_a_wrong_checkpoint_shape_is_reported():
    model = patch_model(fp8_model("qwen3_moe"))
    state = model.state_dict()
    state[f"{BLOCK}.experts.down_proj_scale_inv"] = torch.ones(8, 2, 1)
    with pytest.raises(RuntimeError, match="down_proj_scale_inv"):
        model.load_state_dict(state)


# --------------------------------------------------------------------------- refusals
def _refused(model: nn.Module, match: str, error=TypeError, **kwargs) -> None:
    """patch_model refuses ``model`` with ``match`` in the message, converting nothing."""
    before = {k: _bits(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match) as err:
        patch_model(model, **kwargs)
    assert count_patched(model) == 0
    assert all(torch.equal(_bits(v), before[k]) for k, v in model.state_dict().items())
    return str(err.value)


def _variant(family: str, **qcfg) -> nn.Module:
    from transformers import FineGrainedFP8Config

    from fp8_models import FP8_SIZES, quantize
    import transformers
    from comet.integrations.tiny_models import _COMMON, TINY_MODELS
    config_cls, model_cls, settings = TINY_MODELS[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **settings, **FP8_SIZES})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    quantize(model, FineGrainedFP8Config(**qcfg))
    return model


def test_static_activation_scales_are_refused():
    msg = _refused(_variant("qwen3_moe", activation_scheme="static"),
                   r"activation_scheme='static'")
    assert "model.layers.0.mlp" in msg and "Qwen3MoeSparseMoeBlock" in msg


@pytest.mark.parametrize("block, what", [((64, 64), r"weight_block_size \[64, 64\]"),
                                         ((128, 64), r"weight_block_size \[128, 64\]")])
def test_other_block_sizes_are_refused(block, what):
    _refused(_variant("deepseek_v3", weight_block_size=block), what)


def test_fp4_experts_are_refused():
    """transformers' FP4 layout (``expert_dtype="fp4"``): int8 weights, K halved."""
    model = fp8_model("qwen3_moe")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.expert_dtype = "fp4"
        for name in ("gate_up_proj", "down_proj"):
            e, n, k = getattr(experts, name).shape
            packed = torch.zeros(e, n, k // 2, dtype=torch.int8)
            setattr(experts, name, nn.Parameter(packed, requires_grad=False))
    _refused(model, "FP4-packed experts")


def test_alternating_fp8_gate_up_is_refused():
    model = fp8_model("qwen3_moe")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts._apply_gate = lambda gu: nn.functional.silu(gu[..., 0::2]) * gu[..., 1::2]
    _refused(model, "alternating gate/up rows")


def test_scales_that_do_not_fit_are_refused():
    model = fp8_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts.down_proj_scale_inv = nn.Parameter(torch.ones(8, 3, 1), requires_grad=False)
    _refused(model, "FP8 scales that do not fit the weights")


def test_per_expert_fp8_linears_are_refused():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = FP8Linear(128, 128, (128, 128)), FP8Linear(128, 128, (128, 128))
            self.down_proj = FP8Linear(128, 128, (128, 128))

    with pytest.raises(NotImplementedError, match="per-expert FP8 linears"):
        inspect_experts(nn.ModuleList([Mlp(), Mlp()]), "MyBlock")


def test_fp8_with_redundant_experts_is_refused_before_converting():
    _refused(fp8_model("qwen3_moe"), "redundant experts", ValueError, redundant_experts=8)


def test_quantize_experts_refuses_a_patched_bf16_block_and_leaves_it_working():
    """A patched bf16 transformers block keeps the model's experts under its keys:
    quantize_experts refuses it by name (load the model in FP8 and patch that), before
    changing anything -- the block still runs in bf16."""
    from comet import CometMoE
    from comet.moe import quantize_experts
    from fp8_models import bf16_model
    model = bf16_model("qwen3_moe")
    patch_model(model)
    block = model.get_submodule(BLOCK)
    assert isinstance(block, CometMoE)
    ids = _tokens(1, 8)
    with torch.no_grad():
        want = model(ids).logits
        with pytest.raises(TypeError, match="FineGrainedFP8Config"):
            quantize_experts(block)
        assert block.cfg.fp8 is None
        assert torch.equal(model(ids).logits, want)


def test_a_patched_fp8_model_cast_to_bf16_keeps_its_experts_fp8():
    """``model.to(torch.bfloat16)`` casts the rest of a patched FP8 model; its experts'
    e4m3 tensors and scales stay as they were (a cast would round the scales, which no
    cast back recovers), and the block computes what it did."""
    model = patch_model(fp8_model("qwen3_moe", scale_fmt="ue8m0"))
    experts = model.get_submodule(BLOCK).experts
    before = {n: p.clone() for n, p in experts.named_parameters()}
    ids = _tokens()
    with emulate_fp8(), torch.no_grad():
        want = model(ids).logits
        model.to(torch.bfloat16)
        got = model(ids).logits
    for name, value in experts.named_parameters():
        assert value.dtype == before[name].dtype, name
        assert torch.equal(_bits(value), _bits(before[name])), name
    assert torch.equal(got, want)
