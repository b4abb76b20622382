#!/usr/bin/env bash
# Energy and cycles per call of comet's GEMMs against torch's grouped GEMMs
# (energy_probe.py), then the hardware counters behind them (gemm_traffic.py under
# Nsight Compute, where ncu is installed; ENERGY_NCU=0 skips it). One GPU, from the repo
# root on a device machine:
#   [ENERGY_NCU_ARGS="--configs mixtral --tokens 4096"] bash scripts/device/energy.sh \
#       --configs mixtral qwen2-moe --tokens 4096 --tiles num_stages=4
# Arguments go to energy_probe.py and to the ncu pass (which ignores the probe's timing
# options), then ENERGY_NCU_ARGS to the ncu pass alone.
# Writes energy_probe.json, energy.log, ncu.csv and ncu_summary.jsonl under $OUT.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
LOG="$OUT/energy.log"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv | tee "$LOG"
timeout "${ENERGY_TIMEOUT_S:-420}" python3 scripts/device/energy_probe.py "$@" 2>&1 | tee -a "$LOG"
[ "${ENERGY_NCU:-1}" = 0 ] && exit 0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then echo "ncu not found: no counters" | tee -a "$LOG"; exit 0; fi
# The probe's arguments, then ENERGY_NCU_ARGS (a later option wins): the same variants
# on fewer configs.
# shellcheck disable=SC2086  # ENERGY_NCU_ARGS is a word list
timeout "${ENERGY_NCU_TIMEOUT_S:-240}" "$NCU" --profile-from-start off --clock-control none \
    --csv --page raw --kernel-name 'regex:layer[01]_kernel|device_kernel|[Gg]emm' \
    --section SpeedOfLight --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,l1tex__t_bytes.sum,smsp__inst_executed.sum \
    python3 scripts/device/gemm_traffic.py "$@" ${ENERGY_NCU_ARGS---configs mixtral qwen2-moe --tokens 4096} \
    > "$OUT/ncu.csv" 2> >(tee -a "$LOG" >&2)
echo "ncu exit $?" | tee -a "$LOG"
python3 scripts/device/gemm_traffic.py --summarise "$OUT/ncu.csv" | tee "$OUT/ncu_summary.jsonl"
