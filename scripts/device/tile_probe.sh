#!/usr/bin/env bash
# usage: [NPROC=1] VARIANTS="default block_n0=64 num_stages=4,block_n1=128" NAME=tp-qwen2 \
#        bash scripts/device/tile_probe.sh [comet bench args...]
# The same comet bench cases once per TileConfig variant (`--tile FIELD=V,...`; "default":
# the layer's own tile; "lead_us=N": the default tile, whole calls issued ahead with
# `--lead-us N`), one rank (NPROC=2: two, expert-parallel), from the repository root with no install: which tile
# fields pay for a shape before any default changes. Writes $OUT/NAME-<variant>.json/.md
# (the variant's "=" as "-" and "," as "+": device machines return plain names only),
# $OUT/NAME.log, and $OUT/NAME-summary.txt (per variant and record: fused, compute-only,
# torch GEMM, and each layer's comet GEMM time over torch's; then every variant's whole
# call over the first variant's, record by record). ROUNDS=N runs the variants N times in
# turn (A B A B ...: a drift of the machine over the call shows as spread, not as a
# difference), writing NAME-<variant>-round<i>.json; the summary then gives the median
# ratio over the rounds with its range -- what small calls, whose whole-call times swing
# by tens of microseconds between runs, need before a lever is judged.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
out="${OUT:-out}"; name="${NAME:-tile-probe}"
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  rounds=${ROUNDS:-1}
  for round in $(seq 1 "$rounds"); do
  for v in ${VARIANTS:-default}; do
    dir=$(mktemp -d)
    # "lead_us=N" is no tile field: it times the whole calls issued ahead (--lead-us N)
    case "$v" in
      default)   tile=() ;;
      lead_us=*) tile=(--lead-us "${v#lead_us=}") ;;
      *)         tile=(--tile "$v") ;;
    esac
    tag=$(echo "$v" | tr '=,' '-+')
    [ "$rounds" -gt 1 ] && tag="$tag-round$round"
    echo "== $v (round $round of $rounds)"
    # The first run of a fresh machine compiles every kernel: it gets twice the limit
    # (PROBE_FIRST_TIMEOUT_S) so that the first variant's first round is not cut short.
    limit=${PROBE_TIMEOUT_S:-240}
    [ -z "${probe_warm:-}" ] && limit=${PROBE_FIRST_TIMEOUT_S:-$((2 * limit))}
    probe_warm=1
    timeout "$limit" python3 -m comet.cli.bench --nproc "${NPROC:-1}" --no-plot \
      --output-dir "$dir" "${tile[@]}" "$@" > "$dir/run.log" 2>&1 || echo "variant $v: exit $?"
    tail -n 3 "$dir/run.log"
    for f in "$dir"/bench-*.json; do [ -f "$f" ] && cp "$f" "$out/$name-$tag.json"; done
    for f in "$dir"/bench-*.md; do [ -f "$f" ] && cp "$f" "$out/$name-$tag.md"; done
    rm -rf "$dir"
  done
  done
  first=$(set -- ${VARIANTS:-default}; echo "$1" | tr '=,' '-+')
  python3 scripts/device/probe_summary.py "$out" "$name" "$first" | tee "$out/$name-summary.txt"
} 2>&1 | tee "$out/$name.log"
