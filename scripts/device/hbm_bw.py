"""The decode floor: every expert's weights read once per call, at the HBM read rate.

Experiment, one GPU. At small token counts every local expert still receives rows (a
128-token call of deepseek-v3-like sends 2048 pairs to 256 experts at EP=2), so a layer
reads all of its rank's expert weights whatever its GEMM does; the call can be no faster
than those bytes over the best read rate of the GPU's memory. This measures that rate
(``torch.sum`` over a weight-sized bf16 buffer: reads only; ``copy_``: read + write) and
prints each preset's floor per rank at EP=2 and EP=4.

    PYTHONPATH=. python3 scripts/device/hbm_bw.py [--json $OUT/hbm_bw.json]
"""

import argparse
import json
import os

import torch

from comet.config import PRESETS


def timed_us(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="buffer size for the read rate")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "hbm_bw.json"))
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 2
    buf = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    read_us = timed_us(lambda: buf.sum(dtype=torch.float32))
    read = 2 * n / read_us / 1e6
    dst = torch.empty_like(buf)
    copy_us = timed_us(lambda: dst.copy_(buf))
    copy = 2 * 2 * n / copy_us / 1e6
    del dst
    out = {"device": torch.cuda.get_device_name(), "read_TBps": read, "copy_TBps": copy,
           "floors": []}
    print(f"{out['device']}: read {read:.2f} TB/s, copy (read + write) {copy:.2f} TB/s")
    for name, cfg in sorted(PRESETS.items()):
        per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * cfg.dtype.itemsize
        for ep in (2, 4):
            nbytes = per_expert * cfg.num_experts // ep
            floor = nbytes / (read * 1e6)
            out["floors"].append({"config": name, "ep": ep, "weight_bytes": nbytes,
                                  "floor_us": floor})
            print(f"{name:18s} ep={ep}: {nbytes / 1e9:6.2f} GB of expert weights per rank "
                  f"-> >= {floor:7.0f} us per call")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
