"""usage: torchrun --nproc-per-node 2 scripts/device/check_replicated.py

``CometMoE(check_replicated=True)`` on GPUs over NCCL: a (tp=W, ep=1) replicated layer's
input check passes equal inputs and makes every rank raise the same ValueError when TP
rank 1 passes another routing weight or token count (the check runs before any kernel,
so nothing is compiled). Prints one line per rank; exit 1 on any failure."""

import os
import sys

import torch
import torch.distributed as dist

from comet import CometMoE
from comet.mesh import MeshLayout


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    layer = CometMoE(8, 2, 256, 512, device="cuda", mesh=MeshLayout(tp=world, ep=1),
                     convention="replicated", check_replicated=True)
    g = torch.Generator(device="cuda").manual_seed(0)     # the same inputs on every rank
    x = torch.randn(64, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (64, 2), device="cuda", generator=g)
    w = torch.rand(64, 2, device="cuda", generator=g)
    layer._check_replicated(x, ids, w)
    seen = []
    for what, (xx, ww) in {"topk_weights": (x, w + (rank == 1)),
                           "tokens": (x[:63] if rank == 1 else x, w[:63] if rank == 1 else w)
                           }.items():
        try:
            layer._check_replicated(xx, ids[:xx.shape[0]], ww)
            seen.append(f"{what}: no error")
        except ValueError as err:
            seen.append(f"{what}: {'ok' if f'passed different {what}' in str(err) else err}")
    good = all(s.endswith(": ok") for s in seen)
    print(f"rank {rank} ({torch.cuda.get_device_name()}): equal inputs passed; "
          + "; ".join(seen), flush=True)
    dist.destroy_process_group()
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
