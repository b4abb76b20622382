#!/usr/bin/env bash
# comet bench on the 4x H200 machine (nvidia-h200-x4): EP=4. Run from the repository root;
# extra arguments go to `comet bench` (e.g. --config mixtral --tokens 4096).
exec "$(dirname "$0")/run_bench.sh" 4 "$@"
