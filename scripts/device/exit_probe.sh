#!/usr/bin/env bash
# Does a pytest process that made comet's private CUDA streams exit cleanly? (2026-11-25,
# 1x H100: every GPU test that made one passed, then the process segfaulted in its
# atexit weakref finalizers, exit 139; a test without them, and the same calls in a plain
# script, exited 0 -- benchmarks/results/2026-11-25/h100-exit-probe.log.)
# Each case runs in its own process, with Python's fault handler; writes $OUT/exit_probe.log.
#   bash scripts/device/exit_probe.sh [tests] [ingredients] [scripts] [native]   (default: all)
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"; LOG="$OUT/exit_probe.log"
PARTS=${*:-tests ingredients scripts native}
want() { [[ " $PARTS " == *" $1 "* ]]; }
case_() {
    echo "== $1" | tee -a "$LOG"; shift
    timeout 120 "$@" 2>&1 | grep -v "^Extension modules" | tail -n "${TAIL:-8}" | tee -a "$LOG"
    echo "rc ${PIPESTATUS[0]}" | tee -a "$LOG"
}
pytest_() { case_ "pytest $1" python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider \
    -p no:faulthandler "$1"; }
PRIVATE=tests/test_gpu.py::test_private_streams_are_never_shared_while_alive
if want tests; then
    pytest_ "$PRIVATE"
    pytest_ "tests/test_gpu.py::test_no_host_sync_and_cuda_graph_replay"
    pytest_ "tests/test_gpu.py::test_copy_dispatch_matches_the_push_at_full_size"
    pytest_ "tests/test_gpu.py::test_virtual_ranks_bf16[mixtral-2-scatter]"  # control: no private stream
fi
# Which ingredient? Each a one-test file inside tests/ (so the suite's conftest.py and
# pytest settings apply, as they do to the crashing tests), removed afterwards.
probe_test() {
    local f="tests/test_exit_probe_$1.py"
    printf 'import weakref\n\nimport torch\n\n\ndef test_it():\n%s\n' "$2" > "$f"
    cp "$f" "$OUT/"
    case_ "pytest ingredient: $1" python3 -X faulthandler -m pytest -q -p no:cacheprovider \
        -p no:faulthandler "$f"
    rm -f "$f"
}
CUDA_PYTHON_STREAM='    from cuda.bindings import runtime as rt
    dev = torch.device("cuda", 0)
    torch.ones(4, device=dev)
    err, h = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    assert int(err) == 0'
DRIVER_STREAM='    import ctypes
    dev = torch.device("cuda", 0)
    torch.ones(4, device=dev)
    cu = ctypes.CDLL("libcuda.so.1")
    h = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(h), 1) == 0
    h = h.value'
USE='    with torch.cuda.stream(s):
        y = torch.ones(1024, device=dev) * 2
    torch.cuda.synchronize()
    assert y.sum().item() == 2048'
if want ingredients; then
    probe_test cuda_python_stream_unwrapped "$CUDA_PYTHON_STREAM"
    probe_test cuda_python_stream_wrapped "$CUDA_PYTHON_STREAM
    s = torch.cuda.ExternalStream(int(h), device=dev)"
    probe_test cuda_python_stream_wrapped_used "$CUDA_PYTHON_STREAM
    s = torch.cuda.ExternalStream(int(h), device=dev)
$USE"
    probe_test cuda_python_stream_wrapped_finalized "$CUDA_PYTHON_STREAM
    s = torch.cuda.ExternalStream(int(h), device=dev)
    weakref.finalize(s, rt.cudaStreamDestroy, h)"
    probe_test driver_stream_wrapped_used "$DRIVER_STREAM
    s = torch.cuda.ExternalStream(h, device=dev)
$USE"
    probe_test pool_stream_wrapped_used '    dev = torch.device("cuda", 0)
    s = torch.cuda.ExternalStream(torch.cuda.Stream().cuda_stream, device=dev)
'"$USE"
    probe_test comet_private_stream_once '    from comet.runtime.streams import PrivateStream
    dev = torch.device("cuda", 0)
    s = PrivateStream(dev)'
    probe_test comet_private_stream_used '    from comet.runtime.streams import PrivateStream
    dev = torch.device("cuda", 0)
    s = PrivateStream(dev)
'"$USE"
fi
if want scripts; then
    case_ "script, everything alive at exit" python3 -X faulthandler scripts/device/exit_probe.py --keep
    case_ "script, freed in stages" python3 -X faulthandler scripts/device/exit_probe.py
fi
# The native stack of the crash: gdb where the machine has it, else a SIGSEGV handler that
# prints glibc's backtrace (scripts/device/segv_backtrace.c, preloaded).
if want native; then
    NATIVE_CMD=(python3 -m pytest -q -m gpu -p no:cacheprovider -p no:faulthandler "$PRIVATE")
    if command -v gdb > /dev/null; then
        echo "== gdb: $PRIVATE" | tee -a "$LOG"
        timeout 240 gdb -q -batch -ex run -ex bt --args "${NATIVE_CMD[@]}" 2>&1 \
            | grep -v "^\[New Thread\|^\[Thread .* exited\|^\[Detaching" | tail -n 80 | tee -a "$LOG"
    else
        gcc -shared -fPIC -O0 -o "$OUT/segv_backtrace.so" scripts/device/segv_backtrace.c
        TAIL=80 case_ "native stack (no gdb here): $PRIVATE" env LD_PRELOAD="$OUT/segv_backtrace.so" \
            "${NATIVE_CMD[@]}"
    fi
fi
