"""usage: python scripts/device/probe_summary.py DIR NAME

One line per (tile variant, record) of the bench JSONs ``DIR/NAME-<variant>.json`` that
``tile_probe.sh`` writes: the whole call (fused, compute-only, torch GEMM, HBM floor, the
host's time per call), the comm blocks it ran with, the best fixed split's time (with
``--fixed-splits``), and each layer's comet GEMM time over torch's. The comm blocks are
shown because a ``--tile`` variant is not served by the tuned tables: its calls run the
analytic split where the default variant runs the table's, so a difference in the fused
time may be the split, not the tile. Compare the best fixed splits, or the fused call's
phases (``comet_phases_us``); not the compute-only column, whose decomposed call runs
layer1's column-split reduce whatever the tile (comet.runtime.strategies.strategy_for).
"""

import glob
import json
import os
import sys


def main(out: str, name: str) -> None:
    for path in sorted(glob.glob(os.path.join(out, f"{name}-*.json"))):
        variant = path[len(os.path.join(out, name)) + 1:-5]
        records = json.load(open(path))
        records = records if isinstance(records, list) else records["records"]
        by = {}
        for r in records:
            by.setdefault((r["config"], r["tokens_per_rank"], r["routing"]), {})[r["layer"]] = r
        for key, layers in sorted(by.items()):
            moe = layers.get("moe", {})
            ratios = " ".join(
                f"{l}={layers[l]['comet_gmm_us'] / layers[l]['torch_gmm_us']:.3f}"
                for l in ("layer0", "layer1") if l in layers
                and layers[l].get("comet_gmm_us") and layers[l].get("torch_gmm_us"))
            print(f"{variant:28s} {key[0]:18s} {key[1]:6d} {key[2]:8s} "
                  f"fused {moe.get('fused_us') or 0:9.1f} "
                  f"compute {moe.get('compute_only_us') or 0:9.1f} "
                  f"torch {moe.get('torch_gmm_us') or 0:9.1f} "
                  f"hbm {moe.get('hbm_floor_us') or 0:8.1f} "
                  f"host {moe.get('fused_host_us') or 0:6.1f} "
                  f"comm {moe.get('n_comm')} best fixed {moe.get('best_fixed_us') or 0:9.1f} "
                  f"comet/torch {ratios}")


if __name__ == "__main__":
    main(*sys.argv[1:])
