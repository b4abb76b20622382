"""The examples users start from run as their docstrings say (CPU here; their GPU halves on
the device: scripts/device/fp8_check.sh example)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_fp8_example_runs_and_its_numbers_are_the_recipes():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fp8_experts.py")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rel, diff = (float(v) for v in re.search(r"rel L2 ([0-9.e+-]+), calc_diff ([0-9.e+-]+)",
                                             out.stdout).groups())
    # The W8A8 recipe's own distance from bf16 on random data (docs/precision.md).
    assert 3e-2 < rel < 1e-1 and 1e-3 < diff < 4e-3, out.stdout
    assert "UE8M0 scales exact in fp32: True" in out.stdout
    assert re.search(r"experts 3\.00 MiB in bf16 -> 1\.50 MiB in FP8", out.stdout), out.stdout
