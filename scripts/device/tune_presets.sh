#!/usr/bin/env bash
# comet tune for the four presets on every GPU of the machine, from the repository root:
#   bash scripts/device/tune_presets.sh [comet tune args...]
# Tables go to $OUT/tune (./out/tune if unset) and, since file names with '=' or ','
# do not come back from the device machines, also into $OUT/tune.tar.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT/tune"
status=0
for c in mixtral qwen2-moe phi3.5-moe deepseek-v3-like; do
  python3 -m comet.cli.tune --config "$c" --output-dir "$OUT/tune" "$@" 2>&1 \
    | tee -a "$OUT/tune.log" || status=$?
done
tar -C "$OUT" -cf "$OUT/tune.tar" tune
exit "$status"
