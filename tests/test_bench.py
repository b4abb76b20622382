"""`comet bench` on the CPU, its record math, and the report/plot/trace writers."""

import contextlib
import glob
import gzip
import importlib
import json
import os
import sys

import pytest

from comet.cli import launch
import torch

import comet
from comet.baseline import ep_moe_forward
from comet.bench import records as rec
from comet.bench import provenance, report, trace
from comet.bench.inputs import HOT_EXPERT, make_routing
from comet.bench.runner import Fused
from comet.bench.timing import PhaseClock, combine_ranks, reduce_over_ranks
from comet.cli import bench
from comet.config import TileConfig
from comet.constants import TRACE_PROGRAM, kernel_identity

SMALL = ["--tokens", "16", "--iters", "2", "--warmup", "0", "--input-sets", "2",
         "--routing", "uniform"]


# --------------------------------------------------------------------------- fakes
class FakeFusedMoE:
    """Stands in for comet.runtime.layer.FusedMoE on the CPU: the baseline's numbers,
    the fused layer's interface (modes, phase timer, block split)."""

    programs = 8

    def __init__(self, cfg, w13, w2, group=None):
        self.w13, self.w2, self.group = w13, w2, group
        self.last_comm_blocks = None
        self.last_decode, self.last_tile_overrides = False, {}
        self.splits_asked = set()
        # recorded as the record's dispatch
        self.tile = TileConfig().with_fields(layer0_gather=True)

    def __call__(self, x, topk_ids, topk_weights, comm_blocks=None, mode="fused", timer=None):
        assert mode in ("fused", "sequential", "compute_only", "comm_only")
        self.splits_asked.add(comm_blocks)
        self.last_comm_blocks = (0, 0) if mode == "sequential" else (2, 3)
        self.last_decode = x.shape[0] < 64
        self.last_tile_overrides = {"group_m": 16} if x.shape[0] >= 64 else {}
        y = None
        for name in ("plan", "layer0", "layer1", "combine"):
            with timer.phase(name) if timer is not None else contextlib.nullcontext():
                if name == "layer0":
                    y = self.forward(x, topk_ids, topk_weights)
        return y.to(x.dtype)

    def forward(self, x, topk_ids, topk_weights):
        return ep_moe_forward(x, topk_ids, topk_weights, self.w13, self.w2, self.group)



def _fake_record_timeline(layer, x, topk_ids, topk_weights, comm_blocks=None, align=None,
                          phases=None, programs=None):
    """Stands in for comet.bench.trace.record_timeline on a FakeFusedMoE (calling the
    CLI's ``align``, as the real one does before the recorded call, and filling
    ``phases`` as a timed call would)."""
    layer.last_comm_blocks = (2, 3)
    if align is not None:
        align()
    if phases is not None:
        phases.update(plan=5.0, layer0=10.0, layer1=8.0, combine=2.0)
    return _synthetic_timeline(blocks=6, n_comm=2)


def _synthetic_timeline(blocks=4, n_comm=1, t0=1_000_000):
    out = []
    for layer_i, layer in enumerate(("layer0", "layer1")):
        for b in range(blocks):
            for u in range(3):
                start = t0 + layer_i * 10_000 + u * 2_000 + b * 100
                out.append(dict(block=b, role="comm" if b < n_comm else "compute",
                                layer=layer, unit=u, start_ns=start, end_ns=start + 1_500))
    return out


@pytest.fixture
def fake_fused(monkeypatch):
    def build(cfg, w13, w2, group, device):
        return Fused(FakeFusedMoE(cfg, w13, w2, group), lambda: PhaseClock(device)), None
    monkeypatch.setattr(bench, "_build_fused", build)


def _synthetic_records():
    base = dict(device="NVIDIA H200", world_size=4, layout="ep4", dtype="bfloat16",
                date="2026-01-01T00:00:00+00:00", command="comet bench", n_comm=[16, 24],
                torch_gmm_tflops=600.0, comet_gmm_tflops=650.0, cutlass_gmm_tflops=None,
                nccl_a2a_us=400.0, chunked_us=1300.0, sequential_us=1500.0,
                baseline_phases_us={"sync": 100.0, "a2a": 300.0, "gemm": 900.0,
                                    "act": 100.0, "permute": 50.0})
    out = []
    for config in ("mixtral", "qwen2-moe"):
        for tokens in (128, 4096):
            for layer in rec.LAYERS:
                r = dict(base, config=config, tokens_per_rank=tokens, routing="uniform",
                         layer=layer, baseline_us=2000.0, fused_us=1000.0,
                         compute_only_us=900.0, comm_only_us=400.0)
                out.append(rec.derive(r))
    return out


# --------------------------------------------------------------------------- the CLI
def test_cpu_default_run_prints_table_and_writes_records(tmp_path, capsys):
    assert bench.main(SMALL + ["--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "(a) baseline us" in out and "cpu-tiny" in out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    records = rec.read_json(path)
    assert len(records) == 3
    for r in records:
        assert set(rec.REQUIRED_KEYS) <= set(r)
        assert r["baseline_us"] > 0 and r["fused_us"] is None
        assert r["cutlass_gmm_tflops"] is None
        assert r["world_size"] == 1 and r["layout"] == "ep1" and r["device"] == "cpu"
        # the provenance every results file carries, its paths repo-relative
        assert not provenance.missing_fields(r) and r["kernels"] == kernel_identity()
        assert r["command"].startswith("comet bench ") and str(tmp_path) not in r["command"]
    assert provenance.absolute_paths(records) == []
    moe = next(r for r in records if r["layer"] == "moe")
    assert moe["chunked_us"] > 0 and moe["chunked_chunks"] in (2, 4)
    assert moe["max_rel_err"]["baseline_vs_reference"] < 1e-4
    assert moe["max_rel_err"]["chunked"] < 1e-4
    assert set(moe["baseline_phases_us"]) == {"sync", "a2a", "gemm", "act", "permute"}
    assert moe["comet_phases_us"] is None
    assert set(moe["baselines"]) == {"baseline", "chunked"}
    assert "ep_moe_forward" in moe["baselines"]["baseline"]
    md = open(path[:-5] + ".md").read()
    assert "| config | tokens/rank | routing | layer |" in md
    assert f"- chunked: {moe['baselines']['chunked']}" in md    # what each column runs
    assert not os.path.exists(path[:-5] + ".png")     # nothing fused to plot


def test_a_sweep_cut_short_leaves_the_cases_it_finished(tmp_path, monkeypatch):
    """The records are rewritten after every case, so a sweep killed mid-way (a device
    call's time limit) still returns its finished cases; a finished sweep leaves none."""
    real, calls = bench.run_case, []

    def cut_after_one(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt("cut")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_case", cut_after_one)
    args = SMALL + ["--tokens", "16", "32", "--output-dir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(args)
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.partial.json"))
    assert [r["tokens_per_rank"] for r in rec.read_json(path)] == [16] * 3
    os.remove(path)
    monkeypatch.setattr(bench, "run_case", real)
    assert bench.main(args) == 0
    assert not glob.glob(str(tmp_path / "*.partial.json"))
    assert len(glob.glob(str(tmp_path / "bench-ep1-*.json"))) == 1


def test_fused_columns_with_a_fake_layer(tmp_path, capsys, fake_fused):
    argv = SMALL + ["--layers", "layer0", "moe", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    records = rec.read_json(path)
    assert [r["layer"] for r in records] == ["layer0", "moe"]
    for r in records:
        for key in ("fused_us", "sequential_us", "compute_only_us", "comm_only_us"):
            assert r[key] > 0
        assert r["n_comm"] == [2, 3]
        assert r["decode_tile"] is (r["tokens_per_rank"] < 64)
        assert r["tile_overrides"] == ({} if r["tokens_per_rank"] < 64 else {"group_m": 16})
        assert r["layer0_gather"] is True
        assert r["speedup"] == pytest.approx(r["baseline_us"] / r["fused_us"])
        assert r["hidden_comm_fraction"] == pytest.approx(rec.hidden_fraction(
            r["compute_only_us"], r["comm_only_us"], r["fused_us"]))
        assert r["comet_gmm_tflops"] > 0
        assert r["max_rel_err"]["fused"] < 1e-4
    moe = records[1]
    assert set(moe["comet_phases_us"]) == {"fused", "sequential", "compute_only", "comm_only"}
    assert set(moe["comet_phases_us"]["fused"]) == {"plan", "layer0", "layer1", "combine"}
    assert moe["fused_host_us"] > 0 and records[0]["fused_host_us"] is None
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert os.path.exists(path[:-5] + ".png")


def test_whole_layer_records_hold_every_variant_to_calls_without_phase_events(
        tmp_path, capsys, fake_fused, monkeypatch):
    """A phase-timed iteration starts on a rested GPU (parked in a sleep), which runs a
    long call faster on a power-limited GPU: "moe" records take every variant's whole-call
    time -- comet's and the references' -- from iterations without phase events; GEMM
    TFLOP/s stay phase against phase, and comet's GEMM alone has no whole-call time."""
    from comet.bench import runner
    real = runner.time_calls
    WHOLE_US = 1000.0

    def time_calls(fn, **kw):
        series = real(fn, **kw)
        if kw.get("make_timer") is None:
            series["total"] = [WHOLE_US] * len(series["total"])
        return series
    monkeypatch.setattr(runner, "time_calls", time_calls)
    argv = SMALL + ["--layers", "layer0", "moe", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    layer0, moe = rec.read_json(path)
    for key in ("baseline_us", "fused_us", "sequential_us", "compute_only_us",
                "torch_gmm_us"):
        assert moe[key] == WHOLE_US, key
        assert layer0[key] != WHOLE_US, key
    assert moe["comet_gmm_us"] is None and layer0["comet_gmm_us"] > 0
    assert moe["gemm_floor_us"] == WHOLE_US          # torch's, the one GEMM timed whole
    flops = moe["gemm_tflop_per_rank"] * 1e12
    assert moe["torch_gmm_tflops"] != pytest.approx(rec.tflops(flops, WHOLE_US))


def test_fixed_splits_hold_the_choice_against_the_best_of_them(tmp_path, capsys, monkeypatch):
    layers = []

    def build(cfg, w13, w2, group, device):
        layers.append(FakeFusedMoE(cfg, w13, w2, group))
        return Fused(layers[-1], lambda: PhaseClock(device)), None
    monkeypatch.setattr(bench, "_build_fused", build)
    argv = SMALL + ["--layers", "moe", "--fixed-splits", "0", "2", "99",
                    "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    capsys.readouterr()
    assert {0, 2} <= layers[0].splits_asked and 99 not in layers[0].splits_asked  # > programs
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    [r] = rec.read_json(path)
    assert set(r["fixed_split_us"]) == {"0", "2"}
    assert r["best_fixed_us"] == min(r["fixed_split_us"].values())
    assert r["fixed_split_us"][str(r["best_fixed_split"])] == r["best_fixed_us"]
    assert r["fused_over_best_fixed"] == pytest.approx(r["fused_us"] / r["best_fixed_us"])
    assert r["fused_over_sequential"] == pytest.approx(r["fused_us"] / r["sequential_us"])
    md = open(path[:-5] + ".md").read()
    assert "b/best fixed" in md and "b/best fixed split <= 1 in" in md
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--fixed-splits", "-1"])


def test_timeline_writes_a_trace(tmp_path, capsys, fake_fused, monkeypatch):
    monkeypatch.setattr(bench.trace, "record_timeline", _fake_record_timeline)
    argv = ["--timeline", "--timeline-tokens", "16", "--no-plot", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    [path] = glob.glob(str(tmp_path / "timeline-ep1-cpu-tiny-16-*.json"))
    data = json.load(open(path))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(_synthetic_timeline(blocks=6, n_comm=2))
    assert "comm blocks [2, 3]" in data["otherData"]["title"]
    # Each layer's units span 6 us of its phase (synthetic stamps, no program runs), the
    # rest is outside.
    budget = data["otherData"]["phases"]["0"]
    assert (budget["layer0_units"], budget["layer0_outside"]) == (6.0, 4.0)
    assert (budget["layer1_units"], budget["layer1_outside"]) == (6.0, 2.0)
    assert budget["sum"] == 25.0
    # The milestones read back the same from the gzipped copy the results folders keep.
    from comet.bench import trace
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        dst.write(src.read())
    assert trace.main([path]) == 0 and trace.main([path + ".gz"]) == 0
    plain, packed = capsys.readouterr().out.split(path + ".gz\n")
    assert plain.rsplit(path + "\n", 1)[1] == packed and "gemm_start" in packed
    assert "layer0 10.0 (set-up 0.0, units 6.0, drain 0.0, outside 4.0)" in packed
    assert "sum 25.0 us" in packed


def test_phase_budget_sets_each_layers_units_beside_its_kernel_time():
    """A layer's units span from its first start to its last end; its programs' runs
    add the set-up before the first unit and the drain after the last; the rest of its
    phase is outside them. A layer with no units spans 0; a call whose phases were not
    timed says so."""
    from comet.bench import trace
    entries = [dict(layer="layer0", start_ns=2_000, end_ns=9_000),
               dict(layer="layer0", start_ns=1_000, end_ns=5_000)]
    runs = [dict(layer="layer0", start_ns=500, end_ns=9_500),
            dict(layer="layer0", start_ns=0, end_ns=10_000)]
    phases = {"plan": 20.0, "layer0": 12.5, "layer1": 3.0, "combine": 1.5}
    b = trace.phase_budget(phases, entries)
    assert (b["layer0_units"], b["layer0_outside"]) == (8.0, 4.5)
    assert (b["layer1_units"], b["layer1_outside"]) == (0.0, 3.0)
    assert b["sum"] == 37.0
    b = trace.phase_budget(phases, entries, runs)
    assert (b["layer0_setup"], b["layer0_units"], b["layer0_drain"]) == (1.0, 8.0, 1.0)
    assert b["layer0_outside"] == 2.5
    text = trace.format_phase_budget({0: b, 1: trace.phase_budget({}, entries)})
    assert "plan 20.0 | layer0 12.5 (set-up 1.0, units 8.0, drain 1.0, outside 2.5)" in text
    assert "rank 1: the call's phases were not timed" in text


def test_the_recorded_call_starts_after_the_alignment():
    """record_timeline: the first (compiling) call, then ``align`` (the ranks' barrier),
    then the recorded call; its stamps come back relative to the earliest."""
    log = []

    class Layer:
        programs, device = 2, torch.device("cpu")
        par = type("Par", (), {"world_size": 2})()

        @property
        def selection(self):
            return self

        def comm_blocks(self, m, requested):
            return (0, 0)

        def check_errors_now(self):
            pass

        def __call__(self, x, ids, w, comm_blocks, trace, timer=None):
            log.append(("call", comm_blocks, timer is not None))
            if timer is not None:
                with timer.phase("layer0", x.device):
                    pass
            trace["layer0"][1, 0] = torch.tensor([0, 3, 5_000, 7_000])
            trace["layer0"][1, -1] = torch.tensor([int(TRACE_PROGRAM), 0, 4_000, 7_500])

    x = torch.zeros(4, 8)
    phases, programs = {}, []
    records = trace.record_timeline(Layer(), x, None, None, align=lambda: log.append("align"),
                                    phases=phases, programs=programs)
    # Only the recorded call is timed (the first compiles).
    assert log == [("call", (1, 0), False), "align", ("call", (1, 0), True)]
    assert list(phases) == ["layer0"] and phases["layer0"] >= 0
    # The program's run (the row's last slot) sets the origin with the units.
    assert programs == [dict(block=1, layer="layer0", start_ns=0, end_ns=3_500)]
    assert [(r["block"], r["layer"], r["start_ns"], r["end_ns"]) for r in records] == [
        (1, "layer0", 1_000, 3_000)]


def test_timeline_without_gpu_says_why(capsys):
    assert bench.main(["--timeline", "--timeline-tokens", "16"]) == 1
    assert "needs a GPU" in capsys.readouterr().out


def test_report_from_json(tmp_path, capsys):
    path = rec.write_json(_synthetic_records(), str(tmp_path / "in.json"))
    assert bench.main(["--from-json", path, "--no-plot", "--output-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "summary: uniform: geomean a/b at >= 4096 tokens/rank 2.00" in out
    assert glob.glob(str(tmp_path / "o" / "bench-*.md"))
    # a file written before a ratio existed gets it from its times
    older = [{k: v for k, v in dict(r, torch_gmm_us=850.0).items()
              if k != "gmm_over_compute_only"} for r in _synthetic_records()]
    path = rec.write_json(older, str(tmp_path / "older.json"))
    assert bench.main(["--from-json", path, "--no-plot", "--output-dir", str(tmp_path / "p")]) == 0
    assert "torch GEMM/c >= 0.9 in 2/2 (worst 0.94)" in capsys.readouterr().out


def test_markdown_from_json_names_each_file_and_its_kernels(tmp_path, capsys):
    """--from-json --markdown prints the docs' tables: each file's provenance, the
    whole-layer rows of the routings asked for, the summary; it writes nothing. A file of
    other kernels is reported on stderr, naming both."""
    records = [dict(r, commit="abc1234", kernel_revision=10) for r in _synthetic_records()]
    path = rec.write_json(records, str(tmp_path / "in.json"))
    for r in records:                        # as an older file: a revision, no identity
        r.pop("kernels", None)
    json.dump(records, open(path, "w"))
    assert bench.main(["--from-json", path, "--markdown", "--routing", "uniform"]) == 0
    out, err = capsys.readouterr()
    assert f"`{path}`: " in out and "commit `abc1234`, kernels revision 10" in out
    assert "Whole layer, uniform routing" in out and "skewed" not in out
    assert "| mixtral | 4096 | 2000 | 1000 |" in out          # moe rows, whole us
    assert "- summary: uniform: geomean a/b" in out
    assert "made by kernels revision 10" in err and kernel_identity() in err
    assert os.listdir(tmp_path) == ["in.json"]
    with pytest.raises(SystemExit):
        bench.main(["--markdown"])


def test_summary_checks_each_target_record_by_record():
    records = _synthetic_records()
    skewed = [rec.derive(dict(r, routing="skewed", fused_us=1600.0 if r["layer"] == "layer1"
                              else r["fused_us"])) for r in records]
    uniform, skew = report.summary(records + skewed)[::-1]
    assert uniform.startswith("uniform: geomean a/b at >= 4096 tokens/rank 2.00")
    # whole-layer rows at 4096 tokens: fused 1000, sequential 1500, c 900, d 400, NCCL 400
    assert "b/sequential <= 0.95 in 2/2 (worst 0.67)" in uniform
    assert "hidden >= 0.85 in 0/2 (worst 0.75)" in uniform
    assert "comm/NCCL <= 1.25 in 2/2 (worst 1.00)" in uniform
    assert "torch GEMM/b - (target 0.9)" in uniform            # not measured
    assert "torch GEMM/c - (target 0.9)" in uniform
    assert "a/b at <= 128 tokens/rank >= 2 in 2/2 (worst 2.00)" in uniform
    assert "at the GEMM floor" not in uniform                 # no GEMM time recorded
    floored = [rec.derive(dict(r, torch_gmm_us=1600.0 if r["tokens_per_rank"] == 128
                               else 1250.0)) for r in records]
    line = report.summary(floored)[0]
    assert "geomean a/b at >= 4096 tokens/rank 2.00 (target 1.5; at the GEMM floor 1.60)" \
        in line
    assert "(worst 2.00); at the GEMM floor worst 1.25" in line
    # torch's GEMMs at 850 us: b (1000) misses 0.9 while c (900) would meet it -- the
    # communication and the combine cost, not the GEMMs
    overlap_short = [rec.derive(dict(r, torch_gmm_us=850.0)) for r in records]
    line = report.summary(overlap_short)[0]
    assert "torch GEMM/b >= 0.9 in 0/2 (worst 0.85)" in line
    assert "torch GEMM/c >= 0.9 in 2/2 (worst 0.94)" in line
    # skewed: any record slower than sequential counts, per-layer rows included
    assert "b/sequential, any layer <= 1 in 8/12 (worst 1.07)" in skew
    assert "hidden" not in skew
    assert "host-bound" not in uniform                        # no host times recorded
    assert "HBM floor" not in uniform                         # no floor recorded
    # issue 41's bound on small calls: b (1000 us) against 1.2 x the HBM floor + 30 us
    floors = {"mixtral": 800.0, "qwen2-moe": 900.0}            # bounds 990 and 1110 us
    hbm = [dict(r, hbm_floor_us=floors[r["config"]]) for r in records]
    assert ("b <= 1.2 HBM floor + 30 us at <= 128 tokens/rank in 1/2 (worst: mixtral "
            "128, 10.0 us over)") in report.summary(hbm)[0]
    hbm = [dict(r, hbm_floor_us=900.0) for r in records]
    assert "in 2/2 (worst: mixtral 128, 110.0 us under)" in report.summary(hbm)[0]
    # (a) far above its GPU phases was issued late: its a/b carries the host
    unpaced = [dict(r, baseline_phases_us={"gemm": 1900.0}) for r in records]
    assert "a above its GPU phases" not in report.summary(unpaced)[0]
    paced = [dict(r, baseline_phases_us={"gemm": 1000.0 if r["tokens_per_rank"] == 128
                                         else 1900.0}) for r in records]   # a: 2000 us
    assert report.summary(paced)[0].endswith(
        "a above its GPU phases (a >= 1.2 x their sum: issued late, a/b carries the host) at "
        + ", ".join(f"{r['config']} 128" for r in paced
                    if r["layer"] == "moe" and r["tokens_per_rank"] == 128))
    hosted = [dict(r, fused_host_us=0.95 * r["fused_us"] if r["tokens_per_rank"] == 128
                   and r["layer"] == "moe" else 10.0) for r in unpaced]
    line = report.summary(hosted)[0]
    assert line.endswith("host-bound (b host us >= 0.9 b) at "
                         + ", ".join(f"{r['config']} 128" for r in hosted
                                     if r["layer"] == "moe" and r["tokens_per_rank"] == 128))


def test_the_summary_checks_host_time_per_call_at_ep1():
    """A rank alone (EP=1): the host's time to enqueue one fused call (``fused_host_us``)
    is checked against 30 us, record by record; across ranks it is not."""
    records = [dict(r, fused_host_us=20.0 if r["tokens_per_rank"] == 128 else 45.0)
               for r in _synthetic_records()]
    assert "b host us at EP=1" not in report.summary(records)[0]
    alone = [dict(r, world_size=1, layout="ep1") for r in records]
    moe = [r for r in alone if r["layer"] == "moe" and r.get("fused_us") is not None]
    met = sum(r["tokens_per_rank"] == 128 for r in moe)
    assert (f"b host us at EP=1 <= 30 in {met}/{len(moe)} (worst 45.00)"
            in report.summary(alone)[0])


def test_a_wrong_fused_output_is_named_first_and_fails_the_sweep():
    """A fused output further than MAX_REL_ERR from the baseline's (or not finite) heads
    the summary with its record named, and the sweep exits 1; within it, 0."""
    records = [dict(r, max_rel_err={"fused": 1e-2}) for r in _synthetic_records()]
    assert rec.wrong_fused(records) == [] and bench._status(records) == 0
    assert not report.summary(records)[0].startswith("WRONG")
    records[0]["max_rel_err"] = {"fused": 0.36}
    records[-1]["max_rel_err"] = {"fused": float("nan")}
    assert rec.wrong_fused(records) == [records[0], records[-1]]
    assert bench._status(records) == 1
    first = report.summary(records)[0]
    r = records[0]
    assert first.startswith("WRONG fused output (max rel err > 0.02")
    assert f"{r['config']} {r['tokens_per_rank']} {r['routing']} {r['layer']} (0.36)" in first
    assert first.endswith("(nan)")


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--experts", "8", "--topk", "2"])          # --hidden/--ffn missing
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--comm-blocks", "1", "2", "3"])


def test_launch_keeps_nvlink_multicast_off():
    env = launch.launch_env()
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(comet.__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root
    cmd = launch.torchrun_command(["--nproc", "4", "--tokens", "128", "--nproc=4"], 4,
                                  "comet.cli.bench")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and cmd[-4:] == ["-m", "comet.cli.bench", "--tokens", "128"]


# --------------------------------------------------------------------------- math
def test_ratios_and_hidden_fraction():
    assert rec.hidden_fraction(100.0, 50.0, 110.0) == pytest.approx(0.8)
    assert rec.hidden_fraction(100.0, 50.0, 100.0) == pytest.approx(1.0)   # costs max(c, d)
    assert rec.hidden_fraction(100.0, 50.0, 150.0) == pytest.approx(0.0)   # costs c + d
    assert rec.hidden_fraction(100.0, 50.0, 175.0) < 0
    assert rec.hidden_fraction(None, 50.0, 100.0) is None
    assert rec.ratio(3.0, 0.0) is None and rec.ratio(None, 1.0) is None
    assert rec.tflops(2e12, 1e6) == pytest.approx(2.0)
    assert rec.geomean([1.0, 4.0, None]) == pytest.approx(2.0)
    r = rec.derive(dict(baseline_us=300.0, fused_us=100.0, chunked_us=150.0,
                        compute_only_us=80.0, comm_only_us=40.0, torch_gmm_tflops=500.0,
                        comet_gmm_tflops=550.0, nccl_a2a_us=50.0))
    assert r["speedup"] == pytest.approx(3.0)
    assert r["speedup_vs_chunked"] == pytest.approx(1.5)
    assert r["hidden_comm_fraction"] == pytest.approx(0.5)
    assert r["compute_efficiency"] == pytest.approx(1.1)
    assert r["comm_efficiency"] == pytest.approx(1.25)
    assert r["gemm_floor_us"] is None and r["speedup_at_floor"] is None   # no GEMM timed


def test_gemm_floor_is_the_fastest_gemm_measured():
    r = rec.derive(dict(baseline_us=300.0, fused_us=100.0, torch_gmm_us=90.0,
                        comet_gmm_us=75.0, cutlass_gmm_us=None))
    assert r["gemm_floor_us"] == 75.0
    assert r["speedup_at_floor"] == pytest.approx(4.0)
    r = rec.derive(dict(baseline_us=300.0, torch_gmm_us=90.0, comet_gmm_us=0.0,
                        cutlass_gmm_us=60.0))
    assert r["gemm_floor_us"] == 60.0            # a zero time is no measurement


def test_link_rows_count_pairs_and_token_destinations_sent_elsewhere():
    from comet.bench.floors import link_rows
    # 2 experts a rank, 3 ranks, this is rank 0: token 0 has two experts on rank 1 and
    # one on rank 2; token 1 one here and a dropped slot; token 2 two on rank 2.
    ids = torch.tensor([[2, 3, 4], [0, -1, 1], [4, 5, -1]])
    assert link_rows(ids, 2, 0, 3) == (5, 3)
    assert link_rows(ids, 2, 1, 3) == (5, 3)       # as rank 1: 4; 0, 1; 4, 5 elsewhere
    assert link_rows(torch.empty(0, 2, dtype=torch.long), 2, 0, 2) == (0, 0)
    # A (2, 1) layout's shard slots: every choice is a row to the TP peer (k per token);
    # an invalid id (E * tp, kept for the plan to report) is no row.
    from comet.mesh import MeshLayout
    shard_ids, _ = MeshLayout(tp=2, ep=1).shard_routing(
        torch.tensor([[0, 1], [2, 3], [3, 9]]), torch.rand(3, 2), 4, 0, "sequence")
    assert link_rows(shard_ids, 4, 0, 2) == (5, 3)


def test_hbm_floor_reads_each_touched_expert_once():
    from comet.bench.floors import expert_bytes, hbm_floor_us, hbm_read_gbps
    per = expert_bytes(hidden=4096, ffn=14336, element_size=2)
    assert per["layer0"] == 4096 * 2 * 14336 * 2 and per["moe"] == 3 * 4096 * 14336 * 2
    # Experts 0 and 2 got rows, 1 and 3 none: two experts' weights at 3000 GB/s.
    floor = hbm_floor_us([5, 0, 1, 0], per, 3000.0)
    assert floor["moe"] == pytest.approx(2 * per["moe"] / 3e12 * 1e6)
    assert hbm_floor_us([0, 0], per, 3000.0)["layer1"] == 0.0
    assert hbm_floor_us([1], per, None)["moe"] is None          # no bandwidth measured
    assert hbm_read_gbps(torch.device("cpu")) is None
    r = rec.derive(dict(fused_us=150.0, hbm_floor_us=100.0))
    assert r["fused_over_hbm_floor"] == pytest.approx(1.5)
    assert rec.derive(dict(fused_us=150.0, hbm_floor_us=0.0))["fused_over_hbm_floor"] is None


def test_reduce_over_ranks_is_identity_on_one_process():
    s = {"total": [1.0, 2.0]}
    assert reduce_over_ranks(s) == s


def test_ranks_combine_to_the_slowest_rank_per_iteration():
    fast_gemm = {"total": [10.0, 30.0], "gemm": [2.0, 25.0], "combine": [8.0, 5.0]}
    slow_gemm = {"total": [20.0, 12.0], "gemm": [15.0, 6.0], "combine": [5.0, 6.0]}
    out = combine_ranks([fast_gemm, slow_gemm])
    # phases come from the rank whose total was largest in that iteration, never mixed
    assert out == {"total": [20.0, 30.0], "gemm": [15.0, 25.0], "combine": [5.0, 5.0]}
    flops = combine_ranks([{"moe": [1.0, 2.0]}, {"moe": [3.0, 1.0]}], sums=("moe",))
    assert flops == {"moe": [4.0, 3.0]}
    errs = combine_ranks([{"fused": [0.1]}, {"fused": [0.3]}])
    assert errs == {"fused": [0.3]}


def test_routing_kinds():
    g = torch.Generator().manual_seed(0)
    m, e, k = 4000, 16, 2
    ids, w = make_routing(m, e, k, "uniform", g)
    assert ids.shape == (m, k) and int(ids.min()) >= 0 and int(ids.max()) < e
    assert (ids[:, 0] != ids[:, 1]).all()
    torch.testing.assert_close(w.sum(1), torch.ones(m))
    share = (ids == HOT_EXPERT).any(1).float().mean().item()
    assert share == pytest.approx(k / e, abs=0.03)
    ids, _ = make_routing(m, e, k, "skewed", g)
    assert (ids == HOT_EXPERT).any(1).float().mean().item() == pytest.approx(0.5, abs=0.03)
    assert (ids[:, 0] != ids[:, 1]).all()
    with pytest.raises(ValueError):
        make_routing(4, e, k, "zipf", g)


# --------------------------------------------------------------------------- writers
def test_markdown_and_text_tables():
    records = _synthetic_records()
    md = report.markdown_table(records)
    lines = md.splitlines()
    assert lines[0].startswith("| config | tokens/rank | routing | layer | (a) baseline us")
    assert set(lines[1]) <= set("|-")
    assert len(lines) == 2 + len(records)
    assert "| mixtral | 128 | uniform | layer0 | 2000.0 | 1000.0 |" in md
    assert "| 16 |" in md and "| 16/24 |" in md         # n_comm per layer and for moe
    records[-1]["decode_tile"] = True
    assert "| 16/24d |" in report.markdown_table(records)   # layer1 on the decode tile
    full = report.markdown_report(records, ["a note"])
    for section in ("## Summary", "## Times", "## Compute and communication efficiency",
                    "## Where the unfused baseline spends its time", "- note: a note"):
        assert section in full
    text = report.text_table(records, report.EFFICIENCY_COLUMNS)
    assert "torch GEMM TFLOP/s" in text.splitlines()[0] and "1.08" in text


def test_plots_skip_cleanly_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path, note = report.plot_speedup(_synthetic_records(), str(tmp_path / "p.png"))
    assert path is None and "matplotlib is not installed" in note
    path, note = trace.plot_timeline({0: _synthetic_timeline()}, str(tmp_path / "t.png"))
    assert path is None and "matplotlib is not installed" in note
    assert not os.listdir(tmp_path)


def test_plots_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = report.plot_speedup(_synthetic_records(), str(tmp_path / "p.png"))
    assert os.path.getsize(path) > 0
    path, _ = trace.plot_timeline({0: _synthetic_timeline(), 1: _synthetic_timeline(t0=5)},
                                  str(tmp_path / "t.png"), "title")
    assert os.path.getsize(path) > 0


def test_chrome_trace_is_valid_and_complete(tmp_path):
    timelines = {0: _synthetic_timeline(blocks=4, n_comm=1),
                 1: _synthetic_timeline(blocks=4, n_comm=2, t0=7_000_000)}
    path = str(tmp_path / "t.json")
    written = trace.write_trace(timelines, path, {"config": "mixtral"})
    data = json.load(open(path))
    assert data == json.loads(json.dumps(written))
    events = data["traceEvents"]
    assert data["otherData"]["config"] == "mixtral"
    assert set(data["otherData"]["where_time_goes"]) == {"0", "1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(v) for v in timelines.values())
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert min(e["ts"] for e in mine) == 0          # each rank from its own first stamp
        assert all(e["dur"] == pytest.approx(1.5) for e in mine)
    assert {e["name"] for e in spans} == {"comm layer0", "comm layer1", "compute layer0",
                                          "compute layer1"}
    assert len({e["cname"] for e in spans}) == 4
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[(1, 1)] == "block 1 (layer0:comm, layer1:comm)"
    assert names[(0, 3)] == "block 3 (layer0:compute, layer1:compute)"


def test_where_time_goes_reads_the_milestones_of_a_trace(tmp_path, capsys):
    """A hand-built call: 2 blocks; block 0 dispatches 0-100 us then joins layer0's GEMM,
    block 1 waits for rows until 40 us; layer0 ends at 500 and 620 (median 560), layer1's
    GEMM runs 630-900 and block 0 reduces until 960."""
    def unit(block, role, layer, start, end):
        return dict(block=block, role=role, layer=layer, unit=0,
                    start_ns=int(start * 1e3), end_ns=int(end * 1e3))
    entries = [unit(0, "comm", "layer0", 0, 100), unit(0, "compute", "layer0", 100, 500),
               unit(1, "compute", "layer0", 40, 620),
               unit(0, "compute", "layer1", 630, 880), unit(1, "compute", "layer1", 630, 900),
               unit(0, "comm", "layer1", 900, 960)]
    m = trace.where_time_goes(trace.chrome_trace({3: entries}))[3]
    assert m == pytest.approx(dict(gemm_start_us=40, dispatch_end_us=100, layer0_tail_us=60,
                                   layer1_gap_us=10, reduce_tail_us=60, end_us=960,
                                   packed_gemm_us=(400 + 580 + 250 + 270) / 2))
    path = str(tmp_path / "t.json")
    trace.write_trace({3: entries}, path)
    assert trace.main([path]) == 0
    out = capsys.readouterr().out
    assert "gemm_start" in out and "reduce_tail_us:" in out and " 960.0" in out


def test_paired_comparison_reports_ratios_worst_and_noise(tmp_path, capsys):
    """--from-json NEW --against BASE: per record new/base of comet's columns (the mean of
    each side's runs), the worst one, and the spread of the runs as the noise."""
    def run(fused, seq):
        return [{"config": "mixtral", "tokens_per_rank": t, "routing": "uniform",
                 "layer": "moe", "fused_us": fused * t, "sequential_us": seq * t,
                 "compute_only_us": None, "comm_only_us": 1.0} for t in (128, 4096)]
    paths = {}
    for name, records in {"new1": run(1.1, 2.0), "new2": run(0.9, 2.0),
                          "base": run(1.0, 2.5)}.items():
        paths[name] = str(tmp_path / f"{name}.json")
        rec.write_json(records, paths[name])
    assert bench.main(["--from-json", paths["new1"], paths["new2"], "--against",
                       paths["base"], "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fused_us: new/base geomean 1.000, worst 1.000" in out
    assert "sequential_us: new/base geomean 0.800" in out
    assert "largest run-to-run spread 0.222" in out      # 1.1 / 0.9 - 1
    [written] = glob.glob(str(tmp_path / "paired-*.json"))
    rows = json.load(open(written))["rows"]
    assert [r["fused_us"]["ratio"] for r in rows] == pytest.approx([1.0, 1.0])
    with pytest.raises(SystemExit):
        bench.main(["--against", paths["base"]])


# ----------------------------------------------------------------- tensor-parallel layouts
class FakeMeshFusedMoE(FakeFusedMoE):
    """Stands in for a (tp, ep) FusedMoE on the CPU: the unfused TP pipeline's output,
    the fused layer's interface (modes, phases, block split)."""

    def __init__(self, shard, groups, convention, cfg, tp):
        super().__init__(cfg, shard["w13"], shard["w2"])
        self.shard, self.groups, self.convention, self.cfg, self.tp = (
            shard, groups, convention, cfg, tp)

    def forward(self, x, topk_ids, topk_weights):
        from comet.baseline import mesh_moe_forward
        return mesh_moe_forward(x, topk_ids, topk_weights, self.shard, self.groups,
                                self.convention, self.cfg.activation,
                                token_counts=[x.shape[0]] * self.tp)


def _tensor_parallel_bench_worker(rank, world, store, convention, fixed_splits, results):
    import torch.distributed as dist
    torch.set_num_threads(1)  # forked: keep clear of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from comet.baseline import MeshGroups
        from comet.bench.inputs import make_expert_weights
        from comet.bench.mesh_runner import run_mesh_case
        from comet.bench.runner import Case, Settings
        from comet.mesh import MeshLayout
        mesh = MeshLayout(tp=2, ep=1)
        cfg = bench.CONFIGS[bench.CPU_CONFIG].replace(dtype=torch.float32, max_tokens=32)
        w13, w2 = make_expert_weights(cfg.replace(intermediate_size=cfg.intermediate_size // 2),
                                      cfg.num_experts, "cpu-tiny", rank, 0, torch.device("cpu"))
        st = Settings(device=torch.device("cpu"), world=world, rank=rank, iters=2, warmup=1,
                      n_sets=2, fixed_splits=fixed_splits)
        shard, groups = {"w13": w13, "w2": w2}, MeshGroups.new(mesh)
        fused = None
        if fixed_splits:
            layer = FakeMeshFusedMoE(shard, groups, convention, cfg, mesh.tp)
            fused = Fused(layer, lambda: PhaseClock(torch.device("cpu")))
        records = run_mesh_case(Case("cpu-tiny", cfg, 32, "uniform"), st, mesh, convention,
                                shard, groups, fused=fused)
        if fused is not None:
            records.append(sorted(s for s in fused.layer.splits_asked if s is not None))
        results.put((rank, convention, records))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", repr(err)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
@pytest.mark.parametrize("convention", ["sequence", "replicated"])
def test_tensor_parallel_bench_records(convention, tmp_path):
    """``comet bench --tp 2``'s case runner on two gloo ranks (no GPU: no fused columns):
    the unfused TP pipeline and torch's GEMMs on the rows this rank's shards compute --
    every TP peer's tokens under "sequence", its own group's under "replicated"."""
    import gloo_ranks
    codes, items = gloo_ranks.fork(_tensor_parallel_bench_worker, 2, tmp_path / "store",
                                   (convention, ()), expected=2)
    assert codes == [0, 0], items
    for _, _, records in items:
        assert [r["layer"] for r in records] == list(rec.LAYERS)
        moe = records[-1]
        assert (moe["tp"], moe["ep"], moe["convention"]) == (2, 1, convention)
        assert moe["baseline_us"] > 0 and moe["torch_gmm_us"] > 0 and moe["fused_us"] is None
        k = bench.CONFIGS[bench.CPU_CONFIG].top_k
        assert moe["shard_rows_per_rank"] == (2 if convention == "sequence" else 1) * 32 * k
        # Sequence: every choice of the rank's 32 tokens is a row to its TP peer, once per
        # choice (the push) or once per token (a row once per (token, rank)); replicated:
        # nothing.
        assert (moe["link_rows"], moe["link_token_rows"]) == (
            (32 * k, 32) if convention == "sequence" else (0, 0))
        assert set(moe["baseline_phases_us"]) >= {"a2a", "gemm", "act", "permute"}


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
def test_tensor_parallel_bench_times_the_fixed_splits(tmp_path):
    """``comet bench --tp 2 --fixed-splits``: the TP runner times the fused layer at each
    split this layer can run (fewer comm blocks than programs) and records the best."""
    import gloo_ranks
    codes, items = gloo_ranks.fork(_tensor_parallel_bench_worker, 2, tmp_path / "store",
                                   ("sequence", (0, 2, 99)), expected=2)
    assert codes == [0, 0], items
    for _, _, records in items:
        *records, asked = records
        assert asked == [0, 2]                   # 99 >= the fake's 8 programs: not run
        moe = records[-1]
        assert set(moe["fixed_split_us"]) == {"0", "2"}
        assert moe["best_fixed_us"] == min(moe["fixed_split_us"].values())
        assert moe["fused_over_best_fixed"] == pytest.approx(
            moe["fused_us"] / moe["best_fixed_us"])


def test_tensor_parallel_layout_must_divide_the_ranks(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tp", "2", "--tokens", "8"])
    assert "--tp must divide the number of ranks (1)" in capsys.readouterr().err


def test_a_tile_variant_says_its_comm_blocks_are_not_the_defaults(tmp_path):
    """--tile without --comm-blocks: the records say the tuned tables did not serve the
    variant (so a whole-call difference may be the split, not the tile)."""
    assert bench.main(SMALL + ["--tile", "group_m=4", "--output-dir", str(tmp_path)]) == 0
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    records = rec.read_json(path)
    assert all(bench.TILE_VARIANT_NOTE in r["notes"] for r in records)
    assert records[0]["tile"] == {"group_m": 4}


def test_tile_fields_are_checked(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tile", "no_such_field=1", "--tokens", "8"])
    assert "expected FIELD=INT with FIELD a TileConfig field" in capsys.readouterr().err


def test_a_tile_variant_builds_on_the_layouts_default_tile():
    """--tile changes only the fields it names: a (tp, 1) replicated layout keeps its
    default layer1 (the column reduce) under ``--tile group_m=4``, and
    ``layer1_scatter=1`` brings the scatter back."""
    from comet.mesh import MeshLayout
    from comet.config import preset
    mesh = MeshLayout(tp=4, ep=1)
    cfg = preset("mixtral")
    kept = bench._tile_of({"tile": {"group_m": 4}}, cfg, mesh, "replicated")["tile"]
    assert (kept.gemm.group_m, kept.variant.layer1_scatter) == (4, False)
    back = bench._tile_of({"tile": {"layer1_scatter": 1}}, cfg, mesh, "replicated")["tile"]
    assert back.variant.layer1_scatter
    kept = bench._tile_of({"tile": {"group_m": 4}}, cfg, mesh, "sequence")["tile"]
    assert kept.variant.layer1_scatter
    assert bench._tile_of({}, cfg, mesh, "replicated") == {}


def test_an_expert_parallel_tile_variant_keeps_the_layouts_dispatch(monkeypatch):
    """A variant of an EP sweep builds on the default tile of the sweep's own layout:
    qwen2-moe (top-4) gathers its dispatch at EP=1 (4 slots per rank) but not at EP=2
    (2), and ``--tile group_m=4`` at EP=2 changes group_m alone. (Built on the EP=1
    default, as the sweep once did, every qwen2-moe variant at EP=2 gathered while the
    default did not: 2-4% apart in probes of fields that changed nothing.)"""
    from comet.config import preset
    from comet.mesh import MeshLayout
    from comet.runtime import layer
    from comet.runtime.layer import default_tile
    monkeypatch.setattr(layer, "interpreting", lambda: False)     # the GPU's tiles
    cfg = preset("qwen2-moe")
    for ep, gathers in ((1, True), (2, False)):
        mesh = MeshLayout(ep=ep)
        tile = bench._tile_of({"tile": {"group_m": 4}}, cfg, mesh)["tile"]
        assert tile == default_tile(mesh, cfg=cfg).with_fields(group_m=4)
        assert tile.variant.layer0_gather is gathers, ep


def test_whole_calls_may_be_issued_ahead_of_the_gpu(tmp_path, monkeypatch, fake_fused):
    """``--lead-us``: every whole-call iteration first parks the GPU that long (in sleep
    cycles at up to 2 GHz) so the host issues the call ahead; phase-timed iterations keep
    their 10 ms; the records say so. Without it, whole calls run back to back."""
    from comet.bench import timing
    slept = []
    monkeypatch.setattr(timing, "_queue_ahead",
                        lambda device, cycles=timing.QUEUE_AHEAD_CYCLES: slept.append(cycles))
    series = timing.time_calls(lambda i, t: None, n_sets=1, iters=3, warmup=1,
                               device=torch.device("cpu"), lead_us=250)
    assert slept == [250 * timing.LEAD_CYCLES_PER_US] * 4 and len(series["total"]) == 3
    slept.clear()
    timing.time_calls(lambda i, t: None, n_sets=1, iters=2, warmup=0,
                      device=torch.device("cpu"), make_timer=lambda: timing.PhaseClock("cpu"))
    assert slept == [timing.QUEUE_AHEAD_CYCLES] * 2
    slept.clear()
    timing.time_calls(lambda i, t: None, n_sets=1, iters=2, warmup=0, device=torch.device("cpu"))
    assert slept == [0, 0]
    assert bench.main(SMALL + ["--layers", "moe", "--lead-us", "500",
                               "--output-dir", str(tmp_path)]) == 0
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    assert all(r["lead_us"] == 500 for r in rec.read_json(path))
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--lead-us", "-1"])
