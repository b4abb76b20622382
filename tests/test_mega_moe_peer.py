"""The DeepGEMM SM90 FP8 Mega MoE peer (:mod:`comet.bench.mega_moe`) on the CPU: the operand
conversion against plain torch (the gate/up row order, the scales on DeepGEMM's 128 grid),
what it refuses, the unavailable paths of ``bind`` / ``load_mega_moe``, and a whole call
through a stand-in ``deep_gemm`` that lays out its buffer, asserts what DeepGEMM's host code
asserts and computes the kernel's recipe from the bytes it is handed, written apart from
:func:`comet.bench.mega_moe.emulate_recipe`. The real package runs on a GPU only
(``test_mega_moe_on_the_gpu``)."""

import glob
import types

import pytest
import torch
import torch.nn.functional as F

from comet.activation import SILU, GatedActivation
from comet.bench import mega_moe as mm
from comet.bench import records as rec
from comet.bench.peers import Peer, PeerUnavailable, build_peers, load_peers
from comet.cli import bench
from comet.config import MoEConfig
from comet.constants import interpreting
from comet.quant import E4M3, Fp8Weight, ScaleBlocks, quantize_rows, quantize_weight

E, K, H, FFN = 4, 2, 256, 256


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts(ffn: int = FFN, blocks: ScaleBlocks = ScaleBlocks(), parts: int = 2,
             seed: int = 0, hidden: int = H) -> tuple[Fp8Weight, Fp8Weight]:
    g = _gen(seed)
    gate_up = quantize_weight(torch.randn(E, 2 * ffn, hidden, generator=g) * hidden ** -0.5,
                              blocks, parts=parts)
    down = quantize_weight(torch.randn(E, hidden, ffn, generator=g) * ffn ** -0.5, blocks)
    return gate_up, down


def _expand(sf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """128 x 128 block scales ``[E, n/128, k/128]`` -> one per element ``[E, n, k]``."""
    return sf.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]


def _deinterleave(w: torch.Tensor, gran: int = mm.GATE_UP_GRAN) -> torch.Tensor:
    """The kernel's gate/up rows back to gate rows then up rows, by plain indexing."""
    f = w.shape[1] // 2
    gate = [(i // gran) * 2 * gran + i % gran for i in range(f)]
    up = [g + gran for g in gate]
    return w.view(torch.uint8)[:, gate + up].view(w.dtype)


# --------------------------------------------------------------------------- operands
def test_gate_and_up_rows_alternate_in_groups_of_eight():
    w = torch.arange(2 * 32 * 3, dtype=torch.float32).view(2, 32, 3)
    out = mm.interleave_gate_up_rows(w)
    # gate rows 0-15, up rows 16-31: gate 0-7, up 16-23, gate 8-15, up 24-31
    want = list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
    assert torch.equal(out, w[:, want]) and out.is_contiguous()
    q = w.to(E4M3)
    assert out.dtype == w.dtype and mm.interleave_gate_up_rows(q).dtype == E4M3
    assert torch.equal(mm.interleave_gate_up_rows(q).view(torch.uint8),
                       q.view(torch.uint8)[:, want])
    with pytest.raises(ValueError, match="multiple of 8"):
        mm.interleave_gate_up_rows(torch.zeros(1, 20, 2))


def test_the_gate_up_operand_keeps_every_row_with_its_block_scale():
    gate_up, _ = _experts()
    w, sf = mm.l1_operand(gate_up)
    assert w.dtype == E4M3 and w.shape == gate_up.weight.shape and w.is_contiguous()
    # Scales stay in block order (gate blocks, then up blocks), fp32, contiguous.
    assert sf.dtype == torch.float32 and sf.is_contiguous()
    assert sf.shape == (E, 2 * FFN // 128, H // 128) and torch.equal(sf, gate_up.scale_inv)
    # Row i of gate sits at 16 (i // 8) + i % 8, its up row 8 further on.
    bits, src = w.view(torch.uint8), gate_up.weight.view(torch.uint8)
    for i in (0, 7, 8, 100, FFN - 1):
        assert torch.equal(bits[:, 16 * (i // 8) + i % 8], src[:, i])
        assert torch.equal(bits[:, 16 * (i // 8) + 8 + i % 8], src[:, FFN + i])
    # Undone by indexing and dequantized on the 128 grid: the experts themselves.
    back = _deinterleave(w).float() * _expand(sf, 2 * FFN, H)
    assert torch.equal(back, gate_up.dequantize())


def test_one_grid_over_gate_and_up_gives_the_same_operand():
    g = _gen(3)
    w = torch.randn(E, 2 * FFN, H, generator=g)
    one, two = quantize_weight(w, parts=1), quantize_weight(w, parts=2)
    for a, b in zip(mm.l1_operand(one), mm.l1_operand(two)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b)


@pytest.mark.parametrize("blocks", [ScaleBlocks.per_tensor(), ScaleBlocks(256, 256),
                                    ScaleBlocks(128, None)], ids=["tensor", "256", "rows"])
def test_coarser_scale_grids_are_repeated_onto_the_128_grid_exactly(blocks):
    # 512 wide: a 256 grid has two blocks, each two of the 128 grid's.
    gate_up, down = _experts(ffn=512, blocks=blocks, hidden=512)
    for w, (_, sf) in ((gate_up, mm.l1_operand(gate_up)), (down, mm.l2_operand(down))):
        assert sf.shape == (E, w.n // 128, w.k // 128)
        assert torch.equal(w.weight.float() * _expand(sf, w.n, w.k), w.dequantize())


def test_finer_grids_and_ragged_widths_are_refused():
    w = torch.randn(E, 2 * FFN, H, generator=_gen())
    with pytest.raises(PeerUnavailable, match="1-wide blocks"):
        mm.l1_operand(quantize_weight(w, ScaleBlocks.per_channel(), parts=2))
    with pytest.raises(PeerUnavailable, match="64-wide blocks"):
        mm.l1_operand(quantize_weight(w, ScaleBlocks(128, 64), parts=2))
    # F = 192 (a TP shard): the halves are not whole 128 blocks, in either grid.
    odd = torch.randn(E, 2 * 192, H, generator=_gen())
    for parts in (1, 2):
        with pytest.raises(PeerUnavailable, match="multiples of 128"):
            mm.l1_operand(quantize_weight(odd, ScaleBlocks(64, 128), parts=parts))


def test_the_down_operand_is_the_weight_itself():
    _, down = _experts()
    w, sf = mm.l2_operand(down)
    assert torch.equal(w.view(torch.uint8), down.weight.view(torch.uint8))
    assert torch.equal(sf, down.scale_inv) and sf.shape == (E, H // 128, FFN // 128)


def test_swiglu_and_its_clamped_form_only():
    assert mm.activation_clamp(SILU) is None
    assert mm.activation_clamp(GatedActivation(limit=7.0)) == 7.0
    for act in (GatedActivation(kind="gelu_tanh"), GatedActivation(alpha=1.702, limit=7.0),
                GatedActivation(limit=7.0, up_offset=1.0)):
        with pytest.raises(PeerUnavailable, match="SwiGLU only"):
            mm.activation_clamp(act)


def test_the_shapes_its_host_code_refuses():
    assert mm.shape_reason(7168, 2048, 256, 8) is None          # DeepSeek-V3's layer
    assert mm.shape_reason(2048, 1408, 64, 4) is None           # qwen2-moe
    assert "4096" in mm.shape_reason(4096, 14336, 8, 2)         # Mixtral's F
    assert "4096" in mm.shape_reason(4096, 4224, 8, 2)
    assert "multiples of 128" in mm.shape_reason(4160, 1024, 8, 2)
    assert "top_k" in mm.shape_reason(2048, 1024, 64, 33)
    assert "ranks" in mm.shape_reason(2048, 1024, 6, 2, world=4)


def test_h_is_quantized_per_64_with_power_of_two_scales():
    # The scale only shows in e4m3's subnormals (steps of 2^-9 times the scale): 0.01 is 5
    # steps at scale 1, 3 steps at scale 2.
    h = torch.zeros(3, 128)
    h[0, 0], h[0, 1] = 448.0, 0.01           # amax / 448 = 1 exactly: scale 1, not 2
    h[0, 64], h[0, 65] = 449.0, 0.01         # just over: scale 2, 449 saturates to 448
    h[1, 5], h[1, 6] = -0.75, 3.3            # scale 2^-9 (0.75 / 448 in (2^-10, 2^-9))
    h[2, 64] = 1.0                           # a zero group next to a live one
    q = mm.quantize_pow2(h)
    assert q[0, 0] == 448.0 and q[0, 1] == 5 * 2 ** -9
    assert q[0, 64] == 448.0 and q[0, 65] == 3 * 2 ** -8
    assert q[1, 5] == -0.75 and q[1, 6] == torch.tensor(3.3).to(E4M3).float()
    assert (q[2, :64] == 0).all() and q[2, 64] == 1.0


# --------------------------------------------------------------------------- availability
def test_bind_says_which_ref_has_the_mega_moe():
    why = mm.bind(types.ModuleType("deep_gemm"))
    assert isinstance(why, str) and mm.ENTRY in why and "refs/pull/352" in why
    bare = types.ModuleType("deep_gemm")
    bare.fp8_mega_moe = lambda *a, **k: None
    why = mm.bind(bare)
    assert isinstance(why, str) and all(n in why for n in mm.SIZE_FNS)


def test_load_needs_one_hopper_rank():
    assert mm.load_mega_moe(torch.device("cpu")) == "needs a CUDA GPU"
    assert "one rank" in mm.load_mega_moe(torch.device("cuda"), world=2)
    loaded = load_peers([mm.NAME], torch.device("cpu"), 1, registry=mm.FP8_LAYER_PEERS)
    assert loaded == {mm.NAME: "needs a CUDA GPU"}


# --------------------------------------------------------------------------- stand-in
STANDIN_ALIGN = 8


def _standin(pre_dispatch: bool = False) -> tuple[types.ModuleType, dict]:
    """A ``deep_gemm`` whose ``fp8_mega_moe`` asserts the host contract and computes the
    kernel's recipe from the buffer's bytes and the interleaved weights."""
    state = {"calls": 0, "pre": 0}

    def size(ranks, experts, tokens, topk, h, f, fp8, activation):
        assert (ranks, fp8, activation) == (1, True, "swiglu")
        assert tokens % STANDIN_ALIGN == 0
        # 8-byte fields first so that every view's offset suits its dtype.
        parts = [("idx", tokens * topk * 8), ("wts", tokens * topk * 4),
                 ("x_sf", tokens * h // 128 * 4), ("x", tokens * h), ("ws", 64)]

        def views(buf):
            assert buf.dtype == torch.int8
            off, out = 0, {}
            for name, n in parts:
                out[name], off = buf[off:off + n], off + n
            # e4m3 as int8 bytes, as DeepGEMM's tvm-ffi build hands them out.
            return (out["x"].view(tokens, h), out["x_sf"].view(torch.float32).view(tokens, -1),
                    out["idx"].view(torch.int64).view(tokens, topk),
                    out["wts"].view(torch.float32).view(tokens, topk), None, None, None, None)
        state["views"], state["tokens"] = views, tokens
        return sum(n for _, n in parts), views

    def mega(y, l1, l2, buf, stats, recipe, activation, activation_clamp, fast_math):
        assert recipe == (128, 128, 128) and activation == "swiglu" and stats is None
        assert buf.group.rank() == 0 and buf.handle.buffer_ptrs == [buf.buffer.data_ptr()]
        assert buf.num_max_tokens_per_rank == state["tokens"]
        (w1, s1), (w2, s2) = l1, l2
        e, n2, h = w1.shape
        f = n2 // 2
        for w, sf, shape in ((w1, s1, (e, n2 // 128, h // 128)),
                             (w2, s2, (e, h // 128, f // 128))):
            assert w.dtype == E4M3 and w.is_contiguous()
            assert sf.dtype == torch.float32 and sf.is_contiguous() and sf.shape == shape
        t = y.shape[0]
        assert y.dtype == torch.bfloat16 and y.shape == (t, h) and t <= state["tokens"]
        x8, xs, idx, wts = state["views"](buf.buffer)[:4]
        x = x8[:t].view(E4M3).float() * xs[:t].repeat_interleave(128, 1)

        def blocks(s):
            return s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        rows = w1.view(torch.uint8).view(e, f // 8, 2, 8, h)
        gate = rows[:, :, 0].reshape(e, f, h).view(E4M3).float() * blocks(s1[:, :f // 128])
        up = rows[:, :, 1].reshape(e, f, h).view(E4M3).float() * blocks(s1[:, f // 128:])
        down = w2.float() * blocks(s2)
        acc = torch.zeros(t, h)
        for j in range(idx.shape[1]):
            ex = idx[:t, j]
            g = torch.einsum("th,tfh->tf", x, gate[ex])
            u = torch.einsum("th,tfh->tf", x, up[ex])
            if activation_clamp is not None:
                g, u = g.clamp(max=activation_clamp), u.clamp(-activation_clamp,
                                                              activation_clamp)
            hh = (F.silu(g) * u * wts[:t, j, None]).view(t, f // 64, 64)
            amax = hh.abs().amax(-1) * torch.tensor(1 / 448, dtype=torch.float32)
            exp = torch.where(amax > 0, torch.ceil(torch.log2(amax.double())), 0.0)
            scale = torch.pow(2.0, exp).float()[..., None]
            hq = ((hh / scale).clamp(-448, 448).to(E4M3).float() * scale).view(t, f)
            acc += torch.einsum("tf,thf->th", hq, down[ex]).to(torch.bfloat16).float()
        y.copy_(acc.to(torch.bfloat16))
        state["calls"] += 1

    def pre(x, ids, wts, bx, bxs, bidx, bw, t, group_size=128, routed_scaling_factor=1.0):
        assert ids.dtype == torch.int32 and x.dtype == torch.bfloat16 and x.shape[0] == t
        assert bx.shape[0] == bxs.shape[0] == bidx.shape[0] == bw.shape[0] == state["tokens"]
        xf = x.float().view(t, -1, 128)
        sc = xf.abs().amax(-1).clamp(min=1e-10) / 448
        q = (xf / sc[..., None]).clamp(-448, 448).to(E4M3).view(t, -1)
        bx[:t].view(torch.uint8).copy_(q.view(torch.uint8))
        bxs[:t].copy_(sc)
        bidx[:t].copy_(ids)
        bidx[t:] = -1
        bw[:t].copy_(wts * routed_scaling_factor)
        bw[t:] = 0
        state["pre"] += 1

    module = types.ModuleType("deep_gemm")
    module.fp8_mega_moe = mega
    module._C = types.SimpleNamespace(get_symm_buffer_size_for_sm90_mega_moe=size,
                                      get_token_alignment_for_mega_moe=lambda: STANDIN_ALIGN)
    if pre_dispatch:
        module.mega_moe_pre_dispatch_sm90 = pre
    return module, state


def _routing(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, K, generator=g), dim=1)
    return x, ids, wts


@pytest.mark.parametrize("pre_dispatch", [False, True], ids=["comet-staging", "pre-dispatch"])
@pytest.mark.parametrize("act", [SILU, GatedActivation(limit=0.5)], ids=["silu", "clamped"])
def test_a_call_through_the_standin_computes_its_recipe(pre_dispatch, act):
    module, state = _standin(pre_dispatch)
    bound = mm.bind(module)
    assert isinstance(bound, mm.MegaMoE) and bound.pre_dispatch == pre_dispatch
    gate_up, down = _experts()
    layer = bound.layer(gate_up, down, K, max_tokens=10, activation=act)
    assert layer.buffer.num_max_tokens_per_rank == 16        # 10 rounded up to 8s
    x, ids, wts = _routing(10)
    check = mm.check_layer(layer, x, ids, wts, gate_up, down, act)
    assert state["calls"] == 1 and state["pre"] == int(pre_dispatch)
    rows = layer.staged_rows(10)
    if not pre_dispatch:                       # comet's quantizer: torch's recipe exactly
        want = quantize_rows(x)
        assert torch.equal(rows.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(rows.scale, want.scale)
    assert torch.equal(layer.buffer.topk_idx[:10], ids)
    assert torch.equal(layer.buffer.topk_weights[:10], wts)
    # The stand-in computes the kernel's recipe apart from emulate_recipe: they agree up to
    # summation order; the recipes differ in h, so comet's emulation is further off.
    assert check.rel_l2_recipe <= 1e-3 and check.ok
    assert check.rel_l2_recipe < check.rel_l2 <= 0.1


def test_a_call_refuses_more_rows_than_its_buffer_and_the_wrong_top_k():
    module, _ = _standin()
    layer = mm.bind(module).layer(*_experts(), K, max_tokens=8)
    x, ids, wts = _routing(9)
    with pytest.raises(ValueError, match="<= 8"):
        layer(x, ids, wts)
    with pytest.raises(ValueError, match="top-2"):
        layer(x[:4], ids[:4, :1], wts[:4, :1])
    layer.close()
    assert layer.buffer is None and layer.l1 is None


def test_the_builder_serves_build_peers_at_ep1():
    module, state = _standin()
    bound = mm.bind(module)
    gate_up, down = _experts()
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=FFN,
                    max_tokens=20)
    peers = build_peers({mm.NAME: bound}, cfg, gate_up, down, None, torch.device("cpu"))
    assert peers.unavailable == {} and [p.name for p in peers.ready] == [mm.NAME]
    p = peers.ready[0]
    assert "MiB buffer for 24 tokens" in p.backend and "comet's dispatch quantizer" in p.backend
    x, ids, wts = _routing(20)
    assert p.layer(x, ids, wts).shape == (20, H) and state["calls"] == 1
    peers.close()
    # What it cannot run is a reason, not an exception.
    wide = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=4224)
    bf16 = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=FFN)
    biased = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=FFN,
                       expert_bias=True)
    gelu = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=FFN,
                     activation=GatedActivation(kind="gelu_tanh"))
    for c, w13, w2, why in ((wide, *_experts(ffn=4224), "4096"),
                            (bf16, gate_up.dequantize(), down.dequantize(), "Fp8Weight"),
                            (biased, gate_up, down, "biases"), (gelu, gate_up, down, "SwiGLU")):
        got = build_peers({mm.NAME: bound}, c, w13, w2, None, torch.device("cpu"))
        assert why in got.unavailable[mm.NAME], got.unavailable


@pytest.mark.skipif(not interpreting(), reason="the FP8 layer interpreted on the CPU")
def test_bench_checks_and_times_it_beside_the_fp8_layer(tmp_path, monkeypatch):
    """``comet bench --dtype fp8 --peers mega-moe``: the peer is held to its own recipe,
    its distance from comet's emulation reported, its whole calls timed in the record."""
    module, state = _standin()
    monkeypatch.setitem(mm.FP8_LAYER_PEERS, mm.NAME,
                        Peer(mm.NAME, lambda device, world: mm.bind(module)))
    assert bench.main(["--dtype", "fp8", "--peers", mm.NAME, "--tokens", "4", "--routing",
                       "uniform", "--layers", "moe", "--iters", "1", "--warmup", "0",
                       "--input-sets", "1", "--output-dir", str(tmp_path), "--no-plot"]) == 0
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    [f8] = [r for r in rec.read_json(path) if r["dtype"] == "fp8"]
    status = f8["peers"][mm.NAME]
    assert status["status"] == "timed", status
    assert status["rel_l2_recipe"] <= 1e-2 and 0 < status["rel_l2"] < 0.2
    assert f8[f"peer_{mm.NAME}_us"] > 0 and state["calls"] >= 2
    # A peer wrong by its own recipe is reported, not timed.
    monkeypatch.setattr(mm, "MAX_REL_L2", -1.0)   # the stand-in computes the recipe exactly
    assert bench.main(["--dtype", "fp8", "--peers", mm.NAME, "--tokens", "4", "--routing",
                       "uniform", "--layers", "moe", "--iters", "1", "--warmup", "0",
                       "--input-sets", "1", "--output-dir", str(tmp_path / "b"),
                       "--no-plot"]) == 0
    [path] = glob.glob(str(tmp_path / "b" / "bench-ep1-*.json"))
    [f8] = [r for r in rec.read_json(path) if r["dtype"] == "fp8"]
    assert f8["peers"][mm.NAME]["status"] == "wrong" and f8[f"peer_{mm.NAME}_us"] is None


def test_peers_mega_moe_needs_the_fp8_layer(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--peers", mm.NAME, "--tokens", "4"])
    assert "add --dtype fp8" in capsys.readouterr().err


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_mega_moe_on_the_gpu():
    dev = torch.device("cuda")
    bound = mm.load_mega_moe(dev)
    if isinstance(bound, str):
        pytest.skip(f"DeepGEMM's SM90 Mega MoE unavailable: {bound}")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = quantize_weight(torch.randn(8, 1024, 512, generator=g, device=dev) / 23, parts=2)
    down = quantize_weight(torch.randn(8, 512, 512, generator=g, device=dev) / 23)
    layer = bound.layer(gate_up, down, 2, max_tokens=96)
    x = torch.randn(96, 512, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g, device=dev)[:2] for _ in range(96)])
    wts = torch.softmax(torch.randn(96, 2, generator=g, device=dev), dim=1)
    check = mm.check_layer(layer, x, ids, wts, gate_up, down)
    assert check.ok, check
