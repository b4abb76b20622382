"""Does a GEMM's speed depend on its data? torch's grouped GEMM on random and zeroed A.

Experiment, one GPU. A Hopper GPU running large GEMMs is power-limited: its clock falls
until the board's power cap holds, and the tensor cores' power depends on how many input
bits toggle. Zeroed operands toggle none, so a GEMM on them clocks higher. This matters
for every "compute only" timing: a kernel that reads a freshly zeroed buffer is timed
faster than it runs in a real call. Three large grouped-GEMM shapes (one rank of the
presets at EP=2, 16384 tokens: mixtral's layer0 and layer1, deepseek-v3-like's layer0)
on ``torch._grouped_mm``, random and zeroed A, the same B. Writes
``$OUT/zeros_probe.json``.

    PYTHONPATH=. python3 scripts/device/zeros_probe.py
"""

import json
import os

import torch

from hbm_bw import timed_us   # same folder

# (local experts, rows, K, N)
SHAPES = ((4, 32768, 4096, 28672), (128, 131072, 7168, 4096), (4, 32768, 14336, 4096))


def main():
    records = []
    for experts, rows, k, n in SHAPES:
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
        b = (torch.randn(experts, n, k, device="cuda") * k ** -0.5).bfloat16().transpose(1, 2)
        for name, a in (("randn", torch.randn(rows, k, device="cuda").bfloat16()),
                        ("zeros", torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16))):
            for _ in range(2):                 # the clock settles under load
                torch._grouped_mm(a, b, offs=offs)
            us = timed_us(lambda: torch._grouped_mm(a, b, offs=offs))
            records.append(dict(experts=experts, rows=rows, K=k, N=n, a=name, us=us,
                                tflops=2 * rows * k * n / us / 1e6))
            print(records[-1], flush=True)
        del b
    out = os.path.join(os.environ.get("OUT", "."), "zeros_probe.json")
    with open(out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
