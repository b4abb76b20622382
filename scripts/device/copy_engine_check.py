"""Which copies run beside a grid that holds every SM? (the dispatch by copy engines
depends on it: its layer0 kernels spin on flags that only its copies set)

A Triton kernel spins ``--spin-ms`` on every SM (16 blocks of 4 warps each); 50 ms in,
each kind of copy is issued on another stream, and its time from issue to completion is
taken with CUDA events. A copy that needs SMs finishes only when the spin ends.

    PYTHONPATH=. python3 scripts/device/copy_engine_check.py            # one GPU
    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/device/copy_engine_check.py

Kinds: host to device (pinned), device to device on one GPU (``copy_``), and under
torchrun a copy into the next rank's symmetric memory (``copy_`` into the peer mapping,
what comet.runtime.copy_dispatch issues). JSON: ``$OUT/copy_engine_check.json`` (rank 0).
"""

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from comet.cli.launch import init_ranks

#: Blocks per SM of the spinning grid (4 warps each: 2048 threads, an SM's maximum).
SPIN_BLOCKS_PER_SM = 16


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def spin_kernel(ns, out):
    t0 = _now()
    t = t0
    while t - t0 < ns:
        t = _now()
    tl.store(out + tl.program_id(0), t - t0)


def copy_ms_beside_spin(issue, spin_ms: float) -> float:
    """Milliseconds from issuing ``issue()`` on its own stream, 50 ms into a spin that
    holds every SM, to its completion."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    grid = sms * SPIN_BLOCKS_PER_SM
    out = torch.zeros(grid, dtype=torch.int64, device="cuda")
    spin_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda.synchronize()
    with torch.cuda.stream(spin_stream):
        spin_kernel[(grid,)](int(spin_ms * 1e6), out, num_warps=4)
    time.sleep(0.05)
    with torch.cuda.stream(copy_stream):
        start.record()
        issue()
        end.record()
    end.synchronize()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=int, default=64)
    ap.add_argument("--spin-ms", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "copy_engine_check.json"))
    args = ap.parse_args()
    _, world, rank = init_ranks()
    n = args.mbytes << 20
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    host = torch.randn(n // 4, pin_memory=True)
    kinds = {"host_to_device": lambda: dst.copy_(host, non_blocking=True),
             "device_to_device_same_gpu": lambda: dst.copy_(src)}
    if world > 1:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(n // 4, device="cuda")
        handle = symm_mem.rendezvous(buf, group=dist.group.WORLD)
        peer = handle.get_buffer((rank + 1) % world, (n // 4,), torch.float32)
        kinds["to_peer_gpu_symmetric"] = lambda: peer.copy_(src)
    copy_ms_beside_spin(lambda: None, 1.0)               # compile the spinning kernel
    rec = {k: copy_ms_beside_spin(fn, args.spin_ms) for k, fn in kinds.items()}
    if world > 1:
        torch.distributed.barrier()
    if rank == 0:
        print(json.dumps(rec), flush=True)
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "world": world,
                       "mbytes": args.mbytes, "spin_ms": args.spin_ms,
                       "copy_ms_beside_spin": rec}, fh, indent=1)


if __name__ == "__main__":
    main()
