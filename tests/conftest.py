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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th (from 1) of N contiguous slices of the selected "
                          "tests, equal in count: a GPU file that outgrows one device call "
                          "runs as N calls (scripts/device/gpu_tests.sh)")


def shard_slice(spec: str, count: int) -> slice:
    """The slice of ``count`` selected tests that ``--shard I/N`` keeps: contiguous, so a
    test's parametrizations (which share compiled kernels) mostly stay in one call."""
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N, got {spec!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {spec}: I must be in 1..N")
    return slice((i - 1) * count // n, i * count // n)


@pytest.hookimpl(trylast=True)   # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    if (spec := config.getoption("--shard")) is not None:
        keep = shard_slice(spec, len(items))
        config.hook.pytest_deselected(items=items[:keep.start] + items[keep.stop:])
        items[:] = items[keep]
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
