"""Test configuration.

Without a CUDA GPU the Triton kernels run under the interpreter: TRITON_INTERPRET must be
set before anything imports triton-decorated functions, so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (run by scripts/device/*.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; "
                                             "scripts/device/gpu_tests.sh runs it"))
        if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs; "
                                             "scripts/device/multigpu_check.sh runs it"))


@pytest.fixture
def fake_world():
    """``start(rank, world_size)`` initialises a fake process group (no communication;
    enough to construct layers), torn down after the test."""
    import torch.distributed as dist
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    def start(rank, world_size):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank,
                                world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
