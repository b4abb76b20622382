"""Grouped GEMMs in torch: the unfused pipeline's expert GEMMs and both backwards' weight
gradients. ``torch._grouped_mm`` (CUTLASS on Hopper) where it runs, a per-expert loop
elsewhere (the CPU, dtypes or architectures it has no kernel for)."""

from __future__ import annotations

import warnings

import torch

_torch_gmm_ok: dict[torch.device, bool] = {}


def _use_torch_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch._grouped_mm is CUDA + bf16 only (SM90 CUTLASS kernels, SM80 fallback in newer
    # torch); row strides must be 16-byte multiples, which MoEConfig's size alignment gives.
    return (a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and _torch_gmm_ok.get(a.device, True))


def _torch_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor
                      ) -> torch.Tensor | None:
    """``torch._grouped_mm(a, b, offs=offs)``, or None where it does not run here (and
    never again on that device, with one warning)."""
    if not _use_torch_grouped_mm(a, b):
        return None
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as err:   # e.g. an architecture this torch has no kernel for
        _torch_gmm_ok[a.device] = False
        warnings.warn(f"torch._grouped_mm failed ({err}); using a per-expert loop",
                      stacklevel=3)
        return None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, expert_rows: list[int] | None,
               offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: rows of ``a [R, K]`` grouped by expert times ``b [El, K, N]`` -> ``[R, N]``.

    ``offs`` (device, int32 end offsets) describes the groups, and ``expert_rows`` (host)
    too where the caller has it; without it the per-expert loop reads them from ``offs``
    (a host sync; ``torch._grouped_mm`` needs none).
    """
    if a.shape[0] == 0:
        return a.new_empty(0, b.shape[-1])
    out = _torch_grouped_mm(a, b, offs)
    if out is not None:
        return out
    if expert_rows is None:
        expert_rows = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).tolist()
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, n in enumerate(expert_rows):
        if n:
            torch.mm(a[start:start + n], b[e], out=out[start:start + n])
        start += n
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                        expert_rows: list[int] | None = None) -> torch.Tensor:
    """``[El, K, N]``: for each expert, its rows of ``a [R, K]`` transposed times its rows
    of ``b [R, N]`` (the weight gradient of :func:`grouped_mm`); ``offs`` (int32 ``[El]``,
    device) ends each expert's rows, and rows past ``offs[-1]`` are not read.

    Experts with no rows get zeros when ``expert_rows`` (host) is given; without it, on
    the GPU, the caller zeroes them on the device (``torch._grouped_mm`` does not write an
    empty group in every torch version, and finding them would need a host sync); on the
    CPU the rows are read from ``offs`` (a host sync is free there)."""
    el = offs.shape[0]
    out = _torch_grouped_mm(a.t(), b, offs) if a.shape[0] else None
    if out is not None:
        empty = [e for e, r in enumerate(expert_rows or ()) if r == 0]
        if empty:
            out[empty] = 0
        return out
    if expert_rows is None:
        expert_rows = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).tolist()
    out = a.new_zeros(el, a.shape[1], b.shape[1])
    start = 0
    for e, r in enumerate(expert_rows):
        if r:
            torch.mm(a[start:start + r].t(), b[start:start + r], out=out[e])
        start += r
    return out
