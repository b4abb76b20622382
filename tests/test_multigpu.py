"""Launches tests/multigpu_check.py under torchrun on 2 and 4 GPUs (marker multigpu)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_suite(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    script = os.path.join(os.path.dirname(__file__), "multigpu_check.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                           f"--nproc-per-node={world}", script, "--quick", "--calls", "200"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL MULTIGPU CHECKS PASSED" in proc.stdout
