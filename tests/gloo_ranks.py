"""CPU ranks over gloo for tests: ``spawn(check, world)`` runs ``check(world, rank)`` in
``world`` processes sharing one default process group; ``fork(worker, ...)`` runs a worker
in forked processes (closures and module state carry over) and collects what they
report."""

import contextlib
import os
import sys
import tempfile

import torch

import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, check, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        check(world, rank)
        # No rank tears its group down while a peer still talks to it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A spawned rank that passed leaves without the interpreter's teardown, as a forked
    # one (:func:`fork`) always does. A gloo rank of test_eplb's point-to-point test was
    # killed by SIGABRT ("terminate called without an active exception"; no assertion
    # failed) in 2 of ~19 runs, 1 of ~130 after the barrier above, 0 of 159 on a 2-core
    # machine: torch's gloo backend can hold work objects whose tensors are freed while
    # the interpreter shuts down (pytorch/pytorch PR 179291), and only spawned ranks,
    # not forked ones, run that shutdown. A failed check raises above and reports as
    # before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(check, world: int) -> None:
    """``check`` must be a module-level function (it is pickled by name)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_run, args=(check, world, f"{d}/init"), nprocs=world, join=True)


@contextlib.contextmanager
def group(rank: int, world: int, store, results):
    """A forked worker's gloo process group (the default one, over the file ``store``):
    an exception in the body is reported as ``(rank, "error", repr)`` on ``results`` --
    what :func:`fork` stops at -- and raised again; the group is destroyed after."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        yield
    except Exception as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", repr(err)))
        raise
    finally:
        dist.destroy_process_group()


def fork(worker, world: int, store, args: tuple, expected: int,
         timeout: float = 180.0) -> tuple[list, list]:
    """Run ``worker(rank, world, store, *args, results)`` in ``world`` forked processes
    and collect ``expected`` items they ``results.put``, stopping at one whose second field
    is ``"error"``. Ranks still alive after ``timeout`` (a peer failed: they wait in a
    collective) are killed. Returns ``(exit codes, items)``."""
    ctx = torch.multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store, *args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    items = []
    while len(items) < expected and "error" not in {i[1] for i in items}:
        items.append(results.get(timeout=timeout))
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs], items
