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
    for stamp in ("p0 = _clock(pj)", "p1 = _clock(it)", "t0 = _clock(j)", "t2 = _clock(j)",
                  "stamps: torch.Tensor = None", "STAMPS[0])", "return it, t1"):
        assert src.count(stamp) == 1, stamp
    # a K loop's end on each path: the default items, paired plain, paired gated
    assert src.count("t1 = _clock(it)") == 3
    compile(src, "fp8_ws_trace", "exec")


def test_a_kernel_the_trace_does_not_know_is_refused():
    from fp8_ws_trace import instrument
    with pytest.raises(ValueError, match="has changed"):
        instrument(_source().replace("        j += 1\n", "        j = j + 1\n"))


def test_the_summary_reads_intervals_per_item():
    """Synthetic stamps (4 programs, 10 items of a 400-cycle K loop, a 100-cycle epilogue,
    10 cycles to the next item, the producer 50 ahead) come back as those medians."""
    import torch
    from fp8_ws_trace import MAX_ITEMS, STAMPS, summarize
    programs, items = 4, 10
    stamps = torch.zeros(8 * MAX_ITEMS * STAMPS, dtype=torch.int64)   # sized for more programs
    view = stamps[:programs * MAX_ITEMS * STAMPS].view(programs, MAX_ITEMS, STAMPS)
    for p in range(programs):
        t = 1000
        for j in range(len(range(p, items, programs))):
            view[p, j, 6:8] = torch.tensor([t - 50, t + 300])
            for o in (0, 3):
                view[p, j, o:o + 3] = torch.tensor([t, t + 400, t + 500])
            t += 510
    r = summarize(stamps, items, programs, steps=4, us=1.0)
    got = (r["c0_kloop_cyc"], r["c1_epi_cyc"], r["c0_gap_cyc"], r["lead_cyc"])
    assert got == (400, 100, 10, 50)
    assert r["cyc_per_step"] == 100 and r["skew_cyc"] == 0
    assert abs(r["outside"] - 110 / 510) < 1e-9


def test_the_ring_alone_has_no_wgmma():
    """``--no-mma``: every wgmma and its waits taken out of the traced copy."""
    from fp8_ws_trace import instrument
    src = instrument(_source(), no_mma=True)
    assert "warpgroup_mma(" not in src and "warpgroup_mma_wait(" not in src
    assert src.count("d = tok") == 2
    compile(src, "fp8_ws_trace", "exec")
