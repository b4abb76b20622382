"""comet.quant: the FP8 formats, the quantizers, UE8M0 and shard scales, bad layouts."""

import math

import pytest
import torch

from comet.quant import (E4M3, E4M3_MAX, SCALE_PER_AMAX, Fp8Rows, Fp8Weight, ScaleBlocks,
                         calc_diff, quantize_rows, quantize_weight, ue8m0_to_fp32)


def _w(e=2, n=192, k=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, n, k, generator=g) / 10


@pytest.mark.parametrize("n,k", [(256, 256), (192, 320), (64, 48)])
def test_block_scales_are_amax_times_1_over_448_and_partial_blocks_count(n, k):
    w = _w(n=n, k=k)
    q = quantize_weight(w)
    assert q.weight.dtype == E4M3 and q.weight.shape == w.shape
    assert q.scale_inv.shape == (2, math.ceil(n / 128), math.ceil(k / 128))
    blk = w[1, 128:256, :128] if n > 128 else w[1, :, :128]
    # a multiply by fp32 1/448, as torch's GPU division by a scalar rounds (not CPU's)
    assert q.scale_inv[1, 1 if n > 128 else 0, 0] == blk.abs().max() * SCALE_PER_AMAX
    assert SCALE_PER_AMAX == 1 / E4M3_MAX
    # the block's largest value lands on +-448 exactly; nothing saturates beyond it
    assert q.weight.float().abs().max() == E4M3_MAX
    rel = (q.dequantize() - w).abs() / q.scales()
    assert rel.max() <= 16       # half an e4m3 step at 448 is 16 units of the scale


def test_gate_and_up_are_quantized_apart_with_parts_2():
    w = _w(n=2 * 192)
    q = quantize_weight(w, parts=2)
    assert q.scale_inv.shape == (2, 4, 3)             # 2 x ceil(192 / 128) rows
    gate, up = quantize_weight(w[:, :192]), quantize_weight(w[:, 192:])
    assert torch.equal(q.weight, torch.cat([gate.weight, up.weight], 1))
    assert torch.equal(q.scale_inv, torch.cat([gate.scale_inv, up.scale_inv], 1))
    assert torch.equal(q.dequantize(), torch.cat([gate.dequantize(), up.dequantize()], 1))


def test_zero_block_gets_epsilon_scale_and_zeros():
    w = _w(n=128, k=256)
    w[0, :, 128:] = 0
    q = quantize_weight(w)
    assert q.scale_inv[0, 0, 1] > 0 and torch.all(q.weight[0, :, 128:].float() == 0)


@pytest.mark.parametrize("blocks,grid", [(ScaleBlocks.per_channel(), (192, 1)),
                                         (ScaleBlocks.per_tensor(), (1, 1)),
                                         (ScaleBlocks(1, 128), (192, 3))])
def test_per_channel_and_per_tensor_are_degenerate_blocks(blocks, grid):
    w = _w()
    q = quantize_weight(w, blocks)
    assert q.scale_inv.shape == (2, *grid)
    if blocks == ScaleBlocks.per_tensor():
        assert torch.equal(q.scale_inv.flatten(), w.abs().amax(dim=(1, 2)) / E4M3_MAX)
    assert ((q.dequantize() - w).abs() / q.scales()).max() <= 16


def test_ue8m0_scales_convert_exactly():
    e = torch.tensor([0, 1, 120, 127, 128, 254], dtype=torch.uint8)
    want = torch.tensor([2.0 ** (v - 127) for v in e.tolist()], dtype=torch.float32)
    assert torch.equal(ue8m0_to_fp32(e), want)
    assert torch.equal(ue8m0_to_fp32(e.view(torch.float8_e8m0fnu)), want)
    with pytest.raises(ValueError, match="NaN"):
        ue8m0_to_fp32(torch.tensor([255], dtype=torch.uint8))
    w = quantize_weight(_w(n=256, k=256))
    ue = torch.full((2, 2, 2), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    loaded = Fp8Weight.from_checkpoint(w.weight, ue)
    assert loaded.scale_inv.dtype == torch.float32
    assert torch.all(loaded.scale_inv == 2.0 ** -7)


def test_from_checkpoint_takes_one_expert_and_per_tensor_scales():
    w = quantize_weight(_w(e=1, n=256, k=128))
    one = Fp8Weight.from_checkpoint(w.weight[0], w.scale_inv[0])
    assert torch.equal(one.dequantize(), w.dequantize())
    pt = quantize_weight(_w(e=3), ScaleBlocks.per_tensor())
    loaded = Fp8Weight.from_checkpoint(pt.weight, pt.scale_inv.flatten(), block_size=None)
    assert torch.equal(loaded.dequantize(), pt.dequantize())


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("start", [0, 64, 192, 576])
def test_a_shard_keeps_its_scales_exactly(dim, start):
    """Qwen3-30B-A3B at TP=4: F = 768 in shards of 192, which start inside 128-blocks."""
    w = quantize_weight(_w(e=2, n=768, k=768))
    shard = w.narrow(dim, start, 192)
    assert torch.equal(shard.dequantize(), w.dequantize().narrow(dim, start, 192))
    side = shard.block_shape()[dim - 1]
    assert side == math.gcd(128, start)


def test_quantize_rows_groups_and_partial_last_group():
    x = torch.randn(5, 200)
    x[3] = 0
    r = quantize_rows(x)
    assert r.scale.shape == (5, 2)
    assert torch.equal(r.scale[:, 1], x[:, 128:].abs().amax(1).clamp(min=1e-10) * SCALE_PER_AMAX)
    assert torch.all(r.data[3].float() == 0)
    assert ((r.dequantize() - x).abs() / r.scale.repeat_interleave(128, 1)[:, :200]).max() <= 16


def test_calc_diff():
    x = torch.randn(1000)
    assert calc_diff(x, x) == pytest.approx(0, abs=1e-12)
    assert calc_diff(x, 1.01 * x) == pytest.approx(0.01 ** 2 / 2, rel=0.05)


# ------------------------------------------------------------------ bad layouts
def _q():
    return quantize_weight(_w(n=256, k=256))


@pytest.mark.parametrize("make,match", [
    (lambda q: Fp8Weight(q.weight.float(), q.scale_inv), "float8_e4m3fn"),
    (lambda q: Fp8Weight(q.weight[0], q.scale_inv), r"\[E, N, K\]"),
    (lambda q: Fp8Weight(q.weight.transpose(1, 2), q.scale_inv), "K contiguous"),
    (lambda q: Fp8Weight(q.weight, q.scale_inv.half()), "fp32"),
    (lambda q: Fp8Weight(q.weight, q.scale_inv[:, :1]), r"scale_inv must be \[2, 2, 2\]"),
    (lambda q: Fp8Weight(q.weight, q.scale_inv, ScaleBlocks(64, 128)), r"must be \[2, 4, 2\]"),
    (lambda q: Fp8Weight(q.weight, q.scale_inv, parts=3), "parts"),
    (lambda q: Fp8Weight(q.weight, q.scale_inv.transpose(1, 2).contiguous(),
                         ScaleBlocks(128, 64)), r"must be \[2, 2, 4\]"),
    (lambda q: ScaleBlocks(0, 128), "positive"),
    (lambda q: Fp8Weight.from_checkpoint(q.weight, q.scale_inv, block_size=(128,)), "bn, bk"),
    (lambda q: q.narrow(0, 0, 1), "dim"),
    (lambda q: q.narrow(1, 200, 100), "outside"),
    (lambda q: quantize_weight(q.weight), "float tensor"),
    (lambda q: quantize_weight(torch.randn(4, 4)), r"\[E, N, K\]"),
    (lambda q: quantize_weight(torch.randn(1, 5, 4), parts=2), "parts"),
    (lambda q: quantize_rows(torch.randn(2, 3, 4)), r"\[rows, K\]"),
    (lambda q: Fp8Rows(q.weight[0], torch.ones(256, 3)), r"must be \[256, 2\]"),
    (lambda q: Fp8Rows(q.weight[0].float(), torch.ones(256, 2)), "2-D"),
])
def test_bad_layouts_are_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make(_q())
