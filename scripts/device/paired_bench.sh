#!/usr/bin/env bash
# usage: COMET_COMMIT=... bash scripts/device/paired_bench.sh BASE_DIR NPROC [comet bench args...]
# Paired sweep of two trees on one machine: BASE_DIR holds the package to compare with
# (e.g. `git archive REV comet | tar -x -C .base`, carried), this tree is the new one.
# Runs `comet bench` new, base, new (alternating, so drift over the call shows up as the
# spread of the two new runs; PAIRED_RUNS changes the list, and a run that would start
# after PAIRED_START_BEFORE_S seconds is skipped), then prints and writes the
# record-by-record ratios (comet bench --from-json NEW... --against BASE). Writes under
# $OUT (./out if unset): new-1/, base-1/, new-2/ (JSON records), paired-*.json, paired.log.
# The base runs' records name PAIRED_BASE_COMMIT as their commit (set it to the base's
# revision; COMET_COMMIT names this tree's).
set -uo pipefail
base="${1:?usage: paired_bench.sh BASE_DIR NPROC [comet bench args...]}"
nproc="${2:?usage: paired_bench.sh BASE_DIR NPROC [comet bench args...]}"
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
out="${OUT:-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
here="$PWD"
base="$(cd "$base" && pwd)"
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  for run in ${PAIRED_RUNS:-new-1 base-1 new-2}; do
    if [ "$SECONDS" -gt "${PAIRED_START_BEFORE_S:-100000}" ]; then
      echo "== $run skipped: ${SECONDS}s in"; continue
    fi
    tree="$here"; commit="${COMET_COMMIT:-}"
    if [ "${run%-*}" = base ]; then tree="$base"; commit="${PAIRED_BASE_COMMIT:-base}"; fi
    echo "== $run ($tree) at ${SECONDS}s"
    # From the tree itself: `python -m` puts the working directory first on sys.path.
    (cd "$tree" && COMET_COMMIT="$commit" PYTHONPATH="$tree" timeout "${PAIRED_RUN_TIMEOUT_S:-300}" \
      python3 -m comet.cli.bench --nproc "$nproc" --no-plot --output-dir "$out/$run" "$@" \
      | tail -n 3)
  done
  PYTHONPATH="$here" python3 -m comet.cli.bench --from-json "$out"/new-*/bench-*.json \
    --against "$out"/base-*/bench-*.json --output-dir "$out"
} 2>&1 | tee "$out/paired.log"
