"""FP8 experts with comet (W8A8 e4m3, 128 x 128 weight blocks, forward only), three ways in:

1. a bf16 ``CometMoE`` quantized in place (``comet.moe.quantize_experts``: the reference
   recipe, amax / 448 per block), compared with the bf16 layer it came from;
2. a checkpoint's FP8 tensors -- e4m3 ``[E, 2F, H]`` / ``[E, H, F]`` and their
   ``weight_scale_inv`` (fp32, or UE8M0 exponent bytes as DeepSeek-V4 stores them) --
   straight into the fused layer (``FusedMoE``), compared with comet's fp32 emulation
   of the same FP8 layer (``comet.reference.moe_forward_fp8``): within rel L2 5e-3;
3. (a transformers FP8 model: ``patch_model(model)`` keeps its ``FP8Experts`` in FP8 on
   their own tensors: docs/precision.md, "FP8 transformers models".)

On a CPU (step 1 runs comet's fp32 emulation of the FP8 layer; step 2's fused kernels
need a GPU)::

    python examples/fp8_experts.py

On one GPU (the fused FP8 kernels; step 1 also times bf16 against FP8 at ``--tokens``)::

    python examples/fp8_experts.py --device cuda --experts 64 --hidden 2048 --ffn 1408 \\
        --top-k 4 --tokens 4096

``comet bench --dtype bf16 fp8 --only-fused`` measures the same with the benchmark's
protocol (docs/benchmarking.md).
"""

from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256, help="H (a multiple of 128)")
    p.add_argument("--ffn", type=int, default=256, help="F, each expert's FFN width")
    p.add_argument("--tokens", type=int, default=16)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from comet import CometMoE, MoEConfig
    from comet.moe import quantize_experts
    from comet.quant import Fp8, Fp8Weight, calc_diff, quantize_weight
    from comet.reference import moe_forward_fp8
    from comet.runtime.layer import FusedMoE

    dev = torch.device(args.device)
    e, k, h, f = args.experts, args.top_k, args.hidden, args.ffn
    torch.manual_seed(0)

    def rel(got, want) -> float:
        return float((got.float() - want.float()).norm() / want.float().norm())

    # 1. A bf16 layer, then the same layer in FP8.
    moe = CometMoE(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                   max_tokens=args.tokens, device=dev)
    x = torch.randn(args.tokens, h, dtype=torch.bfloat16, device=dev)
    with torch.inference_mode():       # FP8 experts run the forward only
        y_bf16 = moe(x)
        bf16_bytes = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
        quantize_experts(moe, Fp8())
        y_fp8 = moe(x)
    fp8_bytes = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    print(f"1. CometMoE, {args.tokens} tokens: FP8 against bf16 rel L2 "
          f"{rel(y_fp8, y_bf16):.2e}, calc_diff {calc_diff(y_fp8, y_bf16):.2e} (the recipe "
          f"itself: ~6e-2 / ~2e-3 on random data); experts {bf16_bytes / 2**20:.2f} MiB "
          f"in bf16 -> {fp8_bytes / 2**20:.2f} MiB in FP8 with their scales (the bf16 "
          f"ones are gone)")
    if dev.type == "cuda":
        print(f"   bf16 {timed(moe_bf16(args, dev), x):.1f} us, FP8 {timed(moe, x):.1f} us "
              f"a call (CUDA events, 20 calls after 5)")

    # 2. A checkpoint's tensors: e4m3 weights and their scale_inv (here UE8M0 bytes, which
    # Fp8Weight.from_checkpoint and the layer turn into fp32 scales exactly).
    made = [quantize_weight(torch.randn(e, n, kk, device=dev) * kk ** -0.5, parts=parts)
            for n, kk, parts in ((2 * f, h, 2), (h, f, 1))]
    tensors = [(w.weight, (torch.round(torch.log2(w.scale_inv)) + 127).to(torch.uint8))
               for w in made]
    gate_up, down = (Fp8Weight.from_checkpoint(w, s, (128, 128), parts=parts)
                     for (w, s), parts in zip(tensors, (2, 1)))
    exact = all(torch.equal(w.scale_inv, torch.exp2(s.float() - 127))
                for w, (_, s) in zip((gate_up, down), tensors))
    if dev.type != "cuda":
        print(f"2. a checkpoint's FP8 tensors as Fp8Weights, UE8M0 scales exact in fp32: "
              f"{exact}; the fused layer runs them on a GPU (--device cuda)")
        return
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, k, device=dev)
    want = moe_forward_fp8(x.float(), ids, weights, gate_up, down)
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=f,
                    max_tokens=args.tokens, fp8=Fp8())
    layer = FusedMoE(cfg, tensors[0][0], tensors[1][0], w13_scale_inv=tensors[0][1],
                     w2_scale_inv=tensors[1][1])
    got = layer(x, ids, weights)
    print(f"2. FusedMoE on a checkpoint's FP8 tensors (UE8M0 scales): against the fp32 "
          f"emulation rel L2 {rel(got, want):.2e} (bound 5e-3)")


def moe_bf16(args, dev):
    """The bf16 layer of step 1 again (same seed), to time beside the FP8 one."""
    import torch

    from comet import CometMoE
    torch.manual_seed(0)
    return CometMoE(num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
                    intermediate_size=args.ffn, max_tokens=args.tokens, device=dev)


def timed(moe, x) -> float:
    """Microseconds a call, the median of 20 after 5 warm-up calls."""
    import torch
    times = []
    with torch.inference_mode():
        for i in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            moe(x)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
