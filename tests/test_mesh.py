"""The (tp, ep) layout (comet.mesh) and its spec (comet.reference.mesh_forward): every
rank's shard partial sums compose to the layer's output, for tensor-parallel, expert-
parallel and hybrid layouts and both input conventions."""

import pytest
import torch

from comet import reference
from comet.activation import GatedActivation
from comet.mesh import MeshLayout
from routings import make_ids, make_tokens

#: (tp, ep) layouts of issue 37's acceptance.
LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2), (2, 4)]
GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)


def _layer(e=8, h=32, f=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, h, 2 * f, generator=g) * h ** -0.5,
            torch.randn(e, f, h, generator=g) * f ** -0.5,
            torch.randn(e, 2 * f, generator=g), torch.randn(e, h, generator=g))


def _inputs(mesh, convention, e=8, k=2, h=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = make_tokens("random", mesh.world, 12, g)
    ids = make_ids("random", tokens, e, k, g)
    xs = [torch.randn(m, h, generator=g) * 3 for m in tokens]
    ws = [torch.rand(i.shape, generator=g) for i in ids]
    if convention == "replicated":        # every TP group passes its first rank's tokens
        for r in range(mesh.world):
            first = mesh.tp_group(r)[0]
            xs[r], ids[r], ws[r] = xs[first], ids[first], ws[first]
    return xs, ids, ws


@pytest.mark.parametrize("convention", ["sequence", "replicated"])
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_tensor_parallel_and_hybrid_shards_compose_to_the_layer(tp, ep, convention):
    """With GPT-OSS's clamped SwiGLU and expert biases (b2 added once per token and
    expert), -1 ids included: each rank's output is the full layer's on its tokens."""
    mesh = MeshLayout(tp=tp, ep=ep)
    w13, w2, b13, b2 = _layer()
    xs, ids, ws = _inputs(mesh, convention)
    ids[0][::3, 1] = -1
    got = reference.mesh_forward(xs, ids, ws, w13, w2, mesh, convention, activation=GPT_OSS,
                                 b13=b13, b2=b2)
    for r in range(mesh.world):
        want = reference.moe_forward(xs[r], ids[r], ws[r], w13, w2, activation=GPT_OSS,
                                     b13=b13, b2=b2)
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_shards_cover_the_weights_once():
    mesh = MeshLayout(tp=4, ep=2)
    w13, w2, b13, b2 = _layer()
    f = w2.shape[1]
    for e_rank in range(mesh.ep):
        group = [mesh.shard(r, w13, w2, b13, b2) for r in mesh.tp_group(mesh.rank(e_rank, 0))]
        sel = slice(e_rank * 4, (e_rank + 1) * 4)
        torch.testing.assert_close(torch.cat([s["w2"] for s in group], 1), w2[sel])
        gates = torch.cat([s["w13"][..., :f // 4] for s in group], -1)
        ups = torch.cat([s["w13"][..., f // 4:] for s in group], -1)
        torch.testing.assert_close(torch.cat([gates, ups], -1), w13[sel])
        assert [s["b2"] is not None for s in group] == [True, False, False, False]


def test_tensor_parallel_layout_numbering_and_groups():
    mesh = MeshLayout(tp=2, ep=4)
    assert mesh.world == 8
    assert [mesh.coords(r) for r in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]
    assert all(mesh.rank(*mesh.coords(r)) == r for r in range(8))
    assert mesh.tp_group(5) == [4, 5] and mesh.ep_group(5) == [1, 3, 5, 7]
    assert mesh.expert_range(16, 5) == range(8, 12) and mesh.ffn_range(64, 5) == range(32, 64)


def test_tensor_parallel_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="tp"):
        MeshLayout(tp=0)
    with pytest.raises(ValueError, match="num_experts"):
        MeshLayout(tp=1, ep=3).check(8, 64)
    with pytest.raises(ValueError, match="intermediate_size"):
        MeshLayout(tp=4, ep=1).check(8, 96)          # shards of 24: not multiples of 16
    with pytest.raises(ValueError, match="rank"):
        MeshLayout(tp=2, ep=2).coords(4)
    mesh = MeshLayout(tp=2, ep=1)
    w13, w2, _, _ = _layer()
    xs, ids, ws = _inputs(mesh, "sequence")
    with pytest.raises(ValueError, match="replicated"):
        reference.mesh_forward(xs, ids, ws, w13, w2, mesh, "replicated")
    with pytest.raises(ValueError, match="2 ranks"):
        reference.mesh_forward(xs[:1], ids[:1], ws[:1], w13, w2, mesh)
    with pytest.raises(ValueError, match="convention"):
        reference.mesh_forward(xs, ids, ws, w13, w2, mesh, "allgather")
