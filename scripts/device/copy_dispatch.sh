#!/usr/bin/env bash
# The dispatch by copy engines (TileConfig.copy_dispatch) on every GPU of the machine
# (nvidia-h200-x2 / -x4), from the repo root:
#   COMET_COMMIT=$(git rev-parse --short HEAD) bash scripts/device/copy_dispatch.sh [STEPS]
# STEPS (default "check stress paired"; each under its own timeout, so the three fit in
# one 10-minute device call):
#   check   copy_engine_check.py: do copies into a peer's memory run beside a grid that
#           holds every SM? If not, layer0's kernels would hold the SMs their peers'
#           copies need, and the rest says nothing: stop there.
#   stress  stress.py --tile copy_dispatch=1: the four presets at full size, back-to-back
#           calls drifting apart, every routing, outputs checked
#   paired  paired_tiles.py --tiles copy_dispatch=1: whole calls against the push, in
#           paired rounds (ratios < 1: the copies pay)
# Logs and JSON under $OUT (./out if unset); copy them to benchmarks/results/<date>/.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
W=$(nvidia-smi --list-gpus | wc -l)
LOG="$OUT/copy-dispatch-ep$W.log"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "$W")
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$LOG"
for step in ${1:-check stress paired}; do
    echo "== $step" | tee -a "$LOG"
    case "$step" in
        check) timeout 90 "${RUN[@]}" scripts/device/copy_engine_check.py \
                   --out "$OUT/copy-engine-check-ep$W.json" ;;
        stress) timeout 270 "${RUN[@]}" scripts/device/stress.py --tile copy_dispatch=1 \
                    --tokens 128 4096 16384 uneven --calls 100 \
                    --output "$OUT/stress-copy-dispatch-ep$W.json" ;;
        paired) timeout 220 "${RUN[@]}" scripts/device/paired_tiles.py --ep 1 \
                    --tokens 4096 16384 --tiles copy_dispatch=1 \
                    --out "$OUT/paired-copy-dispatch-ep$W.json" ;;
        *) echo "unknown step $step" ;;
    esac 2>&1 | tee -a "$LOG"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
done
