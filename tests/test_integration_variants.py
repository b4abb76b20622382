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

transformers = pytest.importorskip("transformers")

from comet.activation import SILU, GatedActivation  # noqa: E402
from comet.integrations import (  # noqa: E402
    EXPERTS_BACKEND_REGISTERED, CometMoEBlock, coverage, find_moe_blocks, from_module,
    patch_model)
from comet.weights import gate_up_first  # noqa: E402

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


@pytest.fixture
def fake_world():
    """``start(rank, world_size)``: a fake process group (enough to build layers)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    def start(rank, world_size):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank,
                                world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


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
    with torch.no_grad():
        new.experts.w13.zero_()
        new.experts.b13.zero_()
    new.load_state_dict(original)
    assert all(torch.equal(new.state_dict()[k], v) for k, v in saved.items())
    new.load_state_dict(saved)
    assert all(torch.equal(new.state_dict()[k], v) for k, v in saved.items())


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
    from comet.integrations.experts import _fused_to_kernel, _gate_then_up
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
def _ep_worker(rank, world, store, results):
    torch.set_num_threads(1)  # forked: keep clear of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ids = _tokens(seed=10 + rank)  # each rank serves its own batch
        for family in FAMILIES:
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
    its own tokens: the unfused expert-parallel path gives the unpatched model's logits."""
    ctx = torch.multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ep_worker, args=(r, 2, tmp_path / "store", results))
             for r in range(2)]
    for p in procs:
        p.start()
    outcomes = []
    while len(outcomes) < 2 * (len(FAMILIES) + 1) and "error" not in {o[1] for o in outcomes}:
        outcomes.append(results.get(timeout=180))
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():   # its peer failed: it waits in a collective
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], outcomes
    assert {o[1] for o in outcomes} == set(FAMILIES) | {"linear experts"}, outcomes
    assert max(o[2] for o in outcomes) < 1e-5, outcomes
