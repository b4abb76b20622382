#!/usr/bin/env bash
# One-GPU checks, run from the repo root on a device machine (no pip install there):
#   bash scripts/device/gpu_tests.sh
# Writes logs under $OUT (or ./out).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_tests.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_tests.log"
python3 -m pytest -q -m gpu -x tests/test_gpu.py "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
