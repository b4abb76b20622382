"""scripts/device/overlap_bound.py on the CPU: the hidden fraction and its per-round medians."""

import importlib.util
import os
import sys

import pytest

DEVICE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "scripts", "device")


def load_script():
    sys.path.insert(0, DEVICE)        # its sibling imports, as when the script runs
    try:
        spec = importlib.util.spec_from_file_location(
            "overlap_bound", os.path.join(DEVICE, "overlap_bound.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(DEVICE)


ob = load_script()


def test_hidden_spans_serial_to_perfect():
    assert ob.hidden(100.0, 20.0, 100.0) == 1.0           # costs max: all of 20 hidden
    assert ob.hidden(100.0, 20.0, 120.0) == 0.0           # costs the sum
    assert ob.hidden(100.0, 20.0, 110.0) == pytest.approx(0.5)
    assert ob.hidden(20.0, 100.0, 130.0) == pytest.approx(-0.5)   # slower than in series
    assert ob.hidden(20.0, 100.0, 110.0) == ob.hidden(100.0, 20.0, 110.0)


def round_times(gemm=1000.0, comm=200.0, both=1100.0, fused=1150.0, seq=1250.0,
                c=1020.0, d=210.0, cd=1120.0):
    return {"gemm": gemm, "nccl": comm, "ce": comm / 2, "gemm+nccl": both,
            "gemm+ce": gemm + comm / 4, "fused": fused, "sequential": seq,
            "compute_only": c, "comm_only": d, "c||d": cd, "c+ce": c + comm / 8}


def test_derived_reads_each_pair_from_its_own_variants():
    r = ob.derived(round_times())
    assert r["ceiling_nccl"] == pytest.approx(0.5)        # (1000 + 200 - 1100) / 200
    assert r["ceiling_ce"] == pytest.approx(0.5)          # (1000 + 100 - 1050) / 100
    assert r["ceiling_comet"] == pytest.approx(110 / 210)
    assert r["comet_hidden"] == pytest.approx(80 / 210)
    assert r["ceiling_comet_ce"] == pytest.approx(0.75)   # (1020 + 100 - 1045) / 100
    assert r["fused_over_sequential"] == pytest.approx(1150 / 1250)
    assert r["gemm_stretch_nccl"] == pytest.approx(1.1)
    assert r["gemm_stretch_ce"] == pytest.approx(1.05)
    assert set(round_times()) == set(ob.VARIANTS)


def test_summarise_takes_ratios_within_rounds_then_the_median():
    # Round 2's clocks are 2x slower for every variant: per-round ratios are unchanged,
    # while a ratio of medians over a drifting set would mix the rounds.
    rounds = [round_times(), {k: 2 * v for k, v in round_times().items()},
              round_times(both=1200.0)]
    times = [[r[v] for r in rounds] for v in ob.VARIANTS]
    s = ob.summarise(times)
    assert s["ceiling_nccl"] == pytest.approx(0.5)        # median of 0.5, 0.5, 0.0
    assert s["fused_over_sequential"] == pytest.approx(1150 / 1250)


def test_power_cell_reads_the_first_gpu_or_says_nothing():
    gpu = {"power.draw": {"median": 652.4, "mean": 650.0},
           "clocks.sm": {"median": 1755.0, "mean": 1750.0}}
    assert ob.power_cell({"0": gpu, "1": {}}) == "652W/1755"
    assert ob.power_cell({"1": gpu}) == "652W/1755"
    assert ob.power_cell({}) == "-"
    assert ob.power_cell({"0": {"power.draw": None}}) == "-"
