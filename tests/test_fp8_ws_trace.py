"""scripts/device/fp8_ws_trace.py stamps the kernel it is given: every anchor it needs in
comet/kernels/fp8_ws.py is there, and a source without one is refused by name."""

import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "scripts", "device"))


def _source() -> str:
    with open(os.path.join(HERE, "..", "comet", "kernels", "fp8_ws.py")) as f:
        return f.read()


def test_the_trace_stamps_every_item_of_both_partitions():
    from fp8_ws_trace import instrument
    src = instrument(_source())
    for stamp in ("p0 = _clock(pj)", "p1 = _clock(it)", "t0 = _clock(j)", "t1 = _clock(it)",
                  "t2 = _clock(j)", "stamps: torch.Tensor = None", "STAMPS[0])"):
        assert src.count(stamp) == 1, stamp
    compile(src, "fp8_ws_trace", "exec")


def test_a_kernel_the_trace_does_not_know_is_refused():
    from fp8_ws_trace import instrument
    with pytest.raises(ValueError, match="has changed"):
        instrument(_source().replace("        j += 1\n", "        j = j + 1\n"))
