"""comet.bench.cutlass_ref on the CPU: when the CUTLASS reference is unavailable and why,
header and nvcc discovery, and the build cache (with a stand-in nvcc)."""

import importlib.util
import os
import stat
import sys
import textwrap

import pytest
import torch

from comet.bench import cutlass_ref


@pytest.fixture
def cutlass_tree(tmp_path):
    """A minimal stand-in CUTLASS tree (the two files discovery looks for)."""
    root = tmp_path / "cutlass"
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// stand-in\n")
    (root / "include" / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    (root / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    (root / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp").write_text(
        "// stand-in\n")
    return root


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """An executable ``nvcc`` under CUDA_HOME that logs its calls and writes its ``-o`` file,
    or fails with FAKE_NVCC_FAIL's text on stderr."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    log = tmp_path / "nvcc_calls.log"
    nvcc.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        args = sys.argv[1:]
        if args == ["--version"]:
            print("fake nvcc, release 13.0")
            sys.exit(0)
        with open({str(log)!r}, "a") as f:
            f.write(" ".join(args) + "\\n")
        if os.environ.get("FAKE_NVCC_FAIL"):
            sys.stderr.write("lots of template noise\\n" + os.environ["FAKE_NVCC_FAIL"] + "\\n")
            sys.exit(2)
        with open(args[args.index("-o") + 1], "wb") as f:
            f.write(b"not really a library")
        """))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("COMET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("COMET_NVCC_EXTRA", raising=False)
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    return log


def test_cpu_device_gives_a_note():
    fn, note = cutlass_ref.load_cutlass_grouped_mm(torch.device("cpu"))
    assert fn is None
    assert note.startswith("cutlass reference unavailable") and "CUDA" in note


def test_non_hopper_gpu_gives_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fn, note = cutlass_ref.load_cutlass_grouped_mm(torch.device("cuda", 0))
    assert fn is None and "SM90" in note and "sm_80" in note


def test_non_bf16_gives_a_note():
    fn, note = cutlass_ref.load_cutlass_grouped_mm(torch.device("cuda", 0), torch.float16)
    assert fn is None and "bf16" in note


def test_headers_from_env(monkeypatch, cutlass_tree):
    monkeypatch.setenv("COMET_CUTLASS_DIR", str(cutlass_tree))
    dirs, origin = cutlass_ref.find_cutlass()
    assert dirs == [cutlass_tree / "include", cutlass_tree / "tools" / "util" / "include"]
    assert "COMET_CUTLASS_DIR" in origin


def test_missing_env_dir_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("COMET_CUTLASS_DIR", str(tmp_path / "nowhere"))
    dirs, note = cutlass_ref.find_cutlass()
    assert dirs is None and "COMET_CUTLASS_DIR" in note and "nowhere" in note


def test_no_headers_anywhere(monkeypatch):
    monkeypatch.delenv("COMET_CUTLASS_DIR", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    dirs, note = cutlass_ref.find_cutlass()
    assert dirs is None and "nvidia-cutlass" in note and "COMET_CUTLASS_DIR" in note


def test_cache_key_follows_its_inputs():
    key = cutlass_ref.cache_key(b"src", "nvcc 13.0", ["-O3"], b"4.2")
    assert key == cutlass_ref.cache_key(b"src", "nvcc 13.0", ["-O3"], b"4.2")
    assert key != cutlass_ref.cache_key(b"src changed", "nvcc 13.0", ["-O3"], b"4.2")
    assert key != cutlass_ref.cache_key(b"src", "nvcc 13.1", ["-O3"], b"4.2")
    assert key != cutlass_ref.cache_key(b"src", "nvcc 13.0", ["-O2"], b"4.2")
    assert key != cutlass_ref.cache_key(b"src", "nvcc 13.0", ["-O3"], b"4.3")
    # Parts are delimited: moving bytes from one part to the next changes the key.
    assert key != cutlass_ref.cache_key(b"sr", "cnvcc 13.0", ["-O3"], b"4.2")


def test_no_nvcc_gives_a_note(monkeypatch, cutlass_tree, tmp_path):
    monkeypatch.setenv("COMET_CUTLASS_DIR", str(cutlass_tree))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(cutlass_ref, "NVCC_FALLBACKS", (str(tmp_path / "no-nvcc"),))
    assert cutlass_ref.find_nvcc() is None
    path, note = cutlass_ref.build_library()
    assert path is None and "nvcc" in note and "CUDA_HOME" in note


def test_build_is_cached_and_keyed_by_source(monkeypatch, cutlass_tree, fake_nvcc, tmp_path):
    monkeypatch.setenv("COMET_CUTLASS_DIR", str(cutlass_tree))
    monkeypatch.setenv("COMET_NVCC_EXTRA", "-DEXTRA_FLAG=1")
    path, note = cutlass_ref.build_library()
    assert path is not None and path.read_bytes() == b"not really a library", note
    assert note.startswith("built")
    call = fake_nvcc.read_text().splitlines()
    assert len(call) == 1
    for flag in (*cutlass_ref.NVCC_FLAGS, "-DEXTRA_FLAG=1", f"-I{cutlass_tree / 'include'}"):
        assert flag in call[0].split()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    again, note = cutlass_ref.build_library()
    assert again == path and note.startswith("cached")
    assert len(fake_nvcc.read_text().splitlines()) == 1          # no second compile

    source = tmp_path / "other.cu"
    source.write_text("// a changed kernel\n")
    monkeypatch.setattr(cutlass_ref, "SOURCE", source)
    changed, _ = cutlass_ref.build_library()
    assert changed is not None and changed != path
    assert len(fake_nvcc.read_text().splitlines()) == 2


def test_failed_build_returns_the_stderr_tail(monkeypatch, cutlass_tree, fake_nvcc):
    monkeypatch.setenv("COMET_CUTLASS_DIR", str(cutlass_tree))
    monkeypatch.setenv("FAKE_NVCC_FAIL", "error: no instance of overloaded function")
    path, note = cutlass_ref.build_library()
    assert path is None
    assert "exit 2" in note and "error: no instance of overloaded function" in note
    cache = os.environ["COMET_CACHE_DIR"]
    assert not [f for _, _, files in os.walk(cache) for f in files if f.endswith((".so", ".tmp"))]
