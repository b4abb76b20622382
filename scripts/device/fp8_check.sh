#!/usr/bin/env bash
# usage: bash scripts/device/fp8_check.sh [diff|kernels|tests|models|example|bench|gather|ws|wsprobe|paired|trace|decode|small|rows|deepgemm] ...  (default: diff kernels tests)
# Issue 68's one-GPU checks of the fused FP8 layer, from the repo root on a device machine
# (no pip install), each step in the order given, each under its own time limit so that
# what ran comes back from one 10-minute call:
#   diff      scripts/device/fp8_layer_diff.py: the layer against its emulation and against
#             cuBLAS's FP8 tensor cores on the same recipe, value by value (~70 s)
#   kernels   the FP8 kernel tests the CI runs under the interpreter (tests/test_quant.py,
#             test_fp8_gemm.py, test_fp8_roles.py, test_fp8_layer.py) on the GPU, where the
#             FP8 values must equal torch's bit for bit (the interpreter's casts differ)
#   tests     tests/test_gpu_fp8.py (every layout, CUDA graphs, the FP8 liveness stress; ~6 min
#             now that they pass: the first 14 took 260 s on an H200, the last 3 77 s on an H100)
#   models    tests/test_gpu_fp8_models.py (FP8 transformers models at real MoE widths)
#   example   examples/fp8_experts.py on the GPU at qwen2-moe's width, 4096 tokens (its
#             fused FP8 layer on a checkpoint's tensors against the emulation; bf16 and
#             FP8 CometMoE timed) into example.log, then CometMoE's FP8 GPU tests
#             (quantize_experts frees the bf16 memory; a checkpoint loaded in place runs;
#             redundant experts before and after a rebalance)
#   bench     `comet bench --dtype bf16 fp8 --only-fused` at EP=1: the four presets and the
#             Qwen3-30B-A3B-like shape, decode and prefill, with the summary's FP8 checks
#             (FP8_PROMOTION_K=32 or 128: that promotion in every GEMM; FP8_BENCH_CONFIGS,
#             FP8_BENCH_TOKENS narrow the sweep, FP8_BENCH_QWEN3=0 leaves that shape out)
#   ws        the warp-specialized GEMM (comet.kernels.fp8_ws, Variant.fp8_ws_min_rows):
#             tests/test_gpu_fp8_ws.py; the GEMM gate probe (Mixtral-sized prefill, 8 x 2048
#             rows, N = 28672, K = 4096) on it, promoted per K step and per 32 K, beside
#             the prototype and the tl kernel; then FP8 calls without it (--tile
#             fp8_ws_min_rows=0: the tl kernels), decode and prefill, to hold against the
#             bench step's records (comet bench --from-json ... --against ...;
#             FP8_WS_CONFIGS narrows the presets)
#   wsprobe   scripts/device/fp8_ws_probe.py: layer0's warp-specialized gated GEMM alone at
#             the presets' prefill shapes (FP8_BENCH_CONFIGS, FP8_BENCH_TOKENS), beside the
#             same GEMM without its epilogue and, with FP8_WS_BASE=TREE, another checkout's
#             kernel on the same operands (its h must equal this one's byte for byte);
#             FP8_WSPROBE_ARGS adds the probe's own (--k-sweep: per-step and per-item cost)
#   paired    paired m-tiles (Variant.fp8_ws_paired_rows, off by default): their GPU tests
#             (equal bytes to the 64-row items, gated and plain, and to the unpaired
#             qwen2-moe layer; the one-rank mixtral layer on pairs against the
#             emulation), the probe's --pairs (each GEMM alone
#             beside the default on the same operands: FP8_BENCH_CONFIGS, FP8_BENCH_TOKENS
#             as for wsprobe), then FP8 calls at 4096 and 16384 tokens without and with
#             --tile fp8_ws_paired_rows=128 (paired/default/, paired/on/), compared
#             record by record (paired-vs-default.txt)
#   trace     scripts/device/fp8_ws_trace.py: clock64 stamps per item of the warp-specialized
#             GEMM (K loop, epilogue, gaps, producer lead) at the presets' 16384-token shapes,
#             gated and plain; FP8_WS_BASE=TREE traces that checkout's kernel beside,
#             FP8_TRACE_ARGS adds the script's own (--no-mma, --programs 132 66, --pairs)
#   gather    FP8 calls with layer0's gathered dispatch (--tile layer0_gather=1: a token's
#             row packed once, the GEMMs reading it through the index, the warp-specialized
#             one too since A_GATHER), compared with the bench step's records (run it
#             first; gather-vs-bench.txt; FP8_BENCH_CONFIGS, FP8_BENCH_TOKENS as there)
#   decode    small calls and their K cuts in FP8 (layer0's stream-K and tail splits,
#             layer1's K splits: on by default since 6526001): the small-call tests
#             (tests/test_gpu_fp8_ws.py::test_small_calls_with_the_defaults, and
#             tests/test_gpu_fp8.py::test_fp8_small_calls_cut_the_k_loop), then `comet
#             bench --dtype bf16 fp8 --only-fused` at 1-128 tokens on the four presets
#             (decode/) and FP8 without the cuts at 1-32 tokens (decode-uncut/, --tile
#             layer0_stream_k=0,layer0_tail_split=0,layer1_split_k=1; 128-token calls run
#             the warp-specialized GEMMs), whose fused times `comet bench --from-json ...
#             --against` compares (decode-vs-uncut.txt; FP8_BENCH_CONFIGS narrows the
#             presets, FP8_DECODE_TOKENS the sizes, FP8_UNCUT the --tile of the second run)
#   small     whether the warp-specialized GEMMs (promoted per 128 K) could take every
#             small call: scripts/device/fp8_small_accuracy.py (1-32 tokens, four presets,
#             the defaults and fp8_ws_min_rows=1 against the emulation and the bf16 layer;
#             accuracy/fp8_small_accuracy.json), then FP8 with --tile fp8_ws_min_rows=1 at
#             1-32 tokens (small-ws1/) against the decode step's default FP8 calls
#             (small-ws1-vs-default.txt; run after decode, in the same call or not)
#   rows      small calls and their m-tiles: FP8 at the default tile (rows/default/: 16-row
#             m-tiles where the Selector's small-rows rule picks them, since 9d46a23), then
#             at each --tile of FP8_ROW_TILES into rows/1/, rows/2/, ..., each compared
#             with the default (rows-N-vs-default.txt). Default: small_block_m=0 (64-row
#             tiles everywhere: the default before) and block_m=16,fp8_ws_min_rows=0 (16
#             rows on the tl kernels in every call); FP8_BENCH_CONFIGS, FP8_DECODE_TOKENS
#             as for decode (default 1 8 32)
#   deepgemm  the DeepGEMM peer (carry .gl/peers; scripts/fetch_peer_sources.sh) built,
#             then `comet bench --dtype fp8 --peers deepgemm mega-moe` (FP8_PEERS) on
#             deepseek-v3-like (FP8_BENCH_CONFIGS) at 8 128 4096 tokens (FP8_BENCH_TOKENS);
#             FP8_DEEPGEMM_QWEN3=1 adds the Qwen3-30B-A3B-like shape (deepgemm-qwen3/)
# Writes under $OUT (./out if unset): fp8_layer_diff.json, kernels/pytest.log, tests/ and models/
# (gpu_tests.log), bench/ and deepgemm/ (bench JSON and logs), fp8_check.log.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
status=0

run_tests() {   # $1: name, $2: test file, $3: seconds
  OUT="$OUT/$1" GPU_TEST_FILES="$2" GPU_TESTS_TIMEOUT_S="$3" \
    bash scripts/device/gpu_tests.sh -rA -p no:cacheprovider || status=1
  tail -n 1 "$OUT/$1/gpu_tests.log" | grep -q "exit 0" || status=1
}

bench() {   # $1: folder, then comet bench arguments
  local dir="$OUT/$1"; shift
  mkdir -p "$dir"
  timeout "${FP8_BENCH_TIMEOUT_S:-300}" python3 -m comet.cli.bench --nproc 1 --layers moe \
    --routing uniform --iters "${FP8_BENCH_ITERS:-10}" --no-plot --output-dir "$dir" \
    ${FP8_PROMOTION_K:+--fp8-promotion-k "$FP8_PROMOTION_K"} "$@" \
    > "$dir/bench.log" 2>&1 || status=1
  tail -n 25 "$dir/bench.log"
}

for step in "${@:-diff kernels tests}"; do
  for s in $step; do
    echo "== $s at ${SECONDS}s"
    case "$s" in
      diff) timeout "${FP8_DIFF_TIMEOUT_S:-120}" python3 scripts/device/fp8_layer_diff.py \
              --output "$OUT/fp8_layer_diff.json" || status=1 ;;
      kernels) mkdir -p "$OUT/kernels"
               timeout "${FP8_KERNELS_TIMEOUT_S:-200}" python3 -m pytest -q -rA -p no:cacheprovider \
                 tests/test_quant.py tests/test_fp8_gemm.py tests/test_fp8_roles.py \
                 tests/test_fp8_layer.py > "$OUT/kernels/pytest.log" 2>&1 || status=1
               tail -n 15 "$OUT/kernels/pytest.log" ;;
      tests) run_tests tests tests/test_gpu_fp8.py "${FP8_TESTS_TIMEOUT_S:-400}" ;;
      models) run_tests models tests/test_gpu_fp8_models.py "${FP8_MODELS_TIMEOUT_S:-200}" ;;
      example) timeout "${FP8_EXAMPLE_TIMEOUT_S:-120}" python3 examples/fp8_experts.py \
                 --device cuda --experts 60 --top-k 4 --hidden 2048 --ffn 1408 \
                 --tokens 4096 > "$OUT/example.log" 2>&1 || status=1
               cat "$OUT/example.log"
               run_tests cometmoe "tests/test_gpu_fp8.py::test_comet_moe_quantize_experts_on_cuda
                 tests/test_gpu_fp8.py::test_comet_moe_fp8_with_redundant_experts_on_cuda" \
                 "${FP8_EXAMPLE_TIMEOUT_S:-150}" ;;
      bench) bench bench --dtype bf16 fp8 --only-fused \
               --config ${FP8_BENCH_CONFIGS:-mixtral qwen2-moe phi3.5-moe deepseek-v3-like} \
               --tokens ${FP8_BENCH_TOKENS:-1 8 32 128 4096 16384}
             [ "${FP8_BENCH_QWEN3:-1}" = 1 ] && bench bench-qwen3 --dtype bf16 fp8 --only-fused \
               --experts 128 --topk 8 --hidden 2048 --ffn 768 \
               --tokens ${FP8_BENCH_TOKENS:-1 8 32 128 4096 16384} ;;
      ws) run_tests ws tests/test_gpu_fp8_ws.py "${FP8_WS_TIMEOUT_S:-300}"
          mkdir -p "$OUT/ws"
          OUT="$OUT/ws" timeout 200 python3 scripts/device/fp8_gemm_probe.py --budget-s 150 \
            --variants comet-ws,comet-ws-k32,gluon-ws-stages4,tl-64x128x128-w4-s4 \
            --decode-variants comet-ws,comet-ws-k32 > "$OUT/ws/probe.log" 2>&1 || status=1
          tail -n 12 "$OUT/ws/probe.log"
          bench bench-tl --dtype fp8 --only-fused --tile fp8_ws_min_rows=0 \
            --config ${FP8_WS_CONFIGS:-mixtral deepseek-v3-like} --tokens 8 128 4096 16384 ;;
      gather) FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-10} bench gather --dtype fp8 --only-fused \
                --tile layer0_gather=1 \
                --config ${FP8_BENCH_CONFIGS:-qwen2-moe deepseek-v3-like mixtral phi3.5-moe} \
                --tokens ${FP8_BENCH_TOKENS:-8 128 4096 16384}
              python3 -m comet.cli.bench --from-json "$OUT"/gather/*.json \
                --against "$OUT"/bench/*.json > "$OUT/gather-vs-bench.txt" 2>&1 || status=1
              cat "$OUT/gather-vs-bench.txt" ;;
      wsprobe) mkdir -p "$OUT/wsprobe"
               OUT="$OUT/wsprobe" timeout "${FP8_WSPROBE_TIMEOUT_S:-300}" python3 \
                 scripts/device/fp8_ws_probe.py ${FP8_WS_BASE:+--base "$FP8_WS_BASE"} \
                 ${FP8_BENCH_CONFIGS:+--configs $FP8_BENCH_CONFIGS} \
                 ${FP8_BENCH_TOKENS:+--tokens $FP8_BENCH_TOKENS} ${FP8_WSPROBE_ARGS:-} \
                 > "$OUT/wsprobe/probe.log" 2>&1 || status=1
               tail -n 18 "$OUT/wsprobe/probe.log" ;;
      paired) run_tests paired-tests "tests/test_gpu_fp8_ws.py::test_paired_m_tiles_give_the_default_bytes
                tests/test_gpu_fp8_ws.py::test_paired_m_tiles_give_the_unpaired_layers_bytes
                tests/test_gpu_fp8_ws.py::test_a_one_rank_fp8_layer_runs_large_calls_warp_specialized[mixtral-False-True]" \
                "${FP8_PAIRED_TIMEOUT_S:-200}"
              mkdir -p "$OUT/wsprobe"
              OUT="$OUT/wsprobe" timeout "${FP8_WSPROBE_TIMEOUT_S:-150}" python3 \
                scripts/device/fp8_ws_probe.py --no-gather --pairs \
                ${FP8_BENCH_CONFIGS:+--configs $FP8_BENCH_CONFIGS} \
                --tokens ${FP8_BENCH_TOKENS:-16384} > "$OUT/wsprobe/probe.log" 2>&1 || status=1
              tail -n 24 "$OUT/wsprobe/probe.log"
              presets="${FP8_BENCH_CONFIGS:-qwen2-moe phi3.5-moe deepseek-v3-like mixtral}"
              bench paired/default --dtype fp8 --only-fused --config $presets \
                --tokens 16384 4096
              bench paired/on --dtype fp8 --only-fused --config $presets --tokens 16384 4096 \
                --tile fp8_ws_paired_rows=128
              python3 -m comet.cli.bench --from-json "$OUT"/paired/on/*.json \
                --against "$OUT"/paired/default/*.json > "$OUT/paired-vs-default.txt" 2>&1 \
                || status=1
              cat "$OUT/paired-vs-default.txt" ;;
      trace) mkdir -p "$OUT/trace"
             OUT="$OUT/trace" timeout "${FP8_TRACE_TIMEOUT_S:-120}" python3 \
               scripts/device/fp8_ws_trace.py ${FP8_WS_BASE:+--base "$FP8_WS_BASE"} \
               ${FP8_BENCH_CONFIGS:+--configs $FP8_BENCH_CONFIGS} ${FP8_TRACE_ARGS:-} \
               > "$OUT/trace/trace.log" 2>&1 \
               || status=1
             tail -n 8 "$OUT/trace/trace.log" ;;
      decode) run_tests small "tests/test_gpu_fp8_ws.py::test_small_calls_with_the_defaults
                tests/test_gpu_fp8.py::test_fp8_small_calls_cut_the_k_loop" \
                "${FP8_SMALL_TIMEOUT_S:-300}"
              presets="${FP8_BENCH_CONFIGS:-mixtral qwen2-moe deepseek-v3-like phi3.5-moe}"
              FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-20} bench decode --dtype bf16 fp8 \
                --only-fused --config $presets --tokens ${FP8_DECODE_TOKENS:-1 8 32 128}
              FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-20} bench decode-uncut --dtype fp8 \
                --only-fused --config $presets --tokens ${FP8_DECODE_TOKENS:-1 8 32} \
                --tile "${FP8_UNCUT:-layer0_stream_k=0,layer0_tail_split=0,layer1_split_k=1}"
              python3 -m comet.cli.bench --from-json "$OUT"/decode/*.json \
                --against "$OUT"/decode-uncut/*.json > "$OUT/decode-vs-uncut.txt" 2>&1 \
                || status=1
              cat "$OUT/decode-vs-uncut.txt" ;;
      small) mkdir -p "$OUT/accuracy"
             PYTHONPATH=.:tests timeout "${FP8_SMALL_ACC_TIMEOUT_S:-240}" python3 \
               scripts/device/fp8_small_accuracy.py --output "$OUT/accuracy/fp8_small_accuracy.json" \
               > "$OUT/accuracy/accuracy.log" 2>&1 || status=1
             tail -n 12 "$OUT/accuracy/accuracy.log"
             FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-20} bench small-ws1 --dtype fp8 \
               --only-fused --tile fp8_ws_min_rows=1 \
               --config ${FP8_BENCH_CONFIGS:-mixtral qwen2-moe deepseek-v3-like phi3.5-moe} \
               --tokens ${FP8_DECODE_TOKENS:-1 8 32}
             if ls "$OUT"/decode/*.json > /dev/null 2>&1; then
               python3 -m comet.cli.bench --from-json "$OUT"/small-ws1/*.json \
                 --against "$OUT"/decode/*.json > "$OUT/small-ws1-vs-default.txt" 2>&1 \
                 || status=1
               cat "$OUT/small-ws1-vs-default.txt"
             fi ;;
      rows) presets="${FP8_BENCH_CONFIGS:-mixtral qwen2-moe deepseek-v3-like phi3.5-moe}"
            FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-20} bench rows/default --dtype fp8 --only-fused \
              --config $presets --tokens ${FP8_DECODE_TOKENS:-1 8 32}
            i=0
            for tile in ${FP8_ROW_TILES:-small_block_m=0 block_m=16,fp8_ws_min_rows=0}; do
              i=$((i + 1))
              FP8_BENCH_ITERS=${FP8_BENCH_ITERS:-20} bench "rows/$i" --dtype fp8 --only-fused \
                --config $presets --tokens ${FP8_DECODE_TOKENS:-1 8 32} --tile "$tile"
              { echo "--tile $tile"; python3 -m comet.cli.bench --from-json "$OUT/rows/$i"/*.json \
                  --against "$OUT"/rows/default/*.json; } > "$OUT/rows-$i-vs-default.txt" 2>&1 \
                || status=1
              cat "$OUT/rows-$i-vs-default.txt"
            done ;;
      deepgemm) BUILD_PEERS=deepgemm bash scripts/device/build_peers.sh || status=1
                bench deepgemm --dtype fp8 --peers ${FP8_PEERS:-deepgemm mega-moe} \
                  --config ${FP8_BENCH_CONFIGS:-deepseek-v3-like} \
                  --tokens ${FP8_BENCH_TOKENS:-8 128 4096}
                [ "${FP8_DEEPGEMM_QWEN3:-0}" = 1 ] && bench deepgemm-qwen3 --dtype fp8 \
                  --peers ${FP8_PEERS:-deepgemm mega-moe} --experts 128 --topk 8 \
                  --hidden 2048 --ffn 768 --tokens ${FP8_BENCH_TOKENS:-8 128 4096} ;;
      *) echo "unknown step $s (diff|kernels|tests|models|example|bench|gather|ws|wsprobe|paired|trace|decode|small|rows|deepgemm)"; exit 2 ;;
    esac
  done
done
echo "fp8_check $*: exit $status" | tee -a "$OUT/fp8_check.log"
exit $status
