"""Tensor-parallel and hybrid (tp, ep) layouts in ``CometMoE`` and the transformers
integration (issue 37), on the CPU paths: the unfused :func:`comet.baseline.mesh_moe_forward`
over forked gloo ranks (tests/gloo_ranks.py), layers built from full weights and held to
:func:`comet.reference.mesh_forward` and to the unsharded layer; whole tiny transformers
models patched with a layout against the unpatched model; the checkpoint of a rank's F
shard in the model's own keys; and the errors (a layout that cannot shard the layer,
training). The fused kernels' side of a layout is tests/test_tensor_parallel.py's.

Tolerances: fp32 within atol = rtol = 1e-5, as tests/test_integrations.py (only the
summation order differs: a TP layout adds each token's partial sums shard by shard).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gloo_ranks
from state_dicts import assert_both_load_back
from comet import CometMoE, reference
from comet.activation import GatedActivation
from comet.integrations import CometMoEBlock, coverage, find_moe_blocks, from_module, patch_model
from comet.integrations.experts import expert_layout
from comet.integrations.layout import expert_sizes, reference_biases, reference_weights
from comet.integrations.tiny_models import available_families, build_tiny_model
from comet.mesh import CONVENTIONS, MeshLayout
from comet.weights import gate_up_first, interleave_gate_up

try:                     # an optional extra: only the integration's tests need it
    import transformers
except ImportError:
    transformers = None

H, F, E, K = 32, 64, 8, 2

#: CometMoE variants over gloo: the plain layer, expert biases (b2 added by TP rank 0
#: alone) with another activation, and a gated shared expert (replicated).
VARIANTS = {
    "silu": {},
    "biases-gelu": dict(expert_bias=True, activation=GatedActivation(kind="gelu_tanh")),
    "shared": dict(num_shared_experts=1, shared_intermediate_size=48, shared_expert_gate=True),
}
LAYOUTS = pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 1)],
                                  ids=["tensor_parallel-2x1", "hybrid-2x2", "tensor_parallel-4x1"])
needs_gloo = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")


def _full_layer(seed: int, **kwargs) -> CometMoE:
    """An unsharded single-rank layer with every parameter random (biases too). Build it
    before a process group exists: afterwards a layer's default group is the world."""
    torch.manual_seed(seed)
    layer = CometMoE(E, K, H, F, dtype=torch.float32, **kwargs)
    if layer.experts.b13 is not None:
        with torch.no_grad():
            layer.experts.b13.normal_()
            layer.experts.b2.normal_()
    return layer


def _shard_state(full: CometMoE, mesh: MeshLayout, rank: int) -> dict:
    """``full``'s state dict as rank ``rank`` of ``mesh`` holds it: its F shard of its
    experts (:meth:`MeshLayout.shard`, interleaved), the rest (and ``b2``) replicated."""
    ex = full.experts
    b13 = None if ex.b13 is None else gate_up_first(ex.b13)
    shard = mesh.shard(rank, ex.gate_up(), ex.w2, b13, ex.b2)
    state = full.state_dict()
    state["experts.w13"], state["experts.w2"] = interleave_gate_up(shard["w13"]), shard["w2"]
    if b13 is not None:
        mine = mesh.expert_range(E, rank)
        state["experts.b13"] = interleave_gate_up(shard["b13"])
        state["experts.b2"] = ex.b2[mine.start:mine.stop]
    return state


def _inputs(mesh: MeshLayout, convention: str, seed: int):
    """Every rank's ``(x, ids, weights)``: under ``"sequence"`` its own tokens (a count of
    its own, one rank none), under ``"replicated"`` its TP group's. Routing includes
    ``-1`` (no expert) slots."""
    xs, ids, wts = [], [], []
    for r in range(mesh.world):
        source = r if convention == "sequence" else mesh.tp_group(r)[0]
        gen = torch.Generator().manual_seed(seed + source)
        m = 0 if convention == "sequence" and source == 1 else 5 + 3 * source
        xs.append(torch.randn(m, H, generator=gen))
        i = torch.randint(0, E, (m, K), generator=gen)
        ids.append(torch.where(torch.rand(m, K, generator=gen) < 0.2, -1, i))
        wts.append(torch.rand(m, K, generator=gen))
    return xs, ids, wts


def _module_worker(rank, world, store, tp, results):
    torch.set_num_threads(1)  # forked: keep clear of the parent's OpenMP pool
    mesh = MeshLayout(tp=tp, ep=world // tp)
    fulls = {name: _full_layer(i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}
    with gloo_ranks.group(rank, world, store, results):
        for name, full in fulls.items():
            for convention in CONVENTIONS:
                xs, ids, wts = _inputs(mesh, convention, seed=100)
                layer = CometMoE(E, K, H, F, dtype=torch.float32, mesh=mesh,
                                 convention=convention, **VARIANTS[name])
                layer.load_state_dict(_shard_state(full, mesh, rank))
                assert layer.experts.w13.shape == (E // mesh.ep, H, 2 * F // tp)
                assert layer.expert_offset == mesh.expert_range(E, rank).start
                ex = full.experts
                want = reference.mesh_forward(
                    xs, ids, wts, ex.gate_up(), ex.w2, mesh, convention,
                    activation=full.cfg.activation,
                    b13=None if ex.b13 is None else gate_up_first(ex.b13), b2=ex.b2)[rank]
                with torch.no_grad():
                    routed = layer.experts_forward(xs[rank], ids[rank], wts[rank])
                    whole, unsharded = layer(xs[rank]), full(xs[rank])
                torch.testing.assert_close(routed, want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(whole, unsharded, atol=1e-5, rtol=1e-5)
                # Every rank refuses a call that needs gradients alike: none waits.
                try:
                    layer(xs[rank])
                    raise AssertionError("a TP call with gradients did not raise")
                except NotImplementedError as err:
                    assert "tensor-parallel" in str(err)
                results.put((rank, name, convention))


@needs_gloo
@LAYOUTS
def test_tensor_parallel_and_hybrid_module_matches_the_spec_over_gloo(tp, ep, tmp_path):
    """CometMoE with a (tp, ep) layout on forked gloo ranks, each holding its F shard of
    its experts (from the full layer's weights), both conventions, a rank with no tokens
    under "sequence": the routed experts equal reference.mesh_forward, the whole layer
    (router and shared expert replicated) the unsharded layer's output."""
    world = tp * ep
    codes, items = gloo_ranks.fork(_module_worker, world, tmp_path / "store", (tp,),
                                   expected=world * len(VARIANTS) * len(CONVENTIONS))
    assert codes == [0] * world, items
    assert all(i[1] != "error" for i in items), items


def _check_replicated_worker(rank, world, store, tp, results):
    torch.set_num_threads(1)
    mesh = MeshLayout(tp=tp, ep=world // tp)
    full = _full_layer(0)
    with gloo_ranks.group(rank, world, store, results):
        layer = CometMoE(E, K, H, F, dtype=torch.float32, mesh=mesh, convention="replicated",
                         check_replicated=True)
        layer.load_state_dict(_shard_state(full, mesh, rank))
        xs, ids, wts = _inputs(mesh, "replicated", seed=7)
        with torch.no_grad():
            same = layer.experts_forward(xs[rank], ids[rank], wts[rank])
            layer.check_replicated = False
            torch.testing.assert_close(same, layer.experts_forward(xs[rank], ids[rank],
                                                                   wts[rank]))
            layer.check_replicated = True
            # TP rank 1 of each group: one routing weight off, then one token more.
            bad_w = wts[rank].clone()
            bad_x = xs[rank]
            if mesh.coords(rank)[1] == 1:
                bad_w[0, 0] += 0.5
                bad_x = torch.cat([xs[rank], xs[rank][:1]])
            for x, w, ids_r, what in ((xs[rank], bad_w, ids[rank], "topk_weights"),
                                      (bad_x, None, None, "tokens")):
                try:
                    if w is None:
                        layer(x)
                    else:
                        layer.experts_forward(x, ids_r, w)
                    raise AssertionError("mismatched replicated inputs did not raise")
                except ValueError as err:
                    assert f"passed different {what}" in str(err), err
            # Nothing is left half-done: the next good call works.
            torch.testing.assert_close(layer.experts_forward(xs[rank], ids[rank], wts[rank]),
                                       same)
        results.put((rank, "ok"))


@needs_gloo
@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)], ids=["tensor_parallel-2x1", "hybrid-2x2"])
def test_tensor_parallel_check_replicated_names_the_mismatch_on_every_rank(tp, ep, tmp_path):
    """``check_replicated=True``: equal inputs pass (same output as unchecked); a TP rank
    with another routing weight, or another token count, makes every rank of its group
    raise the same ValueError before anything runs, and the layer works after."""
    world = tp * ep
    codes, items = gloo_ranks.fork(_check_replicated_worker, world, tmp_path / "store", (tp,),
                                   expected=world)
    assert codes == [0] * world, items
    assert all(i[1] == "ok" for i in items), items


def test_tensor_parallel_check_replicated_needs_the_replicated_convention(fake_world):
    fake_world(0, 2)
    with pytest.raises(ValueError, match="replicated convention of a layout with tp > 1"):
        CometMoE(E, K, H, F, mesh=MeshLayout(2, 1), convention="sequence",
                 check_replicated=True, device="meta")


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh=MeshLayout(2, 2)), r"tp \* ep = 4 ranks, but the process group has 2"),
    (dict(mesh=MeshLayout(2, 1), intermediate_size=48), r"intermediate_size \(48\).*tp \(2\)"),
    (dict(mesh=MeshLayout(2, 1), intermediate_size=16), r"intermediate_size \(16\).*16"),
    (dict(mesh=MeshLayout(1, 2), num_experts=3), r"num_experts \(3\).*ep \(2\)"),
    (dict(mesh=MeshLayout(2, 1), convention="tensor"), r"convention must be one of"),
    (dict(convention="tensor"), r"convention must be one of"),
    (dict(tp_group=object()), r"tp_group and ep_group together"),
])
def test_tensor_parallel_bad_layouts_raise_value_error(kwargs, match, fake_world):
    fake_world(0, 2)
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F,
                dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=match):
        CometMoE(**{**args, **kwargs})


def test_tensor_parallel_layout_of_another_type_is_a_type_error(fake_world):
    fake_world(0, 2)
    with pytest.raises(TypeError, match="MeshLayout or a torch DeviceMesh"):
        CometMoE(E, K, H, F, mesh=(2, 1), device="meta")


def test_tensor_parallel_layout_without_distributed_says_so():
    with pytest.raises(ValueError, match="has 1 .*torch.distributed is not initialised"):
        CometMoE(E, K, H, F, mesh=MeshLayout(2, 1), device="meta")


def test_tensor_parallel_layout_from_a_device_mesh(fake_world):
    """A DeviceMesh ("ep", "tp") gives the same layer as its MeshLayout; one that is not
    numbered TP-major, or passed with a group, is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    fake_world(3, 4)
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    layer = CometMoE(E, K, H, F, mesh=dm, device="meta")
    assert layer.mesh == MeshLayout(tp=2, ep=2) and layer.par.rank == 3
    assert layer.expert_offset == 4 and layer.ffn_range == range(32, 64)
    assert "tp=2, ep=2, rank=3, convention=sequence" in repr(layer)
    with pytest.raises(ValueError, match="not both"):
        CometMoE(E, K, H, F, mesh=dm, group=dist.group.WORLD, device="meta")


def test_tensor_parallel_training_raises_not_implemented(fake_world):
    """A TP layer whose call needs gradients (grad mode, parameters that require them)
    raises before anything is exchanged -- the same check guards the fused path, which
    the call reaches only past it. Rank 1 holds b2 but does not add it."""
    fake_world(1, 2)
    layer = CometMoE(E, K, H, F, dtype=torch.float32, mesh=MeshLayout(2, 1), expert_bias=True)
    assert layer.experts.b2 is not None and layer.experts.added_b2 is None
    with pytest.raises(NotImplementedError, match=r"training in tensor-parallel layouts.*"
                                                  r"torch.no_grad\(\)"):
        layer(torch.randn(4, H))
    x = torch.randn(4, H, requires_grad=True)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        layer.experts_forward(x, torch.zeros(4, K, dtype=torch.int64), torch.ones(4, K))


# --------------------------------------------------------------------------- transformers
#: Tiny models over gloo: fused 5.x experts (Mixtral), a shared expert (Qwen2-MoE),
#: grouped sigmoid routing (DeepSeek-V3), dense experts (Llama-4), and from the coverage
#: models GPT-OSS (biases, alternating gate/up) and DBRX (stacked experts).
TINY = [f for f in ("mixtral", "qwen2_moe", "deepseek_v3", "llama4")
        if transformers is not None and f in available_families()]
COVERAGE = [f for f in ("gpt_oss", "dbrx")
            if transformers is not None and f in coverage.discover_families()]
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers")


def _build(family: str, seed: int = 0):
    if family in COVERAGE:
        return coverage.build_tiny_model(family, seed=seed)
    return build_tiny_model(family, seed=seed)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _model_worker(rank, world, store, tp, families, results):
    torch.set_num_threads(1)
    mesh = MeshLayout(tp=tp, ep=world // tp)
    with gloo_ranks.group(rank, world, store, results):
        for family in families:
            model = _build(family)
            for convention in CONVENTIONS:
                # "sequence": each rank runs the model on its own batch (lengths differ);
                # "replicated": a TP group's ranks on the same one.
                source = rank if convention == "sequence" else rank // tp
                seq = 12 + 2 * (rank % tp) if convention == "sequence" else 12
                ids = torch.randint(3, 256, (2, seq),
                                    generator=torch.Generator().manual_seed(10 + source))
                patched = patch_model(copy.deepcopy(model), mesh=mesh, convention=convention)
                blocks = [m for m in patched.modules() if isinstance(m, CometMoEBlock)]
                assert blocks and all(
                    b.experts.w2.shape[1] * tp == b.cfg.intermediate_size
                    and b.local_experts * mesh.ep == b.cfg.num_experts for b in blocks)
                err = (_logits(patched, ids) - _logits(model, ids)).abs().max().item()
                results.put((rank, family, convention, err))
            # The checkpoint in the model's keys: the full one loads into a patched model
            # of other weights, and so does what a rank saved (its shard), on that rank.
            saved = patched.state_dict()
            assert saved.keys() == model.state_dict().keys()
            for state in (model.state_dict(), saved):
                other = patch_model(_build(family, seed=1), mesh=mesh)
                other.load_state_dict(state)
                err = (_logits(other, ids) - _logits(model, ids)).abs().max().item()
                results.put((rank, family, "state_dict", err))


@needs_gloo
@needs_transformers
@pytest.mark.parametrize("tp, ep, families", [
    (2, 1, TINY + COVERAGE), (2, 2, [f for f in ("mixtral", "gpt_oss") if f in TINY + COVERAGE])],
    ids=["tensor_parallel-2x1", "hybrid-2x2"])
def test_tensor_parallel_and_hybrid_patched_models_match_over_gloo(tp, ep, families, tmp_path):
    """Tiny transformers models patched with a (tp, ep) layout on forked gloo ranks give
    the unpatched model's logits, both conventions; a full checkpoint and a rank's own
    (saved in the model's keys) load into a patched model and give them too."""
    world = tp * ep
    codes, items = gloo_ranks.fork(_model_worker, world, tmp_path / "store", (tp, families),
                                   expected=world * len(families) * (len(CONVENTIONS) + 2),
                                   timeout=300)
    assert codes == [0] * world, items
    assert all(i[1] != "error" for i in items), items
    assert max(i[3] for i in items) < 1e-5, items


@needs_transformers
def test_tensor_parallel_layout_that_cannot_shard_a_block_is_rejected(fake_world):
    """Tiny Mixtral's F = 32 does not split over tp = 4 into multiples of 16: ValueError
    naming the block class, and nothing is replaced."""
    from comet.integrations import count_patched
    model = build_tiny_model("mixtral")
    fake_world(0, 4)
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock.*intermediate_size \(32\)"
                                         r".*tp \(4\)"):
        patch_model(model, mesh=MeshLayout(tp=4, ep=1))
    assert count_patched(model) == 0


class _LinearExpert(nn.Module):
    """A 4.x per-expert MLP with biases: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, h, f):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, f), nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """transformers 4.x's Mixtral block, as comet converts it (by this class name): a
    router and a ``ModuleList`` of per-expert MLPs (only their state matters here)."""

    def __init__(self, h=64, f=32, e=4, top_k=2):
        super().__init__()
        torch.manual_seed(0)
        self.hidden_dim, self.num_experts, self.top_k, self.jitter_noise = h, e, top_k, 0.0
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(_LinearExpert(h, f) for _ in range(e))


def _block(kind: str) -> nn.Module:
    if kind == "linear":
        return MixtralSparseMoeBlock()
    family = {"fused": "mixtral", "fused-biases": "gpt_oss", "stacked": "dbrx"}[kind]
    if family not in available_families() + COVERAGE:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    return find_moe_blocks(_build(family))[0][1]


@needs_transformers
@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("kind", ["fused", "fused-biases", "stacked", "linear"])
def test_tensor_parallel_block_keeps_and_saves_its_shard(kind, rank, fake_world):
    """Rank ``rank`` of a (2, 2) layout keeps its F shard of its experts (what
    MeshLayout.shard gives of the full weights; b2 whole, added by TP rank 0 only); it
    saves them in the replaced module's keys, and both the full checkpoint and its own
    load back. Each layout kind: fused (GPT-OSS: biases, alternating gate/up), stacked
    (DBRX), per-expert nn.Linear with biases."""
    block = _block(kind)
    layout = expert_layout(block.experts)
    e, _, _ = expert_sizes(block.experts, layout)
    w13, w2 = reference_weights(block.experts, layout, 0, e)
    b13, b2 = reference_biases(block.experts, layout, 0, e)
    original = {k: v.clone() for k, v in block.state_dict().items()}
    mesh = MeshLayout(tp=2, ep=2)
    fake_world(rank, mesh.world)
    new = from_module(block, mesh=mesh)
    want = mesh.shard(rank, w13.detach(), w2.detach(),
                      None if b13 is None else b13.detach(), None if b2 is None else b2.detach())
    assert torch.equal(gate_up_first(new.experts.w13), want["w13"])
    assert torch.equal(new.experts.w2, want["w2"])
    mine = mesh.expert_range(e, rank)
    if b13 is not None:
        assert torch.equal(gate_up_first(new.experts.b13), want["b13"])
        assert torch.equal(new.experts.b2, b2[mine.start:mine.stop])
        assert (new.experts.added_b2 is None) == (rank % 2 == 1)
    saved = new.state_dict()
    # Per-expert keys: this rank's experts' (under their global index), as under EP.
    kept = {k for k in original if kind != "linear" or not k.startswith("experts.")
            or int(k.split(".")[1]) in mine}
    assert saved.keys() == kept
    assert_both_load_back(new, original, saved)
    assert torch.equal(gate_up_first(new.experts.w13), want["w13"])


@needs_transformers
def test_tensor_parallel_shard_of_another_layout_is_a_size_mismatch(fake_world):
    """A fused checkpoint whose F is neither the model's nor this rank's shard."""
    block = _block("fused")
    original = block.state_dict()
    fake_world(0, 2)
    new = from_module(block, mesh=MeshLayout(2, 1))
    quarter = dict(original, **{k: v[:, :v.shape[1] // 4] if k.endswith("gate_up_proj")
                                else v[..., :v.shape[-1] // 4] for k, v in original.items()
                                if k.startswith("experts.")})
    with pytest.raises(RuntimeError, match="size mismatch for experts.gate_up_proj/down_proj"):
        new.load_state_dict(quarter)
