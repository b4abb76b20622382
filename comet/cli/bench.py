"""``comet bench``: time comet's fused MoE layer against the unfused and the chunked EP
baselines, per layer, config, tokens per rank and routing (docs/benchmarks.md has the
protocol).

Examples::

    comet bench                                   # every GPU, the four model configs
    comet bench --config mixtral --tokens 4096 --routing uniform --layers moe
    comet bench --experts 64 --topk 8 --hidden 4096 --ffn 1024 --output-dir out/
    comet bench --timeline --config mixtral --output-dir out/   # per-block trace
    comet bench --from-json out/bench-ep4-*.json --output-dir docs/  # tables from JSON
    comet bench --from-json FILE... --markdown      # the tables docs/benchmarks.md shows

With several GPUs visible it re-launches itself under torchrun, one rank per GPU, with
NVLink multicast off. With one GPU it runs in-process (EP=1). With none it times the torch
paths on a scaled-down config on the CPU, to show the tool works; those are no GPU timings.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comet.baseline import BASELINE_NOTES
from comet.bench import records as rec
from comet.bench import paired, report, trace
from comet.bench.cutlass_ref import load_cutlass_grouped_mm
from comet.bench.floors import hbm_read_gbps
from comet.bench.inputs import (ROUTINGS, make_expert_weights, make_input_sets,
                                quantize_expert_weights)
from comet.bench.provenance import provenance, write_result
from comet.bench.timing import park_and_align
from comet.bench.mesh_runner import layout_name, run_mesh_case
from comet.bench.deepgemm import FP8_PEERS
from comet.bench.deepgemm import NAME as DEEPGEMM
from comet.bench.mega_moe import FP8_LAYER_PEERS
from comet.bench.peers import PEERS, build_peers, load_peers
from comet.bench.runner import Case, Fused, Settings, run_case, run_fp8_case
from comet.cli.launch import init_ranks, maybe_relaunch
from comet.config import PRESETS, MoEConfig, ParallelConfig, check_layout
from comet.constants import interpreting, kernel_identity, kernels_of
from comet.mesh import CONVENTIONS, MeshLayout
from comet.quant import PROMOTION_KS, Fp8, Fp8Weight

#: Small enough that the CPU run finishes in seconds.
CPU_CONFIG = "cpu-tiny"
CONFIGS: dict[str, MoEConfig] = {
    **PRESETS,
    CPU_CONFIG: MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512),
}
GPU_CONFIGS = ("mixtral", "qwen2-moe", "phi3.5-moe", "deepseek-v3-like")
GPU_TOKENS = (128, 1024, 4096, 16384)
CPU_TOKENS = (64, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: ``--dtype`` of comet's FP8 layer: bf16 rows, FP8 experts (``MoEConfig.fp8``).
FP8 = "fp8"
FP8_INTERPRETED_NOTE = ("fp8 without a GPU: comet's FP8 layer runs under the Triton "
                        "interpreter, to show the records; its times mean nothing")
NO_FP8_NOTE = ("fp8 skipped: the FP8 layer has no torch path; without a GPU it runs under "
               "the Triton interpreter only (TRITON_INTERPRET=1)")
NO_GPU_NOTE = ("no GPU: these are CPU times of the torch paths (unfused and chunked "
               "baselines, per-expert GEMM loop) on a scaled-down config, not GPU timings; "
               "comet's fused kernels need CUDA, so its columns are empty")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="comet bench", description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Columns and protocol: docs/benchmarks.md.")
    g = p.add_argument_group("what to run")
    g.add_argument("--config", nargs="+", choices=sorted(CONFIGS), default=None,
                   metavar="NAME",
                   help=f"named configs, of {', '.join(sorted(CONFIGS))} (default: "
                        f"{' '.join(GPU_CONFIGS)} on a GPU, {CPU_CONFIG} on the CPU)")
    g.add_argument("--experts", type=int, help="explicit config: E (with --topk/--hidden/--ffn)")
    g.add_argument("--topk", type=int, help="explicit config: experts per token")
    g.add_argument("--hidden", type=int, help="explicit config: H")
    g.add_argument("--ffn", type=int, help="explicit config: expert FFN size F")
    g.add_argument("--tokens", nargs="+", type=int, default=None,
                   help=f"tokens per rank (default: {' '.join(map(str, GPU_TOKENS))} on a GPU, "
                        f"{' '.join(map(str, CPU_TOKENS))} on the CPU)")
    g.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS),
                   help="uniform, or skewed: expert 0 chosen by half of all tokens "
                        "(default: both)")
    g.add_argument("--layers", nargs="+", choices=rec.LAYERS, default=list(rec.LAYERS),
                   help="layer0 (dispatch + GEMM0 + act), layer1 (GEMM1 + combine), moe "
                        "(the whole layer) (default: all)")
    g.add_argument("--dtype", nargs="+", choices=[*sorted(DTYPES), FP8], default=None,
                   help="default: bf16 on a GPU, fp32 on the CPU (CPU bf16 GEMMs crawl); "
                        "fp8: comet's FP8 layer (forward only) on the same weights "
                        "quantized (comet.quant); 'bf16 fp8' times both, case by case, and "
                        "holds the FP8 layer against bf16 (docs/benchmarking.md, 'FP8')")
    g.add_argument("--comm-blocks", nargs="+", type=int, default=None, metavar="N",
                   help="fix the block split: one count for both layers or two "
                        "(layer0 layer1); default: comet chooses per call")
    g.add_argument("--fixed-splits", nargs="+", type=int, default=[], metavar="N",
                   help="also time the fused layer at each of these comm-block counts (both "
                        "layers), so every record shows comet's choice against the best "
                        "fixed split (columns best fixed, b/best fixed); e.g. 0 8 16 32")
    g.add_argument("--lead-us", type=float, default=0.0, metavar="US",
                   help="park the GPU this long before each whole-call iteration, so the "
                        "host issues the call ahead and small calls are timed as device "
                        "work, not partly as the host's issue time (default 0: calls back "
                        "to back); e.g. 500")
    g.add_argument("--tile", default="", metavar="FIELD=V[,FIELD=V]",
                   help="integer TileConfig fields of comet's layer (e.g. layer1_scatter=0 "
                        "for layer1's column-split reduce; default: the layer's defaults)")
    g.add_argument("--only-fused", action="store_true",
                   help="time comet's layer alone (its modes, --fixed-splits): not the "
                        "baselines, reference GEMMs, NCCL or peers, whose columns stay "
                        "empty -- what --dtype bf16 fp8's ratios need, in a fraction of "
                        "the time")
    g.add_argument("--fp8-promotion-k", type=int, choices=PROMOTION_KS, default=None,
                   help="with --dtype fp8: the K values the FP8 tensor cores sum before "
                        "the sum is promoted to fp32 (comet.quant.Fp8.promotion_k): 128, "
                        "one K step, or 32, every MMA instruction, in every GEMM (default: "
                        "128 in the warp-specialized GEMMs of large calls, 32 in the "
                        "others); the FP8 records name it (\"auto\" for the default)")
    g.add_argument("--chunks", nargs="+", type=int, default=[2, 4],
                   help="chunk counts tried for the coarse-grained baseline, the best "
                        "kept (default: 2 4)")
    g.add_argument("--peers", nargs="+", choices=sorted({**PEERS, **FP8_PEERS, **FP8_LAYER_PEERS}), default=[],
                   metavar="NAME",
                   help="also time other projects' layers on the same inputs, whole layer, "
                        "each checked against the unfused baseline first: "
                        f"{', '.join(sorted(PEERS))}; and with --dtype fp8, {DEEPGEMM}: "
                        "DeepGEMM's grouped FP8 GEMMs on the FP8 layer's rows, checked "
                        "against the fp32 emulation, beside comet's GEMM phases (optional "
                        "packages: scripts/device/build_peers.sh); one that cannot run shows "
                        "'-' and why (docs/benchmarks.md, 'Peers')")
    g.add_argument("--redundant-experts", type=int, default=None, metavar="R",
                   help="run comet's layer on E + R physical experts placed by the EPLB "
                        "planner from each case's own routing (comet.placement), and add "
                        "the rows' balance over ranks (max/mean) and the share computed on "
                        "the token's own rank, with R and without replicas (docs/eplb.md); "
                        "0: the balance columns only")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch (default: every visible GPU)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: a (tp, ranks/tp) layout, each expert's FFN "
                        "split over tp ranks, timed against the unfused TP pipeline "
                        "(default: 1, expert parallelism over every rank)")
    g.add_argument("--convention", choices=CONVENTIONS, default="sequence",
                   help="with --tp: each rank passes its own tokens (sequence) or a TP "
                        "group the same ones (replicated) (default: sequence)")
    m = p.add_argument_group("how to measure")
    m.add_argument("--iters", type=int, default=None,
                   help="timed iterations per variant (default: 20 on a GPU, 3 on the CPU)")
    m.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations first (default: 5 on a GPU, 1 on the CPU)")
    m.add_argument("--input-sets", type=int, default=4,
                   help="input sets rotated through, with an L2 flush between "
                        "iterations (default: 4)")
    m.add_argument("--seed", type=int, default=0, help="seed of every input (default: 0)")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default=None,
                   help="write the JSON records, a markdown report and a PNG plot here")
    o.add_argument("--no-plot", action="store_true", help="skip the PNG")
    o.add_argument("--timeline", action="store_true",
                   help="instead of the sweep: a per-block timeline of one fused call of the "
                        "first config (Chrome/Perfetto trace + PNG)")
    o.add_argument("--timeline-tokens", type=int, default=4096,
                   help="tokens per rank of the --timeline call (default: 4096)")
    o.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="measure nothing: print and write the report of these result files "
                        "(their ratios derived again from their times)")
    o.add_argument("--markdown", action="store_true",
                   help="with --from-json: print the markdown tables docs/benchmarks.md shows "
                        "(each file's device, commit, kernels and command; whole-layer rows "
                        "of each --routing; the summary) and write nothing")
    o.add_argument("--against", nargs="+", default=None, metavar="PATH",
                   help="with --from-json: compare those runs (new) with these (base), "
                        "record by record, and write the ratios (paired-<stamp>.json)")
    return p


# --------------------------------------------------------------------------- helpers
def _configs(args, parser, on_gpu: bool) -> list[tuple[str, MoEConfig]]:
    explicit = [args.experts, args.topk, args.hidden, args.ffn]
    out = []
    names = args.config or ([] if any(v is not None for v in explicit) else
                            (GPU_CONFIGS if on_gpu else [CPU_CONFIG]))
    out += [(n, CONFIGS[n]) for n in names]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            parser.error("--experts, --topk, --hidden and --ffn go together")
        try:
            cfg = MoEConfig(num_experts=args.experts, top_k=args.topk,
                            hidden_size=args.hidden, intermediate_size=args.ffn)
        except ValueError as err:
            parser.error(str(err))
        out.append((f"e{args.experts}-k{args.topk}-h{args.hidden}-f{args.ffn}", cfg))
    return out


def _paired(new_paths, base_paths, output_dir, stamp) -> int:
    """Print (and write) the paired comparison of two sets of sweeps."""
    rows = paired.compare([rec.read_json(p) for p in new_paths],
                          [rec.read_json(p) for p in base_paths])
    print(paired.text_table(rows))
    lines = paired.summary(rows)
    print("\n".join(lines))
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, f"paired-{stamp:%Y%m%d-%H%M%S}.json")
        write_result(path, {"new": new_paths, "base": base_paths, "summary": lines,
                            "rows": rows})
        print(f"wrote {path}")
    return 0


#: Why two --tile variants' whole-call times may differ by more than the tile.
TILE_VARIANT_NOTE = (
    "--tile builds a TileConfig variant: tables tuned for the default TileConfig (every "
    "shipped one) do not serve it -- unless its fields leave the default tile as it is "
    "(say dispatch_parts=8), when they do -- so its comm blocks come from a table tuned "
    "for the variant if there is one, else the analytic model, against the default's "
    "tuned ones. Compare variants by their --fixed-splits, --comm-blocks or phases.")


def _tile_field(kv: str) -> tuple[str, int]:
    """``"FIELD=V"`` -> ``(FIELD, int(V))``, FIELD an integer TileConfig field (its own or
    its :class:`~comet.config.Variant`'s, by name)."""
    from comet.config import TileConfig
    name, _, value = kv.partition("=")
    fields = set(TileConfig().flat())
    if name not in fields or not value.lstrip("-").isdigit():
        raise ValueError(f"expected FIELD=INT with FIELD a TileConfig field, got {kv!r}")
    return name, int(value)


def _tile_of(meta: dict, cfg, mesh: MeshLayout, convention: str = "sequence") -> dict:
    """``{"tile": TileConfig}`` of this run's --tile fields (``meta["tile"]``) over the
    default tile of ``cfg`` in the layout ``mesh`` -- the tile the layer itself would
    pick, so that a variant differs from the default by its fields alone (whether the
    dispatch gathers depends on the layout) -- or ``{}`` for the layer's default: keyword
    arguments of :func:`_build_fused`."""
    from comet.runtime.layer import default_tile
    fields = meta.get("tile")
    return ({"tile": default_tile(mesh, convention, cfg).with_fields(**fields)}
            if fields else {})


def _comm_blocks(values, parser):
    if values is None or len(values) > 2:
        if values is not None:
            parser.error("--comm-blocks takes one count (both layers) or two (layer0 layer1)")
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _build_fused(cfg, w13, w2, group, device, **kwargs) -> tuple[Fused | None, str | None]:
    """comet's layer for ``cfg`` (``kwargs``: FusedMoE's ``tile``, and ``mesh`` and
    ``convention`` of a TP layout), or None and why; every rank gets the same answer."""
    # The FP8 layer has no torch path to time instead: on the CPU it runs interpreted.
    if device.type != "cuda" and not (cfg.fp8 is not None and interpreting()):
        return None, None
    try:
        from comet.runtime.layer import FusedMoE, PhaseTimer
        fused, why = Fused(FusedMoE(cfg, w13, w2, group=group, **kwargs), PhaseTimer), None
    except Exception as err:  # report and go on: the baselines are still worth measuring
        fused, why = None, f"comet fused unavailable: {type(err).__name__}: {err}"
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ok = torch.tensor([fused is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not ok.item() and fused is not None:
            fused, why = None, "comet fused unavailable: it failed to build on another rank"
    return fused, why


def _gather_objects(obj, group) -> list:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _report_other_kernels(paths: list[str]) -> None:
    """Say (on stderr) which result files other kernels than these made."""
    ours = kernel_identity()
    for path in paths:
        theirs = sorted({kernels_of(r) for r in rec.read_json(path)})
        if theirs != [ours]:
            print(f"note: {path} was made by kernels {', '.join(theirs)}; this checkout's "
                  f"are {ours}", file=sys.stderr)


def _emit(records: list[dict], notes: list[str], output_dir: str | None, stem: str,
          plot: bool) -> None:
    """Print the report and write JSON, markdown and PNG (rank 0 only)."""
    rec.pair_dtypes(records)
    for n in notes:
        print(f"note: {n}")
    plain = [r for r in records if not rec.is_fp8(r)]
    fp8 = [r for r in records if rec.is_fp8(r) and r["layer"] == "moe"]
    if plain:
        print()
        print(report.text_table(plain, report.MAIN_COLUMNS))
        print()
        print(report.text_table(plain, report.EFFICIENCY_COLUMNS))
    if fp8:
        print()
        print(report.text_table(fp8, report.fp8_columns(fp8)))
    moe = [r for r in plain if r["layer"] == "moe"]
    if moe:
        print()
        print(report.text_table(moe, report.BREAKDOWN_COLUMNS))
    if any("rows_max_over_mean_r0" in r for r in moe):
        print()
        print(report.text_table(moe, report.EPLB_COLUMNS))
    if peers := report.peer_rows(records):
        print()
        print(report.text_table(peers, report.peer_columns(peers)))
        for line in report.peer_notes(peers):
            print(f"note: {line}")
    for line in report.summary(records):
        print(f"summary: {line}")
    if output_dir is None:
        return
    base = os.path.join(output_dir, stem)
    print(f"wrote {rec.write_json(records, base + '.json')}")
    if plot and plain:
        _, note = report.plot_speedup(plain, base + ".png")
        notes = notes + [note]
        print(note)
    with open(base + ".md", "w") as f:
        f.write(report.markdown_report(records, notes))
    print(f"wrote {base}.md")


class _Partial:
    """The records so far, rewritten after every case (rank 0, with an output folder), so
    a sweep cut short -- a device call's time limit, a hang -- still leaves its results;
    removed once the full report is written."""

    def __init__(self, output_dir: str | None, stem: str, rank: int):
        self.path = (os.path.join(output_dir, stem + ".partial.json")
                     if output_dir and rank == 0 else None)

    def save(self, records: list[dict]) -> None:
        if self.path:
            rec.write_json(records, self.path)

    def done(self) -> None:
        if self.path and os.path.exists(self.path):
            os.remove(self.path)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc)

    if args.against and not args.from_json:
        parser.error("--against compares with the runs of --from-json")
    if args.markdown and not args.from_json:
        parser.error("--markdown renders the files of --from-json")
    if args.from_json:
        _report_other_kernels(args.from_json + (args.against or []))
    if args.against:
        return _paired(args.from_json, args.against, args.output_dir, stamp)
    if args.from_json and args.markdown:
        print(report.docs_markdown([(p, [rec.derive(r) for r in rec.read_json(p)])
                                    for p in args.from_json], args.routing), end="")
        return 0
    if args.from_json:
        # the ratios again from the stored times: an older file gains the ones added since
        records = [rec.derive(r) for path in args.from_json for r in rec.read_json(path)]
        notes = sorted({n for r in records for n in r.get("notes", [])})
        _emit(records, notes, args.output_dir, f"bench-{stamp:%Y%m%d-%H%M%S}", not args.no_plot)
        return 0

    code = maybe_relaunch(argv, args.nproc, "comet.cli.bench")
    if code is not None:
        return code
    device, world, rank = init_ranks()
    group = None
    try:
        return _run(args, parser, argv, stamp, device, group, world, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args, parser, argv, stamp, device, group, world, rank) -> int:
    on_gpu = device.type == "cuda"
    configs = _configs(args, parser, on_gpu)
    tokens = args.tokens or list(GPU_TOKENS if on_gpu else CPU_TOKENS)
    iters = args.iters or (20 if on_gpu else 3)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    if min(tokens) < 0 or iters < 1 or args.input_sets < 1 or min(args.chunks) < 1:
        parser.error("--tokens must be >= 0; --iters, --input-sets and --chunks >= 1")
    if any(n < 0 for n in args.fixed_splits):
        parser.error("--fixed-splits must be >= 0")
    dtypes = list(dict.fromkeys(args.dtype or ["bf16" if on_gpu else "fp32"]))
    plain = [d for d in dtypes if d != FP8]
    if len(plain) > 1:
        parser.error("--dtype takes one row dtype per run, and fp8 beside it")
    fp8 = FP8 in dtypes
    if args.fp8_promotion_k is not None and not fp8:
        parser.error("--fp8-promotion-k needs --dtype fp8")
    if fp8 and (args.tp > 1 or args.timeline or args.redundant_experts is not None):
        parser.error("--dtype fp8 times an expert-parallel sweep (no --tp, --timeline or "
                     "--redundant-experts)")
    # The FP8 layer's experts are quantized from bf16 ones, the bf16 layer's own.
    dtype = DTYPES[plain[0]] if plain else torch.bfloat16
    notes = [] if on_gpu else [NO_GPU_NOTE]
    if fp8 and not on_gpu:
        notes.append(FP8_INTERPRETED_NOTE if interpreting() else NO_FP8_NOTE)
        fp8 = interpreting()
    if on_gpu and iters < 20:
        notes.append(f"only {iters} timed iterations; the protocol quotes medians of >= 20")
    if args.tp < 1 or world % args.tp:
        parser.error(f"--tp must divide the number of ranks ({world})")
    mesh = MeshLayout(tp=args.tp, ep=world // args.tp)
    if args.only_fused and (args.peers or mesh.tp > 1):
        parser.error("--only-fused times an expert-parallel sweep's own layer (no --peers, "
                     "no --tp)")
    if args.peers and mesh.tp > 1:
        parser.error("--peers times expert-parallel layers only (no --tp)")
    layer_peers = [n for n in args.peers if n in PEERS]
    gemm_peers = [n for n in args.peers if n in FP8_PEERS]
    fp8_layer_peers = [n for n in args.peers if n in FP8_LAYER_PEERS]
    if (gemm_peers or fp8_layer_peers) and FP8 not in dtypes:
        parser.error(f"--peers {' '.join(gemm_peers + fp8_layer_peers)} times FP8 "
                     "layers or GEMMs: add --dtype fp8")
    if args.redundant_experts is not None and (args.redundant_experts < 0 or mesh.tp > 1
                                               or args.timeline):
        parser.error("--redundant-experts takes R >= 0, in an expert-parallel sweep (no "
                     "--tp, no --timeline)")
    layout = f"ep{world}" if mesh.tp == 1 else layout_name(mesh)
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    meta = {**provenance(shlex.join(["comet", "bench", *argv]), device_name),
            "world_size": world, "layout": layout,
            "date": stamp.isoformat(timespec="seconds")}
    if args.redundant_experts is not None:
        meta["redundant_experts"] = args.redundant_experts
    try:
        tile_fields = dict(_tile_field(kv) for kv in args.tile.split(",") if kv)
    except ValueError as err:
        parser.error(f"--tile: {err}")
    if tile_fields:
        meta["tile"] = tile_fields
        if args.comm_blocks is None:
            notes.append(TILE_VARIANT_NOTE)
    if args.lead_us < 0:
        parser.error(f"--lead-us must be >= 0, got {args.lead_us}")
    st = Settings(device=device, group=group, world=world, rank=rank, iters=iters,
                  warmup=warmup, n_sets=args.input_sets, seed=args.seed,
                  comm_blocks=_comm_blocks(args.comm_blocks, parser),
                  chunk_options=tuple(args.chunks), fixed_splits=tuple(args.fixed_splits),
                  lead_us=args.lead_us, only_fused=args.only_fused)
    if args.lead_us:
        meta["lead_us"] = args.lead_us
    if args.timeline:
        return _timeline(args, configs[0], st, dtype, meta, stamp, mesh)
    st.hbm_gbps = hbm_read_gbps(device)
    meta["baselines"] = {k: BASELINE_NOTES[k] for k in (
        ("mesh",) if mesh.tp > 1 else ("baseline", "chunked"))}
    if mesh.tp > 1:
        meta["convention"] = args.convention
        return _run_mesh(args, configs, tokens, st, dtype, meta, notes, stamp, mesh)

    cutlass_mm, cutlass_note = (load_cutlass_grouped_mm(device, dtype) if plain
                                else (None, None))
    if plain and cutlass_mm is None:
        notes.append(cutlass_note)
    loaded_peers = load_peers(layer_peers, device, world, group) if plain else None
    deepgemm = (load_peers(gemm_peers, device, world, group, FP8_PEERS).get(DEEPGEMM)
                if fp8 else None)
    loaded_fp8_peers = (load_peers(fp8_layer_peers, device, world, group, FP8_LAYER_PEERS)
                        if fp8 and fp8_layer_peers else None)
    cases = [(name, t, r) for name, _ in configs for t in tokens for r in args.routing]
    records: list[dict] = []
    stem = f"bench-{layout}-{stamp:%Y%m%d-%H%M%S}"
    partial = _Partial(args.output_dir, stem, rank)
    from tqdm import tqdm
    bar = tqdm(total=len(cases), desc="comet bench", disable=rank != 0, dynamic_ncols=True)
    for name, base_cfg in configs:
        cfg = base_cfg.replace(dtype=dtype, max_tokens=max(max(tokens), 1))
        try:
            check_layout(cfg, ParallelConfig(world, rank))
        except ValueError as err:
            notes.append(f"{name} skipped: {err}")
            bar.update(len(tokens) * len(args.routing))
            continue
        w13, w2 = make_expert_weights(cfg, cfg.num_experts // world, name, rank, args.seed,
                                      device)
        fused = peers = fp8_peers = replicas = None
        if plain and args.redundant_experts is not None:
            try:
                replicas = _replicated(cfg, name, args, meta, group, device, world, rank,
                                       w13, w2)
            except ValueError as err:
                notes.append(f"{name} skipped: {err}")
                bar.update(len(tokens) * len(args.routing))
                continue
            fused, why = replicas.fused, replicas.why
        elif plain:
            fused, why = _build_fused(cfg, w13, w2, group, device,
                                      **_tile_of(meta, cfg, MeshLayout(ep=world)))
        else:
            why = None
        if why and why not in notes:
            notes.append(why)
        if plain and layer_peers:
            peers = build_peers(loaded_peers, cfg, w13, w2, group, device)
        fp8_layer = None
        if fp8:
            fp8_layer = _fp8_layer(name, cfg, w13, w2, meta, args.seed, group, device,
                                   world, rank, args.fp8_promotion_k)
            if isinstance(fp8_layer, str):
                notes.append(fp8_layer)
                fp8_layer = None
            elif fp8_layer.why and fp8_layer.why not in notes:
                notes.append(fp8_layer.why)
            if fp8_layer is not None and loaded_fp8_peers is not None:
                fp8_peers = build_peers(loaded_fp8_peers, fp8_layer.cfg, fp8_layer.gate_up,
                                        fp8_layer.down, group, device)
        for t in tokens:
            for routing in args.routing:
                bar.set_postfix_str(f"{name} {t} {routing}")
                if plain:
                    balance = ({} if replicas is None else
                               replicas.prepare(Case(name, cfg, t, routing), st))
                    for r in run_case(Case(name, cfg, t, routing), st, w13, w2, fused,
                                      cutlass_mm, args.layers, peers):
                        records.append({**meta, **r, **balance, "notes": notes})
                if fp8_layer is not None:
                    f8 = fp8_layer
                    for r in run_fp8_case(Case(name, f8.cfg, t, routing), st, f8.gate_up,
                                          f8.down, f8.fused, args.layers, deepgemm,
                                          fp8_peers):
                        records.append({**meta, **r, "fp8_promotion_k":
                                        f8.cfg.fp8.promotion_k or "auto", "notes": notes})
                partial.save(records)
                bar.update()
        for built in (peers, fp8_peers):
            if built is not None:
                built.close()
        del w13, w2, fused, peers, fp8_peers, fp8_layer
        if on_gpu:
            torch.cuda.empty_cache()
    bar.close()
    if rank == 0:
        _emit(records, notes, args.output_dir, stem, not args.no_plot)
    partial.done()
    return _status(records)


@dataclass
class _Fp8Layer:
    """comet's FP8 layer of one config: its config, this rank's FP8 experts, the layer
    (None, and ``why``, where it cannot be built)."""

    cfg: MoEConfig
    gate_up: Fp8Weight
    down: Fp8Weight
    fused: Fused | None
    why: str | None


def _fp8_layer(name: str, cfg: MoEConfig, w13, w2, meta: dict, seed: int, group, device,
               world: int, rank: int, promotion_k: int | None = None) -> _Fp8Layer | str:
    """The :class:`_Fp8Layer` of ``cfg`` on this rank's experts quantized (``w13``/``w2``
    where they are bf16, else the same draws in bf16), or a note saying why the config
    has no FP8 form. ``promotion_k``: :attr:`comet.quant.Fp8.promotion_k`."""
    try:
        fp8 = Fp8(promotion_k=promotion_k)
        cfg8 = cfg.replace(dtype=torch.bfloat16, fp8=fp8)
        check_layout(cfg8, ParallelConfig(world, rank))
    except ValueError as err:
        return f"{name} fp8 skipped: {err}"
    if w13.dtype != torch.bfloat16:
        w13, w2 = make_expert_weights(cfg8, cfg8.num_experts // world, name, rank, seed,
                                      device)
    gate_up, down = quantize_expert_weights(w13, w2)
    fused, why = _build_fused(cfg8, gate_up, down, group, device,
                              **_tile_of(meta, cfg8, MeshLayout(ep=world)))
    return _Fp8Layer(cfg8, gate_up, down, fused, why)


class _Replicas:
    """``--redundant-experts``: comet's layer of one config on its physical experts
    (:class:`comet.bench.eplb.ReplicatedLayer`), re-placed before each case from that
    case's routing; ``fused`` None (and ``why``) where it cannot run (no GPU)."""

    def __init__(self, cfg, name, placement, seed, group, device, world, rank, w13, w2,
                 fused_kwargs):
        from comet.bench import eplb
        from comet.eplb import physical_config
        from comet.placement import home_placement
        self.cfg, self.name, self.placement, self.seed = cfg, name, placement, seed
        self.group, self.device, self.world, self.rank = group, device, world, rank
        self.weights = None
        self.layer = eplb.ReplicatedLayer(None, placement, rank, device)
        if not placement.redundant_experts:         # the plain layer, balance columns only
            self.fused, self.why = _build_fused(cfg, w13, w2, group, device, **fused_kwargs)
            return
        if device.type == "cuda":
            self.weights = eplb.physical_weights(cfg, home_placement(placement), rank, world,
                                                 name, seed, device)
        fused, self.why = _build_fused(physical_config(cfg, placement.redundant_experts),
                                       *(self.weights or (w13, w2)), group, device,
                                       w13_layout="interleaved", **fused_kwargs)
        self.fused = None
        if fused is not None:
            self.layer.layer = fused.layer
            self.fused = Fused(self.layer, fused.make_timer)

    def prepare(self, case: Case, st: Settings) -> dict:
        """Place the experts for ``case``'s routing; its balance columns."""
        from comet.bench import eplb
        from comet.bench.inputs import make_input_sets
        p = self.placement
        ids = [s.topk_ids for s in make_input_sets(case.cfg, case.config, case.tokens,
                                                   case.routing, st.n_sets, st.rank,
                                                   st.seed, st.device)]
        el = p.num_experts // p.num_gpus
        plain = eplb.balance_columns(eplb.gathered_rows(ids, el, self.world, self.rank,
                                                        self.group))
        out = {f"{k}_r0": v for k, v in plain.items()}
        if not p.redundant_experts:
            return {**out, **plain}
        plan = eplb.plan_for(ids, p, self.group)
        self.layer.load_plan(plan)
        if self.weights is not None:
            eplb.physical_weights(self.cfg, plan, self.rank, self.world, self.name,
                                  self.seed, self.device, out=self.weights)
        phys = [self.layer.translate(i) for i in ids]
        return {**out, **eplb.balance_columns(eplb.gathered_rows(
            phys, p.slots_per_gpu, self.world, self.rank, self.group))}


def _replicated(cfg, name, args, meta, group, device, world, rank, w13, w2) -> _Replicas:
    """The :class:`_Replicas` of one config; ValueError where R does not fit."""
    from comet.placement import PlacementConfig
    placement = PlacementConfig(cfg.num_experts, args.redundant_experts, world)
    return _Replicas(cfg, name, placement, args.seed, group, device, world, rank, w13, w2,
                     _tile_of(meta, cfg, MeshLayout(ep=world)))


def _run_mesh(args, configs, tokens, st: Settings, dtype, meta, notes, stamp,
              mesh: MeshLayout) -> int:
    """The sweep of a (tp, ep) layout: comet's fused layer against the unfused TP
    pipeline and torch's grouped GEMMs on the shard's rows (comet.bench.mesh_runner)."""
    from tqdm import tqdm

    from comet.baseline import MeshGroups
    groups = MeshGroups.new(mesh)
    layout = meta["layout"]
    cases = [(name, t, r) for name, _ in configs for t in tokens for r in args.routing]
    records: list[dict] = []
    # Both conventions' sweeps may start in the same second into one directory.
    stem = f"bench-{layout}-{meta['convention']}-{stamp:%Y%m%d-%H%M%S}"
    partial = _Partial(args.output_dir, stem, st.rank)
    bar = tqdm(total=len(cases), desc=f"comet bench {layout}", disable=st.rank != 0,
               dynamic_ncols=True)
    for name, base_cfg in configs:
        cfg = base_cfg.replace(dtype=dtype, max_tokens=max(max(tokens), 1))
        try:
            mesh.check(cfg.num_experts, cfg.intermediate_size)
        except ValueError as err:
            notes.append(f"{name} skipped: {err}")
            bar.update(len(tokens) * len(args.routing))
            continue
        shard_cfg = cfg.replace(intermediate_size=cfg.intermediate_size // mesh.tp)
        w13, w2 = make_expert_weights(shard_cfg, cfg.num_experts // mesh.ep, name, st.rank,
                                      args.seed, st.device)
        shard = {"w13": w13, "w2": w2}
        fused, why = _build_fused(cfg, w13, w2, st.group, st.device, mesh=mesh,
                                  convention=args.convention,
                                  **_tile_of(meta, cfg, mesh, args.convention))
        if why and why not in notes:
            notes.append(why)
        for t in tokens:
            for routing in args.routing:
                bar.set_postfix_str(f"{name} {t} {routing}")
                for r in run_mesh_case(Case(name, cfg, t, routing), st, mesh,
                                       args.convention, shard, groups, fused, args.layers):
                    records.append({**meta, **r, "notes": notes})
                partial.save(records)
                bar.update()
        del w13, w2, shard, fused
        if st.device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    if st.rank == 0:
        _emit(records, notes, args.output_dir, stem, not args.no_plot)
    partial.done()
    return _status(records)


def _status(records: list[dict]) -> int:
    """The sweep's exit status: 1 if some fused output was wrong (the summary names it;
    every rank has the same verdicts), else 0."""
    return 1 if rec.wrong_fused(records) else 0


def _timeline(args, config, st: Settings, dtype, meta, stamp, mesh: MeshLayout) -> int:
    """Write the per-block trace (and PNG) of one fused call of ``config`` (in ``mesh``'s
    layout: each rank its F shard of its EP group's experts)."""
    name, base_cfg = config
    tokens, routing = args.timeline_tokens, args.routing[0]
    cfg = base_cfg.replace(dtype=dtype, max_tokens=max(tokens, 1))
    mesh.check(cfg.num_experts, cfg.intermediate_size)
    shard_cfg = cfg.replace(intermediate_size=cfg.intermediate_size // mesh.tp)
    w13, w2 = make_expert_weights(shard_cfg, cfg.num_experts // mesh.ep, name, st.rank,
                                  args.seed, st.device)
    layout = {} if mesh.tp == 1 else {"mesh": mesh, "convention": args.convention}
    fused, why = _build_fused(cfg, w13, w2, st.group, st.device,
                              **_tile_of(meta, cfg, mesh, args.convention), **layout)
    if fused is None:
        if st.rank == 0:
            print(f"comet bench --timeline: {why or 'the fused layer needs a GPU'}")
        return 1
    s = make_input_sets(cfg, name, tokens, routing, 1,
                        mesh.token_source(st.rank, args.convention), args.seed,
                        st.device)[0]
    # The first call compiles the kernels; the timeline is of a warm call.
    fused.layer(s.x, s.topk_ids, s.topk_weights, comm_blocks=st.comm_blocks, mode="fused")
    def align() -> None:
        if dist.is_initialized():
            dist.barrier(group=st.group)
        park_and_align(st.device, st.group)

    phases: dict[str, float] = {}
    programs: list[dict] = []
    entries = trace.record_timeline(fused.layer, s.x, s.topk_ids, s.topk_weights,
                                    comm_blocks=st.comm_blocks, align=align, phases=phases,
                                    programs=programs)
    timelines = dict(enumerate(_gather_objects(entries, st.group)))
    budget = trace.phase_budget(phases, entries, programs)
    budgets = dict(enumerate(_gather_objects(budget, st.group)))
    if st.rank != 0:
        return 0
    stem = f"timeline-{meta['layout']}-{name}-{tokens}-{stamp:%Y%m%d-%H%M%S}"
    base = os.path.join(args.output_dir or ".", stem)
    title = (f"{name}, {tokens} tokens/rank, {routing}, {meta['layout']} on {meta['device']}, "
             f"comm blocks {list(fused.layer.last_comm_blocks)}")
    written = trace.write_trace(timelines, base + ".json",
                                {**meta, "title": title, "phases": budgets})
    print(f"wrote {base}.json")
    print(trace.format_where_time_goes(written["otherData"]["where_time_goes"]))
    print(trace.format_phase_budget(budgets))
    if not args.no_plot:
        print(trace.plot_timeline(timelines, base + ".png", title)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
