"""Do the warps of one block see the same value of a flag that another block keeps
advancing? (The premise of the block-vote rule in comet/kernels/sync.py.)

    python3 scripts/device/divergence_probe.py [--json FILE]

Program 0 publishes 1, 2, 3, ... into a flag with release stores; program 1 (8 warps)
reads it ROUNDS times with an acquire load per thread -- what every thread of comet's
old spin loop did -- and stores what each thread saw. Printed: in how many rounds the
block's threads disagreed, and the largest spread within one round.
"""

import argparse
import json

import torch
import triton
import triton.language as tl

ROUNDS = 4096
THREADS = 256


@triton.jit
def _probe(flag, out, publishes, ROUNDS: tl.constexpr, THREADS: tl.constexpr):
    if tl.program_id(0) == 0:
        for i in range(publishes):
            tl.atomic_xchg(flag, (i + 1).to(tl.int64), sem="release", scope="gpu")
    else:
        lanes = tl.zeros([THREADS], dtype=tl.int32)
        for r in range(ROUNDS):
            v = tl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l",
                                          [flag + lanes], dtype=tl.int64, is_pure=False,
                                          pack=1)
            tl.store(out + r * THREADS + tl.arange(0, THREADS), v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.zeros(ROUNDS, THREADS, dtype=torch.int64, device="cuda")
    _probe[(2,)](flag, out, 1 << 22, ROUNDS=ROUNDS, THREADS=THREADS, num_warps=THREADS // 32)
    torch.cuda.synchronize()
    live = out[(out.min(dim=1).values > 0) & (out.max(dim=1).values < (1 << 22))]
    spread = (live.max(dim=1).values - live.min(dim=1).values)
    warps = live.view(-1, THREADS // 32, 32)
    per_warp_equal = bool((warps == warps[:, :, :1]).all())
    res = {"device": torch.cuda.get_device_name(), "rounds_while_advancing": len(live),
           "rounds_where_threads_disagree": int((spread > 0).sum()),
           "max_spread": int(spread.max()) if len(live) else 0,
           "lanes_of_a_warp_always_agree": per_warp_equal}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
