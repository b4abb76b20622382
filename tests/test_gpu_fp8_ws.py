"""comet.kernels.fp8_ws, the warp-specialized FP8 GroupGEMM (Gluon: no interpreter, so
GPU only, marker gpu): the plain GEMM and layer0's gated, requantizing one against the
fp32 emulation (partial column boxes, ragged K and F, every activation variant), and the
one-rank FP8 layer whose large calls run it (``Variant.fp8_ws_min_rows``, here a threshold
of its own) against the emulation -- large and small calls interleaved, graph replays, and
many back-to-back calls of drifting sizes at a preset's full width."""

import pytest
import torch

from comet.activation import SILU, GatedActivation, gated
from comet.config import PRESETS
from comet.kernels.fp8_gemm import m_tiles
from comet.quant import E4M3, Fp8, Fp8Rows, ScaleBlocks, quantize_rows, quantize_weight
from fp8_checks import SUM_RTOL, requant_close, same_fp8
from test_fp8_gemm import _emulated, _randn

pytestmark = pytest.mark.gpu
DEV = "cuda"




@pytest.mark.parametrize("promotion_k", [32, 128])
@pytest.mark.parametrize("n, k", [
    (256, 256),       # two column boxes, one item wide
    (192, 320),       # box 1 partly past N (past the tensor for the last expert); 3 K steps
    (640, 4096),      # a partial second item; 32 K steps (per step: drained two at a time)
])
def test_ws_gemm_matches_the_emulation(n, k, promotion_k):
    """Promotion every 32 K (four wgmmas on slices of a step's boxes) or every step."""
    from comet.kernels.fp8_ws import ws_group_gemm
    e_rows = [70, 0, 33, 64, 1]
    w = quantize_weight(_randn(len(e_rows), n, k, seed=n + k) / k ** 0.5)
    a = quantize_rows(_randn(sum(e_rows), k, seed=1))
    out = ws_group_gemm(a, w, m_tiles(e_rows, 64, DEV), promotion_k=promotion_k)
    ref = _emulated(a, w, e_rows)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    # a persistent grid of fewer programs than items walks the same items
    few = ws_group_gemm(a, w, m_tiles(e_rows, 64, DEV), programs=3, promotion_k=promotion_k)
    assert torch.equal(few, out)


@pytest.mark.parametrize("f, parts, act, promotion_k", [
    (192, 2, SILU, 32),                   # F not a multiple of 128: gate and up apart
    (256, 1, SILU, 32),
    (256, 1, SILU, 128),
    (128, 1, GatedActivation(kind="gelu_tanh"), 32),
    (320, 2, GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0), 128),
])
def test_ws_gated_epilogue_requantizes_for_layer1(f, parts, act, promotion_k):
    from comet.kernels.fp8_ws import ws_group_gemm
    e_rows = [50, 30, 129]
    k = 512
    w = quantize_weight(_randn(3, 2 * f, k, seed=f) / k ** 0.5, parts=parts)
    a = quantize_rows(_randn(sum(e_rows), k, seed=2))
    q = ws_group_gemm(a, w, m_tiles(e_rows, 64, DEV), activation=act, promotion_k=promotion_k)
    gu = _emulated(a, w, e_rows)
    ref = quantize_rows(gated(gu[:, :f], gu[:, f:], act))
    assert isinstance(q, Fp8Rows) and q.data.dtype == E4M3 and q.scale.shape == ref.scale.shape
    torch.testing.assert_close(q.scale, ref.scale, rtol=SUM_RTOL, atol=0)
    assert torch.all(requant_close(q.data, ref.data))
    assert same_fp8(q.data, ref.data).float().mean() > 0.97


def test_ws_gemm_at_mixtral_width():
    """Mixtral-width layer0 (H = 4096, F = 14336 of it) on whole m-tiles, a partial one
    and a one-row expert: the requantized h against the emulation."""
    from comet.kernels.fp8_ws import ws_group_gemm
    e_rows = [256, 64, 1, 100]
    f = 14336
    w = quantize_weight(_randn(4, 2 * f, 4096, seed=3) / 64, parts=2)
    a = quantize_rows(_randn(sum(e_rows), 4096, seed=4))
    q = ws_group_gemm(a, w, m_tiles(e_rows, 64, DEV), activation=SILU)
    gu = _emulated(a, w, e_rows)
    ref = quantize_rows(gated(gu[:, :f], gu[:, f:], SILU))
    torch.testing.assert_close(q.scale, ref.scale, rtol=SUM_RTOL, atol=0)
    assert torch.all(requant_close(q.data, ref.data))


@pytest.mark.parametrize("activation", [None, SILU])
def test_ws_gemm_reads_rows_through_an_index(activation):
    """``A_GATHER``: A's rows read through an index from packed token rows (each token
    row read by several rows, partial m-tiles, an empty expert) give the bytes the GEMM
    gives on the same rows placed, and a persistent grid of few programs the same."""
    from comet.kernels.fp8_gemm import Fp8Gather
    from comet.kernels.fp8_roles import pack_rows
    from comet.kernels.fp8_ws import ws_group_gemm
    e_rows = [70, 0, 33, 64, 129]
    k, n = 1024, 384
    tokens = quantize_rows(_randn(90, k, seed=5))
    src = torch.randint(0, 90, (sum(e_rows), ), generator=torch.Generator().manual_seed(6),
                        dtype=torch.int32).to(DEV)
    placed = Fp8Rows(tokens.data[src.long()], tokens.scale[src.long()])
    w = quantize_weight(_randn(len(e_rows), 2 * n, k, seed=7) / k ** 0.5)
    tiles = m_tiles(e_rows, 64, DEV)
    gather = Fp8Gather(src, pack_rows(tokens), pack_rows(tokens).shape[1])
    want = ws_group_gemm(placed, w, tiles, activation=activation)
    for programs in (None, 3):
        got = ws_group_gemm(gather, w, tiles, activation=activation, programs=programs)
        if activation is None:
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("k, stages, act", [(1024, 4, None), (640, 4, None), (640, 6, None),
                                            (1024, 4, SILU), (640, 4, GatedActivation(
                                                alpha=1.702, limit=7.0, up_offset=1.0))])
def test_paired_m_tiles_give_the_default_bytes(k, stages, act):
    """``paired``: 128-row m-tiles, the consumers on their row halves over one B box
    (with ``act``, layer0's: the gate box, parked, then the up box), give the bytes of the
    64-row items over two boxes (the same wgmmas and promotions; h's group amax the max of
    the same values): odd step counts, a box past N, halves past an expert's rows, an
    empty expert, a persistent grid of few programs, six ring slots."""
    from comet.kernels.fp8_ws import ws_group_gemm
    e_rows = [70, 0, 33, 64, 129, 300, 1]
    n = 320
    w = quantize_weight(_randn(len(e_rows), n, k, seed=k + stages) / k ** 0.5,
                        parts=2 if act else 1)
    a = quantize_rows(_randn(sum(e_rows), k, seed=8))
    want = ws_group_gemm(a, w, m_tiles(e_rows, 64, DEV), activation=act)
    for programs in (None, 3):
        got = ws_group_gemm(a, w, m_tiles(e_rows, 128, DEV), paired=True, stages=stages,
                            programs=programs, activation=act)
        if act is None:
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("name, gather, paired", [("mixtral", False, False),
                                                  ("deepseek-v3-like", False, False),
                                                  ("deepseek-v3-like", True, False),
                                                  ("mixtral", False, True)])
def test_a_one_rank_fp8_layer_runs_large_calls_warp_specialized(name, gather, paired):
    """FusedMoE on FP8 experts at the preset's size, one rank: calls large enough for
    the warp-specialized GEMMs and small ones interleaved, each twice (graph replay),
    then 60 back-to-back calls of drifting sizes, every output against the emulation;
    ``gather``: with layer0's gathered dispatch (the GEMM reads the home rows through
    the index, ``A_GATHER``); ``paired``: both GEMMs on paired m-tiles from 128 rows
    per expert (``Variant.fp8_ws_paired_rows``)."""
    from test_gpu_fp8 import _bf16, _check, _emulate, _experts, _inputs
    from comet.runtime.layer import FusedMoE, default_tile
    rows = 128      # two m-tiles per expert
    cfg = PRESETS[name].replace(max_tokens=4096, fp8=Fp8())
    gu, dn, gu8, dn8 = _experts(cfg, 0)
    tile = default_tile(cfg=cfg).with_fields(fp8_ws_min_rows=rows, layer0_gather=gather,
                                             fp8_ws_paired_rows=rows if paired else 0)
    layer = FusedMoE(cfg, gu8, dn8, check_errors="sync", tile=tile)
    assert layer.tile.variant.fp8_ws_min_rows == rows
    assert layer.tile.variant.layer0_gather is gather
    large = -(-rows * cfg.num_experts // cfg.top_k)
    sizes = [4096, 3, large, 200, 4096]
    xs, ids, ws = _inputs(cfg, sizes, 5)
    for x, i, w in zip(xs, ids, ws):
        expect = _emulate(x, i, w, gu8, dn8, cfg.activation)
        bf16 = _bf16(x, i, w, gu, dn, cfg.activation)
        for _ in range(2):
            _check(layer(x, i, w), expect, bf16)
        assert (layer.last_tile.variant.fp8_ws_min_rows > 0) is (x.shape[0] >= large), \
            x.shape[0]
        assert layer.last_ws_gemm is (x.shape[0] >= large), x.shape[0]
        on_pairs = layer.last_tile.variant.fp8_ws_paired_rows > 0
        assert on_pairs is (paired and x.shape[0] >= large), x.shape[0]
    drift = [int(v) for v in torch.randint(1, 4097, (60, ), generator=torch.Generator()
                                          .manual_seed(6))]
    xs, ids, ws = _inputs(cfg, drift, 7)
    outs = [layer(x, i, w) for x, i, w in zip(xs, ids, ws)]
    for y, x, i, w in zip(outs, xs, ids, ws):
        _check(y, _emulate(x, i, w, gu8, dn8, cfg.activation))


def test_paired_m_tiles_give_the_unpaired_layers_bytes():
    """The one-rank layer at qwen2-moe size (F = 1408: a partial column block; rows per
    expert not multiples of 128) with and without paired m-tiles over drifting calls of
    1-4096 tokens, those of >= 128 rows per expert on pairs: equal outputs, byte for byte
    (the same wgmmas, promotions and h groups). Against the emulation this shape's
    warp-specialized calls pass rel L2 but one element of ~7M lies 0.0024 past the
    elementwise bound, paired or not (docs/precision.md, "Accuracy")."""
    from test_gpu_fp8 import _experts, _inputs
    from comet.runtime.layer import FusedMoE, default_tile
    cfg = PRESETS["qwen2-moe"].replace(max_tokens=4096, fp8=Fp8())
    _, _, gu8, dn8 = _experts(cfg, 0)
    layers = [FusedMoE(cfg, gu8, dn8, check_errors="sync",
                       tile=default_tile(cfg=cfg).with_fields(fp8_ws_min_rows=128,
                                                              fp8_ws_paired_rows=paired))
              for paired in (0, 128)]
    drift = [int(v) for v in torch.randint(1, 4097, (40, ), generator=torch.Generator()
                                          .manual_seed(6))]
    on_pairs = 0
    for x, i, w in zip(*_inputs(cfg, drift, 7)):
        want, got = (layer(x, i, w) for layer in layers)
        assert torch.equal(got, want), x.shape[0]
        on_pairs += layers[1].last_tile.variant.fp8_ws_paired_rows > 0
    assert on_pairs >= 10, on_pairs


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "deepseek-v3-like", "phi3.5-moe"])
def test_small_calls_with_the_defaults(name):
    """Decode-sized calls with the layer's defaults: 1-32 tokens and the smallest call the
    Selector puts on the warp-specialized GEMMs (``fp8_ws_min_rows`` expected rows per
    expert, promoted per 128 K), which is the call whose few products per output spread
    per-128's error widest; the smaller ones run the ``tl`` kernels (per 32 K). Each
    against the emulation and the bf16 layer with the bounds of every FP8 call, three
    routings per size, each call twice (the second replays a graph); the worst rel L2 of
    each kernel is printed."""
    from test_gpu_fp8 import REL_L2, _bf16, _check, _emulate, _experts, _inputs
    from comet.runtime.layer import FusedMoE
    cfg = PRESETS[name].replace(max_tokens=256, fp8=Fp8())
    gu, dn, gu8, dn8 = _experts(cfg, 21)
    layer = FusedMoE(cfg, gu8, dn8, check_errors="sync")
    assert layer.selection.may_ws_gemm
    first_ws = next(t for t in range(1, cfg.max_tokens + 1)
                    if layer.selection.ws_gemm_by_rule(t))
    worst = {False: 0.0, True: 0.0}
    for tokens in sorted({1, 2, 3, 5, 8, 16, 32, first_ws}):
        for seed, kind in enumerate(("random", "skewed", "random")):
            (x,), (i,), (w,) = _inputs(cfg, [tokens], 1000 * tokens + seed, kind)
            expect = _emulate(x, i, w, gu8, dn8, cfg.activation)
            bf16 = _bf16(x, i, w, gu, dn, cfg.activation)
            for _ in range(2):
                y = layer(x, i, w)
                ws = layer.last_tile.variant.fp8_ws_min_rows > 0
                assert ws is (tokens >= first_ws), tokens
                _check(y, expect, bf16)
            worst[ws] = max(worst[ws], float((y.float() - expect).norm() / expect.norm()))
    print(f"{name}: worst rel L2 tl {worst[False]:.2e} (1-{first_ws - 1} tokens), "
          f"warp-specialized {worst[True]:.2e} (from {first_ws}; bound {REL_L2})")


def test_scale_blocks_the_kernel_cannot_read_run_the_tl_kernels():
    """A layer whose weights' scale blocks are not whole boxes (per-channel here) keeps
    the fused kernels' K loop for every call."""
    from comet.runtime.layer import FusedMoE, default_tile
    cfg = PRESETS["mixtral"].replace(max_tokens=1024, fp8=Fp8(blocks=ScaleBlocks.per_channel()))
    f, h = cfg.intermediate_size, cfg.hidden_size
    gu8 = quantize_weight(_randn(8, 2 * f, h, seed=8) / h ** 0.5, ScaleBlocks.per_channel(),
                          parts=2)
    dn8 = quantize_weight(_randn(8, h, f, seed=9) / f ** 0.5, ScaleBlocks.per_channel())
    layer = FusedMoE(cfg, gu8, dn8, check_errors="sync",
                     tile=default_tile(cfg=cfg).with_fields(fp8_ws_min_rows=128))
    assert not layer.tile.variant.fp8_ws_min_rows
