#!/usr/bin/env bash
# The tuning issue's check on shapes no preset has, on every GPU of the machine:
#   bash scripts/device/tune_check.sh [comet tune args, e.g. --iters 5]
# Per shape: `comet tune` (local search, default buckets 1..16384), then `comet tune
# --check --tokens 128 3000 8192` (the table's picks, a fixed 16 and the analytic model
# against every candidate). Writes $OUT/tune_check.log and, since file names with '=' or
# ',' do not come back from the device machines, the tables and check JSONs in
# $OUT/tune_check.tar.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=60
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; dir="$OUT/tune_check"; mkdir -p "$dir"
shapes=(
  "--experts 64 --topk 8 --hidden 2048 --ffn 1024"     # OLMoE-1B-7B
  "--experts 128 --topk 8 --hidden 2048 --ffn 768"     # Qwen3-30B-A3B
  "--experts 16 --topk 4 --hidden 6144 --ffn 10752"    # DBRX
)
{
  status=0
  for s in "${shapes[@]}"; do
    # shellcheck disable=SC2086  # $s is a list of arguments
    python3 -m comet.cli.tune $s --output-dir "$dir" "$@" || status=$?
    # shellcheck disable=SC2086
    python3 -m comet.cli.tune $s --check --tokens 128 3000 8192 --output-dir "$dir" "$@" \
      || status=$?
  done
  exit "$status"
} 2>&1 | tee "$OUT/tune_check.log"
status=${PIPESTATUS[0]}
tar -C "$OUT" -cf "$OUT/tune_check.tar" tune_check
exit "$status"
