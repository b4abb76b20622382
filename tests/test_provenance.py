"""The one results writer: every file it writes carries device, commit, kernels and
command, and no absolute path (comet.bench.provenance)."""

import json

import pytest

from comet.bench import provenance
from comet.constants import kernel_identity, kernels_of


def test_a_dict_gets_the_four_fields_and_keeps_its_own(tmp_path):
    path = provenance.write_result(tmp_path / "r.json", {"device": "NVIDIA H200", "x": 1},
                                   command="comet bench --tokens 128")
    data = json.loads(open(path).read())
    assert data["device"] == "NVIDIA H200" and data["x"] == 1    # the writer's own kept
    assert data["kernels"] == kernel_identity() and data["commit"]
    assert data["command"] == "comet bench --tokens 128"
    assert provenance.missing_fields(data) == []


def test_each_record_of_a_list_gets_them(tmp_path):
    path = provenance.write_result(tmp_path / "r.json", [{"a": 1}, {"a": 2, "commit": "abc"}])
    records = json.loads(open(path).read())
    assert provenance.missing_fields(records) == []
    assert [r["commit"] for r in records][1] == "abc"
    with pytest.raises(TypeError):
        provenance.write_result(tmp_path / "bad.json", "text")


def test_paths_are_written_repo_relative(tmp_path, monkeypatch):
    root = str(provenance.REPO_ROOT)
    monkeypatch.chdir(tmp_path)
    data = {"table": f"{root}/comet/configs/E=8,H=4096.json",
            "new": [f"{tmp_path}/out/bench-ep1.json", "/outside-any-checkout/y/paired.json"],
            "note": "2.1 tokens/s, a/b 1.5x; see benchmarks/results/2026-12-03/x.json"}
    path = provenance.write_result(tmp_path / "r.json", data,
                                   command=f"python {root}/scripts/device/stress.py "
                                           f"--json /work/out/s.json")
    out = json.loads(open(path).read())
    assert out["table"] == "comet/configs/E=8,H=4096.json"
    assert out["new"] == ["out/bench-ep1.json", "paired.json"]
    assert out["note"] == data["note"]                   # relative paths and ratios left alone
    assert out["command"] == "python scripts/device/stress.py --json s.json"
    assert provenance.absolute_paths(out) == []
    assert provenance.absolute_paths(data) == [data["table"], *data["new"]]


def test_missing_fields_names_what_an_old_file_lacks():
    old = {"device": "NVIDIA H200", "commit": "279e552", "kernel_revision": 10}
    assert provenance.missing_fields(old) == ["command", "kernels"]
    assert kernels_of(old) == "revision 10" and kernels_of({}) == "unknown"
    assert provenance.missing_fields([old, {**old, "kernels": "k", "command": "c"}]) == [
        "command", "kernels"]
