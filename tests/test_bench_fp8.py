"""``comet bench --dtype fp8`` and ``comet tune --dtype fp8`` on the CPU (issue 68's
benchmark): the CLI, an interpreted FP8 sweep's records, the FP8 floor and dispatch
bytes, the summary's ratio lines from synthetic records, and the tuned tables' dtype
guard (a bf16 table never serves an FP8 layer, nor an FP8 table a bf16 one)."""

import glob
import json

import pytest
import torch

from comet.bench import floors, report
from comet.bench import records as rec
from comet.bench.inputs import quantize_expert_weights
from comet.cli import bench, tune
from comet.config import MoEConfig, TileConfig, Variant
from comet.constants import interpreting
from comet.kernels.fp8_roles import packed_row_bytes
from comet.quant import Fp8, quantize_weight
from comet.scheduler import tuned
from test_bench import fake_fused  # noqa: F401  (a fixture)

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128,
                max_tokens=64)
CFG8 = CFG.replace(fp8=Fp8())


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch):
    tuned._load.cache_clear()
    monkeypatch.delenv(tuned.ENV_FOLDER, raising=False)


# --------------------------------------------------------------------------- the CLI
def test_bench_parses_fp8_beside_one_row_dtype(capsys):
    args = bench.build_parser().parse_args(["--dtype", "bf16", "fp8"])
    assert args.dtype == ["bf16", "fp8"]
    for bad in (["--dtype", "bf16", "fp16"], ["--dtype", "fp8", "--redundant-experts", "0"],
                ["--dtype", "bf16", "fp8", "--timeline"], ["--fp8-promotion-k", "32"],
                ["--dtype", "fp8", "--fp8-promotion-k", "64"]):
        with pytest.raises(SystemExit):
            bench.main(bad + ["--tokens", "4"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "--fp8-promotion-k needs --dtype fp8" in err
    assert "invalid choice: 64" in err
    args = bench.build_parser().parse_args(["--dtype", "fp8", "--fp8-promotion-k", "32"])
    assert args.fp8_promotion_k == 32


@pytest.mark.skipif(not interpreting(), reason="the FP8 layer interpreted on the CPU")
def test_an_fp8_sweep_under_the_interpreter_writes_fp8_records(tmp_path, capsys):
    """bf16 and FP8 in one run: the FP8 record has the fused layer's times in every mode,
    no bf16-only column (and says why), its dispatch bytes against the bf16 record's,
    its output within bounds of the quantized layer's emulation."""
    assert bench.main(["--dtype", "bf16", "fp8", "--tokens", "4", "--routing", "uniform",
                       "--layers", "moe", "--iters", "1", "--warmup", "0", "--input-sets",
                       "1", "--chunks", "2", "--output-dir", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    records = rec.read_json(path)
    [b16] = [r for r in records if r["dtype"] == "bfloat16"]
    [f8] = [r for r in records if r["dtype"] == "fp8"]
    assert set(rec.REQUIRED_KEYS) <= set(f8)
    assert f8["fp8_promotion_k"] == "auto" and "fp8_promotion_k" not in b16
    for mode in ("fused_us", "sequential_us", "compute_only_us", "comm_only_us"):
        assert f8[mode] > 0, mode
    assert f8["skipped_modes"] is None
    assert f8["baseline_us"] is None and f8["chunked_us"] is None
    assert set(f8["omitted"]) >= {"baseline_us", "chunked_us", "torch_gmm_us", "peers"}
    assert b16["baseline_us"] > 0 and "omitted" not in b16
    assert f8["dispatch_row_bytes"] == packed_row_bytes(256) == 272
    assert b16["dispatch_row_bytes"] == 256 * 2
    assert f8["dispatch_rows"] == b16["dispatch_rows"] == 4 * 2
    assert f8["dispatch_bytes_over_bf16"] == pytest.approx(272 / 512)
    assert f8["max_rel_err"]["fused"] <= rec.MAX_REL_ERR
    assert f8["comet_phases_us"]["fused"]["layer0"] > 0
    assert f8["hbm_floor_us"] is None                       # no bandwidth measured on a CPU
    assert "FP8 (b) us" in out and "summary: fp8 uniform:" in out
    assert "dispatch bytes FP8/bf16 <= 0.53 in 0/1 (worst 0.53)" in out
    assert "## The FP8 layer against bf16" in open(path[:-5] + ".md").read()


# --------------------------------------------------------------------------- floors
def test_fp8_experts_are_the_bf16_draws_quantized_a_chunk_at_a_time():
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(5, 128, 2 * 192, generator=g).bfloat16()
    w2 = torch.randn(5, 192, 128, generator=g).bfloat16()
    gate_up, down = quantize_expert_weights(w13, w2, chunk=2)
    whole = quantize_weight(w13.transpose(1, 2), parts=2)
    assert gate_up.weight.shape == (5, 384, 128) and gate_up.parts == 2
    assert torch.equal(gate_up.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(gate_up.scale_inv, whole.scale_inv)
    assert torch.equal(down.scale_inv, quantize_weight(w2.transpose(1, 2)).scale_inv)


def test_the_fp8_floor_counts_weights_scales_and_rows():
    gate_up, down = quantize_expert_weights(torch.ones(2, 256, 2 * 192),
                                            torch.ones(2, 192, 256))
    per_expert = floors.fp8_expert_bytes(gate_up, down)
    # e4m3 values plus fp32 scales of 128 x 128 blocks: gate and up 2 x 2 blocks each,
    # down 2 x 2 (192 = 128 + a partial block)
    assert per_expert == {"layer0": 256 * 384 + 4 * 8, "layer1": 192 * 256 + 4 * 4,
                          "moe": 256 * 384 + 192 * 256 + 4 * 12}
    per_row = floors.fp8_row_bytes(256, 192)
    assert per_row == {"layer0": packed_row_bytes(256), "layer1": 192 + 4 * 2,
                       "moe": packed_row_bytes(256) + 200}
    got = floors.hbm_floor_us([3, 0, 1], per_expert, 1.0, per_row)     # 1 GB/s
    assert got["moe"] == pytest.approx((2 * per_expert["moe"] + 4 * per_row["moe"]) / 1e3)
    bf16 = floors.hbm_floor_us([3, 0, 1], per_expert, 1.0)
    assert bf16["layer1"] == pytest.approx(2 * per_expert["layer1"] / 1e3)


def test_dispatch_rows_per_expert_or_per_rank():
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [-1, 3]])        # 2 experts a rank, 2 ranks
    assert floors.dispatch_rows(ids, 2, 2, gathered=False) == 7
    assert floors.dispatch_rows(ids, 2, 2, gathered=True) == 5   # (0,r0) (1,r1) (2,r0,r1) (3,r1)


# --------------------------------------------------------------------------- summary
def _pair(tokens, bf16_us, fp8_us, floor_us=None, routing="uniform"):
    base = dict(date="d", layout="ep1", config="q", tokens_per_rank=tokens,
                routing=routing, layer="moe")
    b = rec.derive(dict(base, dtype="bfloat16", fused_us=bf16_us, dispatch_bytes=4096.0))
    f = rec.derive(dict(base, dtype="fp8", fused_us=fp8_us, hbm_floor_us=floor_us,
                        dispatch_bytes=2112.0))
    return [b, f]


def test_the_fp8_lines_hold_fp8_against_bf16_of_the_same_run():
    records = (_pair(1, 20.0, 19.0) + _pair(8, 100.0, 55.0, floor_us=20.0)
               + _pair(128, 100.0, 70.0, floor_us=40.0) + _pair(4096, 1300.0, 1000.0)
               + _pair(16384, 6000.0, 4000.0))
    rec.pair_dtypes(records)
    f8 = [r for r in records if rec.is_fp8(r)]
    assert [r["fp8_over_bf16"] for r in f8][:3] == pytest.approx([0.95, 0.55, 0.7])
    assert f8[0]["bf16_fused_us"] == 20.0
    assert f8[0]["dispatch_bytes_over_bf16"] == pytest.approx(2112 / 4096)
    lines = report.summary(records)
    [line] = [s for s in lines if s.startswith("fp8 ")]
    assert line.startswith("fp8 uniform: ")
    assert "FP8/bf16 b at 8-128 tokens/rank <= 0.6 in 1/2 (worst 0.70)" in line
    # bounds: 1.2 x 20 + 30 = 54 (55: 1 us over), 1.2 x 40 + 30 = 78 (70: under)
    assert "b <= 1.2 FP8 HBM floor + 30 us at 8-128 tokens/rank in 1/2 (worst +1.0 us)" in line
    assert "FP8/bf16 b at 1 token/rank <= 1 in 1/1 (worst 0.95)" in line
    assert "bf16/FP8 b at >= 4096 tokens/rank >= 1.3 in 2/2 (worst 1.30)" in line
    assert f"geomean bf16/FP8 b at >= 4096 tokens/rank {(1.3 * 1.5) ** 0.5:.2f}" in line
    assert "dispatch bytes FP8/bf16 <= 0.53 in 5/5 (worst 0.52)" in line
    assert "DeepGEMM" in line and "not measured" in line
    # the bf16 lines see the bf16 records alone
    assert not any("fp8" in s for s in lines if not s.startswith("fp8 "))
    # the docs' tables: bf16 rows in the layer's table, FP8 rows in their own
    md = report.docs_markdown([("f.json", records)])
    bf16_table, fp8_table = md.split("The FP8 layer against bf16, uniform routing:")
    assert bf16_table.count("| q | ") == 5 and fp8_table.count("| q | ") == 5
    assert "| q | 8 | uniform | 55.0 | 100.0 | 0.55 |" in fp8_table


def test_fp8_ratios_are_never_taken_across_runs():
    b, f = _pair(8, 100.0, 55.0)
    f["date"] = "another run"
    rec.pair_dtypes([b, f])
    assert f["fp8_over_bf16"] is None and f["dispatch_bytes_over_bf16"] is None
    assert "FP8/bf16 b at 8-128 tokens/rank - (target 0.6)" in report.fp8_summary([f])[0]


# --------------------------------------------------------------------------- tune
def test_an_fp8_table_says_fp8_in_its_name_and_meta():
    assert tuned.file_name(CFG8, 1, "NVIDIA_H200").endswith(",dtype=fp8.json")
    assert tuned.file_name(CFG, 1, "NVIDIA_H200").endswith(",dtype=bf16.json")
    assert tuned.expected_meta(CFG8, 1, "cpu")["dtype"] == "fp8"


def _layer(cfg, folder, tile):
    from comet.runtime.layer import FusedMoE
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13, w2 = torch.randn(e, h, 2 * f).bfloat16(), torch.randn(e, f, h).bfloat16()
    if cfg.fp8 is not None:
        w13, w2 = quantize_expert_weights(w13, w2)
    return FusedMoE(cfg, w13, w2, tuned_config_folder=folder, tile=tile)


def _write_table(folder, layer, splits, tile=None):
    cfg, tile = layer.selection.cfg, tile or layer.tile
    (folder / tuned.file_name(cfg, 1, "cpu", tile=tile)).write_text(json.dumps({
        "meta": tuned.expected_meta(cfg, 1, "cpu", tile),
        "buckets": {"32": {"layer0": splits[0], "layer1": splits[1]}}}))


def test_a_bf16_table_never_serves_an_fp8_layer_nor_the_other_way(tmp_path):
    """Same shape, same TileConfig (the FP8 layer's; a bf16 layer's own has the FP8-only
    field at its default): only the dtype tells the tables apart, and each layer loads
    its own or none."""
    fp8 = _layer(CFG8, tmp_path, TileConfig.small())
    bf16 = _layer(CFG, tmp_path, fp8.tile)
    assert bf16.tile == fp8.tile.with_fields(fp8_ws_min_rows=Variant.fp8_ws_min_rows)
    _write_table(tmp_path, bf16, (1, 2), tile=fp8.tile)
    assert fp8.selection.analytic(32) != (1, 2)
    assert fp8.selection.comm_blocks(32) == fp8.selection.analytic(32)   # not bf16's
    _write_table(tmp_path, fp8, (2, 1))
    _write_table(tmp_path, bf16, (1, 2))
    tuned._load.cache_clear()
    assert _layer(CFG8, tmp_path, TileConfig.small()).selection.comm_blocks(32) == (2, 1)
    assert _layer(CFG, tmp_path, fp8.tile).selection.comm_blocks(32) == (1, 2)


def test_tune_builds_the_fp8_layer_and_names_its_table(tmp_path):
    parser = tune.build_parser()
    args = parser.parse_args(["--experts", "8", "--topk", "2", "--hidden", "128", "--ffn",
                              "128", "--dtype", "fp8", "--tokens", "16"])
    cfg = tune.resolve_config(args, parser).replace(fp8=Fp8(), max_tokens=16)
    layer, table_cfg = tune.tuned_layer(cfg, args, torch.device("cpu"), 1, 0)
    assert layer.cfg.fp8 is not None and table_cfg.fp8 is not None
    assert "dtype=fp8" in tuned.file_name(table_cfg, 1, "cpu", tile=layer.tile)
    with pytest.raises(SystemExit):       # the FP8 layer needs H in whole groups of 128
        tune.main(["--experts", "8", "--topk", "2", "--hidden", "96", "--ffn", "64",
                   "--dtype", "fp8"])


def test_only_fused_leaves_the_baselines_out(tmp_path, fake_fused):
    """``--only-fused``: comet's layer is timed, the baselines and reference GEMMs not."""
    assert bench.main(["--only-fused", "--tokens", "16", "--iters", "1", "--warmup", "0",
                       "--input-sets", "1", "--routing", "uniform", "--layers", "moe",
                       "--output-dir", str(tmp_path), "--no-plot"]) == 0
    [r] = rec.read_json(glob.glob(str(tmp_path / "bench-ep1-*.json"))[0])
    assert r["fused_us"] > 0
    assert r["baseline_us"] is r["chunked_us"] is r["torch_gmm_us"] is None
    assert r["max_rel_err"]["fused"] is not None         # still checked against the baseline
    with pytest.raises(SystemExit):
        bench.main(["--only-fused", "--peers", "deepep", "--tokens", "4"])
