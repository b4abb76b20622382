"""CPU ranks over gloo for tests: ``spawn(check, world)`` runs ``check(world, rank)`` in
``world`` processes sharing one default process group."""

import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, check, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        check(world, rank)
    finally:
        dist.destroy_process_group()


def spawn(check, world: int) -> None:
    """``check`` must be a module-level function (it is pickled by name)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_run, args=(check, world, f"{d}/init"), nprocs=world, join=True)
