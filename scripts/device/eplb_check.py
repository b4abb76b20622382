# usage: PYTHONPATH=. python scripts/device/eplb_check.py [--tiny] [--models M ...] [--ep 4 8] [--cases M:EP ...] [--calls 200] [--output FILE.json]
"""Redundant experts (EPLB) on one GPU with virtual ranks: balance, outputs, liveness.

For each model (full size: a DeepSeek-V3-like layer, E=256 H=7168 F=2048 top-8, and a
Qwen3-30B-A3B-like one, E=128 H=2048 F=768 top-8), each EP size (W virtual ranks on one
GPU, concurrently on W streams: comet.runtime.virtual) and each routing (Zipf 1.2 over a
random order of the experts, and ``comet bench``'s skewed routing: expert 0 chosen by half
of all tokens), with several thousand tokens per rank:

1. the layer without replicas (R=0) runs the routing; its outputs are kept, and the rows
   each rank's experts compute give ``rows_max_over_mean`` and ``rows_local_fraction``
   (comet.bench.eplb);
2. the layer on E + R physical experts (R = E/8), placed by comet.placement from that
   routing's own load (an oracle window; each virtual rank's load, so the plan's
   dispatch shares keep pairs on their rank where the balance allows), runs the same
   inputs through the replica translation (comet.replicas): its balance columns, and
   its outputs against step 1's (the same experts, so the same sums up to summation
   order). ``scripts/eplb_balance.py`` computes the same balance columns on the CPU;
3. liveness: ``--calls`` back-to-back calls of the replicated layer, routings in turn,
   ranks drifting apart (device spins before some calls), the load counted on the device
   every call and a rebalance every ``--rebalance-every`` calls (weights and tables
   written in place while the layer's CUDA graphs stay captured); after each rebalance
   the next call of each routing is checked against step 1.

Steps 4-6 run first (before the cases of steps 1-3):

4. the module: ``CometMoE(redundant_experts=E/8)`` at EP=1 (one process, the Qwen3-like
   size) against ``CometMoE`` without replicas holding the same weights: its parameter
   and buffer bytes against the layer's without (the slots are the storage: ``(E + R) /
   E``), outputs before and after ``rebalance()`` from its own device load count, and a
   training step's gradients (the fused backward, replica gradients summed into each
   expert's owner slot; compared as the logical experts, ``logical_experts(grad=True)``);
5. the knob: ``CometMoE(redundant_experts=E/8, rebalance_interval=N)``, ``3 N`` calls
   whose hot experts move every ``N`` calls, each against the layer without replicas,
   and the rebalances the layer ran itself (one per ``N`` calls);
6. ``comet.patch_model(redundant_experts=..., rebalance_interval=2)`` on a tiny
   transformers MoE model built from its config (no download; skipped without
   transformers): logits against the model patched without replicas across automatic
   rebalances, and the checkpoint keys and shapes of the unpatched model.

The translation and the load count are also run once under
``torch.cuda.set_sync_debug_mode("error")``: a host sync there fails the run.

Exit 1 ("EPLB CHECK FAILED") on a timeout, an output further than
comet.bench.records.MAX_REL_ERR from the layer without replicas, a host sync, a layer
with replicas holding over 1% more bytes than its ``(E + R) / E`` share, or an automatic
rebalance count other than one per interval.
``--tiny``: the same steps on the CPU under TRITON_INTERPRET=1 at toy sizes (phase by
phase, comet.runtime.virtual.VirtualEP), to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time

if "--tiny" in sys.argv:                   # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comet.bench.eplb import balance_columns, destination_rows  # noqa: E402
from comet.bench.inputs import derive_seed, make_routing  # noqa: E402
from comet.bench.provenance import write_result  # noqa: E402
from comet.bench.records import MAX_REL_ERR  # noqa: E402
from comet.config import MoEConfig  # noqa: E402
from comet.eplb import physical_config  # noqa: E402
from comet.placement import (Placement, PlacementConfig, dispatch_shares,  # noqa: E402
                             plan_placement)
from comet.replicas import ReplicaTables, count_load, translate  # noqa: E402

MODELS = {
    "deepseek-v3-like": MoEConfig(num_experts=256, top_k=8, hidden_size=7168,
                                  intermediate_size=2048),
    "qwen3-30b-a3b-like": MoEConfig(num_experts=128, top_k=8, hidden_size=2048,
                                    intermediate_size=768),
}
TINY = {"tiny": MoEConfig(num_experts=32, top_k=4, hidden_size=32, intermediate_size=32,
                          dtype=torch.float32)}
ROUTINGS = ("zipf1.2", "skewed")
ZIPF_S = 1.2
SEED = 4321
#: Drift: a device spin of up to this many SM cycles (~0.5 ms) before ~1 call in 3.
MAX_DELAY_CYCLES = 1_000_000


def zipf_routing(tokens: int, cfg: MoEConfig, g: torch.Generator):
    """Top-k distinct experts per token drawn with Zipf(s) popularity over a random
    order of the experts (hot experts land on any rank); softmax weights."""
    e = cfg.num_experts
    order = torch.randperm(e, generator=g)
    probs = torch.empty(e)
    probs[order] = 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** ZIPF_S
    ids = torch.multinomial(probs.expand(tokens, e), cfg.top_k, generator=g) if tokens \
        else torch.empty(0, cfg.top_k, dtype=torch.int64)
    return ids, torch.randn(tokens, cfg.top_k, generator=g).softmax(dim=1)


def inputs(cfg: MoEConfig, kind: str, tokens: int, world: int, device):
    """Every rank's ``(xs, ids, weights)`` of one routing."""
    xs, ids, ws = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(derive_seed(SEED, kind, tokens, world, r))
        i, w = (zipf_routing(tokens, cfg, g) if kind.startswith("zipf")
                else make_routing(tokens, cfg.num_experts, cfg.top_k, kind, g))
        x = torch.randn(tokens, cfg.hidden_size, generator=g).to(cfg.dtype)
        xs.append(x.to(device))
        ids.append(i.to(device))
        ws.append(w.to(device))
    return xs, ids, ws


class Group:
    """W virtual ranks of one layer: the real fused calls concurrently on W streams on a
    GPU, or phase by phase under the interpreter. The weight shards are held, and a
    refill writes into them (a GPU group's captured graphs read the same addresses)."""

    def __init__(self, cfg: MoEConfig, w13: list, w2: list, device):
        self.cfg, self.w13, self.w2, self.device = cfg, w13, w2, device
        if device.type == "cuda":
            from comet.runtime.virtual import virtual_group
            self.layers = virtual_group(cfg, w13, w2, w13_layout="interleaved")
            self.streams = [torch.cuda.Stream() for _ in w13]
        else:
            self._build_virtual()

    def _build_virtual(self) -> None:
        from comet.runtime.virtual import VirtualEP
        from comet.weights import gate_up_first
        self.virtual = VirtualEP(self.cfg, [gate_up_first(w) for w in self.w13], self.w2)

    def refill(self, w13_all: torch.Tensor, w2_all: torch.Tensor, phy2log: torch.Tensor
               ) -> None:
        """Slot by slot (no second copy of every expert at full size)."""
        slots = phy2log.shape[-1] // len(self.w13)
        with torch.no_grad():
            for s, e in enumerate(phy2log.tolist()):
                self.w13[s // slots][s % slots].copy_(w13_all[e])
                self.w2[s // slots][s % slots].copy_(w2_all[e])
        if self.device.type != "cuda":
            self._build_virtual()          # VirtualEP keeps an interleaved copy

    def forward(self, xs, ids, ws, delays=None) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return self.virtual.forward(xs, ids, ws)
        from comet.runtime.virtual import concurrent_forward
        torch.cuda.synchronize()
        ys = concurrent_forward(self.layers, xs, ids, ws, self.streams, delay_cycles=delays)
        torch.cuda.synchronize()
        return ys

    def check(self) -> None:
        if self.device.type == "cuda":
            for layer in self.layers:
                layer.check_errors_now()


def shards(w_all: torch.Tensor, phy2log: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Per rank the experts of its slots (copies)."""
    slots = phy2log.shape[-1] // world
    return [w_all[phy2log[r * slots:(r + 1) * slots].to(w_all.device)].contiguous()
            for r in range(world)]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()


def tokens_for(cfg: MoEConfig, world: int, wanted: list[int], budget_gb: float,
               device) -> int:
    """The most tokens per rank of ``wanted`` whose W workspaces fit ``budget_gb``."""
    if device.type != "cuda":
        return wanted[0]
    from comet.mesh import MeshLayout
    from comet.runtime.layer import default_tile
    from comet.runtime.workspace import workspace_bytes
    for t in sorted(wanted, reverse=True):
        c = cfg.replace(max_tokens=t)
        if world * workspace_bytes(c, world, default_tile(MeshLayout(ep=world), "sequence",
                                                          c)) <= budget_gb * 2 ** 30:
            return t
    return min(wanted)


def no_host_sync(ids: torch.Tensor, tables: ReplicaTables, load: torch.Tensor) -> bool:
    """Translate and count once with CUDA's sync debug mode on "error"."""
    if not ids.is_cuda:
        return True
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        translate(ids, tables, 0)
        count_load(load, ids)
        ok = True
    except RuntimeError:
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return ok


def run_model(name: str, base: MoEConfig, world: int, args, device, rng) -> dict:
    e, k = base.num_experts, base.top_k
    redundant = args.redundant if args.redundant is not None else e // 8
    tokens = tokens_for(base, world, args.tokens, args.workspace_gb, device)
    cfg = base.replace(max_tokens=tokens)
    placement = PlacementConfig(e, redundant, world)
    t0 = time.time()
    g = torch.Generator(device=device).manual_seed(SEED)
    h, f = cfg.hidden_size, cfg.intermediate_size
    # Every logical expert once, in the kernels' layout; random values are as good
    # interleaved as not (both layers read the same ones).
    w13_all = torch.empty(e, h, 2 * f, dtype=cfg.dtype, device=device)
    w2_all = torch.empty(e, f, h, dtype=cfg.dtype, device=device)
    for i in range(e):
        w13_all[i].normal_(generator=g).mul_(h ** -0.5)
        w2_all[i].normal_(generator=g).mul_(f ** -0.5)
    cases = {kind: inputs(cfg, kind, tokens, world, device) for kind in ROUTINGS}
    el = e // world
    record = {"model": name, "experts": e, "top_k": k, "hidden": h, "ffn": f, "ep": world,
              "redundant_experts": redundant, "tokens_per_rank": tokens,
              "dtype": str(cfg.dtype).removeprefix("torch."), "routings": {}}

    # 1. without replicas
    plain = Group(cfg, [w13_all[r * el:(r + 1) * el] for r in range(world)],
                  [w2_all[r * el:(r + 1) * el] for r in range(world)], device)
    expected = {}
    for kind, (xs, ids, ws) in cases.items():
        expected[kind] = plain.forward(xs, ids, ws)
        record["routings"][kind] = {
            f"{key}_r0": v for key, v in balance_columns(_rows(ids, el, world)).items()}
    plain.check()
    del plain
    if device.type == "cuda":
        gc.collect()                # the group's graphs and workspaces, before the next
        torch.cuda.empty_cache()
        record["gib_held_between_groups"] = torch.cuda.memory_allocated() / 2 ** 30

    # 2. with R replicas, placed per routing from its own load
    pcfg = physical_config(cfg, redundant)
    tables = ReplicaTables.empty(e, redundant, world, device)
    first = plan_placement(None, placement, rank_load=_rank_load(cases[ROUTINGS[0]][1], e))
    group = Group(pcfg, shards(w13_all, first.phy2log[0], world),
                  shards(w2_all, first.phy2log[0], world), device)
    worst, synced_ok = 0.0, True
    for kind, (xs, ids, ws) in cases.items():
        plan = plan_placement(None, placement, rank_load=_rank_load(ids, e))
        _place(group, tables, plan, w13_all, w2_all, world)
        load = torch.zeros(e + 1, dtype=torch.int64, device=device)
        synced_ok &= no_host_sync(ids[0], tables, load)
        phys = [translate(i, tables, r) for r, i in enumerate(ids)]
        ys = group.forward(xs, phys, ws)
        err = max(rel_err(y, ref) for y, ref in zip(ys, expected[kind]))
        worst = max(worst, err)
        rows = _rows(phys, placement.slots_per_gpu, world)
        record["routings"][kind].update({
            **balance_columns(rows), "max_rel_err_vs_r0": err,
            "replicated_experts": int((plan.replicas[0] > 1).sum()),
            "max_replicas": int(plan.replicas[0].max()),
            "planned_gpu_load_max_over_mean": float(
                (lambda gl: gl.max() / gl.mean())(plan.gpu_loads(_load(ids, e))[0]))})
    group.check()

    # 3. liveness: drifting calls, device load count, a rebalance every N calls
    load = torch.zeros(e + 1, dtype=torch.int64, device=device)
    failures, rebalances, checked, calls = [], 0, 0, 0
    to_check = set()
    t1 = time.time()
    try:
        for i in range(args.calls):
            kind = ROUTINGS[i % len(ROUTINGS)]
            xs, ids, ws = cases[kind]
            for r in range(world):
                count_load(load, ids[r])
            phys = [translate(ids[r], tables, r) for r in range(world)]
            delays = [rng.randint(1, MAX_DELAY_CYCLES) if rng.random() < 1 / 3 else 0
                      for _ in range(world)] if device.type == "cuda" else None
            ys = group.forward(xs, phys, ws, delays)
            calls += 1
            if kind in to_check:
                err = max(rel_err(y, ref) for y, ref in zip(ys, expected[kind]))
                worst = max(worst, err)
                checked += 1
                to_check.discard(kind)
            if (i + 1) % args.rebalance_every == 0:
                plan = plan_placement(load[1:].cpu(), placement)
                _place(group, tables, plan, w13_all, w2_all, world)
                load.zero_()
                rebalances += 1
                to_check = set(ROUTINGS)
        group.check()
    except Exception as err:  # noqa: BLE001 - a timeout (CometError) is the finding
        failures.append(f"{type(err).__name__}: {err}"[:400])
    record["liveness"] = {"calls": calls, "rebalance_every": args.rebalance_every,
                          "rebalances": rebalances, "outputs_checked": checked,
                          "failures": failures, "seconds": time.time() - t1}
    record["max_rel_err"] = worst
    record["no_host_sync"] = synced_ok
    record["seconds"] = time.time() - t0
    del group, w13_all, w2_all, cases, expected
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return record


def run_module(base: MoEConfig, tokens: int, device) -> dict:
    """Step 4: CometMoE with and without replicas on one process, forward and backward."""
    from comet import CometMoE
    redundant = base.num_experts // 8
    kw = dict(dtype=base.dtype, max_tokens=tokens, device=device)
    torch.manual_seed(SEED)
    plain = CometMoE(base.num_experts, base.top_k, base.hidden_size, base.intermediate_size, **kw)
    layer = CometMoE(base.num_experts, base.top_k, base.hidden_size, base.intermediate_size,
                     redundant_experts=redundant, **kw)
    layer.load_state_dict(plain.state_dict())
    held = {"without_replicas": _bytes(plain), "with_replicas": _bytes(layer)}
    g = torch.Generator().manual_seed(SEED)
    ids, w = zipf_routing(tokens, base, g)
    ids, w = ids.to(device), w.to(device)
    x = (torch.randn(tokens, base.hidden_size, generator=g) * 0.5).to(base.dtype).to(device)
    errs = {}
    with torch.no_grad():
        want = plain(x, ids, w)
        errs["forward"] = rel_err(layer(x, ids, w), want)
        load = layer.expert_load()
        plan = layer.rebalance()
        for i in range(3):        # the graph's capture, then replays after the re-placement
            errs[f"after_rebalance_{i}"] = rel_err(layer(x, ids, w), want)
    grads = []
    for m in (plain, layer):
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        m(xg, ids, wg).float().square().mean().backward()
        logical = m.logical_experts(grad=True)
        grads.append({"x": xg.grad, "topk_weights": wg.grad, "w13": logical["w13"],
                      "w2": logical["w2"]})
    for name in grads[0]:
        errs[f"grad_{name}"] = rel_err(grads[1][name], grads[0][name])
    expected = (base.num_experts + redundant) / base.num_experts
    return {"model": "module", "experts": base.num_experts, "redundant_experts": redundant,
            "tokens": tokens, "pairs_counted": int(load.sum()), "bytes_per_rank": held,
            "bytes_ratio": held["with_replicas"] / held["without_replicas"],
            "bytes_ratio_slots": expected,
            "bytes_ok": held["with_replicas"] <= 1.01 * expected * held["without_replicas"],
            "replicated_experts": int((plan.replicas[0] > 1).sum()), "rel_err": errs,
            "max_rel_err": max(errs.values())}


def run_interval(base: MoEConfig, tokens: int, interval: int, device) -> dict:
    """Step 5: ``rebalance_interval`` through CometMoE: ``3 * interval`` calls whose Zipf
    order changes every ``interval`` calls, each against the layer without replicas."""
    from comet import CometMoE
    kw = dict(dtype=base.dtype, max_tokens=tokens, device=device)
    torch.manual_seed(SEED)
    dims = (base.num_experts, base.top_k, base.hidden_size, base.intermediate_size)
    plain = CometMoE(*dims, **kw)
    layer = CometMoE(*dims, redundant_experts=base.num_experts // 8,
                     rebalance_interval=interval, **kw)
    layer.load_state_dict(plain.state_dict())
    rebalances, plans = [], set()
    rebalance = layer.rebalance

    def counted(plan=None, **kwargs):
        rebalances.append(len(rebalances))
        out = rebalance(plan, **kwargs)
        plans.add(tuple(layer.replicas.phy2log.tolist()))
        return out

    layer.rebalance = counted
    phases = []
    for phase in range(3):
        g = torch.Generator().manual_seed(derive_seed(SEED, "interval", phase))
        ids, w = zipf_routing(tokens, base, g)
        x = (torch.randn(tokens, base.hidden_size, generator=g) * 0.5).to(base.dtype)
        phases.append((x.to(device), ids.to(device), w.to(device)))
    worst, calls = 0.0, 3 * interval
    with torch.no_grad():
        for i in range(calls):
            x, ids, w = phases[i // interval]
            worst = max(worst, rel_err(layer(x, ids, w), plain(x, ids, w)))
    return {"model": "module-interval", "experts": base.num_experts, "tokens": tokens,
            "rebalance_interval": interval, "calls": calls, "rebalances": len(rebalances),
            "distinct_plans": len(plans), "max_rel_err": worst,
            "liveness": {"calls": calls, "rebalances": len(rebalances),
                         "failures": [] if len(rebalances) == 3 else
                         [f"{len(rebalances)} automatic rebalances in {calls} calls, "
                          f"expected 3"]}}


def run_patched(device) -> dict:
    """Step 6: ``patch_model`` with redundant experts on a tiny transformers model."""
    try:
        from comet import CometMoE
        from comet.integrations.tiny_models import build_tiny_model, patched_copy
        model = build_tiny_model("mixtral", dtype=torch.float32 if device.type == "cpu"
                                 else torch.bfloat16, device=device)
    except ImportError as err:
        return {"model": "patch_model", "skipped": f"{err}", "max_rel_err": 0.0}
    plain = patched_copy(model)
    patched = patched_copy(model, redundant_experts=4, rebalance_interval=2)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    keys_ok = {k: tuple(v.shape) for k, v in patched.state_dict().items()} == shapes
    worst = 0.0
    with torch.no_grad():
        for seed in range(5):                  # automatic rebalances after calls 2 and 4
            ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
            ids = ids.to(device)
            worst = max(worst, rel_err(patched(ids).logits, plain(ids).logits))
    blocks = [m for m in patched.modules() if isinstance(m, CometMoE) and m.replicas is not None]
    return {"model": "patch_model", "family": "mixtral", "blocks": len(blocks),
            "checkpoint_keys_and_shapes_kept": keys_ok, "max_rel_err": worst
            if keys_ok and blocks else float("inf")}


def _bytes(module) -> int:
    """Parameter and buffer bytes of ``module``."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _rows(ids: list, slots_per_rank: int, world: int) -> torch.Tensor:
    """``[W_src, W_dst]`` rows of the virtual ranks' ids (one process holds them all)."""
    return torch.stack([destination_rows(i, slots_per_rank, world) for i in ids])


def _rank_load(ids: list, num_experts: int) -> torch.Tensor:
    """``[W, E]`` pairs per logical expert of each virtual rank."""
    return torch.stack([_load([i], num_experts) for i in ids])


def _load(ids: list, num_experts: int) -> torch.Tensor:
    flat = torch.cat([i.reshape(-1) for i in ids]).cpu()
    return torch.bincount(flat[flat >= 0], minlength=num_experts)


def _place(group: Group, tables: ReplicaTables, plan: Placement, w13_all, w2_all,
           world: int) -> None:
    """The plan's weights into the group's shards and its tables, in place."""
    group.refill(w13_all, w2_all, plan.phy2log[0])
    shares = plan.shares if plan.shares is not None else dispatch_shares(plan)
    tables.load_(plan.phy2log[0], plan.log2phy[0], plan.replicas[0], shares[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="toy sizes on the CPU under the interpreter (checks the script)")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"of {', '.join(MODELS)} (default: both)")
    ap.add_argument("--ep", nargs="+", type=int, default=None,
                    help="virtual ranks (default: 4 8; --tiny: 2 4)")
    ap.add_argument("--cases", nargs="+", default=None, metavar="MODEL:EP",
                    help="model and virtual ranks pairs, instead of every --models by "
                         "every --ep (e.g. deepseek-v3-like:4 qwen3-30b-a3b-like:8)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="tokens per rank, the most whose workspaces fit --workspace-gb "
                         "taken (default: 4096 3072 2048; --tiny: 12)")
    ap.add_argument("--workspace-gb", type=float, default=60.0,
                    help="device memory the W workspaces may take (default 60)")
    ap.add_argument("--redundant", type=int, default=None, help="R (default: E / 8)")
    ap.add_argument("--calls", type=int, default=None,
                    help="liveness calls (default 200; --tiny: 6)")
    ap.add_argument("--rebalance-every", type=int, default=None,
                    help="calls between rebalances (default 50; --tiny: 2)")
    ap.add_argument("--no-module", action="store_true",
                    help="skip steps 4-6 (CometMoE with and without replicas at EP=1, "
                         "rebalance_interval, patch_model)")
    ap.add_argument("--module-interval", type=int, default=None,
                    help="step 5's rebalance_interval (default 50; --tiny: 2)")
    ap.add_argument("--output", default=None,
                    help="JSON file (default: $OUT/eplb_check.json, $OUT or ./out)")
    args = ap.parse_args()
    tiny = args.tiny
    models = TINY if tiny else {m: MODELS[m] for m in (args.models or MODELS)}
    args.ep = args.ep or ([2, 4] if tiny else [4, 8])
    args.tokens = args.tokens or ([12] if tiny else [4096, 3072, 2048])
    args.calls = args.calls if args.calls is not None else (6 if tiny else 200)
    args.rebalance_every = args.rebalance_every or (2 if tiny else 50)
    args.module_interval = args.module_interval or (2 if tiny else 50)
    cases = _cases(args, models)
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    if not tiny:
        models = {n: c.replace(dtype=torch.bfloat16) for n, c in models.items()}
    out_dir = os.environ.get("OUT", "out")
    path = args.output or os.path.join(out_dir, "eplb_check.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rng = random.Random(SEED)
    records = []
    if not args.no_module:
        # First: the steps that run CometMoE's own storage, exchanges and knobs (the
        # virtual-rank cases after them hold the weights themselves), within a time limit.
        name = "tiny" if tiny else "qwen3-30b-a3b-like"
        base = TINY["tiny"] if tiny else MODELS[name].replace(dtype=torch.bfloat16)
        tokens = 16 if tiny else 2048
        for step in (lambda: run_module(base, tokens, device),
                     lambda: run_interval(base, tokens, args.module_interval, device),
                     lambda: run_patched(device)):
            rec = step()
            records.append(rec)
            print(json.dumps(rec), flush=True)
            _write(path, records, device, partial=True)
            if device.type == "cuda":
                gc.collect()            # the layers' workspaces, before the cases' groups
                torch.cuda.empty_cache()
    for name, world in cases:
        rec = run_model(name, models[name], world, args, device, rng)
        records.append(rec)
        print(json.dumps(_summary(rec)), flush=True)
        _write(path, records, device, partial=True)
    bad = [r for r in records if r.get("liveness", {}).get("failures")
           or not r.get("no_host_sync", True) or not r.get("bytes_ok", True)
           or not r["max_rel_err"] <= MAX_REL_ERR]
    _write(path, records, device, partial=False)
    print(f"wrote {path}")
    print(f"EPLB CHECK {'FAILED' if bad else 'PASSED'}: {len(records)} records, "
          f"{len(bad)} bad", flush=True)
    return 1 if bad else 0


def _cases(args, models: dict) -> list[tuple[str, int]]:
    """``(model, EP)`` pairs to run: ``--cases``, else every model by every ``--ep``.
    SystemExit naming a bad pair, before anything runs."""
    if args.cases is None:
        return [(name, world) for name in models for world in args.ep]
    out = []
    for case in args.cases:
        name, _, world = case.partition(":")
        if name not in models or not world.isdigit() or int(world) < 1:
            sys.exit(f"--cases takes MODEL:EP with MODEL one of {', '.join(models)} and EP "
                     f"a positive int, got {case!r}")
        out.append((name, int(world)))
    return out


def _summary(rec: dict) -> dict:
    out = {k: rec[k] for k in ("model", "ep", "redundant_experts", "tokens_per_rank",
                               "max_rel_err", "no_host_sync")}
    for kind, cols in rec["routings"].items():
        out[kind] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in cols.items()
                     if k.startswith("rows")}
    out["liveness"] = {k: rec["liveness"][k] for k in ("calls", "rebalances", "failures")}
    return out


def _write(path: str, records: list, device, partial: bool) -> None:
    """The results file: device, commit, kernels and command (comet.bench.provenance)."""
    write_result(path, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "partial": partial, "records": records},
        command="PYTHONPATH=. python scripts/device/eplb_check.py " + " ".join(sys.argv[1:]),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


if __name__ == "__main__":
    sys.exit(main())
