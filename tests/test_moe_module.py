"""CometMoE as a module on the CPU: shapes, routing in and out, shared experts, the spec,
and the errors a caller gets for wrong inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comet import CometMoE, MoEConfig, reference

H, F, E, K = 32, 16, 8, 2


def _layer(**kwargs) -> CometMoE:
    torch.manual_seed(0)
    kwargs.setdefault("dtype", torch.float32)
    return CometMoE(E, K, H, F, **kwargs)


def _x(tokens=10, dtype=torch.float32, seed=1):
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _expected(layer: CometMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's function written with comet.reference only (fp32)."""
    logits = x.float() @ layer.gate.weight.float().t()
    weights, ids = reference.route(logits, layer.cfg, layer.gate.e_score_correction_bias)
    y = reference.moe_forward(x, ids, weights, layer.experts.w13, layer.experts.w2)
    if layer.shared_expert is not None:
        w13, w2 = layer.shared_expert.fused_weights()
        gate = None if layer.shared_expert_gate is None else layer.shared_expert_gate.weight[0]
        y = y + reference.shared_mlp(x, w13, w2, gate)
    return y


# --------------------------------------------------------------------------- behaviour
def test_tokens_by_hidden_matches_the_reference():
    layer = _layer()
    x = _x()
    with torch.no_grad():
        y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, _expected(layer, x), atol=1e-5, rtol=1e-5)


def test_batch_seq_hidden_keeps_its_shape():
    layer = _layer()
    x = _x(12).view(3, 4, H)
    with torch.no_grad():
        y = layer(x)
        flat = layer(x.reshape(12, H))
    assert y.shape == (3, 4, H)
    torch.testing.assert_close(y.reshape(12, H), flat)


def test_bf16_layer_matches_the_reference_within_bf16():
    layer = _layer(dtype=torch.bfloat16)
    x = _x(dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = _expected(layer, x)
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_output_router_logits():
    layer = _layer()
    x = _x().view(2, 5, H)
    with torch.no_grad():
        y, logits = layer(x, output_router_logits=True)
    assert y.shape == x.shape and logits.shape == (10, E)
    torch.testing.assert_close(logits, x.reshape(10, H) @ layer.gate.weight.t())


def test_precomputed_routing_equals_the_router_and_reports_no_logits():
    layer = _layer()
    x = _x()
    with torch.no_grad():
        _, weights, ids = layer.gate(x)
        y, logits = layer(x, ids, weights, output_router_logits=True)
        torch.testing.assert_close(y, layer(x))
    assert logits is None


def test_minus_one_ids_contribute_nothing():
    layer = _layer()
    x = _x(6)
    ids = torch.tensor([[0, -1], [-1, -1], [3, 5], [-1, 7], [2, 2], [-1, 0]])
    weights = torch.rand(6, K, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x, ids, weights)
    kept = torch.where(ids >= 0, ids, torch.zeros_like(ids))
    expected = reference.moe_forward(x, kept, torch.where(ids >= 0, weights, 0.0),
                                     layer.experts.w13, layer.experts.w2)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[1], torch.zeros(H))


def test_int32_ids_and_bf16_weights_are_accepted():
    layer = _layer()
    x = _x()
    with torch.no_grad():
        _, weights, ids = layer.gate(x)
        y = layer(x, ids.to(torch.int32), weights.to(torch.bfloat16))
    torch.testing.assert_close(y, layer(x, ids, weights.to(torch.bfloat16).float()))


def test_shared_expert_with_sigmoid_gate():
    layer = _layer(num_shared_experts=1, shared_intermediate_size=48, shared_expert_gate=True)
    assert layer.shared_expert.gate_proj.weight.shape == (48, H)
    assert layer.shared_expert_gate.weight.shape == (1, H)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _expected(layer, x), atol=1e-5, rtol=1e-5)
        routed_only = layer(x, torch.full((10, K), -1), torch.zeros(10, K))
        gate = torch.sigmoid(x @ layer.shared_expert_gate.weight.t())
        torch.testing.assert_close(routed_only, gate * layer.shared_expert(x), atol=1e-6,
                                   rtol=1e-5)


def test_shared_experts_without_gate_default_width():
    layer = _layer(num_shared_experts=2)
    assert layer.shared_expert.gate_proj.weight.shape == (2 * F, H)
    assert layer.shared_expert_gate is None
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _expected(layer, x), atol=1e-5, rtol=1e-5)


def test_grouped_sigmoid_router_matches_the_reference():
    layer = _layer(router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   score_correction_bias=True)
    with torch.no_grad():
        layer.gate.e_score_correction_bias.copy_(0.1 * torch.randn(E))
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _expected(layer, x), atol=1e-5, rtol=1e-5)


def test_from_config_builds_the_same_layer():
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F,
                    dtype=torch.float32, max_tokens=64)
    layer = CometMoE.from_config(cfg)
    assert layer.cfg == cfg and layer.local_experts == E and layer.expert_offset == 0


def test_parameter_layout():
    layer = _layer()
    assert layer.experts.w13.shape == (E, H, 2 * F)
    assert layer.experts.w2.shape == (E, F, H)
    assert layer.gate.weight.shape == (E, H)


def test_expert_parallel_layout_without_a_mesh():
    """No mesh: expert parallelism over the group -- every F column, b2 added here."""
    from comet.mesh import MeshLayout
    layer = _layer(expert_bias=True)
    assert layer.mesh == MeshLayout(tp=1, ep=1) and layer.ffn_range == range(F)
    assert layer.experts.added_b2 is layer.experts.b2
    assert layer.extra_repr() == (f"experts={E} (local {E}), top_k={K}, hidden={H}, "
                                  f"ffn={F}, ep=1, rank=0, router=softmax")


def test_a_tile_reaches_the_fused_layer():
    """``tile=``: the fused kernels run the caller's TileConfig (here layer1's column-split
    reduce instead of the scatter epilogue); anything else is a TypeError."""
    from comet.config import TileConfig
    tile = TileConfig().with_fields(layer1_scatter=False)
    layer = _layer(tile=tile)
    assert layer.fused_layer().tile == tile
    assert _layer().fused_layer().tile.variant.layer1_scatter
    with pytest.raises(TypeError, match="TileConfig"):
        _layer(tile={"layer1_scatter": False})


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("shape", [(10, H + 16), (2, 5, H - 16), (H,), (1, 2, 5, H)])
def test_wrong_hidden_shape(shape):
    with pytest.raises(ValueError, match=rf"\[tokens, {H}\]"):
        _layer()(torch.randn(shape))


def test_wrong_dtype():
    with pytest.raises(TypeError, match="dtype"):
        _layer()(_x(dtype=torch.bfloat16))


def test_wrong_device():
    layer = CometMoE(E, K, H, F, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="on cpu but the experts on meta"):
        layer(_x())


def test_not_a_tensor():
    with pytest.raises(TypeError, match="tensor"):
        _layer()([[0.0] * H])


def test_too_many_tokens():
    layer = _layer(max_tokens=8)
    layer(_x(8))
    with pytest.raises(ValueError, match="9 tokens exceed max_tokens=8"):
        layer(_x(9))


@pytest.mark.parametrize("bad", [E, -2])
def test_out_of_range_expert_ids(bad):
    ids = torch.zeros(10, K, dtype=torch.int64)
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=rf"\[-1, {E}\)"):
        _layer()(_x(), ids, torch.ones(10, K))


def test_only_one_of_ids_and_weights():
    ids = torch.zeros(10, K, dtype=torch.int64)
    with pytest.raises(ValueError, match="both"):
        _layer()(_x(), ids, None)
    with pytest.raises(ValueError, match="both"):
        _layer()(_x(), None, torch.ones(10, K))


def test_routing_of_the_wrong_shape_or_type():
    layer = _layer()
    with pytest.raises(ValueError, match=r"\[10, 2\]"):
        layer(_x(), torch.zeros(10, K + 1, dtype=torch.int64), torch.ones(10, K + 1))
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(_x(), torch.zeros(10, K), torch.ones(10, K))
    with pytest.raises(TypeError, match="floating point"):
        layer(_x(), torch.zeros(10, K, dtype=torch.int64), torch.ones(10, K, dtype=torch.int64))


@pytest.mark.parametrize("kwargs, field", [
    (dict(hidden_size=40), "hidden_size"),
    (dict(top_k=E + 1), "top_k"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(n_group=3), "n_group"),
])
def test_bad_construction_names_the_field(kwargs, field):
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=F)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        CometMoE(**args)


def test_group_size_not_dividing_experts():
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=3)
    try:
        with pytest.raises(ValueError, match=r"num_experts \(8\).*world_size \(3\)"):
            _layer()
        layer = CometMoE(6, K, H, F, dtype=torch.float32, device="meta")
        assert layer.local_experts == 2 and layer.par.world_size == 3
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- torch.compile
def test_cpu_gradients_reach_every_parameter():
    layer = _layer()
    layer(_x()).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_inference_is_one_graph(backend):
    """Under no_grad the routed experts are one opaque op: fullgraph compiles (the
    layer's own Python has data-dependent shapes that would break the graph)."""
    layer = _layer()
    x = _x()
    ids = torch.randint(0, E, (10, K), generator=torch.Generator().manual_seed(2))
    w = torch.rand(10, K, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, want_ids = layer(x), layer(x, ids, w)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        torch.testing.assert_close(compiled(x), want)
        torch.testing.assert_close(compiled(_x(tokens=3)), layer(_x(tokens=3)))
        routed = torch.compile(lambda a, i, g: layer(a, i, g), fullgraph=True, backend=backend)
        torch.testing.assert_close(routed(x, ids, w), want_ids)


def test_compiled_training_keeps_the_gradients():
    """With autograd on, the CPU paths are traced as written (graph breaks allowed) so
    that the gradients are those of eager mode."""
    eager, compiled_layer = _layer(), _layer()
    x = _x()
    eager(x).square().sum().backward()
    torch._dynamo.reset()
    torch.compile(compiled_layer, backend="aot_eager")(x).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled_layer.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_the_op_passes_torch_library_checks():
    from comet import custom_op
    layer = _layer()
    x = _x()
    ids = torch.randint(0, E, (10, K), generator=torch.Generator().manual_seed(2))
    w = torch.rand(10, K, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(custom_op.routed_experts,
                            (x, ids, w, layer.experts.w13, layer.experts.w2, layer._op_key))


def test_a_copied_layer_compiles_to_itself():
    import copy
    layer = _layer()
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.experts.w2.mul_(2.0)
        x = _x()
        torch._dynamo.reset()
        got = torch.compile(twin, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(got, twin(x))
        assert not torch.allclose(got, layer(x))


def test_a_graph_that_outlived_its_layer_says_so():
    from comet import custom_op
    layer = _layer()
    key, w13, w2 = layer._op_key, layer.experts.w13.detach(), layer.experts.w2.detach()
    del layer
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        custom_op.routed_experts(_x(), torch.zeros(10, K, dtype=torch.int64),
                                 torch.ones(10, K), w13, w2, key)
