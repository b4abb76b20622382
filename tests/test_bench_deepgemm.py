"""``comet bench --dtype fp8 --peers deepgemm`` on the CPU: DeepGEMM's row layouts against
plain torch references, its weight operand, the peer's unavailable paths, the check and
timing driven through a stand-in ``deep_gemm`` that computes what DeepGEMM's M-grouped FP8
GEMMs compute (and asserts what their host code asserts), the records' ratio and the
summary line. The real package runs on a GPU only (``test_deepgemm_on_the_gpu``)."""

import ctypes
import glob
import sys
import types

import pytest
import torch

from comet.baseline import plan_dispatch
from comet.bench import deepgemm as dg
from comet.bench import records as rec
from comet.bench import report
from comet.bench.peers import PeerUnavailable
from comet.bench.runner import (Case, Fused, Settings, case_timer, deepgemm_series,
                               fp8_gemm_mode)
from comet.bench.timing import L2Flush
from comet.cli import bench
from comet.config import MoEConfig
from comet.constants import interpreting
from comet.quant import Fp8Rows, Fp8Weight, ScaleBlocks, quantize_rows, quantize_weight
from comet.reference import grouped_gemm_fp8


def _rows(n: int, k: int = 256, seed: int = 0) -> Fp8Rows:
    return quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


# --------------------------------------------------------------------------- layouts
def test_scales_are_mn_major_in_tma_aligned_columns():
    assert [dg.tma_aligned_rows(m) for m in (0, 1, 4, 5, 130)] == [0, 4, 4, 8, 132]
    s = torch.arange(15.0).view(5, 3)
    t = dg.mn_major_scales(s)
    assert t.shape == (5, 3) and t.stride() == (1, 8) and torch.equal(t, s)
    s3 = torch.arange(30.0).view(2, 5, 3)
    t3 = dg.mn_major_scales(s3)
    assert t3.shape == (2, 5, 3) and t3.stride() == (24, 1, 8) and torch.equal(t3, s3)


def test_the_contiguous_layout_pads_each_expert_to_the_alignment():
    counts, align = [3, 0, 5, 1], 4
    a = _rows(sum(counts))
    out = dg.contiguous_layout(a, counts, align)
    # expert 0: rows 0-2 (+1 pad), expert 1: none, expert 2: rows 4-8 (+3), expert 3: 12 (+3)
    want_idx = [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1, 3, -1, -1, -1]
    assert out.m_indices.dtype == torch.int32 and out.m_indices.tolist() == want_idx
    assert out.rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12]
    assert out.data.shape == (16, 256) and out.data.dtype == a.data.dtype
    assert out.scale.shape == (16, 2) and out.scale.stride() == (1, 16)
    bits = out.data.view(torch.uint8)
    for src, dst in enumerate(out.rows.tolist()):
        assert torch.equal(bits[dst], a.data[src].view(torch.uint8))
        assert torch.equal(out.scale[dst], a.scale[src])
    pad = torch.tensor(want_idx) < 0
    assert not bits[pad].any() and not out.scale[pad].any()
    assert out.output(384).shape == (16, 384)


def test_the_masked_layout_has_one_block_of_rows_per_expert():
    counts = [3, 0, 5, 1]
    a = _rows(sum(counts))
    out = dg.masked_layout(a, counts, align=4)
    assert out.data.shape == (4, 8, 256) and out.scale.shape == (4, 8, 2)
    assert out.scale.stride() == (16, 1, 8)
    assert out.masked_m.dtype == torch.int32 and out.masked_m.tolist() == counts
    assert out.expected_m == 3                                      # ceil(9 / 4)
    assert out.rows.tolist() == [0, 1, 2, 16, 17, 18, 19, 20, 24]
    live = torch.zeros(4, 8, dtype=torch.bool)
    for e, n in enumerate(counts):
        live[e, :n] = True
    assert torch.equal(out.data.view(torch.uint8)[live], a.data.view(torch.uint8))
    assert torch.equal(out.scale[live], a.scale)
    assert not out.data.view(torch.uint8)[~live].any() and not out.scale[~live].any()
    assert out.output(128).shape == (4, 8, 128)


def test_layouts_refuse_counts_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="rows per expert"):
        dg.contiguous_layout(_rows(4), [2, 1])
    with pytest.raises(ValueError, match="layouts are"):
        dg.layout_rows("dense", _rows(3), [3])
    assert dg.layouts_for(128) == ("contiguous", "masked")
    assert dg.layouts_for(129) == ("contiguous",)


# --------------------------------------------------------------------------- weights
def test_the_weight_operand_is_the_experts_as_they_are():
    w = quantize_weight(torch.randn(2, 512, 256), parts=2)          # gate/up, F = 256
    data, scale = dg.weight_operand(w)
    assert data is w.weight and torch.equal(scale, w.scale_inv) and scale.shape == (2, 4, 2)
    for bad in (quantize_weight(torch.randn(2, 384, 256), parts=2),  # F = 192
                quantize_weight(torch.randn(2, 256, 192)),           # K = 192
                quantize_weight(torch.randn(2, 256, 256), ScaleBlocks.per_channel())):
        with pytest.raises(PeerUnavailable, match="128x128 weight blocks"):
            dg.weight_operand(bad)


def test_the_grouped_reference_is_each_experts_product():
    counts = [2, 0, 3]
    a, w = _rows(5), quantize_weight(torch.randn(3, 128, 256))
    y = grouped_gemm_fp8(a, w, counts)
    expert = torch.tensor([0, 0, 2, 2, 2])
    want = torch.einsum("rk,rnk->rn", a.dequantize(), w.dequantize()[expert])
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        grouped_gemm_fp8(a, w, [5])


# --------------------------------------------------------------------------- a stand-in
def _deq_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.float() * scale.repeat_interleave(128, dim=-1)[..., :data.shape[-1]]


def _check_b(b, k: int) -> torch.Tensor:
    w, ws = b
    e, n, _ = w.shape
    assert w.dtype == torch.float8_e4m3fn and w.stride(-1) == 1 and w.shape[2] == k
    assert ws.dtype == torch.float32 and ws.shape == (e, -(-n // 128), -(-k // 128))
    assert ws.is_contiguous()
    return Fp8Weight(w, ws).dequantize()


def _check_sfa(scale: torch.Tensor) -> None:
    # The layout DeepGEMM's SM90 kernels read without a copy (get_mn_major_tma_aligned_tensor).
    m = scale.shape[-2]
    assert scale.dtype == torch.float32 and scale.stride(-2) == 1
    assert scale.stride(-1) == dg.tma_aligned_rows(m)


def fake_deep_gemm(*, ignore_scales: bool = False, fail: tuple[str, ...] = ()
                   ) -> types.ModuleType:
    """A ``deep_gemm`` whose two M-grouped FP8 GEMMs compute in fp32 what DeepGEMM's do
    (rows times experts transposed, with their scales; ``-1`` rows and rows past
    ``masked_m`` untouched) after asserting the operands' layouts as its host code does;
    ``ignore_scales`` drops the row scales (a wrong GEMM); the layouts in ``fail`` raise."""
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "fake"

    def contiguous(a, b, d, m_indices, disable_ue8m0_cast=False):
        if "contiguous" in fail:
            raise RuntimeError("NVCC compilation failed")
        data, scale = a
        assert disable_ue8m0_cast and data.stride(-1) == 1
        _check_sfa(scale)
        w = _check_b(b, data.shape[1])
        assert m_indices.dtype == torch.int32 and m_indices.shape == (data.shape[0],)
        assert d.dtype == torch.bfloat16 and d.shape == (data.shape[0], w.shape[1])
        # each 128-row block is one expert's (or padding): the contiguous layout's contract
        for blk in m_indices.split(mod.get_mk_alignment_for_contiguous_layout()):
            assert len(set(blk[blk >= 0].tolist())) <= 1
        x = data.float() if ignore_scales else _deq_rows(data, scale)
        for r, e in enumerate(m_indices.tolist()):
            if e >= 0:
                d[r] = (x[r] @ w[e].T).bfloat16()

    def masked(a, b, d, masked_m, expected_m, disable_ue8m0_cast=False):
        if "masked" in fail:
            raise RuntimeError("NVCC compilation failed")
        data, scale = a
        assert disable_ue8m0_cast and expected_m > 0
        _check_sfa(scale)
        w = _check_b(b, data.shape[2])
        assert masked_m.dtype == torch.int32 and masked_m.shape == (data.shape[0],)
        assert d.shape == (*data.shape[:2], w.shape[1])
        x = data.float() if ignore_scales else _deq_rows(data, scale)
        for e, m in enumerate(masked_m.tolist()):
            d[e, :m] = (x[e, :m] @ w[e].T).bfloat16()

    mod.m_grouped_fp8_gemm_nt_contiguous = contiguous
    mod.m_grouped_fp8_gemm_nt_masked = masked
    mod.get_mk_alignment_for_contiguous_layout = lambda: 128
    return mod


@pytest.mark.parametrize("layout", dg.LAYOUTS)
def test_a_right_gemm_passes_the_check_and_a_wrong_one_does_not(layout):
    counts = [0, 5, 130, 1]
    a, w = _rows(sum(counts)), quantize_weight(torch.randn(4, 256, 256), parts=2)
    right = dg.bind(fake_deep_gemm())
    assert right.align == 128 and "fake" in right.backend
    assert dg.check_layout(right, layout, a, w, counts) < 1e-5
    wrong = dg.bind(fake_deep_gemm(ignore_scales=True))
    assert dg.check_layout(wrong, layout, a, w, counts) > dg.MAX_DIFF


# --------------------------------------------------------------------------- unavailable
def test_the_peer_says_why_it_cannot_run(monkeypatch):
    assert dg.load_deepgemm(torch.device("cpu")) == "needs a CUDA GPU"
    assert "no m_grouped_fp8_gemm_nt_masked" in dg.bind(types.SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (10, 0))
    assert "SM90" in dg.load_deepgemm(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setitem(sys.modules, "deep_gemm", None)             # import fails
    why = dg.load_deepgemm(torch.device("cuda", 0))
    assert why.startswith("deep_gemm does not import") and "build_peers.sh" in why


# --------------------------------------------------------------------------- the runner
CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128,
                max_tokens=16)


def _series(module, tokens=8):
    st = Settings(device=torch.device("cpu"), iters=2, warmup=0, n_sets=2)
    gate_up = quantize_weight(torch.randn(4, 256, 256), parts=2)
    down = quantize_weight(torch.randn(4, 256, 128))
    g = torch.Generator().manual_seed(1)
    plans = [plan_dispatch(torch.randint(0, 4, (tokens, 2), generator=g), 4)
             for _ in range(st.n_sets)]
    out = {}
    status = deepgemm_series(module if isinstance(module, str) else dg.bind(module),
                             Case("t", CFG, tokens, "uniform"), plans, gate_up, down, st,
                             case_timer(st, L2Flush(st.device)), out)
    return status, out


@pytest.mark.skipif(not interpreting(), reason="comet's FP8 quantizer interpreted on the CPU")
def test_deepgemm_is_checked_then_timed_in_each_layout():
    status, out = _series(fake_deep_gemm())
    assert status["status"] == "timed" and status["layout"] in dg.LAYOUTS
    assert set(status["calc_diff"]) == set(status["layout_us"]) == set(dg.LAYOUTS)
    assert all(v < 1e-5 for d in status["calc_diff"].values() for v in d.values())
    series = out["deepgemm"]
    assert len(series.layer("layer0")) == len(series.layer("layer1")) == 2
    assert status["layout_us"][status["layout"]] == min(status["layout_us"].values())
    status, _ = _series(fake_deep_gemm(), tokens=200)               # no masked layout
    assert set(status["layout_us"]) == {"contiguous"}


@pytest.mark.skipif(not interpreting(), reason="comet's FP8 quantizer interpreted on the CPU")
def test_a_wrong_failing_or_missing_deepgemm_is_not_timed():
    status, out = _series(fake_deep_gemm(ignore_scales=True))
    assert status["status"] == "wrong" and "calc_diff" in status["reason"] and not out
    status, out = _series(fake_deep_gemm(fail=dg.LAYOUTS))
    assert status["status"] == "failed" and "NVCC compilation failed" in status["reason"]
    assert not out
    status, out = _series(fake_deep_gemm(fail=("contiguous",)))     # the other one runs
    assert status["status"] == "timed" and status["layout"] == "masked" and out
    assert "NVCC compilation failed" in status["failed_layouts"]["contiguous"]
    assert _series("needs a CUDA GPU")[0] == {"status": "unavailable",
                                             "reason": "needs a CUDA GPU"}


# --------------------------------------------------------------------------- records
def _fp8_record(tokens: int, comet_tflops, deepgemm_tflops, status=None) -> dict:
    r = {"config": "q", "tokens_per_rank": tokens, "routing": "uniform", "layer": "moe",
         "dtype": rec.FP8, "fused_us": 100.0, "comet_gmm_tflops": comet_tflops}
    if status is not None:
        r.update(deepgemm_gmm_tflops=deepgemm_tflops, deepgemm=status)
    return rec.derive(r)


def test_the_summary_holds_the_gemm_phases_to_085_of_deepgemm():
    timed = {"status": "timed", "layout": "contiguous"}
    records = [_fp8_record(128, 400.0, 500.0, timed), _fp8_record(4096, 900.0, 1000.0, timed)]
    assert records[0]["fp8_gmm_over_deepgemm"] == pytest.approx(0.8)
    [line] = report.fp8_summary(records)
    assert ("FP8 GEMM phases vs DeepGEMM's grouped FP8 GEMM, TFLOP/s ratio >= 0.85 in 1/2 "
            "(worst 0.80)") in line and "not measured" not in line
    names = [name for name, _ in report.fp8_columns(records)]
    assert names[-4:] == ["comet GEMM TFLOP/s", "DeepGEMM TFLOP/s", "DeepGEMM layout",
                          "comet/DeepGEMM"]
    assert "| 0.80 |" in report.markdown_table(records, report.fp8_columns(records))


def test_the_summary_says_not_measured_and_why():
    plain = [_fp8_record(128, 400.0, None)]
    assert plain[0]["fp8_gmm_over_deepgemm"] is None
    [line] = report.fp8_summary(plain)
    assert ("FP8 GEMM phases vs DeepGEMM's grouped FP8 GEMM: not measured (comet bench "
            "--dtype fp8 --peers deepgemm)") in line
    assert report.fp8_columns(plain) == report.FP8_COLUMNS
    away = [_fp8_record(128, 400.0, None, {"status": "unavailable",
                                           "reason": "needs a CUDA GPU"})]
    [line] = report.fp8_summary(away)
    assert "DeepGEMM's grouped FP8 GEMM: not measured (needs a CUDA GPU)" in line


# --------------------------------------------------------------------------- the CLI
def test_deepgemm_needs_the_fp8_layer(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--peers", "deepgemm", "--tokens", "4"])
    assert "add --dtype fp8" in capsys.readouterr().err


@pytest.mark.skipif(not interpreting(), reason="the FP8 layer interpreted on the CPU")
def test_an_fp8_sweep_records_why_deepgemm_did_not_run(tmp_path, capsys):
    assert bench.main(["--dtype", "fp8", "--peers", "deepgemm", "--tokens", "4",
                       "--routing", "uniform", "--layers", "layer0", "moe", "--iters", "1",
                       "--warmup", "0", "--input-sets", "1", "--output-dir", str(tmp_path),
                       "--no-plot"]) == 0
    out = capsys.readouterr().out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    for r in rec.read_json(path):
        assert r["deepgemm"] == {"status": "unavailable", "reason": "needs a CUDA GPU"}
        assert r["deepgemm_gmm_us"] is None and r["fp8_gmm_over_deepgemm"] is None
        assert "peer_deepgemm_us" not in r and r.get("best_peer") is None
    assert "DeepGEMM's grouped FP8 GEMM: not measured (needs a CUDA GPU)" in out
    assert "DeepGEMM TFLOP/s" in out


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_deepgemm_on_the_gpu():
    """The real package (scripts/device/build_peers.sh) against the fp32 emulation, both
    layouts (its JIT compiles the kernels on first use)."""
    if isinstance(dg.load_deepgemm(torch.device("cuda")), str):
        pytest.skip(f"deepgemm: {dg.load_deepgemm(torch.device('cuda'))}")
    assert dg._smoke() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dlopen scopes are Linux's")
def test_share_libstdcxx_puts_the_loaded_libstdcxx_in_the_global_scope():
    # torch loaded it; after the promotion a lookup in the global scope (dlopen(NULL))
    # finds libstdc++'s own locale facet id, which deep_gemm's module must bind to.
    paths = dg.share_libstdcxx()
    assert paths and all("libstdc++.so" in p for p in paths)
    assert hasattr(ctypes.CDLL(None), "_ZNSt5ctypeIcE2idE")


def test_comet_side_times_the_gemms_the_fused_call_ran():
    # The decomposed modes never run the warp-specialized GEMMs: where the fused call did,
    # its own phases are comet's GEMM side.
    class Layer:
        last_ws_gemm = False
    fused = Fused(Layer(), lambda: None)
    assert fp8_gemm_mode(fused) == "compute_only"
    fused.layer.last_ws_gemm = True
    assert fp8_gemm_mode(fused) == "fused"
    assert fp8_gemm_mode(Fused(object(), lambda: None)) == "compute_only"
