"""usage: torchrun --nproc-per-node N scripts/device/models_check.py [--models NAME ...] [--batch B --seq S] [--tp T [--convention sequence|replicated]] [--json FILE] [--tiny]

transformers models patched with comet over N ranks -- expert parallelism (EP=N), or with
``--tp T`` the (T, N/T) layout of comet.mesh: every expert's F split over T ranks, the
experts over N/T -- against the same models unpatched: two decoder layers at the real
layer sizes, random weights (seeded, the same on every rank), bf16. Per model and rank:

* logits of a prefill of ``B x S`` tokens, patched against unpatched on this rank's GPU:
  the per-token relative L2 difference (median, max); and both against the unpatched
  model run in fp32 (same weights), with how often each one's argmax is the fp32 argmax
  -- so comet's rounding is seen beside transformers' own. Each rank runs its own prompts
  (``--convention sequence``, the default), or with ``--convention replicated`` the ranks
  of a TP group run the same ones;
* greedy ``generate()`` of 16 new tokens from a 32-token prompt, all three ways (how many
  of the 16 agree; near-uniform logits of random weights tie often, so a bf16 run may
  leave the fp32 path at any token: reported, not required);
* the prefill time (CUDA events, median of ``--iters`` after warm-up), patched over the N
  ranks against unpatched on one GPU.

``--tiny`` shrinks every model to CPU size (fp32, gloo) to check this script itself, e.g.
``torchrun --nproc-per-node 2 scripts/device/models_check.py --tiny --tp 2 --batch 1
--seq 64``. Writes one JSON record per model (rank 0's numbers, every rank's
differences).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import transformers

from comet.bench.provenance import provenance, write_result

#: Real layer sizes (two layers), by the family's config field names.
MODELS = {
    "phi3.5-moe": ("phimoe", dict(hidden_size=4096, intermediate_size=6400,
                                  num_local_experts=16, num_experts_per_tok=2,
                                  num_attention_heads=32, num_key_value_heads=8)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880,
                                    num_local_experts=32, num_experts_per_tok=4,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                    layer_types=["sliding_attention", "full_attention"])),
    "glm-4.5-air-like": ("glm4_moe", dict(hidden_size=4096, moe_intermediate_size=1408,
                                          intermediate_size=10944, n_routed_experts=128,
                                          num_experts_per_tok=8, n_shared_experts=1,
                                          first_k_dense_replace=0, num_attention_heads=96,
                                          num_key_value_heads=8, head_dim=128)),
    "qwen3-next-like": ("qwen3_next", dict(hidden_size=2048, moe_intermediate_size=512,
                                           num_experts=512, num_experts_per_tok=10,
                                           shared_expert_intermediate_size=512,
                                           num_attention_heads=16, num_key_value_heads=2,
                                           head_dim=256,
                                           layer_types=["linear_attention", "full_attention"])),
    # Dense experts: the block calls experts(routed_in [E*T, H]); comet is sized for
    # E * max_tokens rows.
    "llama4-scout-like": ("llama4_text", dict(hidden_size=5120, intermediate_size=8192,
                                              intermediate_size_mlp=16384,
                                              num_local_experts=16, num_experts_per_tok=1,
                                              num_attention_heads=40, num_key_value_heads=8,
                                              head_dim=128, moe_layers=[0, 1],
                                              no_rope_layers=[1, 0],
                                              layer_types=["chunked_attention",
                                                           "full_attention"])),
}
#: --tiny: every size field divided down to this.
TINY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            intermediate_size_mlp=64,
            shared_expert_intermediate_size=32, head_dim=16, num_attention_heads=4,
            num_key_value_heads=2)
VOCAB = 32064
#: What each rank reports: patched vs unpatched bf16 logits (per-token relative L2), each
#: bf16 run against the fp32 run of the same weights (median, 99th percentile), how often
#: each one's argmax is the fp32 one's, and greedy tokens that agree (of 16).
PER_RANK = ("median_rel_l2", "max_rel_l2", "comet_vs_fp32_median", "comet_vs_fp32_p99",
            "hf_vs_fp32_median", "hf_vs_fp32_p99", "comet_argmax_is_fp32s",
            "hf_argmax_is_fp32s", "generate_agree", "generate_comet_vs_fp32",
            "generate_hf_vs_fp32")
GENERATE_PROMPT, GENERATE_NEW = 32, 16


def _config(name: str, tiny: bool):
    from transformers import AutoConfig
    model_type, sizes = MODELS[name]
    sizes = dict(sizes)
    if tiny:
        sizes.update({k: v for k, v in TINY.items() if k in sizes})
        for k in ("num_local_experts", "n_routed_experts", "num_experts"):
            if k in sizes:
                sizes[k] = 16
    return AutoConfig.for_model(model_type, num_hidden_layers=2, vocab_size=VOCAB, **sizes)


def _build(cfg, dtype, device):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)    # the same weights on every rank (initialised on the device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        # Expert biases start at zero: random ones, or the bias epilogues go untested.
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name and name.endswith("bias"):
                    p.normal_(std=0.5)
    return model.eval()


def _prefill_ms(model, ids, iters: int, device, group) -> float:
    times = []
    for i in range(iters + 2):
        if dist.is_initialized():
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _generate(model, prompt):
    return model.generate(prompt, max_new_tokens=GENERATE_NEW, min_new_tokens=GENERATE_NEW,
                          do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float().flatten(0, -2), b.float().flatten(0, -2)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


def check(name: str, args, device, group, rank: int, world: int) -> dict:
    from comet import CometMoE
    from comet.integrations import patch_model
    from comet.mesh import MeshLayout
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cfg = _config(name, args.tiny)
    model = _build(cfg, dtype, device)
    mesh = MeshLayout(tp=args.tp, ep=world // args.tp)
    # "replicated": the ranks of a TP group (consecutive ranks) run the same prompts.
    prompts = rank if args.convention == "sequence" else rank // args.tp
    g = torch.Generator().manual_seed(100 + prompts)
    ids = torch.randint(1, VOCAB, (args.batch, args.seq), generator=g).to(device)
    prompt = ids[:1, :GENERATE_PROMPT]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        ref_tokens = _generate(model, prompt)
        ref_ms = _prefill_ms(model, ids, args.iters, device, group)
        # The same model in fp32 (its bf16 weights, exactly): the truth both bf16 runs
        # are held against, so comet's rounding is seen beside transformers' own.
        # A copy: casting the model there and back would also round its fp32 buffers and
        # parameters (rotary frequencies, fp32 routers) to bf16.
        exact_model = copy.deepcopy(model).float()
        exact = exact_model(input_ids=ids, use_cache=False).logits.float()
        exact_tokens = _generate(exact_model, prompt)
        del exact_model
        patch_model(model, group=group, mesh=mesh, convention=args.convention,
                    max_tokens=args.batch * args.seq)
        blocks = sum(isinstance(m, CometMoE) for m in model.modules())
        got = model(input_ids=ids, use_cache=False).logits
        tokens = _generate(model, prompt)
        ms = _prefill_ms(model, ids, args.iters, device, group)
    rel, comet_err, hf_err = _rel_l2(got, ref), _rel_l2(got, exact), _rel_l2(ref, exact)
    top = exact.argmax(-1)
    mine = torch.tensor([
        rel.median().item(), rel.max().item(), comet_err.median().item(),
        comet_err.quantile(0.99).item(), hf_err.median().item(), hf_err.quantile(0.99).item(),
        (got.argmax(-1) == top).float().mean().item(), (ref.argmax(-1) == top).float().mean().item(),
        (tokens == ref_tokens).sum().item(), (tokens == exact_tokens).sum().item(),
        (ref_tokens == exact_tokens).sum().item()], device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    if dist.is_initialized():
        dist.all_gather(every, mine, group=group)
    else:
        every = [mine]
    per_rank = [dict(zip(PER_RANK, e.tolist())) for e in every]
    return dict(model=name, model_type=MODELS[name][0], layers=2, comet_blocks=blocks,
                tp=mesh.tp, ep=mesh.ep, convention=args.convention,
                tokens_per_rank=args.batch * args.seq, dtype=str(dtype),
                experts=cfg.to_dict().get("num_local_experts") or cfg.to_dict().get(
                    "n_routed_experts") or cfg.to_dict().get("num_experts"),
                per_rank=per_rank,
                median_rel_l2=max(r["median_rel_l2"] for r in per_rank),
                median_rel_l2_vs_fp32={"comet": max(r["comet_vs_fp32_median"] for r in per_rank),
                                       "transformers": max(r["hf_vs_fp32_median"]
                                                           for r in per_rank)},
                generate_new_tokens=GENERATE_NEW,
                generate_agree_min=min(r["generate_agree"] for r in per_rank),
                prefill_ms_patched=ms, prefill_ms_unpatched_one_gpu=ref_ms,
                prefill_speedup=ref_ms / ms, generated=tokens.tolist())


def _argv(args) -> list[str]:
    out = []
    for k, v in vars(args).items():
        if v is True:
            out.append(f"--{k}")
        elif v not in (None, False):
            out += [f"--{k}", *(map(str, v) if isinstance(v, list) else [str(v)])]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: the (tp, N/tp) layout of comet.mesh")
    p.add_argument("--convention", default="sequence", choices=["sequence", "replicated"],
                   help="each rank its own prompts, or a TP group's ranks the same ones")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    cuda = torch.cuda.is_available() and not args.tiny
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.tp < 1 or world % args.tp:
        p.error(f"--tp {args.tp} does not divide the {world} ranks")
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.group.WORLD if dist.is_initialized() else None
    records = []
    for name in args.models:
        try:
            rec = check(name, args, device, group, rank, world)
        except Exception as e:  # noqa: BLE001 - one model's failure is its record
            rec = dict(model=name, error=f"{type(e).__name__}: {e}")
        rec.update(**provenance(" ".join(["scripts/device/models_check.py", *_argv(args)]),
                                torch.cuda.get_device_name(device) if cuda else "cpu"),
                   transformers=transformers.__version__)
        records.append(rec)
        if rank == 0:
            short = {k: v for k, v in rec.items() if k not in ("generated", "per_rank")}
            print(json.dumps(short), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        write_result(args.json, records)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
