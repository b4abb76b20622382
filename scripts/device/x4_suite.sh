#!/usr/bin/env bash
# Everything that needs the 4-GPU machine, in one call (device time is scarce):
#   multi-GPU correctness at W=4 and W=2, comet tune for the four configs (world 4),
#   comet bench with those tables, and a timeline. Run from the repo root:
#   bash scripts/device/x4_suite.sh
# At most 8 files come back from $OUT: run.log, multigpu4.json, tuned.tar, the bench
# JSON/markdown/PNG and the timeline trace/PNG.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
LOG="$OUT/run.log"
TUNED=/tmp/comet_tuned; mkdir -p "$TUNED"
run() { echo "=== $(date -u +%T) $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG" | tail -25; }
run nvidia-smi --query-gpu=name,driver_version --format=csv
run timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
    tests/multigpu_check.py --quick --calls 1000 --json "$OUT/multigpu4.json"
run timeout 40 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/multigpu_check.py --quick --calls 200 --configs mixtral
for c in mixtral qwen2-moe phi3.5-moe deepseek-v3-like; do
  run timeout 38 python3 -m comet.cli.tune --config "$c" --tokens 1024 4096 16384 \
      --candidates 0 4 8 16 32 --iters 5 --warmup 2 --output-dir "$TUNED"
done
tar cf "$OUT/tuned.tar" -C "$TUNED" .
export COMET_TUNED_CONFIG_FOLDER="$TUNED"
run timeout 180 python3 -m comet.cli.bench \
    --output-dir "$OUT" --iters 20 --warmup 3
run timeout 30 python3 -m comet.cli.bench --timeline \
    --config mixtral --output-dir "$OUT"
ls -la "$OUT" | tee -a "$LOG"
