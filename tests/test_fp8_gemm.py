"""comet.kernels.fp8_gemm under the interpreter (and on a GPU): each role against the
fp32 emulation -- the row quantizer, the block-scaled K loop (partial N and K blocks,
per-channel, per-tensor, shard scales), the gated epilogue's requantization -- and the
launcher's bad-input errors.

The interpreter's fp32 -> e4m3 cast halves a value that rounds up across a power of two
(126.8 -> 64, not 128; ~1.4% of values): :func:`fp8_checks.same_fp8` allows exactly that there."""

import pytest
import torch

from comet.activation import SILU, GatedActivation, gated
from comet.kernels.fp8_gemm import (MIN_BLOCK_K, Fp8GemmConfig, fp8_group_gemm,
                                    imprecise_acc, m_tiles, quantize_rows_triton)
from comet.quant import E4M3, Fp8, Fp8Rows, ScaleBlocks, quantize_rows, quantize_weight
from fp8_checks import SUM_RTOL, requant_close, same_fp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Fp8GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=2)




def _randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded draws on DEV: each test's data is the same whatever ran before it."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _rows(e_rows, k, seed=0):
    return _randn(sum(e_rows), k, seed=seed)


def _emulated(a: Fp8Rows, w, e_rows) -> torch.Tensor:
    """Each expert's rows times its dequantized weight, fp32 (the emulation)."""
    x, wd, out, base = a.dequantize(), w.dequantize(), [], 0
    for e, n in enumerate(e_rows):
        out.append(x[base:base + n] @ wd[e].T)
        base += n
    return torch.cat(out)


def test_row_quantizer_kernel_is_the_recipe():
    x = _rows([37], 320)
    x[5] = 0
    got, ref = quantize_rows_triton(x), quantize_rows(x)
    assert torch.equal(got.scale, ref.scale)
    assert torch.all(same_fp8(got.data, ref.data))


@pytest.mark.parametrize("n,k,blocks,block_n,block_k", [
    (192, 320, ScaleBlocks(), 64, 128),          # partial N and K blocks; scalar B scale
    (192, 320, ScaleBlocks(), 128, 128),         # a tile over one partial block
    (256, 256, ScaleBlocks(), 256, 128),         # two scale blocks per tile: per-column
    (192, 256, ScaleBlocks.per_channel(), 64, 128),
    (192, 256, ScaleBlocks.per_tensor(), 128, 64),
])
def test_block_scaled_k_loop_matches_the_emulation(n, k, blocks, block_n, block_k):
    e_rows = [70, 0, 33]
    w = quantize_weight(_randn(3, n, k, seed=n + k) / 10, blocks)
    a = quantize_rows(_rows(e_rows, k))
    cfg = Fp8GemmConfig(block_m=64, block_n=block_n, block_k=block_k, num_warps=4,
                        num_stages=2)
    out = fp8_group_gemm(a, w, m_tiles(e_rows, 64, DEV), config=cfg)
    ref = _emulated(a, w, e_rows)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_a_tp_shard_runs_in_64_wide_blocks():
    """Qwen3-30B-A3B at TP=4: rank 1's F shard [192, 384) of a 768 down projection's K,
    its scales re-blocked to 64 (comet.quant.Fp8Weight.narrow); the K step follows."""
    full = quantize_weight(_randn(2, 128, 768, seed=2) / 10)
    shard = full.narrow(2, 192, 192)
    assert shard.block_shape() == (128, 64)
    e_rows = [20, 45]
    a = quantize_rows(_rows(e_rows, 192))
    cfg = Fp8GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2)
    out = fp8_group_gemm(a, shard, m_tiles(e_rows, 64, DEV), config=cfg)
    torch.testing.assert_close(out.float(), _emulated(a, shard, e_rows), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("f,parts,act", [
    (192, 2, SILU),                       # F not a multiple of 128: gate and up apart
    (256, 1, SILU),
    (128, 1, GatedActivation(kind="gelu_tanh")),
    (192, 1, GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)),   # unaligned up half
])
def test_gated_epilogue_requantizes_for_layer1(f, parts, act):
    e_rows = [50, 30]
    k = 256
    w = quantize_weight(_randn(2, 2 * f, k, seed=f) / 10, parts=parts)
    a = quantize_rows(_rows(e_rows, k, seed=1))
    cfg = Fp8GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=2)
    tiles = m_tiles(e_rows, 64, DEV)
    gu = _emulated(a, w, e_rows)
    h_ref = gated(gu[:, :f], gu[:, f:], act)
    h = fp8_group_gemm(a, w, tiles, activation=act, config=cfg)
    torch.testing.assert_close(h.float(), h_ref, atol=2e-2, rtol=1e-2)
    q = fp8_group_gemm(a, w, tiles, activation=act, requant=True, config=cfg)
    ref = quantize_rows(h_ref)
    assert isinstance(q, Fp8Rows) and q.data.dtype == E4M3 and q.scale.shape == ref.scale.shape
    torch.testing.assert_close(q.scale, ref.scale, rtol=SUM_RTOL, atol=0)
    # the same value up to the fp32 rounding of the sums: at most one e4m3 step, rarely
    same = same_fp8(q.data, ref.data)
    assert torch.all(requant_close(q.data, ref.data))
    assert same.float().mean() > 0.97


@pytest.mark.parametrize("change,match", [
    (dict(k=200), "multiple of 16"),
    (dict(cfg=Fp8GemmConfig(block_k=256)), "block_k = 256 must divide"),
    (dict(requant=True, cfg=Fp8GemmConfig(block_n=64)), "whole groups"),
    (dict(cfg=Fp8GemmConfig(block_m=32)), "longer than block_m"),
    (dict(cfg=Fp8GemmConfig(block_n=96)), "power of two"),
    (dict(k_rows=128), "K = 128"),
    (dict(bf16_rows=True), "Fp8Rows"),
])
def test_bad_input_is_a_value_error_before_any_launch(change, match):
    k = change.get("k", 256)
    w = quantize_weight(torch.randn(2, 256, k) / 10)
    a = quantize_rows(torch.randn(80, change.get("k_rows", k)))
    tiles = m_tiles([40, 40], 64)
    cfg = change.get("cfg", Fp8GemmConfig())
    with pytest.raises(ValueError, match=match):
        fp8_group_gemm(a.data.float() if change.get("bf16_rows") else a, w, tiles,
                       activation=SILU if change.get("requant") else None,
                       requant=change.get("requant", False), config=cfg)


@pytest.mark.parametrize("change,match", [
    (dict(k_rows=128), "K = 128"),
    (dict(rows_per_tile=65), "longer than block_m = 64"),
    (dict(blocks=ScaleBlocks(64, 128)), "whole 128x128 boxes"),
    (dict(group=64), r"row group \(64\)"),
    (dict(bf16_rows=True), "Fp8Rows"),
])
def test_the_warp_specialized_gemm_refuses_bad_input_before_any_launch(change, match):
    """comet.kernels.fp8_ws's launcher checks what its kernel relies on (the Gluon kernel
    itself runs on a GPU only: these errors come first on any machine)."""
    from comet.kernels.fp8_ws import ws_group_gemm
    w = quantize_weight(torch.randn(2, 256, 256) / 10, change.get("blocks", ScaleBlocks()))
    a = quantize_rows(torch.randn(130, change.get("k_rows", 256)), change.get("group", 128))
    tiles = m_tiles([change.get("rows_per_tile", 64), 66], change.get("rows_per_tile", 64))
    with pytest.raises(ValueError, match=match):
        ws_group_gemm(a.data.float() if change.get("bf16_rows") else a, w, tiles)


@pytest.mark.parametrize("change, match", [
    (dict(gather=True), "placed rows only"),
    (dict(rows_per_tile=129), "longer than block_m = 128"),
    (dict(rows_per_tile=129, activation=True), "longer than block_m = 128"),
])
def test_paired_m_tiles_refuse_what_they_cannot_run(change, match):
    """``paired``: placed rows, over m-tiles of at most 128 rows."""
    from comet.activation import SILU
    from comet.kernels.fp8_gemm import Fp8Gather
    from comet.kernels.fp8_roles import pack_rows
    from comet.kernels.fp8_ws import ws_gemm, ws_group_gemm
    w = quantize_weight(torch.randn(2, 256, 256) / 10)
    a = quantize_rows(torch.randn(260, 256))
    rows = change.get("rows_per_tile", 128)
    tiles = m_tiles([rows, 66], rows)
    act = SILU if change.get("activation") else None
    with pytest.raises(ValueError, match=match):
        if change.get("gather"):
            packed = pack_rows(a)
            src = torch.zeros(rows + 66, dtype=torch.int32)
            ws_gemm(Fp8Gather(src, packed, packed.shape[1]), None, w, tiles, (), paired=True)
        else:
            ws_group_gemm(a, w, tiles, paired=True, activation=act)


@pytest.mark.parametrize("change,match", [
    (dict(src_dtype=torch.int64), "int32"),
    (dict(row_bytes=256), "needs at least 264 bytes"),
    (dict(strided=True), "contiguous packed rows"),
    (dict(rows_per_tile=65), "longer than block_m = 64"),
    (dict(own=True), "one rank"),
])
def test_the_warp_specialized_gemm_refuses_a_bad_gather_before_any_launch(change, match):
    """A's rows read through an index (``A_GATHER``): the index, the packed rows, the
    m-tiles and a gather of a multi-rank layout are checked before the Gluon launch."""
    from comet.kernels.fp8_gemm import Fp8Gather, Fp8OwnRows
    from comet.kernels.fp8_roles import pack_rows
    from comet.kernels.fp8_ws import ws_group_gemm
    w = quantize_weight(torch.randn(2, 256, 256) / 10)
    packed = pack_rows(quantize_rows(torch.randn(10, 256)))
    if change.get("row_bytes"):
        packed = packed[:, :change["row_bytes"]].contiguous()
    if change.get("strided"):
        packed = torch.cat([packed, packed], 1)[:, :packed.shape[1]]
    src = torch.zeros(130, dtype=change.get("src_dtype", torch.int32))
    own = Fp8OwnRows(0, 0, 10) if change.get("own") else None
    tiles = m_tiles([change.get("rows_per_tile", 64), 66], change.get("rows_per_tile", 64))
    with pytest.raises(ValueError, match=match):
        ws_group_gemm(Fp8Gather(src, packed, packed.shape[1], own), w, tiles)


@pytest.mark.gpu
def test_fp8_gemm_at_size_on_gpu():
    """Mixtral-width layer0 (H = 4096, F = 1024 of it) at the default tile: whole m-tiles,
    a partial one and a one-row expert; the requantized output against the emulation."""
    e_rows = [200, 64, 1]
    w = quantize_weight(torch.randn(3, 2 * 1024, 4096, device="cuda") / 64, parts=2)
    a = quantize_rows(_rows(e_rows, 4096))
    q = fp8_group_gemm(a, w, m_tiles(e_rows, 128, "cuda"), activation=SILU, requant=True)
    gu = _emulated(a, w, e_rows)
    ref = quantize_rows(gated(gu[:, :1024], gu[:, 1024:], SILU))
    torch.testing.assert_close(q.scale, ref.scale, rtol=SUM_RTOL, atol=0)
    assert torch.all(requant_close(q.data, ref.data))
    assert same_fp8(q.data, ref.data).float().mean() > 0.97


def test_fp32_promotion_per_instruction_in_tl_per_k_step_warp_specialized():
    """By default the ``tl`` K loop's dots promote each 32-value MMA instruction's sum to
    fp32 and the warp-specialized GEMMs each K step's (DeepSeek-V3's 128); a
    ``promotion_k`` holds for both; a shorter K step (a re-blocked TP shard) is promoted
    whole either way."""
    assert Fp8().promotion(warp_specialized=False) == MIN_BLOCK_K == 32
    assert Fp8().promotion(warp_specialized=True) == 128
    for k in (32, 128):
        assert {Fp8(promotion_k=k).promotion(ws) for ws in (False, True)} == {k}
    assert imprecise_acc(32, 128) == 32 and imprecise_acc(128, 128) == 128
    assert imprecise_acc(32, 16) == 16 and imprecise_acc(128, 64) == 64
    for bad in (64, 0, True, 128.0):
        with pytest.raises(ValueError, match="promotion_k"):
            Fp8(promotion_k=bad)
