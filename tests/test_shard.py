"""``pytest --shard I/N`` (tests/conftest.py): the slices of a selection cover it once, in
order, and bad specs are usage errors."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> tuple[int, list[str]]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                         cwd=ROOT, capture_output=True, text=True)
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_cover_the_selection_once_in_order():
    select = ("tests/test_config.py", "-k", "not invalid_fields")   # -k first, then --shard
    rc, whole = _collected(*select)
    assert rc == 0 and len(whole) >= 6 and not any("invalid_fields" in t for t in whole)
    parts = []
    for i in (1, 2, 3):
        rc, part = _collected(*select, "--shard", f"{i}/3")
        assert rc == 0 and abs(len(part) - len(whole) / 3) < 1, (i, len(part))
        parts += part
    assert parts == whole


@pytest.mark.parametrize("spec", ["3/2", "two"])
def test_a_bad_shard_is_a_usage_error(spec):
    rc, _ = _collected("tests/test_config.py", "--shard", spec)
    assert rc == 4   # pytest's usage error
