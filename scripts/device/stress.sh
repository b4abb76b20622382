#!/usr/bin/env bash
# usage: COMET_COMMIT=$(git rev-parse --short HEAD) [STRESS_TIMEOUT_S=540] [STRESS_NAME=tp2-sequence] bash scripts/device/stress.sh [stress.py args]
# Liveness stress on NPROC GPUs (default: every GPU of the machine, 2 or more), in one device call:
# the four presets at full size, 200 back-to-back calls per (preset, token count), with
# drift; writes $OUT/stress-ep<W>-<device>.json and $OUT/stress-ep<W>.log. Copy both to
# benchmarks/results/<date>/ afterwards. A hang ends at the `timeout` below (exit 124).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COMET_TIMEOUT_S=${COMET_TIMEOUT_S:-10}
OUT=${OUT:-out}; mkdir -p "$OUT"
W=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | awk '{print $NF}')
NAME=${STRESS_NAME:-ep$W}     # e.g. tp2-sequence with --tp 2 --convention sequence
LOG="$OUT/stress-$NAME.log"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$LOG"
timeout "${STRESS_TIMEOUT_S:-540}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$W" scripts/device/stress.py \
    --output "$OUT/stress-$NAME-$DEV.json" "$@" 2>&1 | tee -a "$LOG"
echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
