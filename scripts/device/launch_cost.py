"""Host time of one eager launch of each layer kernel, and of one eager compute-only
call (no CUDA graph), one GPU; then cProfile of 50 layer0 launches.

Experiment (seventh session of 2026-11-23): why a synchronised per-call timer made the
layer kernels look slower than the variant tile loops (scripts/device/layer_vs_loop.py):
their launches cost the host more. qwen2-moe, one EP=2 rank's experts, 128 tokens.

    PYTHONPATH=. python3 scripts/device/launch_cost.py
"""
import cProfile, pstats, sys, time, torch
sys.path[:0] = ["scripts/device", "."]
from comet.config import preset
from comet.kernels import launch as L
from comet.runtime.layer import FusedMoE
base = preset("qwen2-moe"); el = base.num_experts // 2
cfg = base.replace(num_experts=el, top_k=min(base.top_k, el), n_group=min(base.n_group, el), max_tokens=1024)
h, f = cfg.hidden_size, cfg.intermediate_size
w13 = torch.randn(el, h, 2 * f, device="cuda").to(cfg.dtype) * 0.02
w2 = torch.randn(el, f, h, device="cuda").to(cfg.dtype) * 0.02
layer = FusedMoE(cfg, w13, w2, use_graphs=False)
x = torch.randn(128, h, device="cuda", dtype=cfg.dtype)
ids = torch.stack([torch.randperm(el, device="cuda")[:cfg.top_k] for _ in range(128)])
w = torch.rand(ids.shape, device="cuda")
for _ in range(3): layer(x, ids, w, mode="compute_only")
torch.cuda.synchronize()
ws, tile, s, grid = layer.ws, layer.tile, layer._static, layer.programs
def l0(): L.launch_layer0(ws, cfg, s.addr[0:1], layer.w13, tile, L.ROLE_COMPUTE, s.split[0:1], grid, wait=False)
def l1(): L.launch_layer1(ws, cfg, layer.w2, tile, L.ROLE_COMPUTE, s.split[1:2], grid)
for name, fn in (("layer0", l0), ("layer1", l1), ("call", lambda: layer(x, ids, w, mode="compute_only"))):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): fn()
    host = (time.perf_counter() - t) / 50 * 1e6
    torch.cuda.synchronize()
    print(f"{name}: host {host:.1f} us per launch", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(50): l0()
pr.disable(); torch.cuda.synchronize()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(30)
