"""scripts/device/eplb_check.py's step of ``CometMoE(rebalance_interval=...)``, at the
script's toy size on the CPU: the device run is the only other caller of its wrapper around
``rebalance``, and a signature drift there once cost a device call."""

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("eplb_check",
                                              ROOT / "scripts" / "device" / "eplb_check.py")
eplb_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eplb_check)


def test_interval_step_rebalances_automatically_and_matches():
    rec = eplb_check.run_interval(eplb_check.TINY["tiny"], 16, 2, torch.device("cpu"))
    assert rec["rebalances"] == 3 and rec["calls"] == 6
    assert rec["liveness"]["failures"] == []
    assert rec["max_rel_err"] <= eplb_check.MAX_REL_ERR
