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
#   2. Installs every wheel of .gl/peers/wheels (DeepEP's, megatron-core's) into this
#      python3, without an index or dependencies, and checks that each imports.
# Logs everything to $OUT/build_peers.log ($OUT: ./out if unset). DEEPEP_BUILD_TIMEOUT_S
# [480] bounds the build, so the log comes back inside a 10-minute device call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out="${OUT:-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
peers="$PWD/.gl/peers"
wheels="$peers/wheels"
mkdir -p "$wheels"
{
  status=0
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  nvcc --version | tail -n 1
  # bdist_wheel: setuptools >= 70.1 has it, older ones need the wheel package.
  python3 -c 'import sys, setuptools, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "setuptools", setuptools.__version__)'
  echo "DeepEP source: $(cat "$peers/DeepEP.commit" 2>/dev/null || echo none)"
  if ls "$wheels"/deep_ep-*.whl >/dev/null 2>&1; then
    echo "DeepEP: installing the carried $(basename "$wheels"/deep_ep-*.whl)"
  elif [ -f "$peers/DeepEP/setup.py" ]; then
    build=$(mktemp -d)
    cp -a "$peers/DeepEP"/. "$build"/
    cuda_home=$(python3 -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)')
    echo "DeepEP: building in $build with $cuda_home, $(nproc) jobs, at ${SECONDS}s"
    # -lcuda: the driver library may be only a stub at link time; Hopper (H100, H200) only.
    (cd "$build" && LIBRARY_PATH="$cuda_home/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}" \
      TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="$(nproc)" \
      timeout "${DEEPEP_BUILD_TIMEOUT_S:-480}" python3 - "$wheels" <<'PY'
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
    ) || { status=$?; echo "DeepEP: build failed (exit $status) at ${SECONDS}s"; }
    rm -rf "$build"
    for w in "$wheels"/deep_ep-*.whl; do
      [ -f "$w" ] && cp "$w" "$out"/ && echo "DeepEP: built $(basename "$w")" \
        "($(du -h "$w" | cut -f1)) at ${SECONDS}s; copied to \$OUT"
    done
  else
    echo "DeepEP: no wheel in $wheels and no source in $peers/DeepEP" \
         "(scripts/fetch_peer_sources.sh, then carry .gl/peers)"
  fi
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --force-reinstall \
      "$wheels"/*.whl || status=$?
  fi
  python3 -c 'import deep_ep; print("deep_ep imports:", deep_ep.Buffer, "sm90:", deep_ep.Buffer.is_sm90_compiled())' \
    || { echo "deep_ep does not import"; status=1; }
  python3 -W ignore -c 'import megatron.core as m; from megatron.core.extensions.transformer_engine import HAVE_TE; print("megatron.core imports:", m.__version__, "Transformer Engine:", HAVE_TE)' \
    || echo "megatron.core does not import"
  exit "$status"
} 2>&1 | tee "$out/build_peers.log"
