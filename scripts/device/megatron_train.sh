#!/usr/bin/env bash
# usage: [MEGATRON_WHEELS=.whl] [COMET_COMMIT=sha] bash scripts/device/megatron_train.sh [megatron_train.py args]
# Trains a small GPT with MoE layers at real widths in Megatron-Core three ways (Megatron's
# SequentialMLP, its grouped experts, comet's CometMoELayer) from the same weights and
# batches, one GPU (scripts/device/megatron_train.py). The device image has no
# megatron-core: its wheel (cp312, pure Python apart from one helper; its dependencies
# torch, numpy, packaging are there) is carried in MEGATRON_WHEELS (default .whl, an
# ignored folder named in the device call's carry) and installed into /tmp/site, no index,
# no dependencies. Writes $OUT/megatron_train.{json,png,log} (./out if OUT is unset).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
WHEELS=${MEGATRON_WHEELS:-.whl}
LOG="$OUT/megatron_train.log"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHEELS"/megatron_core-*.whl || { echo "no megatron-core wheel in $WHEELS"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOG"
python3 -W ignore -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)" | tee -a "$LOG"
timeout "${MEGATRON_TRAIN_TIMEOUT_S:-560}" python3 scripts/device/megatron_train.py \
    --json "$OUT/megatron_train.json" --plot "$OUT/megatron_train.png" "$@" 2>&1 | tee -a "$LOG"
echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
