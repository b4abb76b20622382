"""Launching the multi-GPU commands: re-run under torchrun, one rank per GPU, with NVLink
multicast off, and set up the process group in the children."""

from __future__ import annotations

import faulthandler
import os
import shlex
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

#: NVLink multicast stays off: a program using it can take a shared host's GPUs out of
#: service (docs/design.md, "Cross-GPU rules").
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_env() -> dict[str, str]:
    """The environment of the torchrun children: NVLink multicast off, and this checkout
    importable without an install."""
    env = dict(os.environ, **NVLS_OFF)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def torchrun_command(argv: list[str], nproc: int, module: str) -> list[str]:
    """torchrun of ``python -m module argv`` on ``nproc`` ranks. ``--nproc`` is dropped:
    the children do not need it, and torchrun's parser would take it for an
    abbreviation of its own ``--nproc-per-node`` even after the module name."""
    child, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            child.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *child]


def maybe_relaunch(argv: list[str], nproc: int | None, module: str) -> int | None:
    """Re-run under torchrun when several GPUs are visible and this is not a torchrun
    child; returns its exit code, or None to go on in this process."""
    os.environ.update(NVLS_OFF)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if under_torchrun() or n_gpu <= 1 or (nproc or n_gpu) <= 1:
        return None
    cmd = torchrun_command(argv, nproc or n_gpu, module)
    print("launching: " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env=launch_env()).returncode


def init_ranks() -> tuple[torch.device, int, int]:
    """(device, world size, rank): the process group under torchrun, else one rank."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not under_torchrun():
        return (torch.device("cuda", 0) if n_gpu else torch.device("cpu")), 1, 0
    local_rank = int(os.environ["LOCAL_RANK"])
    # A rank killed by torchrun (a timeout, a peer's crash) prints where it was stuck.
    faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)
    if n_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_world_size(), dist.get_rank()
