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
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
dir=${TUNE_DIR:-$OUT/tune}
mkdir -p "$OUT" "$dir"
deadline=$((SECONDS + ${DEADLINE_S:-560}))
status=0
for c in ${CONFIGS:-mixtral qwen2-moe phi3.5-moe deepseek-v3-like}; do
  left=$((deadline - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "tune_presets: no time left for $c" | tee -a "$OUT/tune.log"; status=124; break
  fi
  timeout "$left" python3 -m comet.cli.tune --config "$c" --output-dir "$dir" "$@" 2>&1 \
    | tee -a "$OUT/tune.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && status=$rc
  tar -C "$dir" -cf "$OUT/tune.tar" .
done
exit "$status"
