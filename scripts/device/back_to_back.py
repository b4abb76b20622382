"""Repro of issue 10 (copied from shared/repro): N back-to-back calls of the fused layer at
full model size (no host sync between calls: lazy error checks, calls 2+ replay the
captured CUDA graph), then one check. At commit 66d677d it hung on 4x and 2x H200
(benchmarks/results/2026-11-23/h200x2-repro-back-to-back.log).

    torchrun --nproc-per-node 4 scripts/device/back_to_back.py E K H F TOKENS SPLIT [SPLIT...]
    SPLIT: "auto" or "n0,n1" (comm blocks of layer0, layer1); run each case in its own process,
    since a failed case leaves the group unusable. Example that hung on 4x H200:
    torchrun --nproc-per-node 4 scripts/device/back_to_back.py 64 4 2048 1408 4096 16,16

Run from the project root with PYTHONPATH=. and COMET_TIMEOUT_S=5.
"""
import os, sys, time
import torch
import torch.distributed as dist
from comet import reference
from comet.config import MoEConfig
from comet.runtime.layer import FusedMoE

CALLS = int(os.environ.get("CALLS", 6))
e, k, h, f, m = [int(v) for v in sys.argv[1:6]]
splits = sys.argv[6:] or ["auto"]
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
W, r = dist.get_world_size(), dist.get_rank()
el = e // W
cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                dtype=torch.bfloat16, max_tokens=m)
g = torch.Generator(device="cuda").manual_seed(1)
w13 = (torch.randn(e, h, 2 * f, generator=g, device="cuda") * h ** -0.5).to(cfg.dtype)
w2 = (torch.randn(e, f, h, generator=g, device="cuda") * f ** -0.5).to(cfg.dtype)
s13, s2 = list(w13.split(el)), list(w2.split(el))
layer = FusedMoE(cfg, s13[r].contiguous(), s2[r].contiguous())
cg = torch.Generator().manual_seed(3)
ids = [torch.rand(m, e, generator=cg).topk(k, dim=1).indices.cuda() for _ in range(W)]
xs = [torch.randn(m, h, generator=cg).to(cfg.dtype).cuda() for _ in range(W)]
ws = [torch.softmax(torch.randn(m, k, generator=cg), -1).cuda() for _ in range(W)]
ref = reference.ep_forward(xs, ids, ws, s13, s2, round_to=cfg.dtype)[r]
for sp in splits:
    nc = None if sp == "auto" else tuple(int(v) for v in sp.split(","))
    t0 = time.time()
    try:
        for i in range(CALLS):
            y = layer(xs[r], ids[r], ws[r], comm_blocks=nc)
        layer.check_errors_now()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        msg = f"ok rel_err={err:.1e} {time.time() - t0:.1f}s split={layer.last_comm_blocks}"
    except Exception as ex:
        msg = f"FAIL {type(ex).__name__}: {str(ex)[:300]} {time.time() - t0:.1f}s"
    print(f"rank {r}", m, sp, msg, flush=True)   # every rank: a failure may be on any
os._exit(0)
