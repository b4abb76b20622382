"""Compile every fused kernel for sm_90 on a machine without a GPU.

The host launchers run for real on CPU tensors; ``JITFunction.run`` is replaced by a
recorder, and each recorded launch is compiled with Triton's own front end, LLVM and the
ptxas it ships, for a Hopper target. This catches type errors, unsupported constructs and
inline-PTX mistakes in CI, before any GPU time is spent.

Run as a script (``TRITON_INTERPRET`` must be unset): prints one line per kernel, exits 1
on the first failure. ``--digest`` adds each launch's SASS digest (:func:`sass_digest`):
run it on two checkouts and diff the lines to show that a change leaves the machine code
of the kernels a GPU run measured as it was (or which launches it changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

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


def compile_launch(kernel, args, kwargs):
    """Compile one recorded launch as Triton's own launcher would (its binder specialises
    every argument, argument groups included), for a Hopper target."""
    kwargs = dict(kwargs)
    kwargs.pop("launch_cooperative_grid", None)
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    src = source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=HOPPER, options=options.__dict__)
    launcher_source(src, compiled)
    return compiled


def launcher_source(src, compiled) -> str | None:
    """The C source of the launcher a GPU would build for this kernel (Triton's CUDA
    driver, which runs without a GPU up to compiling it): it has its own view of the
    signature -- Triton 3.6's, the GPU machines', takes tensor descriptors only as
    top-level arguments -- and fails here as it would at the first launch. None with a
    Triton whose driver builds its launcher another way (3.9 has no ``make_launcher``)."""
    try:
        from triton.backends.nvidia.driver import make_launcher
    except ImportError:
        return None
    arg_idx = lambda x: (src.fn.arg_names.index(x), ) if isinstance(x, str) else x  # noqa: E731
    constants = {arg_idx(i): v for i, v in src.constants.items()}
    return make_launcher(constants, dict(src.signature),
                         getattr(compiled.metadata, "tensordesc_meta", None))


def fused_launches(dtype=torch.bfloat16, world=4):
    from comet.activation import GatedActivation
    from comet.config import MoEConfig, TileConfig
    from comet.constants import ROLE_COMM, ROLE_COMPUTE, ROLE_FUSED
    from comet.kernels.act_backward import act_backward
    from comet.kernels.act_forward import gated_rows
    from comet.kernels.mesh_routing import shard_routing
    from comet.kernels.stage_routing import RoutingStage, launch_stage_routing
    from comet.mesh import MeshLayout
    from comet.runtime.backward import BACKWARD_SCALARS, BackwardCall, GradBuffers
    from comet.runtime.forward import CallInputs, ForwardCall, Grids
    from comet.runtime.staging import StagedScalars, address_of
    from comet.runtime.workspace import allocate_virtual

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256,
                    dtype=dtype, max_tokens=64)
    tile = TileConfig()
    el = cfg.num_experts // world
    ws = allocate_virtual(cfg, world, "cpu", tile)[0]
    w13 = torch.zeros(el, 256, 512, dtype=dtype)
    w2 = torch.zeros(el, 256, 256, dtype=dtype)
    x = torch.zeros(10, 256, dtype=dtype)
    ids = torch.zeros(64, 2, dtype=torch.int64)
    wts = torch.zeros(64, 2)
    split = torch.full((1,), 4, dtype=torch.int64)
    inputs = CallInputs(address_of(x), address_of(x), split, split, split, ids, wts)
    grids = Grids(132, 132, 132, 132)

    def call(mode="fused", t=tile, **kw):
        return ForwardCall(ws, w13, w2, t, inputs, grids, mode, **kw)

    def run():
        # The whole fused call (plan, fused layer0, layer1's scatter, combine over slots):
        # the store of the scatter epilogue to per-row peer addresses must be 16-byte wide.
        call().run()
        # A layer's first launch: the caller's routing into the staged rows; the plan of
        # a small call with that copy in its opening (open_kernel), and of a call of many
        # token blocks (count, scan, layout, place).
        staged = RoutingStage(torch.zeros(2, dtype=torch.int64), split, ids, wts)
        launch_stage_routing(staged)
        for phase in call(routing_stage=staged).stages()[0][1]:
            phase()
        for phase in call(t=tile.with_fields(small_plan_blocks=0)).stages()[0][1]:
            phase()
        # layer0 in every role; layer1's reduce kernel in every role, and its combine.
        for role in (ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE):
            call().launch_layer0(role, 132)
            call("sequential").launch_layer1(role, 132)
        call("sequential").combine(132)
        # A gathered dispatch (Variant.layer0_gather): layer0 in every role, its GEMM
        # reading A through the index (cp.async loads, not TMA boxes) -- all of each
        # tile's index entries; then a small call's kernels, which load only a tile's own
        # rows (layer0_live_rows) in every role and as stream-K or not, and a large
        # call's fused kernel (neither small-call variant), with this rank's own rows read
        # in place (layer0_own_in_place, the default) and copied.
        ga = tile.with_fields(layer0_gather=True, layer0_live_rows=False)
        gws = allocate_virtual(cfg, world, "cpu", ga)[0]
        for role in (ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE):
            ForwardCall(gws, w13, w2, ga, inputs, grids).launch_layer0(role, 132)
        live = ga.with_fields(layer0_live_rows=True)
        for role in (ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE):
            ForwardCall(gws, w13, w2, live, inputs, grids).launch_layer0(role, 132)
        for t in (live.with_fields(layer0_stream_k=False),
                  ga.with_fields(layer0_stream_k=False),
                  ga.with_fields(layer0_own_in_place=False)):
            ForwardCall(gws, w13, w2, t, inputs, grids).launch_layer0(ROLE_FUSED, 132)
        # layer0 as stream-K (Variant.layer0_stream_k, on by default): the fused
        # launch, and with expert biases and a half-tail F (the epilogue on a partial box).
        sk = tile.with_fields(layer0_stream_k=True)
        ForwardCall(allocate_virtual(cfg, world, "cpu", sk)[0], w13, w2, sk, inputs,
                    grids).launch_layer0(ROLE_FUSED, 132)
        sk_half = cfg.replace(intermediate_size=320, expert_bias=True)
        ForwardCall(allocate_virtual(sk_half, world, "cpu", sk)[0],
                    torch.zeros(el, 256, 640, dtype=dtype), torch.zeros(el, 320, 256, dtype=dtype),
                    sk, inputs, grids, b13=torch.zeros(el, 640, dtype=dtype),
                    b2=torch.zeros(el, 256, dtype=dtype)).launch_layer0(ROLE_FUSED, 132)
        # layer0's last partial round in K splits (Variant.layer0_tail_split, on by
        # default, so in every launch above): the fused launch of a call too large for
        # stream-K, and of one too large for both.
        for t in (tile.with_fields(layer0_stream_k=False),
                  tile.with_fields(layer0_stream_k=False, layer0_tail_split=1)):
            ForwardCall(allocate_virtual(cfg, world, "cpu", t)[0], w13, w2, t, inputs,
                        grids).launch_layer0(ROLE_FUSED, 132)
        # The decode tile (small calls): its GEMM roles must pipeline too.
        decode = tile.decode_tile()
        call(t=decode).launch_layer0(ROLE_FUSED, 132)
        call("sequential", decode).launch_layer1(ROLE_FUSED, 132)
        # layer1 in K splits for small calls (Variant.layer1_split_k, on by default):
        # the decode tile with and without expert biases, and with K splits off.
        ForwardCall(ws, w13, w2, decode, inputs, grids).launch_layer1(ROLE_FUSED, 132)
        ForwardCall(allocate_virtual(cfg.replace(expert_bias=True), world, "cpu", tile)[0],
                    w13, w2, decode, inputs, grids, b13=torch.zeros(el, 512, dtype=dtype),
                    b2=torch.zeros(el, 256, dtype=dtype)).launch_layer1(ROLE_FUSED, 132)
        off = tile.with_fields(layer1_split_k=1)
        ForwardCall(allocate_virtual(cfg, world, "cpu", off)[0], w13, w2, off.decode_tile(),
                    inputs, grids).launch_layer1(ROLE_FUSED, 132)
        # Traced launches (comet bench --timeline).
        trace = torch.zeros(132, 512, 4, dtype=torch.int64)
        call(trace={"layer0": trace, "layer1": trace}).run()
        call("sequential", trace={"layer0": trace, "layer1": trace}).launch_layer1(
            ROLE_FUSED, 132)
        # The expert variants: GPT-OSS's clamped SwiGLU with biases (both layer1
        # algorithms), and GELU-tanh on the decode tile's two-dot epilogue.
        gpt_oss = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)
        variant_ws = allocate_virtual(cfg.replace(activation=gpt_oss, expert_bias=True), world,
                                      "cpu", tile)[0]
        b13, b2 = torch.zeros(el, 512, dtype=dtype), torch.zeros(el, 256, dtype=dtype)
        ForwardCall(variant_ws, w13, w2, tile, inputs, grids, b13=b13, b2=b2).run()
        ForwardCall(variant_ws, w13, w2, tile, inputs, grids, "sequential", b13=b13,
                    b2=b2).launch_layer1(ROLE_FUSED, 132)
        gelu_ws = allocate_virtual(cfg.replace(activation=GatedActivation(kind="gelu_tanh")),
                                   world, "cpu", tile)[0]
        ForwardCall(gelu_ws, w13, w2, decode, inputs, grids).launch_layer0(ROLE_FUSED, 132)
        # F ending in half an interleave block (TP shards of F = 1408, GPT-OSS's 2880):
        # layer0's one-dot tiles with the half-tail epilogue, default and GPT-OSS biased.
        half_cfg = cfg.replace(intermediate_size=320)
        w13_h = torch.zeros(el, 256, 640, dtype=dtype)
        w2_h = torch.zeros(el, 320, 256, dtype=dtype)
        ForwardCall(allocate_virtual(half_cfg, world, "cpu", tile)[0], w13_h, w2_h, tile,
                    inputs, grids).launch_layer0(ROLE_FUSED, 132)
        ForwardCall(allocate_virtual(half_cfg.replace(activation=gpt_oss, expert_bias=True),
                                     world, "cpu", tile)[0], w13_h, w2_h, tile, inputs, grids,
                    b13=torch.zeros(el, 640, dtype=dtype), b2=b2).launch_layer0(ROLE_FUSED, 132)
        # A replicated (tp, ep) = (2, 2) layout: the shard-slot launch, the fan-out of
        # the scatter epilogue and of the reduce's sends, the combine's liveness.
        mesh = MeshLayout(tp=2, ep=world // 2)
        mesh_ws = allocate_virtual(mesh.kernel_config(cfg), world, "cpu", tile)[1]
        mesh_ws.fanout, mesh_ws.tp = mesh.home_fanout("replicated"), mesh.tp
        k_slots = cfg.top_k * mesh.tp
        shards = shard_routing(ids, wts, split, torch.zeros(64, k_slots, dtype=torch.int64),
                               torch.zeros(64, k_slots), num_experts=cfg.num_experts,
                               ep=mesh.ep, tp=mesh.tp, kept=1)
        mesh_inputs = inputs._replace(ids=shards.shard_ids, weights=shards.shard_weights)
        f_shard = cfg.intermediate_size // mesh.tp
        w13_t = torch.zeros(el * 2, 256, 2 * f_shard, dtype=dtype)
        w2_t = torch.zeros(el * 2, f_shard, 256, dtype=dtype)
        ForwardCall(mesh_ws, w13_t, w2_t, tile, mesh_inputs, grids,
                    shard_routing=shards).run()
        sequential = ForwardCall(mesh_ws, w13_t, w2_t, tile, mesh_inputs, grids, "sequential")
        sequential.launch_layer1(ROLE_FUSED, 132)
        sequential.combine(132)
        # The backward's activation kernel (training), both W13 layouts, and a variant.
        for interleaved in (True, False):
            act_backward(torch.zeros(64, 2 * 320, dtype=dtype), torch.zeros(64, 320, dtype=dtype),
                         torch.zeros(64), interleaved=interleaved)
        act_backward(torch.zeros(64, 2 * 320, dtype=dtype), torch.zeros(64, 320, dtype=dtype),
                     torch.zeros(64), interleaved=True, activation=gpt_oss)
        # The unfused baselines' activation pass, the default and a variant.
        for act in (None, gpt_oss):
            gated_rows(torch.zeros(64, 2 * 320, dtype=dtype), *([act] if act else []))
        # FP8 experts (MoEConfig.fp8): the whole call (the home rank's quantize, the
        # dispatch of packed rows with layer0's block-scaled GEMM, layer1's scatter,
        # combine), layer0 and layer1's reduce kernel in every role, the decode tile; and
        # a gathered dispatch; a TP shard of F = 192 (a ragged group, 64-wide blocks:
        # per-column scales).
        for fp8_launch in fp8_launches(cfg, world, inputs, grids):
            fp8_launch()
        # The fused backward: every kernel variant of its phases, fused and by role.
        bufs = GradBuffers.allocate(cfg, world, "cpu")
        staged = (torch.full((cfg.max_tokens, cfg.top_k), -1, dtype=torch.int64),
                  torch.zeros(cfg.max_tokens, cfg.top_k), StagedScalars(BACKWARD_SCALARS, "cpu"))
        for fused in (True, False):
            BackwardCall(ws, cfg, tile, w13, w2, bufs, *staged, 132, fused=fused,
                         layer0_comm=True).start(x, x, ids[:10], wts[:10], (4, 4)).run()
    return record_launches(run)


def fp8_launches(cfg, world, inputs, grids) -> list:
    """The FP8 layer's launches of :func:`fused_launches` (callables)."""
    from comet.constants import ROLE_COMM, ROLE_COMPUTE, ROLE_FUSED
    from comet.quant import E4M3, Fp8, Fp8Weight, ScaleBlocks
    from comet.runtime.forward import ForwardCall
    from comet.runtime.layer import fp8_tile
    from comet.runtime.workspace import allocate_virtual
    from comet.config import TileConfig

    def weights(el, h, f, blocks):
        gate_up = Fp8Weight(torch.zeros(el, 2 * f, h, dtype=E4M3),
                            torch.ones(el, 2 * -(-f // blocks.n), -(-h // blocks.k)), blocks,
                            parts=2)
        down = Fp8Weight(torch.zeros(el, h, f, dtype=E4M3),
                         torch.ones(el, -(-h // blocks.n), -(-f // blocks.k)), blocks)
        return gate_up, down

    # The cuts of layer0's K loop (stream-K, tail splits) only where asked, as in the
    # default FP8 tile; layer1's K splits on (the decode tile's launches below).
    tile = fp8_tile(TileConfig().with_fields(layer0_stream_k=False, layer0_tail_split=0))
    el = cfg.num_experts // world
    fp8 = cfg.replace(fp8=Fp8())
    ws = allocate_virtual(fp8, world, "cpu", tile)[0]
    w13, w2 = weights(el, cfg.hidden_size, cfg.intermediate_size, ScaleBlocks())

    def call(mode="fused", t=tile, space=ws, w=(w13, w2)):
        return ForwardCall(space, *w, t, inputs, grids, mode)

    out = [lambda: call().run()]
    for role in (ROLE_FUSED, ROLE_COMM, ROLE_COMPUTE):
        out.append(lambda role=role: call().launch_layer0(role, 132))
        out.append(lambda role=role: call("sequential").launch_layer1(role, 132))
    # layer1 of a small call on the decode tile, in K splits (Variant.layer1_split_k): on
    # the preset's K steps of 128 and on a TP shard's of 64 (below).
    out.append(lambda: call(t=tile.decode_tile()).launch_layer1(ROLE_FUSED, 132))
    # A gathered dispatch (Variant.layer0_gather): the GEMM's packed rows through the
    # index, this rank's own from its home rows (the default) or copied.
    gather = tile.with_fields(layer0_gather=True)
    gather_ws = allocate_virtual(fp8, world, "cpu", gather)[0]
    for t in (gather, gather.with_fields(layer0_own_in_place=False)):
        out.append(lambda t=t: call(t=t, space=gather_ws).run())
    out.append(lambda: call(t=gather, space=gather_ws).launch_layer0(ROLE_COMPUTE, 132))
    shard = fp8.replace(intermediate_size=192)
    shard_ws = allocate_virtual(shard, world, "cpu", tile)[0]
    shard_w = weights(el, cfg.hidden_size, 192, ScaleBlocks(64, 128))
    shard_w = (shard_w[0], weights(el, cfg.hidden_size, 192, ScaleBlocks(128, 64))[1])
    out.append(lambda: call(space=shard_ws, w=shard_w).run())
    out.append(lambda: call(t=tile.decode_tile(), space=shard_ws, w=shard_w).launch_layer1(
        ROLE_FUSED, 132))
    # layer0 of a small call cut in K (Variant.layer0_stream_k, layer0_tail_split: both
    # compiled into one launch) on the decode tile and the large one, and on the TP shard.
    cut = fp8_tile(TileConfig())
    cut_ws = allocate_virtual(fp8, world, "cpu", cut)[0]
    cut_shard_ws = allocate_virtual(shard, world, "cpu", cut)[0]
    for t in (cut.decode_tile(), cut):
        out.append(lambda t=t: call(t=t, space=cut_ws).launch_layer0(ROLE_FUSED, 132))
    out.append(lambda: call(t=cut.decode_tile(), space=cut_shard_ws, w=shard_w).launch_layer0(
        ROLE_FUSED, 132))
    # Small calls on 16-row m-tiles (GemmConfig.small_block_m, the Selector's small-rows
    # rule): the whole call with layer0's cuts, and layer1 on the decode tile.
    small = cut.small_rows_tile()
    out.append(lambda: call(t=small, space=cut_ws).run())
    out.append(lambda: call(t=small.decode_tile(), space=cut_ws).launch_layer1(ROLE_FUSED, 132))
    # Large calls of a one-rank layer on the warp-specialized GEMMs (Variant.fp8_ws_min_rows,
    # comet.kernels.fp8_ws): the whole call (the dispatch launch, both Gluon GEMMs,
    # flag1's release, the combine); GPT-OSS's clamped SwiGLU and GELU-tanh in layer0's
    # epilogue, with F ending in part of a group (320).
    from comet.activation import GatedActivation
    ws_tile = tile.with_fields(fp8_ws_min_rows=128)
    out.append(lambda: call(t=ws_tile, space=allocate_virtual(fp8, world, "cpu", ws_tile)[0]).run())
    # ... with both GEMMs on paired m-tiles (Variant.fp8_ws_paired_rows: the plan's table
    # re-cut in 128-row tiles, comet.kernels.plan.paired_tiles, then the paired GEMMs).
    ws_paired = ws_tile.with_fields(fp8_ws_paired_rows=128)
    out.append(lambda: call(t=ws_paired,
                            space=allocate_virtual(fp8, world, "cpu", ws_paired)[0]).run())
    # ... and with a gathered dispatch: layer0 reads A's rows through the index (A_GATHER).
    ws_gather = ws_tile.with_fields(layer0_gather=True)
    out.append(lambda: call(t=ws_gather,
                            space=allocate_virtual(fp8, world, "cpu", ws_gather)[0]).run())
    for act in (GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0),
                GatedActivation(kind="gelu_tanh")):
        ragged = fp8.replace(intermediate_size=320, activation=act)
        out.append(lambda ragged=ragged: call(
            t=ws_tile, space=allocate_virtual(ragged, world, "cpu", ws_tile)[0],
            w=weights(el, cfg.hidden_size, 320, ScaleBlocks())).run())
    return out


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


def sass_digest(compiled) -> str:
    """12 hex digits of the kernel's SASS (``nvdisasm`` of the cubin, as Triton ships it),
    instruction addresses and encodings stripped: equal digests are the same instructions,
    whatever the source lines or the kernel's debug info."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    code = [re.sub(r"/\*\s*0?x?[0-9a-f]+\s*\*/|;.*$", "", line).strip()
            for line in sass.splitlines()]
    return hashlib.sha1("\n".join(c for c in code if c).encode()).hexdigest()[:12]


def narrow_accesses(compiled, kwargs: dict) -> int:
    """Global loads and stores of 2-byte elements one at a time in the PTX: a row copy
    compiled that way (the pointer's alignment unknown to Triton) runs at a fraction of
    the bandwidth of 16-byte vectors. A GEMM tile's bias row is not counted: its
    ``BLOCK_N`` elements, loaded once per tile, spread one per thread."""
    ptx = compiled.asm["ptx"]
    count = sum(ptx.count(f"{op}.global.{w}b16") for op in ("ld", "st")
                for w in ("", "L1::evict_last."))
    item = kwargs.get("item")
    if item is not None and getattr(item, "BIAS", False):
        count -= ptx.count("ld.global.b16")   # the bias rows' loads (no row copy loads 1)
    return count


def row_pieces(name: str, compiled, kwargs: dict) -> str:
    """The warp-specialized FP8 GEMM's bf16 epilogue (``fp8_ws``, not ``GATED``): its
    4-byte stores in the PTX, each a half-sector piece of a row as the accumulator's layout
    holds it; stored whole rows a warp (16 bytes a thread) they are none, and the FP8 call
    ran 0.981x (benchmarks/results/2026-12-07). ``-`` for the other launches."""
    t = kwargs.get("t")
    if name != "fp8_ws_gemm_kernel" or t is None or t.GATED:
        return "-"
    ptx = compiled.asm["ptx"]
    return str(sum(ptx.count(f"st.global.{w}b32") for w in ("", "v2.")))


def divisions(name: str, compiled, kwargs: dict) -> str:
    """The warp-specialized FP8 GEMM's gated epilogue (``fp8_ws``, ``GATED``): its IEEE
    divisions in the PTX, a reciprocal per row of the requantization (4: two rows a thread,
    two consumers); one per value (64) made it that epilogue's largest cost, 1.06x the
    whole FP8 call (benchmarks/results/2026-12-07). ``-`` for the other launches."""
    t = kwargs.get("t")
    if name != "fp8_ws_gemm_kernel" or t is None or not t.GATED:
        return "-"
    return str(compiled.asm["ptx"].count("div.rn.f32"))


GEMM_KERNELS = ("layer0_kernel", "layer1_reduce_kernel", "layer1_scatter_kernel")


def pipelined(name: str, kwargs: dict, shared: int) -> str:
    """``yes``/``no`` for a launch with a GEMM role: does its shared memory hold at least
    ``num_stages - 1`` (and two) copies of a K step's operands -- a loop on wgmma keeps
    ``num_stages``, one on mma.sync (16-row m-tiles) one fewer
    (scripts/fp8_stage_probe.py), one Triton did not pipeline (e.g. with an atomic inside
    it) one; ``-`` for launches without a GEMM (layer0's comm role apart)."""
    from comet.constants import ROLE_COMM
    if name not in GEMM_KERNELS or kwargs.get("ROLE") == ROLE_COMM:
        return "-"
    item = kwargs["item"]
    gate_up = item.GATED     # gate and up columns per tile
    b_cols = int(item.BLOCK_N) * (2 if gate_up else 1)
    width = 1 if item.FP8 else 2     # bytes of an operand element: e4m3, or 16-bit
    step = width * int(item.BLOCK_K) * (int(item.BLOCK_M) + b_cols)
    return "yes" if shared >= max(2, kwargs["num_stages"] - 1) * step else "no"


def constexprs_behind_none(group, path: str) -> list[str]:
    """Where an argument group nests, after a None field, a group holding a constexpr:
    Triton 3.6 reads that constexpr as None after any run-time ``if`` of the kernel, so
    its branch compiles out without a word (docs/design.md, "Kernel arguments")."""
    if not isinstance(group, tuple):
        return []
    found, after_none = [], False
    for name, value in zip(getattr(group, "_fields", range(len(group))), group):
        where = f"{path}.{name}"
        if value is None:
            after_none = True
        elif isinstance(value, tuple):
            if after_none and _holds_constexpr(value):
                found.append(where)
            found += constexprs_behind_none(value, where)
    return found


def _holds_constexpr(group) -> bool:
    return any(isinstance(v, triton.language.constexpr)
               or (isinstance(v, tuple) and _holds_constexpr(v)) for v in group)


def main(digest: bool = False) -> int:
    failures = 0
    for kernel, args, kwargs in fused_launches():
        name = kernel.fn.__name__
        hidden = [p for arg, v in kwargs.items() for p in constexprs_behind_none(v, arg)]
        if hidden:
            failures += 1
            print(f"FAIL {name}: constexprs behind a None field, read as None: {hidden}")
            continue
        t0 = time.time()
        try:
            k = compile_launch(kernel, args, dict(kwargs))
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        print(f"ok   {name:24s} role={int(kwargs.get('ROLE', -1))} smem={k.metadata.shared} "
              f"pipelined={pipelined(name, kwargs, k.metadata.shared)} "
              f"{resource_usage(k)} b16={narrow_accesses(k, kwargs)} "
              f"pieces={row_pieces(name, k, kwargs)} divs={divisions(name, k, kwargs)} "
              + (f"sass={sass_digest(k)} " if digest else "") + f"({time.time() - t0:.1f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(digest="--digest" in sys.argv[1:]))
