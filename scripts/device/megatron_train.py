# usage: PYTHONPATH=. python3 scripts/device/megatron_train.py [--steps 200] [--impls sequential grouped comet] [--json F] [--plot F] [--tiny]
"""A small GPT with MoE layers at real widths trained in Megatron-Core, with comet's MoE
layer and with Megatron's own experts, from the same weights and batches.

Experiment: does a Megatron model train the same with ``CometMoELayer`` (comet's fused
dispatch + experts + combine, forward and backward) as with Megatron's experts, and what
does a step cost? One GPU (expert parallelism 1), ``--layers`` MoE layers of
``--experts`` experts, top-``--topk``, ``--hidden`` / ``--ffn`` widths, bf16 parameters,
Megatron's local (TransformerEngine-free) layer spec: its attention, norms and router for
all runs. The runs differ only in the experts:

* ``sequential``: Megatron's ``SequentialMLP`` behind its all-to-all dispatcher -- what
  megatron-core runs without TransformerEngine (the reference of the loss deltas);
* ``grouped``: Megatron's grouped experts (``TEGroupedMLP``) behind the same dispatcher,
  on TransformerEngine's ``GroupedLinear`` where TE imports, else on a trainable torch
  grouped-GEMM linear given to it through Megatron's grouped-linear builder protocol
  (``torch._grouped_mm`` on CUDA in bf16; the JSON says which);
* ``comet``: ``CometMoELayer`` (``use_comet`` of the same spec).

Every run starts from the first run's weights (the experts converted) and sees the same
batches: sequences of a fixed random Markov chain over the vocabulary (each token has 4
successors with probabilities .4/.3/.2/.1: a floor of ~1.28 nats), so the loss falls
within a few hundred steps. Optimizer: AdamW on fp32 master copies of the bf16 parameters
(the same code for every run), warmup then constant LR, gradient clipping at 1.0; aux loss
1e-2. Per run: the loss of every step, each step's wall time (synchronised), the first
step's (comet compiles its kernels there), peak memory; then each run's max |loss delta|
against ``sequential`` over all steps and over the last 50. Results go to ``--json`` and a
plot to ``--plot`` (matplotlib, where it imports), each run appended as it finishes.
``--tiny`` runs the script itself on the CPU at toy sizes (with the shims the CPU tests
use), to check it before a device call.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")   # megatron-core warns of every optional package it lacks

REAL = dict(layers=4, hidden=2048, heads=16, experts=64, topk=8, ffn=1408, seq=1024,
            batch=8, vocab=8192, steps=200)
TINY = dict(layers=2, hidden=64, heads=4, experts=4, topk=2, ffn=160, seq=16, batch=2,
            vocab=128, steps=6)


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in REAL.items():
        p.add_argument(f"--{k}", type=int, default=None, help=f"default {v} ({TINY[k]} tiny)")
    p.add_argument("--impls", nargs="+", default=["sequential", "grouped", "comet"],
                   choices=["sequential", "grouped", "comet"])
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "out"),
                                                  "megatron_train.json"))
    p.add_argument("--plot", default=os.path.join(os.environ.get("OUT", "out"),
                                                  "megatron_train.png"))
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="parameter dtype (default bf16; fp32 with --tiny)")
    args = p.parse_args()
    sizes = TINY if args.tiny else REAL
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


# --------------------------------------------------------------------------- setup
def _cpu_shims():
    """Megatron-Core on a CPU-only torch (--tiny; as tests/test_megatron.py does)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _init(args, device):
    from megatron.core import parallel_state, tensor_parallel
    store = tempfile.mktemp()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def _config(args, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        # The all-to-all dispatcher makes CUDA streams: --tiny (CPU) takes the all-gather one.
        moe_token_dispatcher_type="allgather" if args.tiny else "alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=False, init_method_std=0.02)


class TorchGroupedLinear(torch.nn.Module):
    """Megatron's grouped-linear builder protocol (``TEGroupedMLP``'s ``linear_fc1`` /
    ``linear_fc2``) on torch's grouped GEMM, trainable: ``weight [El, in, out]``;
    ``forward(x [R, in], tokens_per_expert) -> (x_e @ W_e per expert's rows, None)``."""

    def __init__(self, num_local_experts, input_size, output_size, *, config, init_method,
                 bias, is_expert=True, **_megatron_kwargs):
        super().__init__()
        if bias:
            raise ValueError("no bias")
        self.weight = torch.nn.Parameter(torch.empty(
            num_local_experts, input_size, output_size, dtype=config.params_dtype,
            device=torch.cuda.current_device()))
        with torch.no_grad():
            for w in self.weight:
                init_method(w.t())
        self.weight.allreduce = True    # EP 1: reduced with the dense parameters

    def forward(self, x, tokens_per_expert):
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = counts.cumsum(0, dtype=torch.int32)
            return torch._grouped_mm(x, self.weight, offs=offs), None
        parts = x.split(counts.tolist())
        return torch.cat([p @ w for p, w in zip(parts, self.weight)]), None

    def backward_dw(self):
        """Weight gradients come with the rest of the backward."""


def _spec(args, impl):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from comet.integrations.megatron import use_comet
    spec = get_gpt_layer_local_spec(num_experts=1, moe_grouped_gemm=False)
    if impl == "sequential":
        return spec, "SequentialMLP (megatron-core's local spec)"
    if impl == "comet":
        return (use_comet(spec, max_tokens=args.batch * args.seq),
                "CometMoELayer + CometExperts")
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.transformer.moe import experts as mcore_experts
    if not hasattr(mcore_experts, "GroupedMLPSubmodules"):
        raise RuntimeError("this megatron-core has no grouped-linear builder protocol "
                           "(GroupedMLPSubmodules, megatron-core >= 0.17)")
    GroupedMLPSubmodules, TEGroupedMLP = (mcore_experts.GroupedMLPSubmodules,
                                          mcore_experts.TEGroupedMLP)
    if HAVE_TE:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        experts, what = TESpecProvider().grouped_mlp_modules(True), "TEGroupedMLP on TE"
    else:
        from megatron.core.transformer.spec_utils import ModuleSpec
        experts = ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear))
        what = "TEGroupedMLP on a torch._grouped_mm linear (no TE)"
    mlp = spec.submodules.mlp
    subs = mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]
    subs.experts = experts
    return spec, what


def _build(args, config, impl):
    from megatron.core.models.gpt import GPTModel
    spec, what = _spec(args, impl)
    torch.manual_seed(args.seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq)
    # megatron-core >= 0.19 makes embeddings and norms in fp32 and leaves the cast to
    # Float16Module (which casts every parameter, as here); 0.16 made them in params_dtype.
    return model.to(config.params_dtype), what


def _experts(mlp):
    """A Megatron MoE layer's experts as ``(fc1 [E, 2F, H], fc2 [E, H, F])``."""
    from comet.integrations.megatron import CometExperts
    e = mlp.experts
    if isinstance(e, CometExperts):
        return e.megatron_weights()
    if hasattr(e, "local_experts"):
        return (torch.stack([m.linear_fc1.weight for m in e.local_experts]).detach(),
                torch.stack([m.linear_fc2.weight for m in e.local_experts]).detach())
    if isinstance(e.linear_fc1, TorchGroupedLinear):
        return e.linear_fc1.weight.transpose(1, 2).detach(), e.linear_fc2.weight.transpose(1, 2).detach()
    n = e.num_local_experts     # TE GroupedLinear: weight{i} [out, in]
    return (torch.stack([getattr(e.linear_fc1, f"weight{i}") for i in range(n)]).detach(),
            torch.stack([getattr(e.linear_fc2, f"weight{i}") for i in range(n)]).detach())


@torch.no_grad()
def _set_experts(mlp, fc1, fc2):
    from comet.integrations.megatron import CometExperts
    e = mlp.experts
    if isinstance(e, CometExperts):
        e.load_megatron_weights(fc1, fc2)
    elif hasattr(e, "local_experts"):
        for i, m in enumerate(e.local_experts):
            m.linear_fc1.weight.copy_(fc1[i])
            m.linear_fc2.weight.copy_(fc2[i])
    elif isinstance(e.linear_fc1, TorchGroupedLinear):
        e.linear_fc1.weight.copy_(fc1.transpose(1, 2))
        e.linear_fc2.weight.copy_(fc2.transpose(1, 2))
    else:
        for i in range(e.num_local_experts):
            getattr(e.linear_fc1, f"weight{i}").copy_(fc1[i])
            getattr(e.linear_fc2, f"weight{i}").copy_(fc2[i])


def _snapshot(model):
    """The model's weights on the CPU: dense ones by name, experts per layer."""
    dense = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and ".mlp.experts." not in k}
    experts = [tuple(t.cpu().clone() for t in _experts(layer.mlp))
               for layer in model.decoder.layers]
    return dense, experts


@torch.no_grad()
def _restore(model, snapshot):
    dense, experts = snapshot
    for k, v in model.state_dict().items():
        if k in dense:
            v.copy_(dense[k])
    device = next(model.parameters()).device
    for layer, (fc1, fc2) in zip(model.decoder.layers, experts):
        _set_experts(layer.mlp, fc1.to(device), fc2.to(device))


# --------------------------------------------------------------------------- data
def _chain(args):
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (args.vocab, 4), generator=g)


def _batch(args, succ, step, device):
    """Step ``step``'s ``(tokens, labels)`` ``[batch, seq]``, drawn on the CPU (the same for
    every run and device)."""
    g = torch.Generator().manual_seed(args.seed + 1000 + step)
    tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    pick = torch.multinomial(probs.expand(args.batch * args.seq, 4), 1, generator=g)
    pick = pick.view(args.batch, args.seq)
    for t in range(args.seq):
        tokens[:, t + 1] = succ[tokens[:, t], pick[:, t]]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


# --------------------------------------------------------------------------- training
def _train(args, model, batches, device):
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if device.type == "cuda" else {}))
    position = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    mask = (None if device.type == "cuda" else
            torch.triu(torch.ones(args.seq, args.seq), 1).bool().view(1, 1, args.seq, args.seq))
    losses, times = [], []
    model.train()
    for step in range(args.steps):
        tokens, labels = batches[step]
        _sync(device)
        start = time.perf_counter()
        for p in params:
            p.grad = None
        loss = model(tokens, position, mask, labels=labels).float().mean()
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        value = loss.item()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"loss {value} at step {step}")
    return losses, times


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _summary(run: dict, ref: dict | None) -> dict:
    steady = run["step_s"][min(10, len(run["step_s"]) - 1):]
    out = {"first_step_s": run["step_s"][0], "median_step_ms": 1e3 * statistics.median(steady),
           "final_loss": run["loss"][-1]}
    if ref is not None:
        delta = [abs(a - b) for a, b in zip(run["loss"], ref["loss"])]
        out["max_abs_delta_loss"] = max(delta)
        out["max_abs_delta_loss_last50"] = max(delta[-50:])
    return out


def _plot(path, record):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib does not import"
    runs = record["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, run in runs.items():
        if "loss" in run:
            top.plot(run["loss"], label=f"{name}: {run['experts']}", lw=1)
    top.set_ylabel("loss (nats)")
    top.set_title(record["title"], fontsize=9)
    top.legend(fontsize=7)
    ref = runs.get("sequential", {}).get("loss")
    for name, run in runs.items():
        if ref is not None and name != "sequential" and "loss" in run:
            bottom.plot([a - b for a, b in zip(run["loss"], ref)], label=name, lw=1)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("loss - sequential's")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    args = _args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        _cpu_shims()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("fp32" if args.tiny else "bf16")]
    _init(args, device)
    import megatron.core
    from comet.bench.provenance import provenance, write_result
    config = _config(args, dtype)
    succ = _chain(args)
    batches = [_batch(args, succ, step, device) for step in range(args.steps)]
    record = {
        **provenance(device=torch.cuda.get_device_name() if device.type == "cuda"
                     else "cpu"),
        "megatron_core": megatron.core.__version__,
        "config": {k: getattr(args, k) for k in (*REAL, "lr", "warmup", "seed")}
        | {"dtype": str(dtype), "tokens_per_step": args.batch * args.seq},
        "runs": {},
    }
    record["title"] = (f"{args.layers} MoE layers, H={args.hidden}, E={args.experts} "
                       f"top-{args.topk}, F={args.ffn}, {args.batch}x{args.seq} tokens, "
                       f"{record['device']}, megatron-core {record['megatron_core']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    snapshot = None
    for impl in args.impls:
        run: dict = {}
        record["runs"][impl] = run
        try:
            model, run["experts"] = _build(args, config, impl)
            if snapshot is None:
                snapshot = _snapshot(model)
                record["weights_from"] = impl
            else:
                _restore(model, snapshot)
            model.to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run["loss"], run["step_s"] = _train(args, model, batches, device)
            if device.type == "cuda":
                run["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as err:  # noqa: BLE001 - recorded; the other runs go on
            run["error"] = f"{type(err).__name__}: {err}"
            run["traceback"] = traceback.format_exc()[-3000:]
            print(f"{impl}: {run['error']}", flush=True)
        finally:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ref = record["runs"].get("sequential")
        ref = ref if ref and "loss" in ref and impl != "sequential" else None
        if "loss" in run:
            run.update(_summary(run, ref))
        write_result(args.json, record)
        print(f"{impl}: done", flush=True)
    record["plot"] = _plot(args.plot, record)
    write_result(args.json, record)
    print(f"\n{record['title']}\ncommit {record['commit']}")
    print(f"{'run':<11}{'first step s':>13}{'median ms':>11}{'final loss':>11}"
          f"{'max|dloss|':>11}{'last50':>9}  experts")
    for impl, run in record["runs"].items():
        if "error" in run:
            print(f"{impl:<11} FAILED: {run['error'][:100]}")
            continue
        print(f"{impl:<11}{run['first_step_s']:>13.2f}{run['median_step_ms']:>11.1f}"
              f"{run['final_loss']:>11.4f}{run.get('max_abs_delta_loss', 0):>11.4f}"
              f"{run.get('max_abs_delta_loss_last50', 0):>9.4f}  {run['experts']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
