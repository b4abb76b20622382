#!/usr/bin/env bash
# comet tune for the presets on every GPU of the machine, from the repository root:
#   [CONFIGS="mixtral qwen2-moe"] [TUNE_DIR=dir] [DEADLINE_S=560] \
#     bash scripts/device/tune_presets.sh [comet tune args...]
# Tables go to $TUNE_DIR ($OUT/tune by default) and, since file names with '=' or ','
# do not come back from the device machines, into $OUT/tune.tar after every preset.
# A device call is cut at 600 s: each preset gets what is left of DEADLINE_S, and
# `comet tune` writes its table after every bucket, so a cut run still returns the
# buckets it finished. To resume, untar the returned tables into a folder of the working
# tree and pass it as TUNE_DIR (comet tune merges into an existing table).
OUT=${OUT:-out}
TUNE_OUT_DIR=${TUNE_DIR:-$OUT/tune} TUNE_TAR=$OUT/tune.tar
export TQDM_MININTERVAL=30
# shellcheck source=scripts/device/tune_steps.sh
source "$(dirname "$0")/tune_steps.sh"
{
  for c in ${CONFIGS:-mixtral qwen2-moe phi3.5-moe deepseek-v3-like}; do
    tune_step --config "$c" "$@"
  done
  exit "$status"
} 2>&1 | tee -a "$OUT/tune.log"
exit "${PIPESTATUS[0]}"
