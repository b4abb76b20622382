"""The expert variants patch_model converts (issue 38): another gated activation, expert
biases, alternating gate/up columns -- found by structure and probing, checked against the
unpatched model.

The transformers families are the tiny fp32 models of :mod:`comet.integrations.coverage`,
whose config sets ``swiglu_limit=1.0`` (the tiny models' gate/up values pass it, so the
clamps are active) and whose zero-initialised expert biases get random values:

* gpt_oss -- GPT-OSS clamped SwiGLU (``alpha=1.702``, ``up + 1``), ``gate_up_proj_bias`` /
  ``down_proj_bias``, gate and up columns alternating (``gate_up[..., ::2]``);
* minimax_m3_vl -- the same activation, concatenated columns, no biases;
* deepseek_v4 -- clamped SiLU gate (``act_fn`` SiLU, ``limit``);
* gemma4 -- GELU-tanh (``act_fn`` gelu_pytorch_tanh).

Per-expert ``ModuleList`` experts (transformers 4.x) with ``nn.Linear`` biases have no
transformers 5.x family; :class:`MixtralSparseMoeBlock` below is 4.x Mixtral's block with
biased, GELU-tanh (or clamped SiLU) experts.

DBRX stores its experts in another layout: stacked 2-D ``mlp.w1`` / ``mlp.v1`` /
``mlp.w2``, each ``[E*F, H]`` (the down projection used untransposed), called like
registry experts; its tests check the logits, the checkpoint in DBRX's own keys (and a
rank's rows of it under EP), training and the refusal of weights of another shape.

Tolerances: fp32 logits within atol = rtol = 1e-5, as tests/test_integrations.py (only
summation order differs). :func:`test_the_comparison_sees_each_variant` shows that
dropping any variant moves the logits far beyond that.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gloo_ranks
from state_dicts import assert_both_load_back

transformers = pytest.importorskip("transformers")

from comet.activation import SILU, GatedActivation  # noqa: E402
from comet.integrations import (  # noqa: E402
    EXPERTS_BACKEND_REGISTERED, CometMoEBlock, coverage, find_moe_blocks, from_module,
    patch_model)
from comet.weights import gate_up_first, interleave_gate_up  # noqa: E402

if not EXPERTS_BACKEND_REGISTERED:
    pytest.skip("the fused expert variants are transformers 5.x families",
                allow_module_level=True)

GPT_OSS_SWIGLU = GatedActivation(alpha=1.702, limit=1.0, up_offset=1.0)

#: family -> (activation, gate/up column order, projections with biases) comet must find.
VARIANTS = {
    "gpt_oss": (GPT_OSS_SWIGLU, "alternating", {"gate", "up", "down"}),
    "minimax_m3_vl": (GPT_OSS_SWIGLU, "concatenated", set()),
    "deepseek_v4": (GatedActivation(limit=1.0), "concatenated", set()),
    "gemma4": (GatedActivation(kind="gelu_tanh"), "concatenated", set()),
}
FAMILIES = [f for f in VARIANTS if f in coverage.discover_families()]
HAS_DBRX = "dbrx" in coverage.discover_families()
needs_dbrx = pytest.mark.skipif(not HAS_DBRX, reason=f"transformers "
                                f"{transformers.__version__} has no dbrx")


def _tokens(batch=2, seq=12, seed=0):
    return torch.randint(3, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, CometMoEBlock)]


@pytest.fixture(scope="module")
def models():
    """family -> (original, patched) tiny fp32 models, built once for the module."""
    out = {}
    for family in FAMILIES:
        model = coverage.build_tiny_model(family)
        out[family] = (model, patch_model(copy.deepcopy(model)))
    return out


# --------------------------------------------------------------------------- fused variants
@pytest.mark.parametrize("family", FAMILIES)
def test_variant_is_found_and_logits_match(family, models):
    model, patched = models[family]
    activation, order, biases = VARIANTS[family]
    blocks = _blocks(patched)
    assert blocks and len(blocks) == len(find_moe_blocks(model))
    for block in blocks:
        assert block.cfg.activation == activation
        assert block.cfg.expert_bias == bool(biases)
        assert block.experts.layout.gate_up == order
        assert block.experts.layout.biases == biases
    ids = _tokens()
    torch.testing.assert_close(_logits(patched, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_comparison_sees_each_variant(family, models):
    """Running the patched model without its variant -- plain SiLU, or zero biases --
    moves the logits by far more than the 1e-5 the tests allow: they can fail."""
    model, patched = models[family]
    ids = _tokens()
    want = _logits(model, ids)
    wrong = copy.deepcopy(patched)
    for block in _blocks(wrong):
        block.cfg = block.cfg.replace(activation=SILU)
    assert (_logits(wrong, ids) - want).abs().max() > 1e-2 * want.abs().max()
    if VARIANTS[family][2]:
        wrong = copy.deepcopy(patched)
        with torch.no_grad():
            for block in _blocks(wrong):
                block.experts.b13.zero_()
                block.experts.b2.zero_()
        assert (_logits(wrong, ids) - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_variants_compile_whole_for_inference(family, models):
    """The routed experts stay one op under torch.compile (fullgraph) with their
    activation and biases."""
    _, patched = models[family]
    ids = _tokens()
    want = _logits(patched, ids)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(patched, fullgraph=True, backend="eager")
        torch.testing.assert_close(_logits(compiled, ids), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keeps_the_models_keys_and_layout(family, models):
    """One rank: state_dict() is the original's, key for key and value for value (GPT-OSS's
    gate/up columns alternate again); the original checkpoint of another seed loads."""
    model, patched = models[family]
    original, saved = model.state_dict(), patched.state_dict()
    assert saved.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(saved[key], value), key
    source = coverage.build_tiny_model(family, seed=1)
    target = patch_model(copy.deepcopy(model))
    target.load_state_dict(source.state_dict())   # strict
    ids = _tokens()
    torch.testing.assert_close(_logits(target, ids), _logits(source, ids), atol=1e-5, rtol=1e-5)


def test_missing_expert_bias_is_named_as_in_transformers(models):
    _, patched = models["gpt_oss"]
    state = patched.state_dict()
    dropped = sorted(k for k in state if k.endswith("experts.gate_up_proj_bias"))[:1]
    del state[dropped[0]]
    result = copy.deepcopy(patched).load_state_dict(state, strict=False)
    assert result.missing_keys == dropped and not result.unexpected_keys


def test_ep_rank_keeps_and_saves_its_slice_in_the_models_layout(fake_world):
    """Rank 1 of 2 keeps experts 4..7 and saves them as GPT-OSS stores them (alternating
    gate/up, biases); the full checkpoint and its own shard both load back."""
    model = coverage.build_tiny_model("gpt_oss")
    _, block = find_moe_blocks(model)[0]
    original = {k: v.clone() for k, v in block.state_dict().items()}
    fake_world(1, 2)
    new = from_module(block)
    assert new.expert_offset == 4 and new.local_experts == 4
    saved = new.state_dict()
    for key in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert torch.equal(saved["experts." + key], original["experts." + key][4:]), key
    assert_both_load_back(new, original, saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_comet_experts_backend(family, models):
    """The registry backend runs the variants too (reference on the CPU)."""
    model, _ = models[family]
    switched = copy.deepcopy(model)
    switched.set_experts_implementation("comet")
    ids = _tokens()
    torch.testing.assert_close(_logits(switched, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)


def test_training_with_biases_on_one_rank():
    """One CPU rank (the differentiable reference): GPT-OSS's experts, biases included,
    get the unpatched model's gradients."""
    from comet.integrations.layout import _fused_to_kernel, _gate_then_up
    model = coverage.build_tiny_model("gpt_oss")
    patched = patch_model(copy.deepcopy(model))
    ids = _tokens()
    for m in (model, patched):
        m(input_ids=ids).logits.float().square().mean().backward()
    for path, block in patched.named_modules():
        if not isinstance(block, CometMoEBlock):
            continue
        ex, orig = block.experts, model.get_submodule(path).experts
        layout = ex.layout
        w13, w2 = _fused_to_kernel(orig.gate_up_proj.grad, orig.down_proj.grad, layout)
        got = {"w13": gate_up_first(ex.w13.grad), "w2": ex.w2.grad,
               "b13": gate_up_first(ex.b13.grad), "b2": ex.b2.grad}
        want = {"w13": w13, "w2": w2, "b2": orig.down_proj_bias.grad,
                "b13": _gate_then_up(orig.gate_up_proj_bias.grad, layout.gate_up)}
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, name=name, path=path: f"{path} {name}: {m}")


# --------------------------------------------------------------------------- stacked experts
#: The tiny DBRX of comet.integrations.coverage: E = 4 experts of F = 32, H = 64.
DBRX_E, DBRX_F, DBRX_H = 4, 32, 64
DBRX_NAMES = ("mlp.w1", "mlp.v1", "mlp.w2")


@pytest.fixture(scope="module")
def dbrx():
    """(original, patched) tiny fp32 DBRX models."""
    if not HAS_DBRX:
        pytest.skip(f"transformers {transformers.__version__} has no dbrx")
    model = coverage.build_tiny_model("dbrx")
    return model, patch_model(copy.deepcopy(model))


def _dbrx_block():
    _, block = find_moe_blocks(coverage.build_tiny_model("dbrx"))[0]
    return block


def test_dbrx_stacked_experts_convert_and_logits_match(dbrx):
    """DBRX's ``mlp.w1/v1/w2`` are found as gate, up and down, SiLU from
    ``mlp.activation_fn``; the logits are the unpatched model's, also compiled whole."""
    model, patched = dbrx
    blocks = _blocks(patched)
    assert len(blocks) == len(find_moe_blocks(model)) == 2
    for block in blocks:
        layout = block.experts.layout
        assert (layout.kind, layout.names, layout.biases) == ("stacked", DBRX_NAMES, set())
        assert block.cfg.activation == SILU and not block.cfg.expert_bias
        assert (block.cfg.num_experts, block.cfg.hidden_size,
                block.cfg.intermediate_size) == (DBRX_E, DBRX_H, DBRX_F)
    ids = _tokens()
    want = _logits(model, ids)
    torch.testing.assert_close(_logits(patched, ids), want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(patched, fullgraph=True, backend="eager")
        torch.testing.assert_close(_logits(compiled, ids), want, atol=1e-5, rtol=1e-5)


def test_dbrx_comparison_sees_gate_and_up(dbrx):
    """Gate and up swapped moves the logits far beyond the tolerance: the roles count."""
    model, patched = dbrx
    wrong = copy.deepcopy(patched)
    with torch.no_grad():
        for block in _blocks(wrong):
            w13 = gate_up_first(block.experts.w13)
            swapped = torch.cat([w13[..., DBRX_F:], w13[..., :DBRX_F]], dim=-1)
            block.experts.w13.copy_(interleave_gate_up(swapped))
    ids = _tokens()
    want = _logits(model, ids)
    assert (_logits(wrong, ids) - want).abs().max() > 1e-2 * want.abs().max()


def test_dbrx_state_dict_keeps_its_keys_and_layout(dbrx):
    """One rank: state_dict() is DBRX's, key for key (``...ffn.experts.mlp.w1`` ``[E*F, H]``)
    and value for value; another seed's DBRX checkpoint loads (strict), and the patched
    model's checkpoint loads back into an unpatched DBRX."""
    model, patched = dbrx
    original, saved = model.state_dict(), patched.state_dict()
    assert saved.keys() == original.keys()
    stacked = [k for k in saved if k.endswith(DBRX_NAMES)]
    assert len(stacked) == 3 * 2
    assert all(saved[k].shape == (DBRX_E * DBRX_F, DBRX_H) for k in stacked)
    for key, value in original.items():
        assert torch.equal(saved[key], value), key
    source = coverage.build_tiny_model("dbrx", seed=1)
    target = patch_model(copy.deepcopy(model))
    target.load_state_dict(source.state_dict())   # strict
    ids = _tokens()
    want = _logits(source, ids)
    torch.testing.assert_close(_logits(target, ids), want, atol=1e-5, rtol=1e-5)
    back = copy.deepcopy(model)
    back.load_state_dict(target.state_dict())     # strict
    torch.testing.assert_close(_logits(back, ids), want)


@needs_dbrx
def test_dbrx_ep_rank_keeps_and_saves_its_rows(fake_world):
    """Rank 1 of 2 keeps experts 2..3 and saves their rows ``[2F, 4F)`` of each stacked
    tensor; the full checkpoint and the rank's own shard both load back, other row counts
    are size mismatches."""
    block = _dbrx_block()
    original = {k: v.clone() for k, v in block.state_dict().items()}
    fake_world(1, 2)
    new = from_module(block)
    assert new.expert_offset == 2 and new.local_experts == 2
    saved = new.state_dict()
    for name in DBRX_NAMES:
        key = "experts." + name
        assert torch.equal(saved[key], original[key][2 * DBRX_F:]), key
    assert_both_load_back(new, original, saved)
    bad = dict(original, **{"experts.mlp.w2": original["experts.mlp.w2"][:48]})
    with pytest.raises(RuntimeError, match=r"size mismatch for experts\.mlp\.w2: 48 rows "
                                           r"\(32 an expert\) in the checkpoint, expected "
                                           r"128 \(all\) or 64"):
        new.load_state_dict(bad)


@needs_dbrx
def test_dbrx_training_on_one_rank():
    """One CPU rank: the stacked experts get the unpatched model's gradients."""
    from comet.integrations.layout import _stacked_to_kernel
    model = coverage.build_tiny_model("dbrx")
    patched = patch_model(copy.deepcopy(model))
    ids = _tokens()
    for m in (model, patched):
        m(input_ids=ids).logits.float().square().mean().backward()
    blocks = [(p, b) for p, b in patched.named_modules() if isinstance(b, CometMoEBlock)]
    assert blocks
    for path, block in blocks:
        mlp = model.get_submodule(path).experts.mlp
        want = _stacked_to_kernel(mlp.w1.grad, mlp.v1.grad, mlp.w2.grad, DBRX_F)
        got = (gate_up_first(block.experts.w13.grad), block.experts.w2.grad)
        for name, g, w in zip(("w13", "w2"), got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, name=name, path=path: f"{path} {name}: {m}")


@needs_dbrx
def test_wrong_shaped_stacked_weight_is_refused():
    """A down projection stored ``[E*H, F]`` (transposed) is not read as ``[E*F, H]``:
    refused with the shapes named, and patch_model replaces nothing."""
    model = coverage.build_tiny_model("dbrx")
    _, block = find_moe_blocks(model)[0]
    mlp = block.experts.mlp
    mlp.w2 = nn.Parameter(mlp.w2.detach().reshape(DBRX_E * DBRX_H, DBRX_F))
    message = (r"the stacked expert weights of DbrxExperts \(mlp\.w1 \[128, 64\], mlp\.v1 "
               r"\[128, 64\], mlp\.w2 \[256, 32\]\) are not gate, up and down of one shape "
               r"\[E\*F, H\] with E = 4 experts")
    with pytest.raises(TypeError, match=message):
        from_module(block)
    with pytest.raises(TypeError, match=message):
        patch_model(model)
    assert not _blocks(model)


@needs_dbrx
def test_stacked_experts_computing_something_else_are_refused():
    """Another activation is refused by the gate probe; a forward that is not the gated
    MLP of its weights (here: scaled) by the forward probe."""
    block = _dbrx_block()
    block.experts.mlp.activation_fn = transformers.activations.ACT2FN["gelu"]
    with pytest.raises(NotImplementedError, match="activation gelu is not SiLU or GELU-tanh"):
        from_module(block)

    class ScaledDbrxExperts(type(block.experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    block = _dbrx_block()
    block.experts.__class__ = ScaledDbrxExperts
    with pytest.raises(NotImplementedError, match=r"ScaledDbrxExperts\.forward does not "
                                                  r"compute the gated MLP comet runs"):
        from_module(block)


# --------------------------------------------------------------------------- ModuleList experts
class _BiasedMLP(nn.Module):
    """A 4.x per-expert MLP: ``w2(act(w1 x) * w3 x)``, with biases on ``w1``/``w3`` and,
    if ``down_bias``, on ``w2``; a ``limit`` clamps the gate (above) and up (both sides)
    before the activation, as DeepSeek-V4's MLP does."""

    def __init__(self, h, f, act, down_bias=False, limit=None):
        super().__init__()
        self.w1 = nn.Linear(h, f)
        self.w3 = nn.Linear(h, f)
        self.w2 = nn.Linear(f, h, bias=down_bias)
        self.act_fn = transformers.activations.ACT2FN[act]
        self.limit = limit

    def forward(self, x):
        gate, up = self.w1(x), self.w3(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(self.act_fn(gate) * up)


class MixtralSparseMoeBlock(nn.Module):
    """transformers 4.x's Mixtral block (comet routes it by this class name), its experts
    a ``ModuleList`` of :class:`_BiasedMLP`."""

    def __init__(self, act="gelu_pytorch_tanh", down_bias=False, limit=None, seed=0,
                 h=64, f=32, e=4, top_k=2):
        super().__init__()
        torch.manual_seed(seed)
        self.hidden_dim, self.num_experts, self.top_k, self.jitter_noise = h, e, top_k, 0.0
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(_BiasedMLP(h, f, act, down_bias, limit) for _ in range(e))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.view(b, s, h), router_logits


def _block_input(seed=0):
    return torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(seed))


def _assert_block_matches(new, block, x):
    with torch.no_grad():
        (got, got_logits), (want, want_logits) = new(x), block(x)
    torch.testing.assert_close(got_logits, want_logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("down_bias", [False, True], ids=["gate-up-biases", "all-biases"])
def test_linear_experts_with_biases_convert(down_bias):
    """Biases on gate/up only (the missing down bias is zeros) or on all three; the
    activation (GELU-tanh) comes from the experts' act_fn, checked on their forward."""
    block = MixtralSparseMoeBlock(down_bias=down_bias)
    new = from_module(block)
    assert new.cfg.activation == GatedActivation(kind="gelu_tanh") and new.cfg.expert_bias
    assert new.experts.layout.biases == ({"gate", "up", "down"} if down_bias else {"gate", "up"})
    if not down_bias:
        assert not new.experts.b2.any()
    _assert_block_matches(new, block, _block_input())
    unbiased = copy.deepcopy(block)                        # the biases matter
    with torch.no_grad():
        for name, p in unbiased.experts.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        assert (unbiased(_block_input())[0] - block(_block_input())[0]).abs().max() > 1e-2
    # The checkpoint is the original's, key for key; another block's loads back.
    original, saved = block.state_dict(), new.state_dict()
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], v) for k, v in original.items())
    other = MixtralSparseMoeBlock(down_bias=down_bias, seed=1)
    new.load_state_dict(other.state_dict())
    _assert_block_matches(new, other, _block_input(1))


def test_linear_experts_with_a_clamp_convert():
    """A ``limit`` on the per-expert MLP: the clamped SiLU gate is found by running the
    experts' own forward (probe rows reach past the bound)."""
    block = MixtralSparseMoeBlock(act="silu", limit=0.5)
    new = from_module(block)
    assert new.cfg.activation == GatedActivation(limit=0.5)
    _assert_block_matches(new, block, _block_input())
    unclamped = MixtralSparseMoeBlock(act="silu")           # same weights, no clamp
    with torch.no_grad():
        assert (unclamped(_block_input())[0] - block(_block_input())[0]).abs().max() > 1e-2


# --------------------------------------------------------------------------- refusals
def test_unknown_gate_function_is_refused_naming_it():
    """A registry experts module whose ``_apply_gate`` is none of comet's activations."""
    Qwen3MoeExperts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts

    class TanhGateExperts(Qwen3MoeExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.tanh(gate) * up

    model = coverage.build_tiny_model("qwen3_moe")
    _, block = find_moe_blocks(model)[0]
    experts = TanhGateExperts(block.experts.config)
    experts.load_state_dict(block.experts.state_dict())
    block.experts = experts
    with pytest.raises(NotImplementedError, match=r"gate function TanhGateExperts\._apply_gate "
                                                  r"computes none of the gated activations"):
        from_module(block)
    with pytest.raises(TypeError, match="TanhGateExperts._apply_gate"):
        patch_model(model)


@pytest.mark.skipif("step3p7" not in coverage.discover_families(), reason="no Step-3.7")
def test_step3p7_clamp_after_the_activation_is_refused():
    """Step-3.7's ``swiglu_limits`` clamp ``silu(gate)``, not the gate: not comet's clamped
    SiLU, so refused with the gate function named."""
    cls = coverage.model_class("step3p7")
    config = coverage.tiny_config("step3p7", cls)
    config.swiglu_limits = [1.0] * config.num_hidden_layers
    model = cls(config)
    _, block = find_moe_blocks(model)[0]
    with pytest.raises(NotImplementedError, match=r"Step3p7Experts\._apply_gate computes none "
                                                  r".*silu\(limit=1\)"):
        from_module(block)


@pytest.mark.parametrize("family, reason", [
    ("inkling2", r"soft-capped SwiGLU \(Inkling2SoftcappedSwiGLU"),
    ("muse_spark", r"a norm after each expert \(post_expert_norm"),
    ("nemotron_h", r"ungated experts \(up_proj -> relu2 -> down_proj\)"),
])
def test_other_variants_stay_refused(family, reason):
    if family not in coverage.discover_families():
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    _, block = find_moe_blocks(coverage.build_tiny_model(family))[0]
    with pytest.raises(NotImplementedError, match=reason):
        from_module(block)


def test_linear_experts_with_another_activation_are_refused():
    with pytest.raises(NotImplementedError, match="activation relu is not SiLU or GELU-tanh"):
        from_module(MixtralSparseMoeBlock(act="relu"))


# --------------------------------------------------------------------------- EP over gloo
#: The transformers families run expert-parallel: the variants, and DBRX's stacked experts.
EP_FAMILIES = FAMILIES + (["dbrx"] if HAS_DBRX else [])


def _ep_worker(rank, world, store, results):
    torch.set_num_threads(1)  # forked: keep clear of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ids = _tokens(seed=10 + rank)  # each rank serves its own batch
        for family in EP_FAMILIES:
            model = coverage.build_tiny_model(family)
            patched = patch_model(copy.deepcopy(model))
            assert all(b.local_experts * world == b.cfg.num_experts for b in _blocks(patched))
            want = _logits(model, ids)
            err = ((_logits(patched, ids) - want).abs().max() / want.abs().max()).item()
            results.put((rank, family, err))
        block = MixtralSparseMoeBlock(down_bias=True)
        new = from_module(block)
        assert new.local_experts == 2
        x = _block_input(seed=rank)
        with torch.no_grad():
            want = block(x)[0]
            err = ((new(x)[0] - want).abs().max() / want.abs().max()).item()
        results.put((rank, "linear experts", err))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", repr(err)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_expert_parallel_over_gloo_matches(tmp_path):
    """Two forked CPU ranks over gloo, half the experts (and their biases) each, each with
    its own tokens: the unfused expert-parallel path gives the unpatched model's logits
    (the variants, DBRX's stacked experts, per-expert nn.Linear experts with biases)."""
    codes, outcomes = gloo_ranks.fork(_ep_worker, 2, tmp_path / "store", (),
                                      expected=2 * (len(EP_FAMILIES) + 1))
    assert codes == [0, 0], outcomes
    assert {o[1] for o in outcomes} == set(EP_FAMILIES) | {"linear experts"}, outcomes
    assert max(o[2] for o in outcomes) < 1e-5, outcomes
