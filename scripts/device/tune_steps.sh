# Sourced by tune_presets.sh and tune_check.sh (not run on its own): the launcher
# environment and `tune_step`, which runs one `comet tune` within a deadline and then
# tars the table folder, so a device call cut at its limit still returns what finished.
# Needs: OUT, TUNE_OUT_DIR (tables), TUNE_TAR (the tar to write); DEADLINE_S (560).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$TUNE_OUT_DIR"
deadline=$((SECONDS + ${DEADLINE_S:-560}))
status=0

tune_step() {   # tune_step ARGS...: comet tune ARGS --output-dir TUNE_OUT_DIR
  local left=$((deadline - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "no time left for: comet tune $*"; status=124; return
  fi
  timeout "$left" python3 -m comet.cli.tune "$@" --output-dir "$TUNE_OUT_DIR" || status=$?
  tar -C "$TUNE_OUT_DIR" -cf "$TUNE_TAR" .
}
