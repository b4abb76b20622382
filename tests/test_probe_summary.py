"""scripts/device/probe_summary.py: a tile probe's variants against its baseline, round by
round (``tile_probe.sh`` with ``ROUNDS``), read from bench JSONs written here."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("probe_summary",
                                              ROOT / "scripts" / "device" / "probe_summary.py")
probe_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe_summary)


def _write(path, fused):
    records = [dict(config=c, tokens_per_rank=t, routing="uniform", layer="moe", fused_us=us)
               for (c, t), us in fused.items()]
    path.write_text(json.dumps(records))


def test_variants_are_paired_round_by_round(tmp_path, capsys):
    # Round 2 of the machine is slower for everyone: a paired ratio does not see it.
    for rnd, slow in ((1, 1.0), (2, 1.5), (3, 1.0)):
        _write(tmp_path / f"p-default-round{rnd}.json",
               {("mixtral", 1): 300 * slow, ("mixtral", 8): 500 * slow})
        _write(tmp_path / f"p-layer0_live_rows-0-round{rnd}.json",
               {("mixtral", 1): 270 * slow, ("mixtral", 8): 510 * slow})
    runs = probe_summary.load_runs(str(tmp_path), "p")
    assert sorted(runs) == ["default", "layer0_live_rows-0"]
    assert sorted(runs["default"]) == [1, 2, 3]
    lines = probe_summary.ratio_lines(runs, "default")
    assert "0.900 [0.900, 0.900] over 3 round(s)" in lines[0]
    assert "1.020 [1.020, 1.020] over 3 round(s)" in lines[1]
    assert "geomean 0.958 over 2 records" in lines[2]
    probe_summary.main(str(tmp_path), "p", "default")
    out = capsys.readouterr().out
    assert "layer0_live_rows-0#2" in out and "whole call over default" in out


def test_a_single_round_keeps_the_plain_names(tmp_path, capsys):
    _write(tmp_path / "p-default.json", {("qwen2-moe", 128): 300.0})
    _write(tmp_path / "p-layer0_gather-0.json", {("qwen2-moe", 128): 330.0})
    probe_summary.main(str(tmp_path), "p")
    out = capsys.readouterr().out
    assert "layer0_gather-0              qwen2-moe" in out and "#" not in out
    assert "1.100 [1.100, 1.100] over 1 round(s)" in out


def test_a_wrong_output_is_marked(tmp_path, capsys):
    records = [dict(config="deepseek-v3-like", tokens_per_rank=t, routing="uniform",
                    layer="moe", fused_us=1000.0, max_rel_err={"fused": err})
               for t, err in ((8, 0.97), (32, 0.011))]
    (tmp_path / "p-default.json").write_text(json.dumps(records))
    probe_summary.main(str(tmp_path), "p")
    lines = capsys.readouterr().out.splitlines()
    assert [line.endswith("WRONG output (0.97)") for line in lines[:2]] == [True, False]


def test_a_variant_on_another_layer_is_marked(tmp_path):
    """A variant whose layer gathered its dispatch where the baseline's did not (a field
    the layer derives, not the variant's) is marked; a variant of that very field is not."""
    def write(name, gathers):
        (tmp_path / f"p-{name}.json").write_text(json.dumps([
            dict(config="qwen2-moe", tokens_per_rank=8, routing="uniform", layer="moe",
                 fused_us=300.0, layer0_gather=gathers)]))
    write("default", False)
    write("layer0_tail_split-1", True)
    write("layer0_gather-1", True)
    lines = probe_summary.ratio_lines(probe_summary.load_runs(str(tmp_path), "p"), "default")
    marked = [line for line in lines if "NOT PAIRED: layer0_gather differs" in line]
    assert len(marked) == 1 and marked[0].startswith("layer0_tail_split-1")


def test_a_small_call_is_held_to_issue_41s_bound(tmp_path, capsys):
    """Records of <= 128 tokens with an HBM floor show (b) over (+) or under (-)
    1.2 x floor + 30 us; larger ones do not."""
    (tmp_path / "p-default.json").write_text(json.dumps([
        dict(config="qwen2-moe", tokens_per_rank=t, routing="uniform", layer="moe",
             fused_us=us, hbm_floor_us=100.0) for t, us in ((1, 160.0), (128, 140.0),
                                                            (4096, 900.0))]))
    probe_summary.main(str(tmp_path), "p")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("bound +10.0") and lines[1].endswith("bound -10.0")
    assert "bound" not in lines[2].split("comet/torch")[1]


def test_a_ratio_of_records_on_different_comm_blocks_says_so(tmp_path):
    """A ``--tile`` variant equal to the default tile is served by a tuned table, the
    other variant by the analytic split: their ratio names both splits; a ratio of two
    records on the same split does not."""
    def write(name, n_comm):
        (tmp_path / f"p-{name}.json").write_text(json.dumps([
            dict(config="qwen2-moe", tokens_per_rank=t, routing="uniform", layer="moe",
                 fused_us=800.0, n_comm=n) for t, n in ((4096, n_comm), (16384, [32, 0]))]))
    write("dispatch_head_parts-0", [32, 0])
    write("dispatch_head_parts-1", [53, 0])
    lines = probe_summary.ratio_lines(probe_summary.load_runs(str(tmp_path), "p"),
                                      "dispatch_head_parts-0")
    assert lines[0].endswith("over 1 round(s) (comm blocks [32, 0] vs [53, 0])")
    assert lines[1].endswith("over 1 round(s)")
