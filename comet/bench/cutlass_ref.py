"""Hook for a second compute reference: a CUTLASS Hopper grouped GEMM on the same rows.

Not built yet. shared/DESIGN.md records why the easy routes fail on the H200 machines
(``cutlass_cppgen`` breaks on the image's cuda-bindings 13 and its grouped GEMM falls back
to SM80 kernels; the CuTe DSL wheel is too large to carry) and the route that should work:
build example 57_hopper_grouped_gemm from the headers the nvidia-cutlass wheel ships into a
torch extension with the machine's nvcc. When that exists, :func:`load_cutlass_grouped_mm`
returns it and the benchmark fills ``cutlass_gmm_tflops``; until then records carry null.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def load_cutlass_grouped_mm(device: torch.device) -> tuple[GroupedMM | None, str]:
    """``(fn, note)``: ``fn(a [R, K], b [El, K, N], offs [El] int32) -> [R, N]`` or None,
    and a line saying why it is unavailable."""
    if torch.device(device).type != "cuda":
        return None, "cutlass reference unavailable: needs a CUDA GPU"
    return None, ("cutlass reference unavailable: the CUTLASS Hopper grouped GEMM "
                  "extension is not built yet (comet/bench/cutlass_ref.py says how)")
