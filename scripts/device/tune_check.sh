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
OUT=${OUT:-out}
TUNE_OUT_DIR=${TUNE_DIR:-$OUT/tune_check} TUNE_TAR=$OUT/tune_check.tar
export TQDM_MININTERVAL=60
# shellcheck source=scripts/device/tune_steps.sh
source "$(dirname "$0")/tune_steps.sh"
shapes=(
  "--experts 64 --topk 8 --hidden 2048 --ffn 1024"     # 0: OLMoE-1B-7B
  "--experts 128 --topk 8 --hidden 2048 --ffn 768"     # 1: Qwen3-30B-A3B
  "--experts 16 --topk 4 --hidden 6144 --ffn 10752"    # 2: DBRX
)
{
  for i in ${SHAPES:-0 1 2}; do
    # shellcheck disable=SC2086  # a shape is a list of arguments
    tune_step ${shapes[$i]} "$@"
    # shellcheck disable=SC2086
    tune_step ${shapes[$i]} --check --tokens 128 3000 8192 "$@"
  done
  exit "$status"
} 2>&1 | tee "$OUT/tune_check.log"
exit "${PIPESTATUS[0]}"
