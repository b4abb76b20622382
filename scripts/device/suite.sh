#!/usr/bin/env bash
# usage: COMET_COMMIT=$(git rev-parse --short HEAD) SUITE_DIR=/tmp/suite [STEPS="stress bench ..."] bash scripts/device/suite.sh
# One GPU: STEPS="tile_probe gpu_liveness gpu_tests" with VARIANTS, PROBE_NAME, PROBE_ARGS and
# GPU_TESTS_K (a pytest -k filter for the liveness file, which outlasts one step whole).
# Two GPUs, the open layout and small-call work in the order it closes it (~32 min on 2x
# H100-class GPUs by the steps' past times: more than one session's device time, so two
# leases): STEPS="small_calls large_calls stress" (issue 41's sweep and liveness), then
# STEPS="tp_stress tp_benches models_tp" with TP_STRESS_LAYOUTS="2:sequence 2:replicated"
# TP_LAYOUTS="2:sequence 2:replicated" (the (2,1) layout in both conventions).
# Every multi-GPU run of a machine in one go, for a machine lent for the first time in a
# while (e.g. four GPUs): the steps below in order, each under its own time limit, each
# writing under $SUITE_DIR/<step>/ as soon as it ends. The whole suite outlasts one
# device call (10 min), so start it detached and collect what it wrote with later calls:
#   call 1:  cp -r . /tmp/comet && cd /tmp/comet && mkdir -p /tmp/suite &&
#            setsid nohup bash scripts/device/suite.sh >/tmp/suite/suite.log 2>&1 &
#   call n:  sleep 500; tar -C /tmp/suite -cf $OUT/suite.tar .; tail -20 /tmp/suite/suite.log
# (the copy: a later call re-sends the working tree, which must not change under a running
# step). $SUITE_DIR/steps.log has each step's start, end and exit status. On 4x H200
# (2026-11-26, 55f873b) stress to tune_check took 22 min; three of the four TP benches
# needed more than the 130 s they had there (a cut bench keeps its finished cases in
# bench-*.partial.json). On 4x H100 (2026-11-26, 7dc6294) stress 83 s, bench 191 s, the
# three TP benches 141 / 221 / 118 s (the last cut by the baseline's OOM).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
W=$(nvidia-smi --list-gpus | wc -l)
DIR=${SUITE_DIR:-/tmp/suite}
mkdir -p "$DIR"

# step NAME LIMIT_S COMMAND...: COMMAND with OUT=$DIR/NAME, cut after LIMIT_S seconds.
step() {
  local name=$1 limit=$2; shift 2
  mkdir -p "$DIR/$name"
  echo "$(date -u +%T) start $name (limit ${limit}s): $*" | tee -a "$DIR/steps.log"
  OUT="$DIR/$name" timeout -k 10 "$limit" "$@" >"$DIR/$name/step.log" 2>&1
  echo "$(date -u +%T) end $name: exit $?" | tee -a "$DIR/steps.log"
}

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >"$DIR/gpus.csv"
for s in ${STEPS:-stress bench multigpu tune hybrid train tune_check hybrid_other}; do
  case "$s" in
    stress)     step stress 260 env STRESS_TIMEOUT_S=250 bash scripts/device/stress.sh ;;
    bench)      step bench 420 env TIMELINES="mixtral qwen2-moe" bash scripts/device/run_bench.sh "$W" \
                  --iters 10 --warmup 3 --fixed-splits 0 8 16 32 ;;
    multigpu)   step multigpu 360 bash scripts/device/multigpu_check.sh "$W" --quick --calls 100 ;;
    tune)       step tune 280 env DEADLINE_S=270 bash scripts/device/tune.sh presets --iters 5 --warmup 2 ;;
    hybrid)     # (2, W/2) in the sequence convention, then (W, 1) replicated
                step hybrid-tp2 440 env TP=2 CONVENTION=sequence BENCH_TIMEOUT_S=300 STRESS_TIMEOUT_S=120 \
                  bash scripts/device/tensor_parallel.sh --tokens 128 4096 16384
                step "hybrid-tp$W" 440 env TP="$W" CONVENTION=replicated BENCH_TIMEOUT_S=300 STRESS_TIMEOUT_S=120 \
                  bash scripts/device/tensor_parallel.sh --tokens 128 4096 16384 ;;
    train)      step train 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$W" \
                  scripts/device/train_step_ep.py --tokens 4096 16384 --rounds 10 --json "$DIR/train/train_step_ep$W.json" ;;
    tune_check) step tune_check 260 env DEADLINE_S=250 bash scripts/device/tune.sh check --iters 5 --warmup 2 ;;
    hybrid_other)
                step hybrid-tp2-replicated 440 env TP=2 CONVENTION=replicated BENCH_TIMEOUT_S=300 STRESS_TIMEOUT_S=120 \
                  bash scripts/device/tensor_parallel.sh --tokens 128 4096 16384
                step "hybrid-tp$W-sequence" 440 env TP="$W" CONVENTION=sequence BENCH_TIMEOUT_S=300 STRESS_TIMEOUT_S=120 \
                  bash scripts/device/tensor_parallel.sh --tokens 128 4096 16384 ;;
    small_calls) # issue 41's small-call sweep: 1-128 tokens per rank issued ahead, both routings,
                # fused against 1.2x the HBM floor + 30 us (the report's line), no timelines
                step small_calls 300 env TIMELINES= bash scripts/device/run_bench.sh "$W" --no-plot \
                  --tokens 1 8 32 128 --layers moe --lead-us 500 ;;
    large_calls) # issue 41's large-call sweep: 4096 / 16384 tokens per rank, both routings
                step large_calls 300 env TIMELINES= bash scripts/device/run_bench.sh "$W" --no-plot \
                  --tokens 4096 16384 --layers moe ;;
    models_tp)  # the five families patched at (2, W/2) in each convention against unpatched
                for c in ${MODELS_TP_CONVENTIONS:-sequence replicated}; do
                  step "models-tp2-$c" 200 python3 -m torch.distributed.run --standalone \
                    --nproc-per-node "$W" scripts/device/models_check.py --tp 2 --convention "$c" \
                    --json "$DIR/models-tp2-$c/models_check.json"
                done ;;
    tp_benches) # the TP benches alone (TP_LAYOUTS: "tp:convention ..."; TP_BENCH_ARGS: the
                # bench's cases, e.g. "--config deepseek-v3-like --tokens 16384" for one case;
                # "tp:convention:ranks" runs on that many GPUs, e.g. "2:sequence:2" for the
                # (2, 1) layout on a four-GPU machine)
                for lc in ${TP_LAYOUTS:-2:sequence $W:replicated $W:sequence}; do
                  IFS=: read -r t c n <<<"$lc"; n=${n:-$W}
                  step "tp-bench-w$n-tp$t-$c" 330 env NPROC="$n" TP="$t" CONVENTION="$c" STRESS=0 \
                    BENCH_TIMEOUT_S=320 bash scripts/device/tensor_parallel.sh \
                    ${TP_BENCH_ARGS:---tokens 128 4096 16384}
                done ;;
    tp_reduce)  # layer1's column reduce (one summed row per token and rank of the group)
                # against the scatter (a row per slot) at tp = 2 and W, in each convention of
                # TP_REDUCE_CONVENTIONS (default: replicated; TP_REDUCE_ROUTING: uniform;
                # TP_REDUCE_TIMEOUT_S: per variant, 200), paired in one call, both named
                # (the default differs by layout: strategies.scatter_pays)
                for c in ${TP_REDUCE_CONVENTIONS:-replicated}; do
                  for t in $(printf '%s\n' 2 "$W" | sort -un); do
                    step "tp-reduce-tp$t-$c" $((2 * ${TP_REDUCE_TIMEOUT_S:-200} + 20)) \
                      env NPROC="$W" NAME="tp-reduce-tp$t-$c" \
                      PROBE_TIMEOUT_S="${TP_REDUCE_TIMEOUT_S:-200}" VARIANTS="layer1_scatter=1 layer1_scatter=0" \
                      bash scripts/device/tile_probe.sh --tp "$t" --convention "$c" \
                      --tokens 128 4096 16384 --layers moe --routing ${TP_REDUCE_ROUTING:-uniform}
                  done
                done ;;
    tp_stress)  # the liveness stress alone in TP layouts (TP_STRESS_LAYOUTS: "tp:convention ...")
                for lc in ${TP_STRESS_LAYOUTS:-$W:replicated 2:sequence}; do
                  IFS=: read -r t c <<<"$lc"
                  step "stress-tp$t-$c" 200 env STRESS_TIMEOUT_S=190 STRESS_NAME="tp$t-$c" \
                    bash scripts/device/stress.sh --tp "$t" --convention "$c"
                done ;;
    paired)     # this tree against PAIRED_BASE (a package tree, e.g. `git archive REV comet`),
                # comet bench with PAIRED_ARGS, runs new, base, new (scripts/device/paired_bench.sh)
                step paired 600 env PAIRED_RUN_TIMEOUT_S=180 bash scripts/device/paired_bench.sh \
                  "${PAIRED_BASE:?PAIRED_BASE: the tree to compare with}" "$W" ${PAIRED_ARGS:-} ;;
    # one-GPU steps: a kernel change's regression check and the small-call tile probe
    gpu_liveness) step gpu_liveness 560 env GPU_TEST_FILES=tests/test_gpu_liveness.py GPU_TESTS_TIMEOUT_S=550 \
                  bash scripts/device/gpu_tests.sh ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ;;
    gpu_tests)  step gpu_tests 560 env GPU_TEST_FILES=tests/test_gpu.py GPU_TESTS_TIMEOUT_S=550 \
                  bash scripts/device/gpu_tests.sh ;;
    tile_probe) step "probe-${PROBE_NAME:-probe}" 900 env NAME="${PROBE_NAME:-probe}" PROBE_TIMEOUT_S=280 \
                  bash scripts/device/tile_probe.sh ${PROBE_ARGS:---config mixtral --tokens 1 8} ;;
    *) echo "unknown step $s" | tee -a "$DIR/steps.log" ;;
  esac
done
echo "$(date -u +%T) suite done" | tee -a "$DIR/steps.log"
