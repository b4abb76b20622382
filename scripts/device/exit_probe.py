"""The copy-dispatch full-size scenario (two virtual EP groups, push and copy, 12 calls
with drift; tests/test_gpu.py::test_copy_dispatch_matches_the_push_at_full_size) in a plain
script: does the process exit cleanly, with everything alive (``--keep``) or freed in
stages (printing before each, so a crash names its stage)?

Measured (1x H100, 2026-11-25, benchmarks/results/2026-11-25/h100-exit-probe.log): exit 0
in every mode, while pytest processes that made comet's private streams segfaulted at
exit. scripts/device/exit_probe.sh runs both.

    PYTHONPATH=. python3 -X faulthandler scripts/device/exit_probe.py [--keep] [--no-copy]
"""

import argparse
import dataclasses
import gc

import torch

from comet.config import preset
from comet.kernels.launch import TileConfig
from comet.runtime.layer import FusedMoE
from comet.runtime.virtual import concurrent_forward

ap = argparse.ArgumentParser()
ap.add_argument("--no-copy", action="store_true", help="both groups push")
ap.add_argument("--no-drift", action="store_true")
ap.add_argument("--test-routing", action="store_true",
                help="the test's routings (uneven token counts, empty ranks)")
ap.add_argument("--keep", action="store_true", help="exit with everything alive")
ap.add_argument("--free-graphs-at-exit", action="store_true",
                help="with --keep: an atexit hook drops every layer's graphs first")
args = ap.parse_args()
cfg = preset("mixtral", max_tokens=2048)
world, el = 2, cfg.num_experts // 2
g = torch.Generator(device="cuda").manual_seed(11)
w13 = [(torch.randn(el, cfg.hidden_size, 2 * cfg.intermediate_size, generator=g,
                    device="cuda") * 0.02).to(cfg.dtype) for _ in range(world)]
w2 = [(torch.randn(el, cfg.intermediate_size, cfg.hidden_size, generator=g, device="cuda")
       * 0.02).to(cfg.dtype) for _ in range(world)]
tile = dataclasses.replace(TileConfig(), copy_dispatch=not args.no_copy)
copy = FusedMoE.virtual_group(cfg, w13, w2, tile=tile)
push = FusedMoE.virtual_group(cfg, w13, w2, programs=copy[0].programs)
streams = [torch.cuda.Stream() for _ in range(world)]
for i in range(12):
    if args.test_routing:
        import sys
        sys.path.insert(0, "tests")
        from routings import KINDS, make_ids, make_tokens
        kind, cg = KINDS[i % len(KINDS)], torch.Generator().manual_seed(i)
        ids = [t.cuda() for t in make_ids(kind, make_tokens(kind, world, 2048, cg),
                                          cfg.num_experts, cfg.top_k, cg)]
    else:
        ids = [torch.randint(0, cfg.num_experts, (2048, cfg.top_k), device="cuda")
               for _ in range(world)]
    xs = [torch.randn(t.shape[0], cfg.hidden_size, device="cuda").to(cfg.dtype)
          for t in ids]
    ws = [torch.softmax(torch.rand(i_.shape, device="cuda"), -1) for i_ in ids]
    delays = [0, 0 if args.no_drift else 100_000 * (i % 4)]
    a = concurrent_forward(push, xs, ids, ws, streams, comm_blocks=16, delay_cycles=delays)
    b = concurrent_forward(copy, xs, ids, ws, streams,
                           comm_blocks=(16, 24)[i % 2] if args.test_routing else 16,
                           delay_cycles=delays[::-1])
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(a, b)), i
print("calls done, outputs identical", flush=True)
if args.keep:
    if args.free_graphs_at_exit:
        import atexit

        @atexit.register
        def _free(layers=push + copy):
            for layer in layers:
                layer._graphs.clear()
            gc.collect()
            torch.cuda.synchronize()
            print("atexit: graphs freed", flush=True)
    raise SystemExit(0)
for name, group in (("push", push), ("copy", copy)):
    for layer in group:
        layer.check_errors_now()
        layer._graphs.clear()
    gc.collect()
    torch.cuda.synchronize()
    print(f"{name} group's graphs freed", flush=True)
del push, a, b
gc.collect()
torch.cuda.synchronize()
print("push group freed", flush=True)
del copy
gc.collect()
torch.cuda.synchronize()
print("copy group freed", flush=True)
torch.cuda.empty_cache()
print("cache emptied; exiting", flush=True)
