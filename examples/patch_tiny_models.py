"""Patch tiny random-initialised transformers MoE models with comet and compare the logits.

For each family of ``comet.integrations.tiny_models`` the installed transformers provides
and comet converts there (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, Phi-3.5-MoE,
GLM-4.5, Llama-4), a two-layer model is built from its config (no download), copied,
patched with ``comet.patch_model`` and run on the same tokens as the original. Then a
patched tiny Mixtral generates greedily next to the original.

``--coverage`` first prints which of *all* the MoE families of the installed transformers
comet converts and why it refuses the others (``comet.integrations.coverage``; one CPU
process, rank 0 only).

On a CPU (one process)::

    python examples/patch_tiny_models.py

On N GPUs with expert parallelism (each rank builds the same seeded model, keeps E/N
experts per block after patching, and feeds its own tokens)::

    torchrun --nproc-per-node N examples/patch_tiny_models.py --device cuda

``--device cpu`` under torchrun runs the same over gloo.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="model dtype (default: float32 on a CPU, bfloat16 on CUDA)")
    p.add_argument("--families", nargs="*", default=None, help="subset of families to run")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generate() produces")
    p.add_argument("--coverage", action="store_true",
                   help="first print the coverage table of every transformers MoE family")
    return p.parse_args()


def setup(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device); joins the torchrun group when launched by torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def worst(value: float, world: int) -> float:
    """The largest ``value`` over all ranks."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def compare(original, patched, ids) -> tuple[float, float, float]:
    """(max, median, share of tokens above 2%) of the per-token max |logit difference|,
    relative to max |logit| of the original."""
    with torch.no_grad():
        ref = original(ids).logits.float()
        got = patched(ids).logits.float()
    per_token = (got - ref).abs().amax(-1).flatten() / ref.abs().max()
    return (per_token.max().item(), per_token.median().item(),
            (per_token > 0.02).float().mean().item())


def generate_both(original, patched, prompt, new_tokens):
    """Greedy generate() with both models -> (original ids, patched ids, whether every
    divergence happened where the original's two candidates were within 2% of max |logit|,
    i.e. a tie that bf16 rounding may break either way)."""
    # A fixed length on every rank: under EP each decode step is a collective call.
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        ref = original.generate(prompt, **kwargs)
        got = patched.generate(prompt, **kwargs)
        tie = True
        for row in range(ref.shape[0]):
            diff = (ref[row] != got[row]).nonzero()
            if len(diff):
                step = diff[0].item()
                logits = original(ref[row:row + 1, :step]).logits[0, -1].float()
                margin = (logits[ref[row, step]] - logits[got[row, step]]).abs()
                tie &= bool(margin <= 0.02 * logits.abs().max())
    return ref, got, tie


def main():
    args = parse_args()
    import transformers

    from comet.integrations import EXPERTS_BACKEND_REGISTERED, count_patched, patch_model
    from comet.integrations.tiny_models import available_families, build_tiny_model

    rank, world, device = setup(args.device)
    if args.coverage and rank == 0:
        from comet.integrations import coverage
        print(f"every MoE family of transformers {transformers.__version__} "
              "(tiny fp32 models, CPU):\n")
        print(coverage.markdown_table(), end="\n\n")
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    # bf16 rounding may flip a near-tie top-k choice in a later layer for a rare token:
    # judge by the median and the share of such tokens, not the single worst token.
    median_tol, tail_tol = (1e-5, 0.0) if dtype == torch.float32 else (1e-2, 1 / 12)
    families = args.families or available_families()
    # Every rank draws its own tokens: under EP each rank serves its own batch.
    tokens = torch.randint(3, 256, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(100 + rank)).to(device)
    if rank == 0:
        print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
              f"device {device.type}, {dtype}, expert-parallel ranks {world}")
        print(f"{'family':<12} {'blocks':>6} {'max err':>9} {'median':>9} {'>2%':>6}  result")

    failed = False
    for family in families:
        original = build_tiny_model(family, dtype=dtype, seed=0, device=device)
        patched = patch_model(copy.deepcopy(original))
        err_max, err_med, tail = (worst(v, world) for v in compare(original, patched, tokens))
        ok = err_med <= median_tol and tail <= tail_tol
        failed |= not ok
        if rank == 0:
            print(f"{family:<12} {count_patched(patched):>6} {err_max:>9.2e} {err_med:>9.2e} "
                  f"{tail:>6.1%}  {'ok' if ok else 'MISMATCH'}")

    if "mixtral" in families:
        original = build_tiny_model("mixtral", dtype=dtype, seed=0, device=device)
        patched = patch_model(copy.deepcopy(original))
        prompt = tokens[:, :6]
        ref, got, tie = generate_both(original, patched, prompt, args.new_tokens)
        diverged = worst(float(not torch.equal(ref, got)), world)
        only_on_ties = worst(float(not tie), world) == 0
        failed |= bool(diverged) and not (dtype != torch.float32 and only_on_ties)
        if rank == 0:
            verdict = ("identical on every rank" if not diverged else
                       "diverged, at a near tie of the original's top logits (bf16)"
                       if only_on_ties else "DIFFERENT")
            print(f"\ngreedy generate() on tiny Mixtral, {args.new_tokens} new tokens: {verdict}")
            print("  original:", ref[0, prompt.shape[1]:].tolist())
            print("  patched: ", got[0, prompt.shape[1]:].tolist())

    if EXPERTS_BACKEND_REGISTERED and world == 1:
        original = build_tiny_model(families[0], dtype=dtype, seed=0, device=device)
        switched = copy.deepcopy(original)
        switched.set_experts_implementation("comet")
        err_max, err_med, tail = compare(original, switched, tokens)
        ok = err_med <= median_tol and tail <= tail_tol
        failed |= not ok
        print(f"\nexperts_implementation='comet' on {families[0]} (no module replaced): "
              f"max err {err_max:.2e}, median {err_med:.2e}: {'ok' if ok else 'MISMATCH'}")

    if world > 1:
        dist.destroy_process_group()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
