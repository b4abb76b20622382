# usage: torchrun --nproc-per-node W scripts/device/stress.py --output FILE.json [--tile FIELD=V,...] [--tp N --convention C]
"""Liveness stress of the fused layer on W GPUs, at full model sizes (run by stress.sh).

``--tp N`` runs a (tp, W / tp) layout (comet.mesh) in ``--convention`` instead of
expert parallelism: each rank holds its F shard of its EP group's experts; under
"replicated" a TP group's ranks pass the same tokens.

For each preset (full size) and each token count (and one uneven set where rank 0 has no
tokens), 200 back-to-back calls with no host sync between them, cycling through routings
(uniform, one hot expert, every token to one rank's experts) and block splits (automatic,
(1,1), (2, P/10), (16,16), (P/2,P/2)), with random device-side delays before some calls
of some ranks so the ranks drift apart. Then the output of the last call of each routing
is checked against comet.reference. A CometError (timeout) counts as a failure; the
layer is reset and the sweep goes on. A hang is caught by the caller's `timeout`. The
run fails (exit 1, "STRESS FAILED") on any failure or an output further than
comet.bench.records.MAX_REL_ERR from the reference.

Every rank checks its own output: rank r's result equals comet.reference.moe_forward of
its tokens over *all* experts (full F), so each rank builds every expert from seeds.
Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comet import reference  # noqa: E402
from comet.bench.inputs import derive_seed, make_expert_weights  # noqa: E402
from comet.bench.mesh_runner import layout_name  # noqa: E402
from comet.bench.provenance import write_result  # noqa: E402
from comet.bench.records import MAX_REL_ERR  # noqa: E402
from comet.config import PRESETS  # noqa: E402
from comet.mesh import CONVENTIONS, MeshLayout  # noqa: E402
from comet.runtime.errors import CometError  # noqa: E402
from comet.runtime.layer import FusedMoE, default_tile  # noqa: E402

ROUTINGS = ("uniform", "hot_expert", "one_rank")
TOKENS = (7, 128, 3000, 4096, 16384)
#: Drift: a device spin of up to this many SM cycles (~0.5 ms) before ~1 call in 3.
MAX_DELAY_CYCLES = 1_000_000
SEED = 1234


def routing(kind: str, tokens: int, cfg, ep: int, g: torch.Generator):
    """``(ids, weights)`` of one rank; ``one_rank``: every token's experts live on EP rank
    ``ep - 1`` (its local experts are the only candidates)."""
    e, k = cfg.num_experts, cfg.top_k
    scores = torch.rand(tokens, e, generator=g)
    if kind == "hot_expert":
        scores[:, 0] += 2.0                    # every token's first choice is expert 0
    elif kind == "one_rank":
        el = e // ep
        scores[:, :(ep - 1) * el] -= 2.0        # only the last EP rank's experts remain
    ids = scores.topk(k, dim=1).indices
    return ids, torch.randn(tokens, k, generator=g).softmax(dim=1)


def rank_tokens(spec, world: int, rank: int) -> int:
    if spec == "uneven":
        return 0 if rank == 0 else 3000 + 500 * rank
    return int(spec)


def run_case(layer, name, cfg, spec, calls, w13_all, w2_all, rng):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = layer.mesh
    src = mesh.token_source(rank, layer.convention)
    p = layer.programs
    splits = [None, (1, 1), (2, max(1, p // 10)), (16, 16), (p // 2, p // 2)]
    m = rank_tokens(spec, world, src)
    inputs = {}
    for kind in ROUTINGS:
        g = torch.Generator().manual_seed(derive_seed(SEED, name, spec, kind, src))
        ids, w = routing(kind, m, cfg, mesh.ep, g)
        gx = torch.Generator(device="cuda").manual_seed(derive_seed(SEED, name, spec, kind,
                                                                   src, "x"))
        x = torch.randn(m, cfg.hidden_size, generator=gx, device="cuda", dtype=cfg.dtype)
        inputs[kind] = (x, ids.cuda(), w.cuda())
    torch.cuda.synchronize()
    dist.barrier()
    last, delays, errors = {}, 0, []
    t0 = time.time()
    try:
        for i in range(calls):
            kind = ROUTINGS[i % len(ROUTINGS)]
            if rng.random() < 1 / 3:
                torch.cuda._sleep(rng.randint(1, MAX_DELAY_CYCLES))
                delays += 1
            last[kind] = layer(*inputs[kind], comm_blocks=splits[i % len(splits)])
        layer.check_errors_now()
    except CometError as e:
        errors.append(f"rank {rank}: {e}")
        layer.reset()
    elapsed = time.time() - t0
    worst = 0.0
    if not errors:
        for kind, y in last.items():
            x, ids, w = inputs[kind]
            if m == 0:
                continue
            ref = reference.moe_forward(x, ids, w, w13_all, w2_all, round_to=cfg.dtype)
            worst = max(worst, ((y.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item())
    # Every rank's verdict, so rank 0 reports failures seen anywhere.
    verdict = [None] * world
    dist.all_gather_object(verdict, {"errors": errors, "max_rel_err": worst,
                                     "delays": delays, "seconds": elapsed})
    return {
        "config": name, "hidden_size": cfg.hidden_size, "tp": mesh.tp, "ep": mesh.ep,
        "convention": layer.convention,
        # What each rank passed: under "replicated" its TP group's source rank's tokens
        # (at (W, 1) the uneven set is an empty call on every rank).
        "tokens_per_rank": ([rank_tokens(spec, world, mesh.token_source(r, layer.convention))
                             for r in range(world)] if spec == "uneven" else int(spec)),
        "routings": list(ROUTINGS),
        "splits": ["auto" if s is None else list(s) for s in splits],
        "calls": calls, "delays": sum(v["delays"] for v in verdict),
        "failures": sum(len(v["errors"]) for v in verdict),
        "errors": [e for v in verdict for e in v["errors"]][:4],
        "max_rel_err": max(v["max_rel_err"] for v in verdict),
        "seconds": max(v["seconds"] for v in verdict),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--tokens", nargs="+", default=[str(t) for t in TOKENS] + ["uneven"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--output", required=True)
    ap.add_argument("--tile", default="", metavar="FIELD=V[,FIELD=V]",
                    help="integer TileConfig fields of the layer (e.g. group_m=16)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size of a (tp, W/tp) layout (default 1: EP)")
    ap.add_argument("--convention", choices=CONVENTIONS, default="sequence")
    args = ap.parse_args()
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")     # NVLink multicast off, as the launchers
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(SEED + 7919 * rank)       # ranks delay different calls
    max_tokens = max(rank_tokens(t, world, r) for t in args.tokens for r in range(world))
    mesh = MeshLayout(tp=args.tp, ep=world // args.tp)
    layout = f"ep{world}" if mesh.tp == 1 else layout_name(mesh)
    fields = {k: int(v) for k, v in (kv.split("=") for kv in args.tile.split(",") if kv)}
    records = []
    for name in args.presets:
        cfg = PRESETS[name].replace(max_tokens=max_tokens)
        tile = default_tile(mesh, args.convention, cfg).with_fields(**fields)
        el = cfg.num_experts // mesh.ep
        shards = [make_expert_weights(cfg, el, name, r, SEED, torch.device("cuda"))
                  for r in range(mesh.ep)]
        w13_all = torch.cat([s[0] for s in shards])
        w2_all = torch.cat([s[1] for s in shards])
        del shards
        mine = mesh.shard(rank, w13_all, w2_all)
        layer = FusedMoE(cfg, mine["w13"], mine["w2"], tile=tile, mesh=mesh,
                         convention=args.convention)
        del mine
        for spec in args.tokens:
            rec = run_case(layer, name, cfg, spec, args.calls, w13_all, w2_all, rng)
            records.append(rec)
            if rank == 0:
                print(json.dumps({k: rec[k] for k in ("config", "tokens_per_rank", "calls",
                                                      "delays", "failures", "max_rel_err",
                                                      "seconds")}), flush=True)
                _write(args.output, world, records, True, layout, args.convention)
        del layer, w13_all, w2_all
        torch.cuda.empty_cache()
    # Every rank holds every rank's verdicts (run_case gathers them): all exit alike.
    bad = [r for r in records if r["failures"] or not r["max_rel_err"] <= MAX_REL_ERR]
    if rank == 0:
        _write(args.output, world, records, False, layout, args.convention)
        print(f"STRESS {'FAILED' if bad else 'PASSED'}: {len(records)} records, "
              f"{len(bad)} bad", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad else 0


def _write(path, world, records, partial, layout, convention):
    command = "torchrun --nproc-per-node {} scripts/device/stress.py {}".format(
        world, " ".join(sys.argv[1:]))
    write_result(path, {"world_size": world, "layout": layout, "convention": convention,
                        "date": datetime.date.today().isoformat(), "partial": partial,
                        "records": records}, command=command)


if __name__ == "__main__":
    sys.exit(main())
