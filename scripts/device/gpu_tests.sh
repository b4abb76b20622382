#!/usr/bin/env bash
# usage: [GPU_TEST_FILES="tests/..."] [GPU_TESTS_TIMEOUT_S=500] bash scripts/device/gpu_tests.sh [pytest args]
# One-GPU checks, from the repo root on a device machine (no pip install there): the
# liveness tests (virtual ranks running concurrently at full model sizes, injected
# stalls, bad routing), then the rest of the GPU suite. The whole suite outgrew one
# 10-minute device call on an H100; run it as two calls there,
# GPU_TEST_FILES=tests/test_gpu_liveness.py, then GPU_TEST_FILES=tests/test_gpu.py. On a
# cold machine the liveness file outgrows one call too (8 of its tests in 430 s on an
# H200, mostly compiling): pass `--shard 1/2`, then `--shard 2/2` (tests/conftest.py).
# Writes $OUT/gpu_tests.log (./out if OUT is unset).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
LOG="$OUT/gpu_tests.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
# shellcheck disable=SC2086  # GPU_TEST_FILES is a list of paths
timeout "${GPU_TESTS_TIMEOUT_S:-500}" python3 -m pytest -q -m gpu -s --durations=20 \
    ${GPU_TEST_FILES:-tests/test_gpu_liveness.py tests/test_gpu.py} "$@" 2>&1 | tee -a "$LOG"
echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
