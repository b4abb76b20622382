#!/usr/bin/env bash
# A short 4-GPU check and benchmark (for when little device time is left):
#   bash scripts/device/x4_quick.sh
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
LOG="$OUT/run.log"
run() { echo "=== $(date -u +%T) $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG" | tail -12; }
run timeout 35 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
    tests/multigpu_check.py --quick --calls 100 --configs qwen2-moe
run timeout 95 python3 -m comet.cli.bench --config mixtral qwen2-moe --tokens 1024 4096 16384 \
    --routing uniform --comm-blocks 8 16 --iters 20 --warmup 3 --output-dir "$OUT"
