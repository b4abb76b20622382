#!/usr/bin/env bash
# usage: COMET_COMMIT=$(git rev-parse --short HEAD) [TP=2] [CONVENTION=sequence] [NPROC=<all GPUs>] [BENCH_TIMEOUT_S=330] [STRESS_TIMEOUT_S=220] [STRESS=0] bash scripts/device/tensor_parallel.sh [comet bench args...]
# A (TP, W/TP) layout on W = NPROC GPUs (every GPU of the machine unless NPROC says), in one device call: the `comet bench
# --tp` sweep (fused vs the unfused TP pipeline vs torch's grouped GEMMs on the shard
# rows; 128, 4096 and 16384 tokens per rank, both routings, every call issued 500 us
# ahead, unless arguments say otherwise), then the liveness stress of the layout
# (scripts/device/stress.py --tp). Issued ahead because the unfused pipeline is
# host-bound at 128 tokens: its whole call took 1.2-3.4x its GPU phases
# (benchmarks/results/2026-11-27/h100x2-r24-bench-tp2-*), so a/b measured the host.
# Writes under $OUT (./out if unset) bench-tp*-<convention>-*.json/.md, bench-tp*.log,
# stress-tp*-<device>.json and stress-tp*.log; copy them to benchmarks/results/<date>/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
OUT=${OUT:-out}; mkdir -p "$OUT"
TP=${TP:-2}; CONVENTION=${CONVENTION:-sequence}
W=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
NAME="tp$TP-$CONVENTION"
LOG="$OUT/bench-$NAME.log"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$LOG"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--tokens 128 4096 16384 --lead-us 500)
timeout "${BENCH_TIMEOUT_S:-330}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$W" -m comet.cli.bench --tp "$TP" --convention "$CONVENTION" \
    --no-plot --output-dir "$OUT" "${args[@]}" 2>&1 | tee -a "$LOG"
echo "bench exit ${PIPESTATUS[0]}" | tee -a "$LOG"
[ "${STRESS:-1}" = 0 ] && exit 0     # the bench only (STRESS=0)
STRESS_NAME="$NAME" STRESS_TIMEOUT_S=${STRESS_TIMEOUT_S:-220} OUT="$OUT" \
    bash scripts/device/stress.sh --tp "$TP" --convention "$CONVENTION"
