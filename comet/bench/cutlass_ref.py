"""Second compute reference for the benchmark: CUTLASS's Hopper grouped GEMM on the same rows.

The easy routes fail on the H200 machines: the nvidia-cutlass Python
interface breaks on the image's cuda-bindings 13 and its grouped GEMM falls back to SM80
kernels; the CuTe DSL wheel is too large to carry. What does work is the C++ the
nvidia-cutlass wheel ships: ``csrc/cutlass_grouped_gemm.cu`` is a CUTLASS 3.x SM90
ptr-array grouped GEMM (TMA, warp-specialized) written against those headers. It is built
here with the machine's nvcc into a plain shared library and called through ctypes, which
keeps the build independent of torch's C++ ABI and of torch's own extension machinery.

The build (one to two minutes) happens once per source/compiler/flags/headers combination and is
cached under ``$COMET_CACHE_DIR`` (default ``~/.cache/comet``); a file lock makes ranks that
start together wait for one build instead of racing.

Environment:

* ``COMET_CUTLASS_DIR`` -- a CUTLASS tree (``include/`` and ``tools/util/include/``) to use
  instead of the installed ``cutlass_library`` package's copy.
* ``CUDA_HOME`` -- where nvcc is looked for first (then /usr/local/cuda, then PATH).
* ``COMET_NVCC_EXTRA`` -- extra nvcc arguments (shell syntax), e.g. include and library
  dirs of a pip-installed CUDA toolkit for a compile check on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# fn(a [R, K], b [El, K, N], expert_rows [El] host ints summing to R) -> [R, N]
GroupedMM = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]

SOURCE = Path(__file__).with_name("csrc") / "cutlass_grouped_gemm.cu"
LIB_NAME = "libcomet_cutlass_gmm.so"
NVCC_FLAGS: tuple[str, ...] = (
    "-O3", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-shared",
    "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
    # What CUTLASS's own CMake build passes: no device asserts, tensor-core MMA on, and no
    # strict aliasing (CuTe type-puns).
    "-DNDEBUG", "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-Xcompiler", "-fno-strict-aliasing",
)
NVCC_FALLBACKS: tuple[str, ...] = ("/usr/local/cuda/bin/nvcc",)
BUILD_TIMEOUT_S = 1200
_UNAVAILABLE = "cutlass reference unavailable: "

_libs: dict[Path, ctypes.CDLL] = {}
_workspaces: dict[int, torch.Tensor] = {}


def find_cutlass() -> tuple[list[Path] | None, str]:
    """``(include dirs, where from)``, or ``(None, why not)``."""
    env = os.environ.get("COMET_CUTLASS_DIR")
    if env:
        root, origin = Path(env), f"COMET_CUTLASS_DIR={env}"
    else:
        # find_spec, not import: locating the headers should not run the package's Python,
        # which is what breaks on the GPU machines.
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            return None, ("no CUTLASS headers: install nvidia-cutlass (pip install --no-deps "
                          "nvidia-cutlass) or set COMET_CUTLASS_DIR to a CUTLASS tree")
        root = Path(next(iter(spec.submodule_search_locations))) / "source"
        origin = f"the cutlass_library package ({root})"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    if not (dirs[0] / "cutlass" / "cutlass.h").is_file() or not (
            dirs[1] / "cutlass" / "util" / "packed_stride.hpp").is_file():
        return None, (f"no CUTLASS headers in {origin}: expected include/cutlass/cutlass.h and "
                      "tools/util/include/cutlass/util/packed_stride.hpp under it")
    return dirs, origin


def find_nvcc() -> str | None:
    """The nvcc to build with: ``$CUDA_HOME/bin/nvcc``, /usr/local/cuda, then PATH."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates += NVCC_FALLBACKS
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("nvcc")


def nvcc_flags() -> list[str]:
    """The nvcc arguments but the include dirs, the source and the output."""
    return [*NVCC_FLAGS, *shlex.split(os.environ.get("COMET_NVCC_EXTRA", ""))]


def cache_key(source: bytes, nvcc_version: str, flags: Sequence[str],
              cutlass_version: bytes = b"") -> str:
    """Hash of everything the built library depends on."""
    h = hashlib.sha256()
    for part in (source, nvcc_version.encode(), "\0".join(flags).encode(), cutlass_version):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    return Path(os.environ.get("COMET_CACHE_DIR") or Path.home() / ".cache" / "comet")


def build_library() -> tuple[Path | None, str]:
    """``(path of the built library, how it was got)``, or ``(None, why not)``."""
    dirs, origin = find_cutlass()
    if dirs is None:
        return None, origin
    nvcc = find_nvcc()
    if nvcc is None:
        return None, ("no nvcc: set CUDA_HOME, or put nvcc in /usr/local/cuda/bin or on PATH "
                      "(the CUDA toolkit, 12.3 or newer)")
    if not SOURCE.is_file():
        return None, f"{SOURCE} is missing from this install of comet"
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{nvcc} --version failed: {err}"
    flags = nvcc_flags()
    # The headers enter the key by their version, not their path: a CUTLASS unzipped to a
    # fresh temporary directory each run should still find its cached build.
    version_h = dirs[0] / "cutlass" / "version.h"
    key = cache_key(SOURCE.read_bytes(), version, flags,
                    version_h.read_bytes() if version_h.is_file() else b"")
    out_dir = cache_dir() / "cutlass" / key
    lib = out_dir / LIB_NAME
    if lib.is_file():
        return lib, f"cached {lib}"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # another rank may be building it: wait for it
        if lib.is_file():
            return lib, f"cached {lib} (built by another process)"
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([nvcc, *flags, *(f"-I{d}" for d in dirs), str(SOURCE),
                                   "-o", tmp], check=False, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as err:
            os.unlink(tmp)
            return None, f"nvcc failed to run: {err}"
        if proc.returncode != 0:
            os.unlink(tmp)
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            return None, f"nvcc failed (exit {proc.returncode}) with {origin}:\n{tail}"
        os.chmod(tmp, 0o755)     # mkstemp's 0600 would hide it from other users
        os.replace(tmp, lib)     # atomic: a reader sees no library or a whole one
    return lib, f"built {lib} in {time.perf_counter() - t0:.0f} s with {origin}"


def _load(path: Path) -> ctypes.CDLL:
    if path not in _libs:
        lib = ctypes.CDLL(str(path))
        lib.comet_cutlass_gmm_last_error.restype = ctypes.c_char_p
        lib.comet_cutlass_gmm_workspace_bytes.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        lib.comet_cutlass_gmm_run.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_void_p]
        _libs[path] = lib
    return _libs[path]


def _make_fn(lib: ctypes.CDLL, device: torch.device) -> GroupedMM:
    index = device.index if device.index is not None else torch.cuda.current_device()

    def check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError("CUTLASS grouped GEMM: "
                               + lib.comet_cutlass_gmm_last_error().decode(errors="replace"))

    sizes: dict[int, int] = {}

    def workspace(groups: int) -> torch.Tensor:
        if groups not in sizes:
            need = ctypes.c_size_t()
            check(lib.comet_cutlass_gmm_workspace_bytes(index, groups, ctypes.byref(need)))
            sizes[groups] = need.value
        ws = _workspaces.get(index)
        if ws is None or ws.numel() < sizes[groups]:
            # Reused across calls: they run in stream order on the caller's stream, and the
            # caching allocator keeps a replaced buffer until that stream is past it.
            ws = torch.empty(sizes[groups], dtype=torch.uint8, device=device)
            _workspaces[index] = ws
        return ws

    def grouped_mm(a: torch.Tensor, b: torch.Tensor, expert_rows: Sequence[int]) -> torch.Tensor:
        """``a [R, K]`` rows grouped by expert times ``b [El, K, N]`` -> ``[R, N]`` bf16."""
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise ValueError("the CUTLASS grouped GEMM is built for bf16 only")
        if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
            raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit")
        if len(expert_rows) != b.shape[0] or sum(expert_rows) != a.shape[0]:
            raise ValueError("expert_rows needs one count per expert of b, summing to a's rows")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("a and b must be contiguous")
        groups, k, n = b.shape
        out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
        if a.shape[0] == 0:
            return out
        ws = workspace(groups)
        rows = (ctypes.c_int64 * groups)(*expert_rows)
        check(lib.comet_cutlass_gmm_run(
            index, a.data_ptr(), b.data_ptr(), out.data_ptr(), groups, n, k, rows,
            ws.data_ptr(), ws.numel(), torch.cuda.current_stream(device).cuda_stream))
        return out

    return grouped_mm


def load_cutlass_grouped_mm(device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                            ) -> tuple[GroupedMM | None, str]:
    """``(fn, note)``: the CUTLASS grouped GEMM for ``device`` (see :data:`GroupedMM`), built
    on first use, and a line saying how it was got; or ``(None, why it is unavailable)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, _UNAVAILABLE + "needs a CUDA GPU"
    if dtype != torch.bfloat16:
        return None, _UNAVAILABLE + f"built for bf16 only, not {dtype}"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) != (9, 0):
        # sm_90a code (wgmma, TMA descriptors rewritten on the device) runs on SM90 alone.
        return None, _UNAVAILABLE + f"needs an SM90 (Hopper) GPU, this is sm_{cap[0]}{cap[1]}"
    path, note = build_library()
    if path is None:
        return None, _UNAVAILABLE + note
    try:
        lib = _load(path)
    except OSError as err:
        return None, _UNAVAILABLE + f"loading {path} failed: {err}"
    return _make_fn(lib, device), "cutlass reference: " + note
