#!/usr/bin/env bash
# comet bench on one GPU (nvidia-h100-x1 or nvidia-h200): EP=1, every expert local, so no
# communication; it measures comet's compute role against torch's grouped GEMM. Run from
# the repository root; extra arguments go to `comet bench`.
exec "$(dirname "$0")/run_bench.sh" 1 "$@"
