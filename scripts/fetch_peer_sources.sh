#!/usr/bin/env bash
# usage: bash scripts/fetch_peer_sources.sh [DEEPEP_GIT [REF]]
#        DEEPGEMM_GIT=DIR CUTLASS_GIT=DIR FMT_GIT=DIR bash scripts/fetch_peer_sources.sh [...]
#   DEEPEP_GIT: a git directory of DeepEP (a bare mirror or a checkout) or a plain source tree
#   REF: the commit to take (default: DEEPEP_REF below; ignored for a plain tree)
#   DEEPGEMM_GIT, CUTLASS_GIT, FMT_GIT (env): git directories (bare mirrors or checkouts) of
#     DeepGEMM and of its two submodules, NVIDIA/cutlass and fmtlib/fmt; DEEPGEMM_REF (env)
#     overrides the commit below: a hash or any ref the git directory resolves, a pull
#     request's too where it holds refs/pull/* (DEEPGEMM_REF=refs/pull/323/head). The
#     submodules are taken at the commits DeepGEMM records.
# On a machine with the sources (and, for megatron-core, a package index), from the
# repository root: fills the ignored folder .gl/peers that scripts/device/build_peers.sh
# builds and installs from on a GPU machine, which reaches no network. Each peer is staged
# when its source is given (at least one must be) and the others staged before are kept.
# Carry .gl/peers to the device call (DeepEP about 3 MiB, DeepGEMM about 16 MiB):
#   .gl/peers/DeepEP/         DeepEP's source at REF (without its figures), and
#   .gl/peers/DeepEP.commit   the commit it is;
#   .gl/peers/DeepGEMM/       DeepGEMM's source at DEEPGEMM_REF with, in third-party/, fmt's
#                             headers and the CUTLASS headers its build and kernels include
#                             (the closure of their #include lines, not CUTLASS's 26 MB);
#   .gl/peers/DeepGEMM.commit the three commits;
#   .gl/peers/wheels/         megatron-core's wheel for the device's Python (pure Python but
#                             for its dataset helpers, so built per CPython version), fetched
#                             with DeepEP: MEGATRON_CORE_VERSION, PEER_PYTHON (env; defaults
#                             below).
# DEEPEP_REF is the last commit of DeepEP's v1 API (deep_ep.Buffer: get_dispatch_layout,
# dispatch, combine), whose setup.py builds the intranode kernels alone when NVSHMEM is
# absent; the EPv2 release after it always compiles NVSHMEM and NCCL in and needs the fmt
# submodule.
# DEEPGEMM_REF is DeepGEMM's newest commit (2026-06-23, version 2.6.1) when this was
# written: its SM90 grouped FP8 GEMMs (m_grouped_fp8_gemm_nt_contiguous /
# m_grouped_fp8_gemm_nt_masked, fp32 scales, 1x128 rows and 128x128 weight blocks) are the
# ones DeepSeek ships, its JIT compiles with CUDA 12.3 to 13 (13 since 2025-08-27), and its
# extension is one C++ file built by torch's CUDAExtension (no nvcc at build time), which
# torch 2.11 builds with the -std=c++17 it asks for. Its kernels are compiled at run time by
# the machine's nvcc against the headers the wheel carries.
# DeepGEMM's SM90 FP8 Mega MoE (deep_gemm.fp8_mega_moe, the peer of comet.bench.mega_moe)
# is not on its main branch (whose Mega MoE is SM100-only) but in pull requests; both record
# the submodule commits above:
#   refs/pull/323/head (8ddf7f9, 2026-07-02; refs/pull/323/merge is the same tree): the
#     newest, on top of DEEPGEMM_REF_DEFAULT -- main's grouped GEMMs, the SM90 FP8 (and FP4)
#     Mega MoE, its pre-dispatch kernel. Its Python package is the sgl-deep-gemm fork's: the
#     extension is csrc/tvm_ffi_api.cpp built with apache-tvm-ffi 0.1.11 and ninja
#     (build_sgl_deep_gemm.sh); the setup.py build above no longer compiles there (every
#     pybind register_apis is under #if 0), and the package names the masked grouped GEMM
#     m_grouped_fp8_fp4_gemm_nt_masked only.
#   refs/pull/352/head (bdb4395, 2026-06-09): on DeepGEMM of 2026-04-24 (891d57b), the same
#     setup.py build as the default; grouped GEMMs under the names comet.bench.deepgemm calls,
#     and the SM90 FP8 Mega MoE as a pair of kernels.
set -euo pipefail
DEEPEP_REF=567632dd59810d77b3cc05553df953cc0f779799
DEEPGEMM_REF_DEFAULT=54e22612409371d6364144b69086735beb54e98b
src="${1:-}"
ref="${2:-$DEEPEP_REF}"
megatron="${MEGATRON_CORE_VERSION:-0.19.2}"
python="${PEER_PYTHON:-3.12}"

[ -f comet/bench/peers.py ] || { echo "run from the comet repository root" >&2; exit 2; }
git check-ignore -q .gl/peers || { echo ".gl/ must be ignored by git (.gitignore)" >&2; exit 2; }
[ -n "$src" ] || [ -n "${DEEPGEMM_GIT:-}" ] || {
  echo "usage: fetch_peer_sources.sh [DEEPEP_GIT [REF]], DEEPGEMM_GIT=... for DeepGEMM" >&2
  exit 2; }
dst=.gl/peers
mkdir -p "$dst/wheels"

stage_deepep() {
  rm -rf "$dst/DeepEP" "$dst/DeepEP.commit"
  mkdir -p "$dst/DeepEP"
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
}

fetch_megatron() {
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
}

# The submodule commit a DeepGEMM commit records for PATH, checked present in GIT_DIR.
submodule_commit() {
  local commit
  commit=$(git -C "$DEEPGEMM_GIT" ls-tree "$1" "$2" | awk '$2 == "commit" {print $3}')
  [ -n "$commit" ] || { echo "DeepGEMM $1 records no submodule $2" >&2; exit 1; }
  git -C "$3" cat-file -e "$commit^{commit}" 2>/dev/null \
    || { echo "$3 lacks $commit, DeepGEMM's $2 (fetch it)" >&2; exit 1; }
  echo "$commit"
}

stage_deepgemm() {
  : "${CUTLASS_GIT:?DEEPGEMM_GIT needs CUTLASS_GIT, a git directory of NVIDIA/cutlass}"
  : "${FMT_GIT:?DEEPGEMM_GIT needs FMT_GIT, a git directory of fmtlib/fmt}"
  local out="$dst/DeepGEMM" commit cutlass fmt full
  commit=$(git -C "$DEEPGEMM_GIT" rev-parse --verify --quiet \
    "${DEEPGEMM_REF:-$DEEPGEMM_REF_DEFAULT}^{commit}") || {
    echo "$DEEPGEMM_GIT has no commit ${DEEPGEMM_REF:-$DEEPGEMM_REF_DEFAULT} (a pull request's" \
         "ref needs refs/pull/* fetched into it)" >&2; exit 1; }
  cutlass=$(submodule_commit "$commit" third-party/cutlass "$CUTLASS_GIT")
  fmt=$(submodule_commit "$commit" third-party/fmt "$FMT_GIT")
  rm -rf "$out" "$dst/DeepGEMM.commit"
  mkdir -p "$out/third-party/fmt" "$out/third-party/cutlass/include"
  git -C "$DEEPGEMM_GIT" archive --format=tar "$commit" | tar -x -C "$out"
  # fmt is used header-only (FMT_HEADER_ONLY): its include/ and licence.
  git -C "$FMT_GIT" archive --format=tar "$fmt" include LICENSE | tar -x -C "$out/third-party/fmt"
  full=$(mktemp -d)
  git -C "$CUTLASS_GIT" archive --format=tar "$cutlass" include LICENSE.txt | tar -x -C "$full"
  cp "$full/LICENSE.txt" "$out/third-party/cutlass/"
  python3 - "$out" "$full/include" <<'PY'
"""Copy the CUTLASS headers DeepGEMM can reach into its third-party/cutlass/include.

Every #include line of DeepGEMM's C++ sources and kernel headers (the JIT's generated code
is in strings of csrc/, found the same way), followed through CUTLASS: a quoted name
relative to its file first, then to the include root. Lines inside any #if branch count,
so the set is a superset of what any one compilation opens; names outside CUTLASS (the CUDA
toolkit's, the C++ library's) are left to the compiler's own paths."""
import pathlib
import re
import shutil
import sys

out, full = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
include = re.compile(r'#\s*include\s*([<"])([^>"]+)[>"]')
seeds = [p for d in ("csrc", "deep_gemm/include") for p in (out / d).rglob("*") if p.is_file()]
todo, found = list(seeds), set()
while todo:
    path = todo.pop()
    for quote, name in include.findall(path.read_text(errors="replace")):
        where = [path.parent / name] if quote == '"' else []
        for cand in where + [full / name]:
            cand = cand.resolve()
            if cand.is_file() and full.resolve() in cand.parents:
                if cand not in found:
                    found.add(cand)
                    todo.append(cand)
                break
dest = out / "third-party/cutlass/include"
for f in found:
    target = dest / f.relative_to(full.resolve())
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(f, target)
size = sum(f.stat().st_size for f in found)
print(f"CUTLASS: {len(found)} headers ({size / 2**20:.1f} MiB) reached from {len(seeds)} "
      "DeepGEMM files")
PY
  rm -rf "$full"
  printf 'DeepGEMM %s\ncutlass %s\nfmt %s\n' "$commit" "$cutlass" "$fmt" > "$dst/DeepGEMM.commit"
  echo "DeepGEMM $commit ($(git -C "$DEEPGEMM_GIT" log -1 --format='%ci %s' "$commit"))," \
       "cutlass $cutlass, fmt $fmt -> $out"
  [ -f "$out/setup.py" ] || { echo "no setup.py in DeepGEMM at $commit" >&2; exit 1; }
}

if [ -n "$src" ]; then
  stage_deepep
  fetch_megatron
fi
[ -z "${DEEPGEMM_GIT:-}" ] || stage_deepgemm
du -sh "$dst"/*
du -sh "$dst"
