#!/usr/bin/env bash
# usage: [TIMELINES="mixtral ..."] [TIMELINE_TOKENS="1 4096"] bash scripts/device/run_bench.sh NPROC [comet bench args...]
#   e.g. run_bench.sh 1 (one GPU: EP=1, no communication, the compute columns only),
#        run_bench.sh 2 --iters 20 --warmup 3, run_bench.sh 4 --config mixtral --tokens 4096
# comet bench on a GPU machine, from the repository root with no install: the sweep on
# NPROC GPUs (default configs and sizes unless arguments say otherwise), then a per-block
# timeline of one call of each preset in $TIMELINES (default: the four; `TIMELINES=`:
# none) at each token count in $TIMELINE_TOKENS (default: 4096; a small call's, e.g. 1,
# shows how each block's weight stream runs against the HBM floor).
# Writes under $OUT (./out if unset) bench-epN-*.json/.md/.png, bench.log and
# timelines.tar (the timelines' JSON and PNG) -- few files, as few come back from a
# device machine. Carry wheels/nvidia_cutlass-*.whl to fill the CUTLASS column (its
# headers are unzipped and the reference built once, ~2 min, before the ranks start).
set -uo pipefail
nproc="${1:?usage: run_bench.sh NPROC [comet bench args...]}"
shift
# NVLink multicast stays off: on shared GPU hosts a program using it can put the host's
# GPUs out of service for everyone.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Progress bars: a line every 30 s is enough in a log.
export TQDM_MININTERVAL=30
out="${OUT:-out}"
mkdir -p "$out"
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  wheel=$(ls wheels/nvidia_cutlass-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ] && [ -z "${COMET_CUTLASS_DIR:-}" ]; then
    hdr=$(mktemp -d)
    python3 -m zipfile -e "$wheel" "$hdr" && export COMET_CUTLASS_DIR="$hdr/cutlass_library/source"
    python3 -c 'import torch; from comet.bench.cutlass_ref import load_cutlass_grouped_mm as f; print(f(torch.device("cuda"))[1])'
  fi
  status=0
  python3 -m comet.cli.bench --nproc "$nproc" --output-dir "$out" "$@" || status=$?
  mkdir -p "$out/timelines"
  for c in ${TIMELINES-mixtral qwen2-moe phi3.5-moe deepseek-v3-like}; do
    for t in ${TIMELINE_TOKENS:-4096}; do
      python3 -m comet.cli.bench --nproc "$nproc" --timeline --config "$c" \
        --timeline-tokens "$t" --output-dir "$out/timelines" \
        || echo "timeline $c $t: not written (exit $?)"
    done
  done
  tar -C "$out" -cf "$out/timelines.tar" timelines && rm -r "$out/timelines"
  exit "$status"
} 2>&1 | tee "$out/bench.log"
