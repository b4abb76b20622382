"""The interleaved W13 layout (comet.weights) and its conversions."""

import pytest
import torch
import triton
import triton.language as tl

from comet.constants import interpreting
from comet.kernels.group_gemm import gate_up_columns
from comet.weights import gate_up_first, interleave_gate_up, interleave_gate_up_


@pytest.mark.parametrize("f, block", [(256, 128), (320, 128), (48, 128), (96, 32)])
def test_interleave_places_gate_and_up_blocks_side_by_side(f, block):
    h = 3
    gate = torch.arange(h * f).view(h, f).float()
    up = -gate - 1
    w = interleave_gate_up(torch.cat([gate, up], dim=1), block)
    col = 0
    for j in range(0, f, block):
        width = min(block, f - j)
        assert torch.equal(w[:, col:col + width], gate[:, j:j + width])
        assert torch.equal(w[:, col + width:col + 2 * width], up[:, j:j + width])
        col += 2 * width
    assert col == 2 * f


@pytest.mark.parametrize("f", [128, 1408, 200, 16])
def test_round_trip_and_in_place(f):
    w = torch.randn(2, 5, 2 * f)
    inter = interleave_gate_up(w)
    assert inter.shape == w.shape and inter.is_contiguous()
    assert torch.equal(gate_up_first(inter), w)
    same = w.clone()
    assert interleave_gate_up_(same) is same and torch.equal(same, inter)


@triton.jit
def _columns_kernel(n0_ptr, out_ptr, F, GATE_UP: tl.constexpr):
    i = tl.program_id(0)
    gate, up = gate_up_columns(tl.load(n0_ptr + i), F, GATE_UP)
    tl.store(out_ptr + 2 * i, gate)
    tl.store(out_ptr + 2 * i + 1, up)


@pytest.mark.skipif(not torch.cuda.is_available() and not interpreting(),
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_kernel_column_map_matches_layout():
    """gate_up_columns (the layer0 kernel's two-dot path) names the columns the conversion
    put each gate and up column in, partial last block included."""
    f, block = 320, 128
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inter = interleave_gate_up(torch.arange(2 * f).view(1, 2 * f), block)[0]
    n0 = torch.tensor([0, 16, 128, 250, 256, 300], dtype=torch.int32, device=device)
    out = torch.zeros(2 * n0.numel(), dtype=torch.int32, device=device)
    _columns_kernel[(n0.numel(),)](n0, out, f, GATE_UP=block)
    got = inter[out.cpu().long()].view(-1, 2)
    assert torch.equal(got[:, 0], n0.cpu().long()) and torch.equal(got[:, 1], f + n0.cpu().long())
