"""The fused FP8 layer (issue 68, phase 2) under the interpreter: FusedMoE at EP=1 and
virtual ranks at EP=2 and 4, against an emulation of the quantized layer.

Under the interpreter the fp32 -> e4m3 cast has known errors (tests/fp8_checks.py: a value
rounded up across a power of two comes out halved, ...) and fp32 -> bf16 truncates, so
the fused layer is checked against the emulation whose rows are quantized by the same
Triton recipe (:func:`comet.kernels.fp8_gemm.quantize_rows_triton`), with the output's
bf16 roundings in the bounds; the GPU suite (tests/test_gpu_fp8.py) checks the layer
against comet.reference's torch emulation with issue 68's bounds.
"""

import pytest
import torch

from comet.activation import SILU, GatedActivation, gated
from comet.config import MoEConfig, TileConfig
from comet.constants import interpreting
from comet.kernels.fp8_gemm import quantize_rows_triton
from comet.kernels.fp8_roles import packed_row_bytes, packed_views
from comet.mesh import MeshLayout
from comet.quant import E4M3, Fp8, ScaleBlocks, quantize_weight
from comet.runtime.layer import FusedMoE, fp8_tile
from comet.runtime.virtual import VirtualEP
from routings import make_ids, make_tokens

GELU = GatedActivation(kind="gelu_tanh")

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="interpreter tests (CPU); tests/test_gpu_fp8.py runs "
                                       "the layer compiled")


def fp8_config(e=4, k=2, h=256, f=192, max_tokens=12, **kw) -> MoEConfig:
    return MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                     max_tokens=max_tokens, fp8=Fp8(), **kw)


def fp8_experts(cfg: MoEConfig, g: torch.Generator):
    """Every expert of ``cfg`` in FP8: ``gate_up [E, 2F, H]`` (per projection) and
    ``down [E, H, F]``."""
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    gate_up = quantize_weight(torch.randn(e, 2 * f, h, generator=g) * h ** -0.5, parts=2)
    down = quantize_weight(torch.randn(e, h, f, generator=g) * f ** -0.5)
    return gate_up, down


def emulate(x, ids, weights, gate_up, down, activation=SILU, expert_offset=0):
    """The FP8 layer in fp32 with rows quantized by the kernels' recipe (their casts)."""
    f = down.k
    xq = quantize_rows_triton(x).dequantize()
    w13, w2 = gate_up.dequantize(), down.dequantize()
    out = torch.zeros(x.shape[0], x.shape[1])
    for local in range(gate_up.experts):
        tok, slot = (ids == expert_offset + local).nonzero(as_tuple=True)
        if tok.numel():
            gu = xq[tok] @ w13[local].T
            h = quantize_rows_triton(gated(gu[:, :f], gu[:, f:], activation)).dequantize()
            out.index_add_(0, tok, (h @ w2[local].T) * weights[tok, slot].unsqueeze(1))
    return out


def assert_matches(y, expect):
    """Two bf16 truncations (the weighted rows, the combined output) cost ~5e-3."""
    y = y.float()
    assert float((y - expect).norm() / expect.norm()) <= 1e-2
    torch.testing.assert_close(y, expect, atol=0.035, rtol=0.035)


def shard(w, rank: int, world: int):
    el = w.experts // world
    return type(w)(w.weight[rank * el:(rank + 1) * el], w.scale_inv[rank * el:(rank + 1) * el],
                   w.blocks, w.parts)


# ------------------------------------------------------------------------- EP=1
@pytest.mark.parametrize("f, act", [(192, SILU), (256, GELU)], ids=["f192_silu", "f256_gelu"])
def test_fused_fp8_layer_on_one_rank_matches_the_emulation(f, act):
    """FusedMoE with FP8 experts on one rank, two calls (the second reuses the workspace):
    the rows are quantized on their home rank into packed rows, layer0 reads them and
    requantizes h (a ragged 64-wide last group at F = 192), layer1 reads h."""
    cfg = fp8_config(f=f, activation=act)
    g = torch.Generator().manual_seed(f)
    gate_up, down = fp8_experts(cfg, g)
    layer = FusedMoE(cfg, gate_up, down)
    for m in (9, 4):
        x = torch.randn(m, cfg.hidden_size, generator=g).bfloat16()
        ids = make_ids("skewed", [m], cfg.num_experts, cfg.top_k, g)[0]
        w = torch.rand(m, cfg.top_k, generator=g)
        y = layer(x, ids, w)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert_matches(y, emulate(x, ids, w, gate_up, down, act))
        # the rows this rank sent are its own, quantized once before crossing
        q, s = packed_views(layer.ws.home_rows[:m], cfg.hidden_size)
        rows = quantize_rows_triton(x)
        assert torch.equal(q.view(torch.uint8), rows.data.view(torch.uint8))
        assert torch.equal(s, rows.scale)


def test_fp8_layer_takes_checkpoint_tensors_and_their_scales():
    """e4m3 tensors with their ``scale_inv`` (a checkpoint's) make the same layer as
    Fp8Weights."""
    cfg = fp8_config()
    g = torch.Generator().manual_seed(1)
    gate_up, down = fp8_experts(cfg, g)
    layer = FusedMoE(cfg, gate_up.weight, down.weight, w13_scale_inv=gate_up.scale_inv,
                     w2_scale_inv=down.scale_inv)
    assert layer.w13.parts == 2
    x = torch.randn(5, cfg.hidden_size, generator=g).bfloat16()
    ids = make_ids("random", [5], cfg.num_experts, cfg.top_k, g)[0]
    w = torch.rand(5, cfg.top_k, generator=g)
    assert_matches(layer(x, ids, w), emulate(x, ids, w, gate_up, down))
    # UE8M0 scales (exponent bytes) are taken exactly: power-of-two scales, same layer
    pow2 = [type(q)(q.weight, torch.exp2(torch.round(torch.log2(q.scale_inv))), q.blocks,
                    q.parts) for q in (gate_up, down)]
    ue8m0 = FusedMoE(cfg, pow2[0].weight, pow2[1].weight,
                     w13_scale_inv=(torch.log2(pow2[0].scale_inv) + 127).to(torch.uint8),
                     w2_scale_inv=(torch.log2(pow2[1].scale_inv) + 127).to(torch.uint8))
    assert torch.equal(ue8m0.w13.scale_inv, pow2[0].scale_inv)
    assert_matches(ue8m0(x, ids, w), emulate(x, ids, w, *pow2))


def _ws_kernel_model(activation, calls):
    """A stand-in for comet.kernels.fp8_ws's kernel (Gluon has no interpreter): what it
    computes from the arguments it is given, in torch -- each m-tile's rows of A (through
    A's descriptor and ``op.a_scale``) times its expert's B rows (through B's descriptor,
    ``op.b_scale`` and ``op.up_scale_row``), then layer0's gated, requantized h or
    layer1's weighted rows into their token slots. ``calls`` gets each launch's tile."""
    def run(*args, grid, warmup, a_desc, b_desc, op, epi, t, **kwargs):
        calls.append(t)
        a, b, tiles = a_desc.base, b_desc.base, op.tiles
        bn, bk, kk = int(t.SCALE_N), int(t.SCALE_K), torch.arange(op.K)

        def weight(e, row0, rows, scale_row0):
            w = b[e * op.NB + row0:e * op.NB + row0 + rows].float()
            s = op.b_scale[e][scale_row0 + torch.arange(rows) // bn]
            return w * s[:, kk // bk]
        for i in range(int(tiles.num[0])):
            e, rs, re = (int(v[i]) for v in (tiles.expert, tiles.row_start, tiles.row_end))
            x = a[rs:re].float() * op.a_scale[rs:re][:, kk // int(t.A_GROUP)]
            if t.GATED:
                gate = x @ weight(e, 0, op.N, 0).T
                up = x @ weight(e, op.N, op.N, op.up_scale_row).T
                h = quantize_rows_triton(gated(gate, up, activation))
                epi.out[rs:re], epi.out_scale[rs:re] = h.data, h.scale
            else:
                y = (x @ weight(e, 0, op.N, 0).T) * epi.weight[rs:re, None]
                epi.pair_out.local.view(-1, op.N)[epi.home[rs:re].long()] = y.bfloat16()
    return run


@pytest.mark.parametrize("f, act, paired", [(192, SILU, False), (256, GELU, False),
                                           (192, SILU, True)],
                         ids=["f192_silu", "f256_gelu", "f192_paired"])
def test_large_calls_on_the_warp_specialized_gemm_read_and_write_the_right_buffers(
        monkeypatch, f, act, paired):
    """A one-rank layer with ``Variant.fp8_ws_min_rows`` (here as on a GPU, at 4 rows per
    expert): a large call runs the dispatch as its own launch, layer0's and layer1's
    GEMMs as the warp-specialized kernel's two launches -- here a torch model of that
    kernel over the very arguments it gets: the descriptors of the packed rows, of h and
    of the weights, the scales, the tile table, the token slots -- then flag1's release
    and the combine, and matches the emulation; a small call keeps the fused kernels.
    ``paired`` (``Variant.fp8_ws_paired_rows``): both GEMMs over the plan's rows re-cut
    in 128-row tiles (comet.kernels.plan.paired_tiles), which the model walks as it gets
    them: a tile table that missed rows, or gave them twice, would miss the emulation."""
    import comet.kernels.fp8_ws as fp8_ws
    import comet.runtime.layer as layer_mod
    monkeypatch.setattr(layer_mod, "ws_gemm_fits", lambda *args: True)
    calls = []
    monkeypatch.setattr(fp8_ws.fp8_ws_gemm_kernel, "run", _ws_kernel_model(act, calls))
    # paired: 150 rows an expert, so that tiles pair
    cfg = fp8_config(f=f, activation=act, max_tokens=300 if paired else 12)
    g = torch.Generator().manual_seed(f + 1)
    gate_up, down = fp8_experts(cfg, g)
    tile = TileConfig.small().with_fields(fp8_ws_min_rows=4,
                                          fp8_ws_paired_rows=4 if paired else 0)
    layer = FusedMoE(cfg, gate_up, down, tile=tile)
    assert layer.tile.variant.fp8_ws_min_rows == 4
    for m, ws in ((12, True), (1, False), (9, True)) + (((300, True), ) if paired else ()):
        x = torch.randn(m, cfg.hidden_size, generator=g).bfloat16()
        ids = make_ids("random", [m], cfg.num_experts, cfg.top_k, g)[0]
        w = torch.rand(m, cfg.top_k, generator=g)
        calls.clear()
        assert_matches(layer(x, ids, w), emulate(x, ids, w, gate_up, down, act))
        assert (layer.last_tile.variant.fp8_ws_min_rows > 0) is ws
        assert layer.last_ws_gemm is ws
        assert [(bool(t.GATED), int(t.EPILOGUE), bool(t.PAIRED)) for t in calls] == (
            [(True, 0, paired), (False, int(fp8_ws.EPILOGUE_SCATTER), paired)] if ws else [])


# ------------------------------------------------------------------------- errors
def _weights():
    cfg = fp8_config()
    return (cfg, *fp8_experts(cfg, torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("case, err, match", [
    ("bf16_w13", TypeError, "must be torch.float8_e4m3fn"),
    ("list_w2", TypeError, "Fp8Weight or an"),
    ("no_scale", ValueError, "needs its w13_scale_inv"),
    ("bad_scale", ValueError, "scale_inv must be"),
    ("bf16_scale", ValueError, "scale_inv must be fp32"),
    ("w13_shape", ValueError, r"FP8 w13 must be \[4, 384, 256\]"),
    ("w2_as_w13", ValueError, r"FP8 w2 must be \[4, 256, 192\]"),
    ("scale_and_weight", ValueError, "pass no w13_scale_inv"),
    ("interleaved", ValueError, "w13_layout 'gate_up'"),
    ("small_k_blocks", ValueError, "K loop steps below 32"),
    ("fp8_without_cfg", ValueError, "need cfg.fp8"),
    ("bias", NotImplementedError, "biases"),
])
def test_bad_fp8_weights_are_refused_before_any_kernel(case, err, match):
    cfg, gate_up, down = _weights()
    args, kw = [cfg, gate_up, down], {}
    if case == "bf16_w13":
        args[1] = gate_up.dequantize().bfloat16()
    elif case == "list_w2":
        args[2] = [down]
    elif case == "no_scale":
        args[1] = gate_up.weight
    elif case == "bad_scale":
        args[1] = gate_up.weight
        kw["w13_scale_inv"] = gate_up.scale_inv[:, :1]
    elif case == "bf16_scale":
        args[2] = down.weight
        kw["w2_scale_inv"] = down.scale_inv.bfloat16()
    elif case == "w13_shape":
        args[1] = quantize_weight(torch.randn(4, 2 * 128, 256), parts=2)
    elif case == "w2_as_w13":
        args[2] = quantize_weight(torch.randn(4, 192, 256))
    elif case == "scale_and_weight":
        kw["w13_scale_inv"] = gate_up.scale_inv
    elif case == "interleaved":
        kw["w13_layout"] = "interleaved"
    elif case == "small_k_blocks":
        args[2] = quantize_weight(down.dequantize(), ScaleBlocks(128, 16))
    elif case == "fp8_without_cfg":
        args[0] = cfg.replace(fp8=None)
    elif case == "bias":
        args[0] = cfg.replace(expert_bias=True)
        kw = dict(b13=torch.zeros(4, 384, dtype=torch.bfloat16),
                  b2=torch.zeros(4, 256, dtype=torch.bfloat16))
    with pytest.raises(err, match=match):
        FusedMoE(*args, **kw)


@pytest.mark.parametrize("changes, match", [
    (dict(dtype=torch.float16), "dtype must be torch.bfloat16"),
    (dict(hidden_size=48), "multiple of 128"),
    (dict(fp8="e4m3"), "comet.quant.Fp8"),
])
def test_bad_fp8_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        fp8_config().replace(**changes)


def test_fp8_layers_run_forward_only():
    """A call that needs gradients, and the backward, raise NotImplementedError; the same
    call under no_grad runs."""
    cfg, gate_up, down = _weights()
    layer = FusedMoE(cfg, gate_up, down)
    x = torch.randn(3, cfg.hidden_size).bfloat16().requires_grad_()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2)
    with pytest.raises(NotImplementedError, match="forward only"):
        layer(x, ids, w)
    with pytest.raises(NotImplementedError, match="forward only"):
        layer.backward(torch.ones_like(x), x.detach(), ids, w)
    with torch.no_grad():
        assert_matches(layer(x, ids, w), emulate(x.detach(), ids, w, gate_up, down))


def test_bad_routing_of_an_fp8_call_is_reported_and_the_layer_stays_usable():
    """An expert id outside [-1, E) is the device-side CometInputError, as for bf16; the
    next call is clean."""
    from comet.runtime.errors import CometInputError
    cfg, gate_up, down = _weights()
    layer = FusedMoE(cfg, gate_up, down)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, cfg.hidden_size, generator=g).bfloat16()
    ids = make_ids("random", [6], cfg.num_experts, cfg.top_k, g)[0]
    w = torch.rand(6, cfg.top_k, generator=g)
    bad = ids.clone()
    bad[4, 1] = cfg.num_experts
    with pytest.raises(CometInputError, match="token 4, slot 1"):
        layer(x, bad, w)
    assert_matches(layer(x, ids, w), emulate(x, ids, w, gate_up, down))


def test_an_fp8_workspace_holds_packed_rows_and_fp8_h():
    """a0 (what peers write) holds rows as they cross -- e4m3 values and fp32 scales
    packed, ~0.52x a bf16 row at H = 7168 -- and h is e4m3 with its scales."""
    assert packed_row_bytes(7168) == 7392 and 7392 / (2 * 7168) < 0.52
    assert packed_row_bytes(256) % 16 == 0
    cfg, gate_up, down = _weights()
    ws = FusedMoE(cfg, gate_up, down).ws
    assert ws.local.a0.dtype == torch.uint8
    assert ws.local.a0.shape[1] == packed_row_bytes(cfg.hidden_size)
    assert ws.h.dtype == E4M3 and ws.h_scale.shape == (ws.h.shape[0], 2)


def test_an_fp8_layer_cuts_its_k_loops():
    """The tile an FP8 layer runs keeps the small-call K cuts (layer0's stream-K and tail
    splits, layer1's K splits: all on the block-scaled K loop), on by default as in
    bf16, and a gathered dispatch where asked, whose FP8 K loop always loads only a
    tile's own rows."""
    cfg, gate_up, down = _weights()
    tile = TileConfig.small().with_fields(layer0_stream_k=True, layer0_tail_split=4,
                                          layer1_split_k=4, layer0_gather=True)
    v = FusedMoE(cfg, gate_up, down, tile=tile).tile.variant
    assert (v.layer0_stream_k, v.layer0_tail_split, v.layer1_split_k) == (True, 4, 4)
    d = FusedMoE(cfg, gate_up, down).tile.variant
    default = TileConfig.small().variant
    assert (d.layer0_stream_k, d.layer0_tail_split, d.layer1_split_k) == (
        default.layer0_stream_k, default.layer0_tail_split, default.layer1_split_k)
    assert d.layer0_stream_k and d.layer0_tail_split > 1 and d.layer1_split_k > 1
    assert (v.layer0_gather, v.layer0_own_in_place, v.layer0_live_rows) == (True, True, False)
    # Hopper's tiles: m-tiles of 64 rows (128 spilled layer0's registers)
    assert fp8_tile(TileConfig()).gemm.block_m == 64
    assert not v.fp8_ws_min_rows    # the interpreter has no Gluon
    # a bf16 layer drops the FP8-only field (its tuned tables then serve the tile)
    from comet.runtime.layer import layer_tile
    asked = TileConfig.small().with_fields(fp8_ws_min_rows=128)
    assert layer_tile(asked, MeshLayout(), "sequence", cfg.replace(fp8=None)) == \
        TileConfig.small()


@pytest.mark.parametrize("blocks, ffn, fits", [
    (ScaleBlocks(), 256, True), (ScaleBlocks(), 320, True),      # ragged F: parts of 2
    (ScaleBlocks(256, 256), 512, True), (ScaleBlocks(64, 128), 256, False),
    (ScaleBlocks(128, 64), 256, False), (ScaleBlocks(1, 128), 256, False)])
def test_the_warp_specialized_gemm_takes_whole_box_scale_blocks(blocks, ffn, fits):
    """comet.kernels.fp8_ws reads one B scale per box and K step: scale blocks that are
    whole 128 x 128 boxes (a TP shard's 64-wide blocks, per-channel scales: the tl
    kernels); and a layer runs it only on its own (it waits for no peer's rows)."""
    from comet.kernels.fp8_ws import fits as ws_fits
    from comet.runtime.layer import ws_gemm_fits
    h = 256
    gate_up = quantize_weight(torch.randn(2, 2 * ffn, h), blocks, parts=2)
    down = quantize_weight(torch.randn(2, h, ffn), blocks)
    assert ws_fits(gate_up, gated=True) is fits and ws_fits(down, gated=False) is fits
    one = MeshLayout()
    assert ws_gemm_fits(one, gate_up, down) is (fits and not interpreting())
    assert not ws_gemm_fits(MeshLayout(ep=2), gate_up, down)
    assert not ws_gemm_fits(MeshLayout(tp=2, ep=1), gate_up, down)
    # one block grid over [gate | up]: the up half must start on a block boundary
    whole = quantize_weight(torch.randn(2, 2 * 320, h), ScaleBlocks())
    assert not ws_fits(whole, gated=True) and ws_fits(whole, gated=False)


# ------------------------------------------------------------------------- virtual ranks
@pytest.mark.parametrize("world, kind, scatter", [
    (2, "random", True), (2, "zero_token_rank", False), (4, "skewed", True)])
def test_virtual_ranks_send_fp8_rows_and_match_the_emulation(world, kind, scatter):
    """W ranks in one process: each quantizes its own rows, which cross into its peers'
    a0 as packed FP8 rows; layer1 scatters (or reduces) bf16 rows home."""
    cfg = fp8_config(e=8, k=2)
    g = torch.Generator().manual_seed(world)
    gate_up, down = fp8_experts(cfg, g)
    tokens = make_tokens(kind, world, cfg.max_tokens, g)
    ids = make_ids(kind, tokens, cfg.num_experts, cfg.top_k, g)
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).bfloat16() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    tile = TileConfig.small().with_fields(layer1_scatter=scatter)
    ep = VirtualEP(cfg, [shard(gate_up, r, world) for r in range(world)],
                   [shard(down, r, world) for r in range(world)], tile)
    ys = ep.forward(xs, ids, wts)
    for r in range(world):
        if ids[r].shape[0]:
            assert_matches(ys[r], emulate(xs[r], ids[r], wts[r], gate_up, down))
    # What crossed: every row a rank's GEMM read is, byte for byte, a packed FP8 row one
    # rank quantized at home -- and more than its own.
    sent = {ws.rank: {bytes(row.tolist()) for row in ws.home_rows[:ids[ws.rank].shape[0]]}
            for ws in ep.ws}
    for ws in ep.ws:
        t = ws.plan.tiles
        live = [i for j in range(int(t.num)) for i in range(int(t.row_start[j]),
                                                              int(t.row_end[j]))]
        got = {bytes(ws.local.a0[i].tolist()) for i in live}
        assert got <= set().union(*sent.values())
        el = cfg.num_experts // world
        if any(bool((ids[s] // el == ws.rank).any()) for s in range(world) if s != ws.rank):
            assert got - sent[ws.rank], "no row came from a peer"


@pytest.mark.parametrize("split_k, layout, f", [
    (2, (1, 2), 192), (4, (1, 2), 192), (2, (2, 1), 384)], ids=lambda v: str(v))
def test_small_fp8_calls_split_layer1_over_k(split_k, layout, f):
    """layer1's K splits on the block-scaled K loop: a call whose layer1 items leave
    programs idle runs each item in as many K splits as fit, up to ``split_k``, each from
    a K step on (F = 192: 128 + a ragged 64; with 4 splits two have no K left; at TP = 2
    the second shard's scale blocks are 64 wide, and so its K steps), the last summing
    the partials; on too few programs, whole items. All match the emulation, and the
    counters say what ran."""
    mesh = MeshLayout(*layout)
    cfg = fp8_config(e=4, k=2, h=128, f=f, max_tokens=6)
    g = torch.Generator().manual_seed(split_k + f)
    gate_up, down = fp8_experts(cfg, g)
    shards = [mesh.shard_fp8(r, gate_up, down) for r in range(mesh.world)]
    ids = make_ids("random", [5, 3], cfg.num_experts, cfg.top_k, g)
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).bfloat16() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    tile = TileConfig.small().with_fields(layer1_split_k=split_k)
    ep = VirtualEP(cfg, [s[0] for s in shards], [s[1] for s in shards], tile, mesh=mesh)
    assert ep.tile.variant.layer1_split_k == split_k
    engaged = set()
    for programs in (48, 9, 3):
        ys = ep.forward(xs, ids, wts, compute_programs=programs)
        for r in range(mesh.world):
            assert_matches(ys[r], emulate_mesh(xs[r], ids[r], wts[r], gate_up, down, mesh.tp))
        for ws in ep.ws:
            items = int(ws.plan.tiles.num) * -(-cfg.hidden_size // tile.gemm.block_n1)
            splits = min(split_k, programs // items)     # as many as fit, up to split_k
            splits = splits if splits >= 2 else 0
            assert items > 0 and ws.count.arrived[:items].tolist() == [splits] * items
            engaged.add(splits)
    assert {0, split_k} <= engaged


@pytest.mark.parametrize("cut", ["stream_k", "tail_split"])
def test_small_fp8_calls_cut_layer0_over_k(cut):
    """layer0's stream-K and tail splits on the block-scaled K loop: two ranks with four
    items each (two m-tiles x two 128-column blocks, 4 K steps of 128), a part's gate and
    up tiles side by side in the scratch, the item's last part summing them in order
    before the activation and h's FP8 groups. Stream-K cuts items on 3 and 5 programs
    (none on 4 and 2); the tail splits cut the last item of one whole round on 3 programs
    into 3 splits (K steps 2, 2 and none), nothing on 2 and 5. All match the emulation,
    and the counters say which items were cut."""
    from test_kernels_interpreter import _stream_k_parts
    cfg = fp8_config(e=4, k=2, h=512, f=256, max_tokens=4)
    g = torch.Generator().manual_seed(17)
    gate_up, down = fp8_experts(cfg, g)
    stream_k = cut == "stream_k"
    tile = TileConfig.small().with_fields(layer0_stream_k=stream_k,
                                          layer0_tail_split=0 if stream_k else 4)
    ep = VirtualEP(cfg, [shard(gate_up, r, 2) for r in range(2)],
                   [shard(down, r, 2) for r in range(2)], tile)
    ids = [torch.tensor([[0, 2], [1, 3], [2, 1]]), torch.tensor([[3, 0], [1, 2]])]
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).bfloat16() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    tails = {3: [3, 0, 0, 0], 2: [0] * 4, 5: [0] * 4}
    cut_on = set()
    for programs in ((3, 5, 4, 2) if stream_k else (3, 2, 5)):
        ys = ep.forward(xs, ids, wts, compute_programs=programs)
        for r in range(2):
            assert_matches(ys[r], emulate(xs[r], ids[r], wts[r], gate_up, down))
        for ws in ep.ws:
            items = int(ws.plan.tiles.num) * (cfg.intermediate_size // 128)
            assert items == 4
            got = ws.count.l0_arrived[:items].tolist()
            want = ((_stream_k_parts(items, cfg.hidden_size // 128, programs) or [0] * 4)
                    if stream_k else tails[programs])
            assert got == want, (programs, got, want)
            if any(want):
                cut_on.add(programs)
    assert cut_on == ({3, 5} if stream_k else {3})


def test_small_fp8_calls_plan_16_row_m_tiles():
    """A layer of 32-row m-tiles whose call's items fill a round of its 4 programs plans
    16-row tiles (``small_block_m``), in the table sized for them: an expert with 17-32
    rows gets two tiles where the layer's tile would be one; the output is the
    emulation's and, value for value, the 32-row layer's; a 1-token call of 2 items keeps
    the layer's tiles."""
    cfg = fp8_config(e=4, k=2, h=256, f=128, max_tokens=40)
    g = torch.Generator().manual_seed(23)
    gate_up, down = fp8_experts(cfg, g)
    tile = TileConfig.small().with_fields(block_m=32)
    layer = FusedMoE(cfg, gate_up, down, tile=tile)
    wide = FusedMoE(cfg, gate_up, down, tile=tile.with_fields(small_block_m=0))
    assert layer.programs == 4 and layer.tile.plan_block_m(True) == 16
    m = 40
    x = torch.randn(m, cfg.hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.tensor([0, 1 + i % 3]) for i in range(m)])   # expert 0: 40
    w = torch.rand(m, cfg.top_k, generator=g)
    assert layer.selection.for_call(m)[1].gemm.block_m == 16
    assert wide.selection.for_call(m)[1].gemm.block_m == 32
    y = layer(x, ids, w)
    assert_matches(y, emulate(x, ids, w, gate_up, down))
    assert torch.equal(y, wide(x, ids, w))
    for fused, rows in ((layer, 16), (wide, 32)):
        t = fused.ws.plan.tiles
        n = int(t.num[0])
        spans = [(int(t.expert[i]), int(t.row_end[i]) - int(t.row_start[i])) for i in range(n)]
        assert max(s for _, s in spans) == rows
        assert sum(s for e, s in spans if e == 0) == m
    one = torch.tensor([[2, 3]])
    assert layer.selection.for_call(1)[1].gemm.block_m == 32      # 2 items on 4 programs
    x1 = torch.randn(1, cfg.hidden_size, generator=g).bfloat16()
    w1 = torch.rand(1, 2, generator=g)
    assert_matches(layer(x1, one, w1), emulate(x1, one, w1, gate_up, down))


# ------------------------------------------------------------------------- gathered dispatch
#: An e4m3 NaN in every byte of a buffer no row may be read from.
POISON = 0x7F


def test_a_gathered_fp8_dispatch_on_one_rank_copies_no_row():
    """Top-4 on one rank with a gathered dispatch (a token's row crosses once per rank,
    0.52x a bf16 row; asked for: an FP8 layer's default tile does not gather): the GEMM
    reads this rank's rows where they were packed on their home rank -- so nothing is
    written into a0, whose poisoned bytes no tile reads."""
    cfg = fp8_config(e=8, k=4)
    g = torch.Generator().manual_seed(8)
    gate_up, down = fp8_experts(cfg, g)
    assert not FusedMoE(cfg, gate_up, down).tile.variant.layer0_gather
    layer = FusedMoE(cfg, gate_up, down, tile=TileConfig.small().with_fields(layer0_gather=True))
    v = layer.tile.variant
    assert v.layer0_gather and v.layer0_own_in_place
    layer.ws.local.a0.fill_(POISON)
    for m in (11, 3):
        x = torch.randn(m, cfg.hidden_size, generator=g).bfloat16()
        ids = make_ids("skewed", [m], cfg.num_experts, cfg.top_k, g)[0]
        w = torch.rand(m, cfg.top_k, generator=g)
        assert_matches(layer(x, ids, w), emulate(x, ids, w, gate_up, down))
        assert bool((layer.ws.local.a0 == POISON).all())


@pytest.mark.parametrize("world, kind, own, scatter", [
    (2, "random", True, True), (2, "zero_token_rank", False, False),
    (4, "skewed", True, False)])
def test_virtual_ranks_gather_fp8_rows_once_per_rank(world, kind, own, scatter):
    """A gathered FP8 dispatch: each rank sends a token's packed row once to every rank
    that holds one of its experts, and the GEMM reads its rows through the index -- its
    own from its home rows (``own``) or from the copy it sent itself."""
    cfg = fp8_config(e=8, k=4)
    g = torch.Generator().manual_seed(10 * world + own)
    gate_up, down = fp8_experts(cfg, g)
    tokens = make_tokens(kind, world, cfg.max_tokens, g)
    ids = make_ids(kind, tokens, cfg.num_experts, cfg.top_k, g)
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).bfloat16() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    tile = TileConfig.small().with_fields(layer0_gather=True, layer0_own_in_place=own,
                                          layer1_scatter=scatter)
    ep = VirtualEP(cfg, [shard(gate_up, r, world) for r in range(world)],
                   [shard(down, r, world) for r in range(world)], tile)
    for ws in ep.ws:
        ws.local.a0.fill_(POISON)
    ys = ep.forward(xs, ids, wts)
    for r in range(world):
        if ids[r].shape[0]:
            assert_matches(ys[r], emulate(xs[r], ids[r], wts[r], gate_up, down))
    el, mx = cfg.num_experts // world, cfg.max_tokens
    for ws in ep.ws:
        for s in range(world):
            hit = (ids[s] // el == ws.rank).any(dim=1)
            got = ws.local.a0[s * mx:s * mx + ids[s].shape[0]]
            sent = ep.ws[s].home_rows[:ids[s].shape[0]]
            if s == ws.rank and own:
                assert bool((got == POISON).all()), "an own row was copied"
            else:   # exactly the tokens with an expert here crossed, byte for byte
                assert torch.equal(got[hit], sent[hit])
                assert bool((got[~hit] == POISON).all())


# ------------------------------------------------------------------------- TP and hybrid
def emulate_mesh(x, ids, weights, gate_up, down, tp):
    """The FP8 layer as a TP layout computes it: the sum over TP shards of each shard's
    layer (h requantized in groups of the shard's own columns)."""
    mesh = MeshLayout(tp=tp, ep=1)
    return sum(emulate(x, ids, weights, *mesh.shard_fp8(t, gate_up, down)) for t in range(tp))


@pytest.mark.parametrize("layout, convention, scatter", [
    ((2, 1), "sequence", True), ((2, 1), "replicated", False), ((2, 2), "sequence", False),
    ((2, 2), "replicated", True)], ids=lambda v: str(v))
def test_tp_and_hybrid_layouts_run_fp8_shards_of_192(layout, convention, scatter):
    """F = 384 over tp = 2: shards of 192 columns (a ragged 64-wide last group of h; the
    second shard's blocks re-blocked 64 wide by Fp8Weight.narrow), rows crossing as FP8;
    a rank's output sums its token's shards."""
    mesh = MeshLayout(*layout)
    cfg = fp8_config(e=4, k=2, f=384, max_tokens=6)
    g = torch.Generator().manual_seed(sum(layout) + len(convention))
    gate_up, down = fp8_experts(cfg, g)
    shards = [mesh.shard_fp8(r, gate_up, down) for r in range(mesh.world)]
    sources = mesh.world if convention == "sequence" else mesh.ep
    ids = make_ids("random", make_tokens("random", sources, cfg.max_tokens, g),
                   cfg.num_experts, cfg.top_k, g)
    xs = [torch.randn(i.shape[0], cfg.hidden_size, generator=g).bfloat16() for i in ids]
    wts = [torch.rand(i.shape, generator=g) for i in ids]
    if convention == "replicated":
        pick = [mesh.coords(r)[0] for r in range(mesh.world)]
        xs, ids, wts = ([a[p] for p in pick] for a in (xs, ids, wts))
    tile = TileConfig.small().with_fields(layer1_scatter=scatter)
    ep = VirtualEP(cfg, [s[0] for s in shards], [s[1] for s in shards], tile, mesh=mesh,
                   convention=convention)
    ys = ep.forward(xs, ids, wts)
    for r in range(mesh.world):
        if ids[r].shape[0]:
            assert_matches(ys[r], emulate_mesh(xs[r], ids[r], wts[r], gate_up, down, mesh.tp))


def test_fp8_shards_are_the_full_weights_columns():
    """MeshLayout.shard_fp8 cuts gate, up and down exactly (scales included), from
    gate_up quantized per projection or as one part."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(4, 2 * 384, 256, generator=g)
    down = quantize_weight(torch.randn(4, 256, 384, generator=g))
    mesh = MeshLayout(tp=2, ep=2)
    for parts in (1, 2):
        gate_up = quantize_weight(full, parts=parts)
        for r in range(mesh.world):
            gu, dn = mesh.shard_fp8(r, gate_up, down)
            e, t = mesh.coords(r)
            cols = torch.cat([torch.arange(192 * t, 192 * t + 192),
                              384 + torch.arange(192 * t, 192 * t + 192)])
            assert gu.parts == 2 and gu.weight.shape == (2, 384, 256)
            assert torch.equal(gu.dequantize(), gate_up.dequantize()[2 * e:2 * e + 2, cols])
            assert torch.equal(dn.dequantize(),
                               down.dequantize()[2 * e:2 * e + 2, :, 192 * t:192 * t + 192])


# ------------------------------------------------------------------------- CometMoE
def test_quantize_experts_turns_a_bf16_comet_moe_into_an_fp8_one():
    """One call quantizes the block's experts (gate rows then up rows, down as [E, H, F]:
    the checkpoints' layout), holds them in FP8 only and sets cfg.fp8; the CPU path is
    then comet.reference's emulation, near the bf16 layer; a call that needs gradients
    raises."""
    from comet import reference
    from comet.moe import CometMoE, Fp8LocalExperts, quantize_experts
    torch.manual_seed(0)
    moe = CometMoE(4, 2, 256, 192, max_tokens=8)
    x = torch.randn(5, 256).bfloat16()
    with torch.no_grad():
        bf16 = moe(x).float()
        logits, wts, ids = moe.gate(x)
    full = moe.experts.gate_up()                   # [E, H, 2F], gate columns first
    assert quantize_experts(moe) is moe and moe.cfg.fp8 == Fp8()
    assert isinstance(moe.experts, Fp8LocalExperts)
    assert {n: p.dtype for n, p in moe.experts.named_parameters()} == {
        "w13": E4M3, "w13_scale_inv": torch.float32, "w2": E4M3, "w2_scale_inv": torch.float32}
    gate_up, down = moe.experts.fp8_weights()
    assert gate_up.weight.shape == (4, 384, 256) and gate_up.parts == 2
    assert down.weight.shape == (4, 256, 192)
    assert torch.equal(gate_up.weight, quantize_weight(full.transpose(1, 2), parts=2).weight)
    with pytest.raises(NotImplementedError, match="forward only"):
        moe(x)
    with torch.no_grad():
        y = moe(x).float()
    expect = reference.moe_forward_fp8(x.float(), ids, wts, gate_up, down)
    torch.testing.assert_close(y, expect.bfloat16().float())
    assert float((y - bf16).norm() / bf16.norm()) < 0.1
    with pytest.raises(ValueError, match="FP8 already"):
        quantize_experts(moe)


def test_an_fp8_comet_moe_loads_fp8_checkpoints_and_bf16_state_dicts():
    """CometMoE(..., fp8=Fp8()) holds FP8 experts only, under FP8 checkpoints' keys: its
    state dict round-trips byte for byte; a checkpoint's e4m3 tensors with UE8M0 scales
    load exactly (as fp32); a bf16 block's state dict loads quantized, so the layer
    serves what that block quantized after serves. A state dict of other shapes is
    refused by the load. ``.to(dtype)`` leaves the FP8 tensors as they are."""
    from comet.moe import CometMoE, quantize_experts
    torch.manual_seed(1)
    source = CometMoE(4, 2, 256, 192, max_tokens=8)
    fp8 = CometMoE(4, 2, 256, 192, max_tokens=8, fp8=Fp8())
    keys = set(source.state_dict())
    assert set(fp8.state_dict()) == keys | {"experts.w13_scale_inv", "experts.w2_scale_inv"}
    fp8.load_state_dict(source.state_dict())
    quantize_experts(source)
    x = torch.randn(6, 256).bfloat16()
    with torch.no_grad():
        assert torch.equal(fp8(x), source(x))
    # FP8 -> FP8: byte for byte
    again = CometMoE(4, 2, 256, 192, max_tokens=8, fp8=Fp8())
    again.load_state_dict(fp8.state_dict())
    for name, value in fp8.state_dict().items():
        assert torch.equal(again.state_dict()[name].view(torch.uint8),
                           value.view(torch.uint8)), name
    # A checkpoint with UE8M0 scales (exponent bytes): exact powers of two in fp32
    state = fp8.state_dict()
    for name in ("experts.w13_scale_inv", "experts.w2_scale_inv"):
        state[name] = torch.full_like(state[name], 120, dtype=torch.uint8)
    again.load_state_dict(state)
    assert torch.all(again.experts.w13_scale_inv == 2.0 ** -7)
    # built on the meta device (no bf16 experts ever allocated), then a checkpoint loaded
    meta = CometMoE(4, 2, 256, 192, max_tokens=8, fp8=Fp8(), device="meta")
    assert meta.experts.w13.dtype == E4M3
    meta = meta.to_empty(device="cpu")
    meta.load_state_dict(fp8.state_dict())
    with torch.no_grad():
        assert torch.equal(meta(x), fp8(x))
    # model.to(torch.bfloat16) / .half() move FP8 experts but never cast them
    before = {n: p.clone() for n, p in again.experts.named_parameters()}
    with torch.no_grad():
        want = again(x)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half().bfloat16()):
        cast(again)
        for name, value in again.experts.named_parameters():
            assert value.dtype == before[name].dtype and torch.equal(
                value.view(torch.uint8), before[name].view(torch.uint8)), name
        with torch.no_grad():
            assert torch.equal(again(x), want)
    bad = dict(source.state_dict(), **{"experts.w2": torch.zeros(4, 256, 256, dtype=E4M3)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        again.load_state_dict(bad)
    with pytest.raises(NotImplementedError, match="biases"):
        CometMoE(4, 2, 256, 192, max_tokens=8, fp8=Fp8(), expert_bias=True)
