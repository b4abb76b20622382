#!/usr/bin/env bash
# The tuning issue's check on shapes no preset has, on every GPU of the machine:
#   [SHAPES="0 1 2"] [TUNE_DIR=dir] [DEADLINE_S=560] \
#     bash scripts/device/tune_check.sh [comet tune args, e.g. --iters 5]
# Per shape: `comet tune` (local search, default buckets 1..16384), then `comet tune
# --check --tokens 128 3000 8192` (the table's picks, a fixed 16 and the analytic model
# against every candidate). Writes $OUT/tune_check.log and, since file names with '=' or
# ',' do not come back from the device machines, the tables and check JSONs in
# $OUT/tune_check.tar after every step. A device call is cut at 600 s: each step gets
# what is left of DEADLINE_S; to go on in the next call, untar the returned folder into
# the working tree, pass it as TUNE_DIR and the shapes still to do as SHAPES (the
# tables resume bucket by bucket).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=60
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
dir=${TUNE_DIR:-$OUT/tune_check}
mkdir -p "$OUT" "$dir"
shapes=(
  "--experts 64 --topk 8 --hidden 2048 --ffn 1024"     # 0: OLMoE-1B-7B
  "--experts 128 --topk 8 --hidden 2048 --ffn 768"     # 1: Qwen3-30B-A3B
  "--experts 16 --topk 4 --hidden 6144 --ffn 10752"    # 2: DBRX
)
deadline=$((SECONDS + ${DEADLINE_S:-560}))
status=0
step() {   # one comet tune command within the deadline, then the tar
  local left=$((deadline - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "tune_check: no time left for: $*"; status=124; return
  fi
  timeout "$left" python3 -m comet.cli.tune "$@" --output-dir "$dir" || status=$?
  tar -C "$dir" -cf "$OUT/tune_check.tar" .
}
{
  for i in ${SHAPES:-0 1 2}; do
    # shellcheck disable=SC2086  # a shape is a list of arguments
    step ${shapes[$i]} "$@"
    # shellcheck disable=SC2086
    step ${shapes[$i]} --check --tokens 128 3000 8192 "$@"
  done
  exit "$status"
} 2>&1 | tee "$OUT/tune_check.log"
exit "${PIPESTATUS[0]}"
