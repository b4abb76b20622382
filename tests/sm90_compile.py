"""Compile every fused kernel for sm_90 on a machine without a GPU.

The host launchers run for real on CPU tensors; ``JITFunction.run`` is replaced by a
recorder, and each recorded launch is compiled with Triton's own front end, LLVM and the
ptxas it ships, for a Hopper target. This catches type errors, unsupported constructs and
inline-PTX mistakes in CI, before any GPU time is spent.

Run as a script (``TRITON_INTERPRET`` must be unset): prints one line per kernel, exits 1
on the first failure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def record_launches(fn):
    """Run ``fn()``; return the (kernel, args, kwargs) of every Triton launch it made."""
    launches = []
    original = JITFunction.run

    def fake_run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = fake_run
    try:
        fn()
    finally:
        JITFunction.run = original
    return launches


def _divisible_by_16(value) -> bool:
    """What Triton's launcher specialises on: 16-byte aligned tensors, integers that are
    multiples of 16 (so the compile sees the alignment a GPU launch would)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_launch(kernel, args, kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_cooperative_grid", None)
    bound = dict(zip([p.name for p in kernel.params], args))
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[p.name] = mangle_type(value)
            if _divisible_by_16(value) and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=options)


def fused_launches(dtype=torch.bfloat16, world=4):
    from comet.config import MoEConfig
    from comet.kernels import launch as L
    from comet.kernels.act_backward import act_backward
    from comet.runtime.backward import BACKWARD_SCALARS, BackwardCall, GradBuffers
    from comet.runtime.staging import StagedScalars
    from comet.runtime.workspace import allocate_virtual

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256,
                    dtype=dtype, max_tokens=64)
    tile = L.TileConfig()
    el = cfg.num_experts // world
    ws = allocate_virtual(cfg, world, "cpu", tile)[0]
    w13 = torch.zeros(el, 256, 512, dtype=dtype)
    w2 = torch.zeros(el, 256, 256, dtype=dtype)
    x = torch.zeros(10, 256, dtype=dtype)
    ids = torch.zeros(64, 2, dtype=torch.int64)
    wts = torch.zeros(64, 2)

    def run():
        L.launch_plan(ws, cfg, ids, wts, tile)
        split = L.split_of(4, "cpu")
        for role in (L.ROLE_FUSED, L.ROLE_COMM, L.ROLE_COMPUTE):
            L.launch_layer0(ws, cfg, L.address_of(x), w13, tile, role, split, 132)
            L.launch_layer1(ws, cfg, w2, tile, role, split, 132)
        # The decode tile (small calls): its GEMM roles must pipeline too.
        decode = tile.decode_tile()
        L.launch_plan(ws, cfg, ids, wts, decode)
        L.launch_layer0(ws, cfg, L.address_of(x), w13, decode, L.ROLE_FUSED, split, 132)
        L.launch_layer1(ws, cfg, w2, decode, L.ROLE_FUSED, split, 132)
        trace = torch.zeros(132, L.MAX_TRACE_EVENTS, 4, dtype=torch.int64)
        L.launch_layer0(ws, cfg, L.address_of(x), w13, tile, L.ROLE_FUSED, split, 132,
                        trace=trace)
        L.launch_layer1(ws, cfg, w2, tile, L.ROLE_FUSED, split, 132, trace=trace)
        L.launch_combine(ws, cfg, L.address_of(x), split, tile, 132)
        # layer1's scatter epilogue: the dispatch with row homes, the GEMM that sends, the
        # combine over slots (the store to per-row peer addresses must be 16-byte wide).
        scatter = dataclasses.replace(tile, layer1_scatter=True)
        wss = allocate_virtual(cfg, world, "cpu", scatter)[0]
        L.launch_plan(wss, cfg, ids, wts, scatter)
        for role in (L.ROLE_FUSED, L.ROLE_COMM):
            L.launch_layer0(wss, cfg, L.address_of(x), w13, scatter, role, split, 132,
                            row_home=True)
        L.launch_layer1(wss, cfg, w2, scatter, L.ROLE_COMPUTE, split, 132, scatter=True)
        L.launch_combine(wss, cfg, L.address_of(x), split, scatter, 132, scatter=True)
        # layer0's dispatch by copy engines: the placing comm role (TileConfig.copy_dispatch).
        copy = dataclasses.replace(scatter, copy_dispatch=True)
        wsc = allocate_virtual(cfg, world, "cpu", copy)[0]
        L.launch_plan(wsc, cfg, ids, wts, copy)
        for role in (L.ROLE_FUSED, L.ROLE_COMM):
            L.launch_layer0(wsc, cfg, L.address_of(x), w13, copy, role, split, 132, copy=True)
        # layer0 with its A rows gathered through an index (TileConfig.a_gather).
        gather = dataclasses.replace(tile, a_gather=True)
        L.launch_plan(ws, cfg, ids, wts, gather)
        L.launch_layer0(ws, cfg, L.address_of(x), w13, gather, L.ROLE_FUSED, split, 132)
        # The backward's activation kernel (training), both W13 layouts.
        for interleaved in (True, False):
            act_backward(torch.zeros(64, 2 * 320, dtype=dtype), torch.zeros(64, 320, dtype=dtype),
                         torch.zeros(64), interleaved=interleaved)
        # The fused backward: every kernel variant of its phases, fused and by role.
        bufs = GradBuffers.allocate(cfg, world, "cpu")
        staged = (torch.full((cfg.max_tokens, cfg.top_k), -1, dtype=torch.int64),
                  torch.zeros(cfg.max_tokens, cfg.top_k), StagedScalars(BACKWARD_SCALARS, "cpu"))
        for fused in (True, False):
            BackwardCall(ws, cfg, tile, w13, w2, bufs, *staged, 132, fused=fused,
                         layer0_comm=True).start(x, x, ids[:10], wts[:10], (4, 4)).run()
    return record_launches(run)


def resource_usage(compiled) -> str:
    """Registers / stack / spills from the cubin, read with the cuobjdump Triton ships."""
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"regs={m.group(1)} stack={m.group(2)} local={m.group(4)}" if m else ""


def narrow_accesses(compiled) -> int:
    """Global loads and stores of 2-byte elements one at a time in the PTX: a row copy
    compiled that way (the pointer's alignment unknown to Triton) runs at a fraction of
    the bandwidth of 16-byte vectors."""
    ptx = compiled.asm["ptx"]
    return sum(ptx.count(f"{op}.global.{w}b16") for op in ("ld", "st")
               for w in ("", "L1::evict_last."))


def pipelined(name: str, kwargs: dict, shared: int) -> str:
    """``yes``/``no`` for a launch with a GEMM role: does its shared memory hold
    ``num_stages`` copies of a K step's operands (a GEMM loop Triton did not pipeline,
    e.g. with an atomic inside it, has one); ``-`` for launches without a GEMM."""
    if name not in ("layer0_kernel", "layer1_kernel") or kwargs.get("ROLE") == 1:
        return "-"
    gate_up = name == "layer0_kernel" and kwargs["GATED"]   # gate and up columns per tile
    b_cols = kwargs["BLOCK_N"] * (2 if gate_up else 1)
    step = 2 * kwargs["BLOCK_K"] * (kwargs["BLOCK_M"] + b_cols)   # 16-bit operands
    return "yes" if shared >= kwargs["num_stages"] * step else "no"


def main() -> int:
    failures = 0
    for kernel, args, kwargs in fused_launches():
        name = kernel.fn.__name__
        t0 = time.time()
        try:
            k = compile_launch(kernel, args, dict(kwargs))
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        print(f"ok   {name:24s} role={kwargs.get('ROLE', '-')} smem={k.metadata.shared} "
              f"pipelined={pipelined(name, kwargs, k.metadata.shared)} "
              f"{resource_usage(k)} b16={narrow_accesses(k)} ({time.time() - t0:.1f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
