#!/usr/bin/env bash
# Does a pytest process that made comet's private CUDA streams exit cleanly? (2026-11-25,
# 1x H100: every GPU test that made one passed, then the process segfaulted in its
# atexit weakref finalizers, exit 139; a test without them, and the same calls in a plain
# script, exited 0 -- benchmarks/results/2026-11-25/h100-exit-probe.log.)
# Each case runs in its own process, with Python's fault handler; writes $OUT/exit_probe.log.
#   bash scripts/device/exit_probe.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"; LOG="$OUT/exit_probe.log"
case_() {
    echo "== $1" | tee -a "$LOG"; shift
    timeout 120 "$@" 2>&1 | grep -v "^Extension modules" | tail -n 8 | tee -a "$LOG"
    echo "rc ${PIPESTATUS[0]}" | tee -a "$LOG"
}
pytest_() { case_ "pytest $1" python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider \
    -p no:faulthandler "$1"; }
pytest_ "tests/test_gpu.py::test_private_streams_are_never_shared_while_alive"
pytest_ "tests/test_gpu.py::test_no_host_sync_and_cuda_graph_replay"
pytest_ "tests/test_gpu.py::test_copy_dispatch_matches_the_push_at_full_size"
pytest_ "tests/test_gpu.py::test_virtual_ranks_bf16[mixtral-2-scatter]"     # control: no private stream
# Which ingredient? Each as a one-test pytest file (under $OUT, outside the suite).
probe_test() {
    printf 'import torch\n\n\ndef test_it():\n%s\n' "$2" > "$OUT/test_exit_$1.py"
    case_ "pytest ingredient: $1" python3 -X faulthandler -m pytest -q -p no:cacheprovider \
        -p no:faulthandler "$OUT/test_exit_$1.py"
}
probe_test external_stream_of_pool \
'    s = torch.cuda.ExternalStream(torch.cuda.Stream().cuda_stream)
    with torch.cuda.stream(s):
        torch.ones(4, device="cuda").sum().item()'
probe_test cuda_python_stream_unwrapped \
'    from cuda.bindings import runtime as rt
    torch.ones(4, device="cuda")
    err, h = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    assert int(err) == 0'
probe_test comet_import_only \
'    import comet.runtime.layer  # noqa: F401
    torch.ones(4, device="cuda").sum().item()'
case_ "script, everything alive at exit" python3 -X faulthandler scripts/device/exit_probe.py --keep
case_ "script, freed in stages" python3 -X faulthandler scripts/device/exit_probe.py
