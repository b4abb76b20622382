#!/usr/bin/env bash
# usage: COMET_COMMIT=... bash scripts/device/paired_bench.sh BASE_DIR NPROC [comet bench args...]
# Paired sweep of two trees on one machine: BASE_DIR holds the package to compare with
# (e.g. `git archive REV comet | tar -x -C .base`, carried), this tree is the new one.
# Runs `comet bench` new, base, new (alternating, so drift over the call shows up as the
# spread of the two new runs), then prints and writes the record-by-record ratios
# (comet bench --from-json NEW... --against BASE). Writes under $OUT (./out if unset):
# new-1/, base-1/, new-2/ (JSON records), paired-*.json, paired.log.
set -uo pipefail
base="${1:?usage: paired_bench.sh BASE_DIR NPROC [comet bench args...]}"
nproc="${2:?usage: paired_bench.sh BASE_DIR NPROC [comet bench args...]}"
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
out="${OUT:-out}"
mkdir -p "$out"
here="$PWD"
base="$(cd "$base" && pwd)"
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  for run in new-1 base-1 new-2; do
    tree="$here"; [ "${run%-*}" = base ] && tree="$base"
    echo "== $run ($tree)"
    PYTHONPATH="$tree" timeout "${PAIRED_RUN_TIMEOUT_S:-300}" python3 -m comet.cli.bench \
      --nproc "$nproc" --no-plot --output-dir "$out/$run" "$@" | tail -n 3
  done
  PYTHONPATH="$here" python3 -m comet.cli.bench --from-json "$out"/new-*/bench-*.json \
    --against "$out"/base-*/bench-*.json --output-dir "$out"
} 2>&1 | tee "$out/paired.log"
