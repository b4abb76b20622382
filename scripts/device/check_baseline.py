"""The unfused and chunked EP baselines against the spec on the GPUs, over NCCL.

    torchrun --standalone --nproc-per-node=4 scripts/device/check_baseline.py

Every rank builds every rank's inputs from one seed, so each can compute the spec
(comet.reference.ep_forward) for itself; the CPU tests do the same over gloo. Here the
GPU paths run: torch._grouped_mm, NCCL all_to_all_single, the chunked side stream.
"""

import os

import torch
import torch.distributed as dist

from comet import reference
from comet.baseline import chunked_ep_moe_forward, ep_moe_forward


def inputs(world, tokens, e, k, h, f, seed, dtype, device, hot=False):
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for m in tokens:
        scores = torch.rand(m, e, generator=g)
        if hot:
            scores[:, 0] += 1.0           # every token picks expert 0
            scores[:, e - 1] = -1.0       # and never the last one: an empty expert
        ids.append(scores.topk(k, dim=1).indices.to(device))
        ws.append(torch.rand(m, k, generator=g).to(device))
        xs.append(torch.randn(m, h, generator=g).to(device, dtype))
    el = e // world
    w13 = (torch.randn(e, h, 2 * f, generator=g) * h ** -0.5).to(device, dtype)
    w2 = (torch.randn(e, f, h, generator=g) * f ** -0.5).to(device, dtype)
    return (xs, ids, ws, [w13[r * el:(r + 1) * el] for r in range(world)],
            [w2[r * el:(r + 1) * el] for r in range(world)])


def main():
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", local)
    worst = 0.0
    for case in [dict(tokens=[300 + 97 * r for r in range(world)], e=8 * world, k=2, h=512,
                      f=768, seed=1, hot=False),
                 dict(tokens=[0 if r == 1 else 257 for r in range(world)], e=4 * world, k=4,
                      h=256, f=512, seed=2, hot=True)]:
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            xs, ids, ws, s13, s2 = inputs(world, device=dev, dtype=dtype, **case)
            want = reference.ep_forward(xs, ids, ws, s13, s2, round_to=dtype)[rank]
            scale = max(want.abs().max().item(), 1e-6) if want.numel() else 1.0
            outs = {"unfused": ep_moe_forward(xs[rank], ids[rank], ws[rank], s13[rank],
                                              s2[rank])}
            for chunks in (2, 4):
                outs[f"chunked{chunks}"] = chunked_ep_moe_forward(
                    xs[rank], ids[rank], ws[rank], s13[rank], s2[rank], chunks=chunks)
            for name, got in outs.items():
                err = (got - want).abs().max().item() / scale if want.numel() else 0.0
                worst = max(worst, err / tol)
                status = "ok" if err <= tol else "FAIL"
                print(f"rank {rank} {name:9s} {str(dtype):14s} tokens={case['tokens'][rank]:4d}"
                      f" rel err {err:.2e} (tol {tol:.0e}) {status}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if worst <= 1.0 else 1)


if __name__ == "__main__":
    main()
