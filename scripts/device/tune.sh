#!/usr/bin/env bash
# usage: [CONFIGS=...|SHAPES=...] [TUNE_DIR=dir] [DEADLINE_S=560] bash scripts/device/tune.sh presets|check [comet tune args...]
# comet tune on every GPU of the machine, from the repository root (no install):
#   presets  the presets in $CONFIGS (default: the four): tables for comet/configs/
#   check    the tuning check on shapes no preset has ($SHAPES, default "0 1 2": OLMoE,
#            Qwen3-30B-A3B, DBRX): `comet tune` (local search), then `comet tune --check
#            --tokens 128 3000 8192` (the table's picks, a fixed 16 and the analytic
#            model against every candidate)
# Tables (and check JSONs) go to $TUNE_DIR ($OUT/tune by default) and, since file names
# with '=' or ',' do not come back from the device machines, into $OUT/tune.tar after
# every step; the log to $OUT/tune.log. A device call is cut at 600 s: each step gets
# what is left of DEADLINE_S, and `comet tune` writes its table after every bucket, so
# a cut run still returns the buckets it finished. To resume, untar the returned tables
# into a folder of the working tree and pass it as TUNE_DIR (comet tune merges into an
# existing table), with the configs or shapes still to do.
set -uo pipefail
mode="${1:?usage: tune.sh presets|check [comet tune args...]}"
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
OUT=${OUT:-out}
dir=${TUNE_DIR:-$OUT/tune}
mkdir -p "$OUT" "$dir"
deadline=$((SECONDS + ${DEADLINE_S:-560}))
status=0

step() {   # step ARGS...: comet tune ARGS --output-dir $dir, within the deadline
  local left=$((deadline - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "no time left for: comet tune $*"; status=124; return
  fi
  timeout "$left" python3 -m comet.cli.tune "$@" --output-dir "$dir" || status=$?
  tar -C "$dir" -cf "$OUT/tune.tar" .
}

shapes=(
  "--experts 64 --topk 8 --hidden 2048 --ffn 1024"     # 0: OLMoE-1B-7B
  "--experts 128 --topk 8 --hidden 2048 --ffn 768"     # 1: Qwen3-30B-A3B
  "--experts 16 --topk 4 --hidden 6144 --ffn 10752"    # 2: DBRX
)
{
  case "$mode" in
    presets)
      for c in ${CONFIGS:-mixtral qwen2-moe phi3.5-moe deepseek-v3-like}; do
        step --config "$c" "$@"
      done ;;
    check)
      for i in ${SHAPES:-0 1 2}; do
        # shellcheck disable=SC2086  # a shape is a list of arguments
        step ${shapes[$i]} "$@"
        # shellcheck disable=SC2086
        step ${shapes[$i]} --check --tokens 128 3000 8192 "$@"
      done ;;
    *) echo "unknown mode $mode (presets or check)"; status=2 ;;
  esac
  exit "$status"
} 2>&1 | tee -a "$OUT/tune.log"
exit "${PIPESTATUS[0]}"
