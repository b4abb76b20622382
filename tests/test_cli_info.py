"""`comet info`, the subcommand dispatcher and comet.runtime.topology, on a CPU machine
(with and without cuda-python) and, where there is one, on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from comet.cli import info as info_cli
from comet.cli import main as cli
from comet.runtime import topology

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_CUDA_MODULES = ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.bindings.nvml",
                 "cuda.cudart")


@pytest.fixture(autouse=True)
def _fresh_topology():
    topology.clear_cache()
    yield
    topology.clear_cache()


@pytest.fixture
def without_cuda_python(monkeypatch):
    """Make every cuda-python import fail, as on an install without it."""
    for name in _CUDA_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    topology.clear_cache()


def _has_cuda_python() -> bool:
    topology.clear_cache()
    return topology.cuda_runtime() is not None


# --------------------------------------------------------------------------- comet info
@no_gpu
def test_info_text_names_the_reference_path(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("comet ")
    assert "CPU reference path (comet.reference) -- no CUDA GPU" in out
    for section in ("Packages", "CUDA", "Environment", "What would run"):
        assert f"\n{section}\n" in out
    assert "NCCL_NVLS_ENABLE" in out and "COMET_TUNED_CONFIG_FOLDER" in out


@no_gpu
def test_info_json_is_one_object(capsys, monkeypatch):
    monkeypatch.setenv("COMET_TUNED_CONFIG_FOLDER", "/tmp/comet-tuned")
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    import comet
    assert data["comet"] == comet.__version__
    from comet.constants import kernel_identity
    assert data["kernels"] == kernel_identity() and data["kernels"].startswith("kernels-")
    assert data["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert data["gpus"] == [] and data["peer_access"] == [] and data["cuda"]["device_count"] == 0
    assert data["env"]["COMET_TUNED_CONFIG_FOLDER"] == "/tmp/comet-tuned"
    assert set(data["env"]) == set(info_cli.ENV_VARS)
    assert data["would_run"]["path"] == info_cli.REFERENCE
    assert data["would_run"]["reason"] == "no CUDA GPU"


@no_gpu
def test_python_dash_m_comet_info_json():
    proc = subprocess.run([sys.executable, "-m", "comet", "info", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["would_run"]["summary"].startswith("CPU reference path")


@no_gpu
def test_info_without_cuda_python(capsys, without_cuda_python):
    assert info_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "device facts from  none" in out
    assert "cuda-python is not installed" in out
    assert "CPU reference path (comet.reference) -- no CUDA GPU" in out


def test_env_text_flags_multicast_settings(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    info_cli.main([])
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert "comet expects 0" in lines["NCCL_NVLS_ENABLE"]
    assert "expects" not in lines["TORCH_SYMM_MEM_DISABLE_MULTICAST"]


# --------------------------------------------------------------------------- what would run
def _dev(major, minor):
    return {"capability": [major, minor], "arch": f"sm_{major}{minor}"}


@pytest.mark.parametrize("devices,triton,torch_cuda,path,reason_part", [
    ([], "3.6.0", True, info_cli.REFERENCE, "no CUDA GPU"),
    ([_dev(9, 0)] * 4, "3.6.0", True, info_cli.FUSED, None),
    ([_dev(9, 0)], None, True, info_cli.REFERENCE, "triton"),
    ([_dev(9, 0)], "3.6.0", False, info_cli.REFERENCE, "without CUDA"),
    ([_dev(8, 0), _dev(8, 6)], "3.6.0", True, info_cli.REFERENCE, "found sm_80, sm_86"),
])
def test_what_would_run(devices, triton, torch_cuda, path, reason_part):
    run = info_cli.what_would_run(devices, triton, torch_cuda)
    assert run["path"] == path
    if reason_part is None:
        assert run["reason"] is None and run["summary"] == "fused Triton kernels (CUDA, sm_90)"
    else:
        assert reason_part in run["reason"] and run["summary"].startswith(path + " -- ")


def test_render_multi_gpu_report():
    """The GPU and peer tables, from a synthetic 2-GPU machine."""
    link = {"can_access_peer": True, "access_supported": True, "native_atomics": True,
            "performance_rank": 0}
    gpu0 = {"index": 0, "name": "NVIDIA H200", "sm_count": 132, "capability": [9, 0],
            "arch": "sm_90", "total_memory": 150 << 30, "l2_cache_size": 60 << 20,
            "smem_per_block_optin": 227 << 10, "cooperative_launch": True,
            "pci_bus_id": "0000:19:00.0"}
    data = {
        "comet": "0.1.0", "python": "3.11.7", "platform": "linux",
        "packages": {p: "1.0" for p in info_cli.PACKAGES}, "torch_cuda_build": "12.8",
        "cuda": {"driver": "12.8", "runtime": "12.8", "source": "cuda-python",
                 "device_count": 2, "no_device_reason": None, "error": None},
        "gpus": [gpu0, {**gpu0, "index": 1, "pci_bus_id": "0000:2a:00.0"}],
        "peer_access": [[True, True], [True, True]],
        "p2p": [[None, {**link, "src": 0, "dst": 1}],
                [{**link, "src": 1, "dst": 0, "native_atomics": False}, None]],
        "nvlink_active_links": [18, None],
        "env": {k: None for k in info_cli.ENV_VARS},
        "would_run": info_cli.what_would_run([gpu0], "3.6.0", True),
    }
    text = info_cli.render(data)
    gpu_rows = [ln for ln in text.splitlines() if "NVIDIA H200" in ln]
    assert len(gpu_rows) == 2 and all("sm_90" in ln and "132" in ln for ln in gpu_rows)
    assert gpu_rows[0].index("sm_90") == gpu_rows[1].index("sm_90")   # aligned columns
    assert "150.0 GiB" in gpu_rows[0] and "227.0 KiB" in gpu_rows[0]
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Peer access"))
    assert lines[at + 1].split() == ["src\\dst", "0", "1"]
    peer_rows = [ln.split() for ln in lines[at + 2:at + 4]]
    assert [".", "r0"] == peer_rows[0][1:] and ["r0*", "."] == peer_rows[1][1:]
    assert "NVLink active links: 0: 18, 1: ?" in text
    assert text.rstrip().endswith("fused Triton kernels (CUDA, sm_90)")


# --------------------------------------------------------------------------- topology
@no_gpu
def test_topology_without_gpu_is_empty():
    assert topology.device_count() == 0
    assert topology.unavailable_reason()
    assert topology.devices() == []
    assert topology.peer_access_matrix() == [] and topology.p2p_matrix() == []
    assert topology.nvlink_links() == []
    topo = topology.topology()
    assert topo.devices == [] and topo.reason and json.dumps(topo.to_dict())
    with pytest.raises(ValueError, match="no CUDA device 0"):
        topology.sm_count(0)
    with pytest.raises(ValueError, match="no current CUDA device"):
        topology.sm_count()


@no_gpu
def test_topology_without_cuda_python(without_cuda_python):
    assert topology.cuda_runtime() is None
    assert topology.runtime_source() == "none"
    assert topology.device_count() == 0
    assert "cuda-python is not installed" in topology.unavailable_reason()
    assert topology.cuda_versions() == {"driver": None, "runtime": None}
    assert topology.peer_access_matrix() == [] and topology.p2p_matrix() == []
    with pytest.raises(ValueError):
        topology.sm_count(0)


@no_gpu
def test_topology_with_cuda_python_reports_the_cuda_error():
    if not _has_cuda_python():
        pytest.skip("cuda-python is not installed")
    assert topology.runtime_source() == "cuda-python"
    assert topology.device_count() == 0
    assert "cudaGetDeviceCount failed: cudaError" in topology.unavailable_reason()


def test_check_raises_named_cuda_errors():
    if not _has_cuda_python():
        pytest.skip("cuda-python is not installed")
    rt = topology.cuda_runtime()
    ok, bad = rt.cudaError_t.cudaSuccess, rt.cudaError_t.cudaErrorInvalidValue
    assert topology.checked(rt, "call", (ok, 7)) == 7
    assert topology.checked(rt, "call", (ok,)) is None
    assert topology.checked(rt, "call", (ok, 1, 2)) == (1, 2)
    with pytest.raises(topology.CudaError, match="cudaFoo failed: cudaErrorInvalidValue") as e:
        topology.checked(rt, "cudaFoo", (bad, None))
    assert e.value.name == "cudaErrorInvalidValue"


def test_unexpected_cuda_error_is_not_swallowed(monkeypatch):
    """Only "no usable GPU" errors mean zero devices; anything else is raised."""
    if not _has_cuda_python():
        pytest.skip("cuda-python is not installed")
    rt = topology.cuda_runtime()
    fake = types.SimpleNamespace(
        cudaError_t=rt.cudaError_t, cudaGetErrorString=rt.cudaGetErrorString,
        cudaGetDeviceCount=lambda: (rt.cudaError_t.cudaErrorIllegalAddress, 0))
    monkeypatch.setattr(topology, "cuda_runtime", lambda: fake)
    topology._count_and_reason.cache_clear()
    with pytest.raises(topology.CudaError, match="cudaErrorIllegalAddress"):
        topology.device_count()
    fake.cudaGetDeviceCount = lambda: (rt.cudaError_t.cudaErrorNoDevice, 0)
    topology._count_and_reason.cache_clear()
    assert topology.device_count() == 0 and "cudaErrorNoDevice" in topology.unavailable_reason()


# --------------------------------------------------------------------------- the dispatcher
def test_missing_subcommand_module_exits_2(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", "a subcommand nobody wrote")
    assert cli.main(["ghost", "--flag"]) == 2
    err = capsys.readouterr().err
    assert "comet ghost" in err and "comet.cli.ghost is missing" in err


def test_missing_dependency_of_a_subcommand_is_named(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", "needs a missing package")

    def fail(name):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    monkeypatch.setattr(cli.importlib, "import_module", fail)
    assert cli.main(["ghost"]) == 2
    assert "'matplotlib'" in capsys.readouterr().err


def test_dispatcher_passes_arguments_untouched(monkeypatch):
    seen = []
    mod = types.ModuleType("comet.cli.ghost")
    mod.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "comet.cli.ghost", mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", "records its argv")
    assert cli.main(["ghost", "--x", "1", "pos", "-h"]) == 3
    assert seen == [["--x", "1", "pos", "-h"]]
    mod.main = lambda argv: None
    assert cli.main(["ghost"]) == 0


def test_dispatcher_usage_errors(capsys):
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("info", "bench", "tune"))


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@gpu
def test_topology_matches_torch():
    n = torch.cuda.device_count()
    assert topology.device_count() == n
    for i in range(n):
        d = topology.device_info(i)
        props = torch.cuda.get_device_properties(i)
        assert topology.sm_count(i) == props.multi_processor_count == d.sm_count
        assert d.capability == torch.cuda.get_device_capability(i)
        assert d.total_memory == props.total_memory
        assert d.smem_per_block_optin > 0 and d.l2_cache_size > 0
    assert topology.sm_count() == topology.sm_count(torch.cuda.current_device())
    access = topology.peer_access_matrix()
    assert len(access) == n and all(access[i][i] for i in range(n))
    p2p = topology.p2p_matrix()
    for i in range(n):
        for j in range(n):
            if i != j:
                assert p2p[i][j].can_access_peer == torch.cuda.can_device_access_peer(i, j)
    assert len(topology.nvlink_links()) == n


@pytest.mark.gpu
@gpu
def test_info_json_on_gpu(capsys):
    assert info_cli.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cuda"]["device_count"] == torch.cuda.device_count() == len(data["gpus"])
    hopper = any(torch.cuda.get_device_capability(i)[0] == 9
                 for i in range(torch.cuda.device_count()))
    assert (data["would_run"]["path"] == info_cli.FUSED) == hopper


@pytest.mark.gpu
@gpu
def test_sm_count_without_cuda_python(without_cuda_python):
    assert topology.runtime_source() == "torch"
    props = torch.cuda.get_device_properties(0)
    assert topology.sm_count(0) == props.multi_processor_count
    assert topology.devices()[0].capability == (props.major, props.minor)
