"""scripts/device/power_probe.py on the CPU: nvidia-smi lines and window statistics."""

import importlib.util
import os
import sys
from datetime import datetime

import pytest

DEVICE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "scripts", "device")


def load_probe():
    sys.path.insert(0, DEVICE)        # its sibling imports, as when the script runs
    try:
        spec = importlib.util.spec_from_file_location(
            "power_probe", os.path.join(DEVICE, "power_probe.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(DEVICE)


pp = load_probe()
T0 = datetime(2026, 11, 23, 12, 34, 56, 789000).timestamp()


def line(gpu, t, watts="652.31", cap="Active"):
    stamp = datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{gpu}, {stamp}, {watts}, 1755, 2619, 61, {cap}, Not Active, Not Active"


def test_parse_sample():
    s = pp.parse_sample("0, 2026/11/23 12:34:56.789, 652.31, 1755, 2619, 61, Active, "
                        "Not Active, Not Active")
    assert s == {"index": 0, "timestamp": pytest.approx(T0), "power.draw": 652.31,
                 "clocks.sm": 1755.0, "clocks.mem": 2619.0, "temperature.gpu": 61.0,
                 "sw_power_cap": True, "hw_slowdown": False, "sw_thermal_slowdown": False}
    assert pp.parse_sample(line(1, T0, watts="[N/A]"))["power.draw"] is None
    basic = pp.parse_sample("3, 2026/11/23 12:34:56.789, 98.5, 1980, 2619, 35", pp.BASIC)
    assert basic["index"] == 3 and "sw_power_cap" not in basic
    # What a driver without a queried field prints, and a line of the wrong width.
    assert pp.parse_sample('Field "clocks_event_reasons.sw_power_cap" is not a valid '
                           'field to query.') is None
    assert pp.parse_sample(line(0, T0), pp.BASIC) is None


def test_window_stats():
    # 10 samples per GPU over [T0, T0 + 1): the first 20% dropped, GPU 1 without power.
    lines = [line(0, T0 + i / 10, watts=str(600 + i), cap="Active" if i % 2 else "Not Active")
             for i in range(10)]
    lines += [line(1, T0 + i / 10, watts="[N/A]") for i in range(10)]
    lines.append(line(0, T0 + 2.0, watts="999"))         # after the window
    samples = [pp.parse_sample(s) for s in lines]
    stats = pp.window_stats(samples, T0, T0 + 0.95)
    assert sorted(stats) == ["0", "1"]
    g0, g1 = stats["0"], stats["1"]
    assert g0["samples"] == 8                              # i = 2..9
    assert g0["power.draw"] == {"median": 605.5, "mean": 605.5}
    assert g0["clocks.sm"]["median"] == 1755.0
    assert g0["sw_power_cap"] == 0.5 and g0["hw_slowdown"] == 0.0
    assert g1["power.draw"] is None and g1["samples"] == 8
    assert pp.window_stats(samples, T0, T0 + 0.95, settle=0)["0"]["samples"] == 10
    assert pp.window_stats(samples, T0 + 5, T0 + 6) == {}
