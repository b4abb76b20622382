#!/usr/bin/env bash
# usage: bash scripts/device/build_peers.sh   (device call with carry [".gl/peers"])
# Makes the peers of `comet bench --peers` importable on a GPU machine that reaches no
# network, from the repository root, out of what scripts/fetch_peer_sources.sh put in the
# ignored folder .gl/peers (nothing is downloaded here):
#   1. DeepEP: unless .gl/peers/wheels holds a deep_ep wheel, builds one from
#      .gl/peers/DeepEP with nvcc -- the intranode kernels only, NVSHMEM left out (torch's
#      CUDA wheels bring NVSHMEM's, which DeepEP's setup.py would otherwise compile its
#      internode kernels against) -- into .gl/peers/wheels and $OUT. Copy it from $OUT to
#      .gl/peers/wheels on the CPU machine: later calls install it instead of building.
#   2. DeepGEMM (`--peers deepgemm`, its grouped FP8 GEMMs beside comet's FP8 layer): unless
#      .gl/peers/wheels holds a deep_gemm wheel, builds one from .gl/peers/DeepGEMM (its one
#      C++ file against torch and the CUDA toolkit; the kernels themselves are compiled at
#      run time by this machine's nvcc, against the CUTLASS headers the wheel carries), into
#      .gl/peers/wheels and $OUT, like DeepEP's.
#   3. Installs every wheel of .gl/peers/wheels (DeepEP's, DeepGEMM's, megatron-core's) into
#      this python3, without an index or dependencies, and checks that each imports.
# Logs everything to $OUT/build_peers.log ($OUT: ./out if unset). DEEPEP_BUILD_TIMEOUT_S
# [480] and DEEPGEMM_BUILD_TIMEOUT_S [300] bound the builds, so the log comes back inside a
# 10-minute device call when one of them builds (with neither wheel carried, build one per
# call: BUILD_PEERS="deepep" or "deepgemm"; default both).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out="${OUT:-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
peers="$PWD/.gl/peers"
wheels="$peers/wheels"
mkdir -p "$wheels"

# needs_build NAME KEY PATTERN: whether this call builds NAME's wheel (KEY in BUILD_PEERS,
# no carried wheel matching PATTERN, a staged source); if not, says why.
needs_build() {
  local name=$1 key=$2 pattern=$3
  echo "$name source: $(tr '\n' ' ' 2>/dev/null < "$peers/$name.commit" || echo none)"
  if [[ " ${BUILD_PEERS:-deepep deepgemm} " != *" $key "* ]]; then
    echo "$name: not built in this call (BUILD_PEERS=${BUILD_PEERS:-})"
  elif ls "$wheels"/$pattern >/dev/null 2>&1; then
    echo "$name: installing the carried $(basename "$wheels"/$pattern)"
  elif [ -f "$peers/$name/setup.py" ]; then
    return 0
  else
    echo "$name: no wheel in $wheels and no source in $peers/$name" \
         "(scripts/fetch_peer_sources.sh, then carry .gl/peers)"
  fi
  return 1
}

# build_wheel NAME PATTERN TIMEOUT_S [VAR=VALUE...] < PYTHON: in a scratch copy of NAME's
# staged source, the Python on stdin (which runs its setup.py's bdist_wheel into the folder
# it is given) with those variables, bounded; the wheel into .gl/peers/wheels and $OUT.
build_wheel() {
  local name=$1 pattern=$2 limit=$3 build w
  shift 3
  build=$(mktemp -d)
  cp -a "$peers/$name"/. "$build"/
  echo "$name: building in $build with $cuda_home, $(nproc) jobs, at ${SECONDS}s"
  (cd "$build" && env "$@" MAX_JOBS="$(nproc)" timeout "$limit" python3 - "$wheels") \
    || { status=$?; echo "$name: build failed (exit $status) at ${SECONDS}s"; }
  rm -rf "$build"
  # A local version's "+" (deep_gemm-2.5.0+local-...) would keep the file from coming back
  # from $OUT: it goes there as "_", and the install step below puts the "+" back.
  for w in "$wheels"/$pattern; do
    [ -f "$w" ] && cp "$w" "$out/$(basename "$w" | tr + _)" && echo "$name: built" \
      "$(basename "$w") ($(du -h "$w" | cut -f1)) at ${SECONDS}s; copied to \$OUT"
  done
}

{
  status=0
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  nvcc --version | tail -n 1
  # bdist_wheel: setuptools >= 70.1 has it, older ones need the wheel package.
  python3 -c 'import sys, setuptools, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "setuptools", setuptools.__version__)'
  cuda_home=$(python3 -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)')
  if needs_build DeepEP deepep 'deep_ep-*.whl'; then
    # -lcuda: the driver library may be only a stub at link time; Hopper (H100, H200) only.
    build_wheel DeepEP 'deep_ep-*.whl' "${DEEPEP_BUILD_TIMEOUT_S:-480}" \
      LIBRARY_PATH="$cuda_home/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
      TORCH_CUDA_ARCH_LIST=9.0 <<'PY'
import importlib.util
import pathlib
import re
import runpy
import sys

find_spec = importlib.util.find_spec


def without_nvshmem(name, *args, **kwargs):
    # DeepEP's setup.py compiles its internode kernels when it finds NVSHMEM's Python
    # package; hidden, it builds the intranode ones alone (-DDISABLE_NVSHMEM).
    return None if name == "nvidia.nvshmem" else find_spec(name, *args, **kwargs)


importlib.util.find_spec = without_nvshmem

# At this commit three shrink-mode methods of deep_ep.cpp call low-latency kernels outside
# the DISABLE_NVSHMEM guard their siblings have: without NVSHMEM the module then links but
# fails to import (undefined internode_ll::*_mask_buffer). Guard the calls in this build's
# copy; shrink mode needs NVSHMEM's buffers anyway, and the methods' asserts refuse it.
src = pathlib.Path("csrc/deep_ep.cpp")
text, n = re.subn(r"(internode_ll::(?:update|query|clean)_mask_buffer\([^;]*;)",
                  r"\n#ifndef DISABLE_NVSHMEM\n\1\n#endif\n", src.read_text())
src.write_text(text)
print(f"DeepEP: guarded {n} unguarded low-latency calls in csrc/deep_ep.cpp")
# Its sm_90 flags compile relocatable device code (-rdc=true) but only NVSHMEM's build adds
# the device-link step; without it the module fails to import (undefined
# __cudaRegisterLinkedBinary_*). Ask torch's BuildExtension for the plain device link.
setup = pathlib.Path("setup.py")
text, n = re.subn(r"nvcc_dlink = \[\]", "nvcc_dlink = ['-dlink']", setup.read_text())
setup.write_text(text)
print(f"DeepEP: device link step added to setup.py ({n} place)")
sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", sys.argv[1]]
runpy.run_path("setup.py", run_name="__main__")
PY
  fi
  if needs_build DeepGEMM deepgemm 'deep_gemm-*.whl'; then
    # DG_USE_LOCAL_VERSION=1 builds from source (0 would first try to download a release
    # wheel); outside a git checkout its version is <version>+local.
    build_wheel DeepGEMM 'deep_gemm-*.whl' "${DEEPGEMM_BUILD_TIMEOUT_S:-300}" \
      CUDA_HOME="$cuda_home" DG_USE_LOCAL_VERSION=1 DG_FORCE_BUILD=1 <<'PY'
import importlib.util
import pathlib
import re
import runpy
import sys
import types

import setuptools
import torch

# setup.py imports bdist_wheel from the wheel package, which setuptools >= 70.1 no longer
# needs (it has its own): lend it setuptools' where wheel is not installed.
if importlib.util.find_spec("wheel") is None:
    from setuptools.command.bdist_wheel import bdist_wheel
    shim = types.ModuleType("wheel.bdist_wheel")
    shim.bdist_wheel = bdist_wheel
    sys.modules["wheel"] = types.ModuleType("wheel")
    sys.modules["wheel.bdist_wheel"] = shim
    print("DeepGEMM: wheel not installed; setup.py gets setuptools' bdist_wheel")
# ... and packaging.version.parse, which setuptools vendors where packaging is not installed.
if importlib.util.find_spec("packaging") is None:
    import setuptools._vendor.packaging as packaging
    import setuptools._vendor.packaging.version
    sys.modules["packaging"], sys.modules["packaging.version"] = packaging, packaging.version
    print("DeepGEMM: packaging not installed; setup.py gets setuptools' vendored copy")
# Its host flags ask for C++17; torch's headers from 2.12 on refuse anything older than
# C++20 (the JIT compiles the kernels as C++20 already).
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
if (major, minor) >= (2, 12):
    setup = pathlib.Path("setup.py")
    text, n = re.subn(r"-std=c\+\+17", "-std=c++20", setup.read_text())
    setup.write_text(text)
    print(f"DeepGEMM: torch {torch.__version__} wants C++20: {n} flag changed in setup.py")
sys.path.insert(0, ".")      # setup.py imports scripts.generate_pyi from its own folder
sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", sys.argv[1]]
runpy.run_path("setup.py", run_name="__main__")
PY
  fi
  for w in "$wheels"/*_local-*.whl; do
    [ -f "$w" ] && mv "$w" "${w/_local-/+local-}"
  done
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --force-reinstall \
      "$wheels"/*.whl || status=$?
  fi
  if [ -f "$peers/DeepEP/setup.py" ] || ls "$wheels"/deep_ep-*.whl >/dev/null 2>&1; then
    python3 -c 'import deep_ep; print("deep_ep imports:", deep_ep.Buffer, "sm90:", deep_ep.Buffer.is_sm90_compiled())' \
      || { echo "deep_ep does not import"; status=1; }
  fi
  # deep_gemm's import compiles nothing; the smoke check JIT-compiles and runs one grouped
  # FP8 GEMM of each layout against the fp32 emulation (comet.bench.deepgemm).
  if [ -f "$peers/DeepGEMM/setup.py" ] || ls "$wheels"/deep_gemm-*.whl >/dev/null 2>&1; then
    CUDA_HOME="$cuda_home" PYTHONPATH=. timeout "${DEEPGEMM_SMOKE_TIMEOUT_S:-240}" python3 -m comet.bench.deepgemm \
      || { echo "DeepGEMM smoke check failed"; status=1; }
    # The SM90 FP8 Mega MoE (--peers mega-moe) is in some refs only (fetch_peer_sources.sh):
    # one small layer against the emulation of its recipe (comet.bench.mega_moe); where the
    # staged ref lacks it, it says so and the call goes on.
    CUDA_HOME="$cuda_home" PYTHONPATH=. timeout "${MEGA_MOE_SMOKE_TIMEOUT_S:-240}" \
      python3 -m comet.bench.mega_moe || echo "Mega MoE smoke check: failed or unavailable (above)"
  fi
  python3 -W ignore -c 'import megatron.core as m; from megatron.core.extensions.transformer_engine import HAVE_TE; print("megatron.core imports:", m.__version__, "Transformer Engine:", HAVE_TE)' \
    || echo "megatron.core does not import"
  exit "$status"
} 2>&1 | tee "$out/build_peers.log"
