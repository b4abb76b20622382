#!/usr/bin/env bash
# usage: bash scripts/fetch_peer_sources.sh DEEPEP_GIT [REF]
#   DEEPEP_GIT: a git directory of DeepEP (a bare mirror or a checkout) or a plain source tree
#   REF: the commit to take (default: DEEPEP_REF below; ignored for a plain tree)
# On a machine with the sources (and, for megatron-core, a package index), from the
# repository root: fills the ignored folder .gl/peers that scripts/device/build_peers.sh
# builds and installs from on a GPU machine, which reaches no network. Carry .gl/peers to
# the device call (about 3 MiB):
#   .gl/peers/DeepEP/         DeepEP's source at REF (without its figures), and
#   .gl/peers/DeepEP.commit   the commit it is;
#   .gl/peers/wheels/         megatron-core's wheel for the device's Python (pure Python but
#                             for its dataset helpers, so built per CPython version):
#                             MEGATRON_CORE_VERSION, PEER_PYTHON (env; defaults below).
# DEEPEP_REF is the last commit of DeepEP's v1 API (deep_ep.Buffer: get_dispatch_layout,
# dispatch, combine), whose setup.py builds the intranode kernels alone when NVSHMEM is
# absent; the EPv2 release after it always compiles NVSHMEM and NCCL in and needs the fmt
# submodule.
set -euo pipefail
DEEPEP_REF=567632dd59810d77b3cc05553df953cc0f779799
src="${1:?usage: fetch_peer_sources.sh DEEPEP_GIT [REF]}"
ref="${2:-$DEEPEP_REF}"
megatron="${MEGATRON_CORE_VERSION:-0.19.2}"
python="${PEER_PYTHON:-3.12}"

[ -f comet/bench/peers.py ] || { echo "run from the comet repository root" >&2; exit 2; }
git check-ignore -q .gl/peers || { echo ".gl/ must be ignored by git (.gitignore)" >&2; exit 2; }
dst=.gl/peers
rm -rf "$dst/DeepEP" "$dst/DeepEP.commit"
mkdir -p "$dst/DeepEP" "$dst/wheels"

if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  commit=$(git -C "$src" rev-parse --verify "$ref^{commit}")
  git -C "$src" archive --format=tar "$commit" -- . ':(exclude)figures' | tar -x -C "$dst/DeepEP"
  echo "$commit" > "$dst/DeepEP.commit"
  echo "DeepEP $commit ($(git -C "$src" log -1 --format='%ci %s' "$commit")) -> $dst/DeepEP"
else
  cp -a "$src"/. "$dst/DeepEP"/
  rm -rf "$dst/DeepEP/.git" "$dst/DeepEP/figures"
  echo "unknown (plain tree: $src)" > "$dst/DeepEP.commit"
  echo "DeepEP from the plain tree $src -> $dst/DeepEP"
fi
[ -f "$dst/DeepEP/setup.py" ] || { echo "no setup.py in $src at $ref" >&2; exit 1; }

# The device machine runs x86-64 Linux; its wheel tags are manylinux.
if python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$python" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dst/wheels" "megatron-core==$megatron"; then
  echo "megatron-core $megatron (CPython $python) -> $dst/wheels"
else
  echo "note: no megatron-core wheel: pip reached no index with megatron-core==$megatron" \
       "for CPython $python; the megatron peer will say it does not import" >&2
fi
du -sh "$dst"
