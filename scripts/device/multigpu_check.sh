#!/usr/bin/env bash
# usage: bash scripts/device/multigpu_check.sh NPROC [tests/multigpu_check.py args, e.g. --quick]
# The multi-GPU correctness suite (tests/multigpu_check.py) on NPROC GPUs, from the repo
# root (no install); then the fused-backward check alone again, on the kernel cache the
# first run left warm: a failure in the first run only (cold) points at kernels compiled
# mid-call, one in both at the gradients themselves. Logs and JSON under $OUT (./out).
set -uo pipefail
nproc="${1:?usage: multigpu_check.sh NPROC [args...]}"
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out="${OUT:-out}"
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$out/multigpu_check.log"
timeout 420 torchrun --nproc-per-node "$nproc" tests/multigpu_check.py \
    --json "$out/multigpu_check.json" "$@" 2>&1 | tee -a "$out/multigpu_check.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$out/multigpu_check.log"
timeout 120 torchrun --nproc-per-node "$nproc" tests/multigpu_check.py --only fused_backward \
    2>&1 | tee "$out/multigpu_check_warm.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$out/multigpu_check_warm.log"
