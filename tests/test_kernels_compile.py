"""Every kernel compiles for sm_90 (Hopper) with the default tiles -- checked on the CPU
machine with Triton's own compiler and the ptxas it ships (tests/sm90_compile.py) --
every GEMM loop is software-pipelined, and no kernel moves rows with 2-byte accesses: copies through addresses loaded on the
device (peer tables, the staged input and output) once did, which capped dispatch, reduce
and combine bandwidth on the GPU; and the warp-specialized FP8 GEMM's bf16 epilogue stores
whole rows, not the accumulator layout's 4-byte pieces of them."""

import os
import re
import subprocess
import sys

import pytest
import triton


def _ptxas_available() -> bool:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.exists(os.path.join(bin_dir, "ptxas"))


@pytest.mark.skipif(not _ptxas_available(), reason="this triton build ships no ptxas")
def test_all_kernels_compile_for_sm90():
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), here,
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(here, "sm90_compile.py"), "--digest"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kernel in ("count_kernel", "open_kernel", "layout_kernel", "place_kernel",
                   "exchange_counts_kernel",
                   "layer0_kernel", "layer1_reduce_kernel", "layer1_scatter_kernel",
                   "combine_kernel", "act_backward_kernel", "row_weights_kernel",
                   "stage_routing_kernel", "shard_routing_kernel", "fp8_ws_gemm_kernel",
                   "release_sources_kernel"):
        assert f"ok   {kernel}" in proc.stdout
    assert "local=0" in proc.stdout and "FAIL" not in proc.stdout
    assert "pipelined=yes" in proc.stdout and "pipelined=no" not in proc.stdout, proc.stdout
    narrow = [line for line in proc.stdout.splitlines() if " b16=0 " not in line]
    assert not narrow, narrow
    ws = [line for line in proc.stdout.splitlines() if "fp8_ws_gemm_kernel" in line]
    assert any(" pieces=0 " in line for line in ws), ws     # layer1's launch is checked
    pieces = [line for line in ws if " pieces=0 " not in line and " pieces=- " not in line]
    assert not pieces, pieces
    # layer0's requantization: one division per row (4), not per value (64).
    gated = [line for line in ws if " divs=- " not in line]
    assert gated and all(" divs=4 " in line for line in gated), gated
    # The SASS digests that tell a change of machine code from a change of source: every
    # launch has one, and the gated and plain GEMMs (other code) never share one.
    digests = [re.search(r" sass=([0-9a-f]{12}) ", line) for line in proc.stdout.splitlines()
               if line.startswith("ok ")]
    assert digests and all(digests), proc.stdout[-3000:]
    plain = {re.search(r" sass=(\w+) ", line)[1] for line in ws if " divs=- " in line}
    assert plain and plain.isdisjoint(re.search(r" sass=(\w+) ", line)[1] for line in gated)
