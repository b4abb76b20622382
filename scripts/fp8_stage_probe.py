"""How many K steps of operands Triton keeps in shared memory for the FP8 GEMM loops, per
m-tile rows, ``num_stages`` and warps: compiled for sm_90 on a machine without a GPU.

Usage (from the repository root, ``TRITON_INTERPRET`` unset)::

    PYTHONPATH=.:tests python scripts/fp8_stage_probe.py [--tiles 64:3:8 16:3:8 16:4:8 ...]

Each ``M:S:W`` compiles the fused layer0 and layer1 launches of a small FP8 layer on a tile
of ``block_m=M, num_stages=S, num_warps=W`` (tests/sm90_compile.py's recorder and
compiler) and prints, per kernel: shared memory, registers and spills, the MMA generation
of its dot (v3: wgmma, v2: mma.sync) and the e4m3 buffers of its K loop (``count x rows x
K step``). Why: at 16 rows Triton runs the dot on mma.sync, whose pipeliner keeps one
buffer fewer than ``num_stages`` (the wgmma path keeps ``num_stages``).
"""

from __future__ import annotations

import argparse
import re

import torch

import sm90_compile as sc
from comet.config import MoEConfig, TileConfig
from comet.constants import ROLE_FUSED
from comet.quant import E4M3, Fp8, Fp8Weight, ScaleBlocks
from comet.runtime.forward import CallInputs, ForwardCall, Grids
from comet.runtime.layer import fp8_tile
from comet.runtime.staging import address_of
from comet.runtime.workspace import allocate_virtual

H = F = 256
WORLD = 4


def probe(block_m: int, stages: int, warps: int) -> list[str]:
    """One line per GEMM kernel of the FP8 layer on that tile."""
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=H, intermediate_size=F,
                    max_tokens=64, fp8=Fp8())
    el, blocks = cfg.num_experts // WORLD, ScaleBlocks()
    w13 = Fp8Weight(torch.zeros(el, 2 * F, H, dtype=E4M3),
                    torch.ones(el, 2 * F // 128, H // 128), blocks, parts=2)
    w2 = Fp8Weight(torch.zeros(el, H, F, dtype=E4M3), torch.ones(el, H // 128, F // 128), blocks)
    x = torch.zeros(10, H, dtype=torch.bfloat16)
    split = torch.full((1,), 4, dtype=torch.int64)
    inputs = CallInputs(address_of(x), address_of(x), split, split, split,
                        torch.zeros(64, 2, dtype=torch.int64), torch.zeros(64, 2))
    grids = Grids(132, 132, 132, 132)
    tile = fp8_tile(TileConfig()).with_fields(block_m=block_m, num_stages=stages,
                                              num_warps=warps)
    ws = allocate_virtual(cfg, WORLD, "cpu", tile)[0]

    def launches():
        ForwardCall(ws, w13, w2, tile, inputs, grids, "fused").launch_layer0(ROLE_FUSED, 132)
        ForwardCall(ws, w13, w2, tile, inputs, grids, "sequential").launch_layer1(
            ROLE_FUSED, 132)

    lines = []
    for kernel, args, kwargs in sc.record_launches(launches):
        name = kernel.fn.__name__
        if name not in sc.GEMM_KERNELS:
            continue
        k = sc.compile_launch(kernel, args, dict(kwargs))
        ttgir = k.asm["ttgir"]
        mma = "v3" if "warp_group_dot" in ttgir else "v2"
        buffers = sorted(set(re.findall(r"memdesc<(\d+x\d+x\d+)xf8E4M3FN", ttgir)))
        lines.append(f"block_m={block_m} num_stages={stages} num_warps={warps} {name:22s} "
                     f"smem={k.metadata.shared} {sc.resource_usage(k)} mma={mma} "
                     f"e4m3 buffers={' '.join(buffers)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="+", default=["64:3:8", "16:3:8", "16:4:8", "16:5:8",
                                                        "16:3:4", "16:4:4"],
                        help="block_m:num_stages:num_warps")
    for spec in parser.parse_args().tiles:
        for line in probe(*(int(v) for v in spec.split(":"))):
            print(line, flush=True)


if __name__ == "__main__":
    main()
