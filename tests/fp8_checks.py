"""e4m3 comparisons that accept exactly the casts Triton's interpreter gets wrong (shared by
the FP8 kernel tests): a value rounded up across a power of two comes out halved (126.8 ->
64), a subnormal is truncated toward zero, and an exact tie rounds away from zero (168 ->
176). On a GPU only equality (or ``steps`` e4m3 steps) passes."""

import torch

from comet.constants import interpreting


#: How far a requantized scale (amax of an fp32 GEMM output / 448) may sit from the one of
#: torch's fp32 matmul: the interpreter sums as torch does; the tensor cores sum K in another
#: order (2e-4 seen at K = 4096 on an H200, 2026-12-05).
SUM_RTOL = 1e-5 if interpreting() else 1e-3


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The distance from each e4m3 value to the next one away from zero (fp32)."""
    _, e = torch.frexp(v.float().abs().clamp(min=2.0 ** -6))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e - 4)


def pow2(v: torch.Tensor) -> torch.Tensor:
    m, _ = torch.frexp(v.abs())
    return m == 0.5


def same_fp8(q: torch.Tensor, ref: torch.Tensor, steps: int = 0,
              quotient: torch.Tensor | None = None) -> torch.Tensor:
    """Where ``q`` is ``ref`` (or within ``steps`` e4m3 steps of it), or the interpreter's
    halved power of two, or (given the fp32 ``quotient`` that was cast) the interpreter's
    rounding of an exact tie away from zero."""
    q, ref = q.float(), ref.float()
    if interpreting() and quotient is not None:
        v = quotient.float().clamp(-448, 448)
        ok_tie = ((q - v).abs() == (ref - v).abs()) & (q.abs() > ref.abs())
    else:
        ok_tie = torch.zeros_like(q, dtype=torch.bool)
    ok = q == ref
    if steps:
        ok |= (q - ref).abs() <= steps * e4m3_step(ref)
    if interpreting():
        ok |= (2 * q == ref) & pow2(ref)
        # subnormals (|q| < 2^-6, steps of 2^-9) truncated toward zero, not rounded
        ok |= (ref.abs() <= 2.0 ** -6) & (q * ref >= 0) & \
            ((ref - q).abs() == 2.0 ** -9) & (q.abs() < ref.abs())
    return ok | ok_tie


def requant_close(q: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A requantized GEMM output ``q`` against the one of the emulation ``ref`` (e4m3, each
    row's groups scaled to 448): one e4m3 step apart; on a GPU also a value the tensor
    cores' summation order moved by up to ``SUM_RTOL`` of its group's amax, which is many
    steps for a value near zero."""
    ok = same_fp8(q, ref, steps=1)
    if not interpreting():
        ok |= (q.float() - ref.float()).abs() <= e4m3_step(ref) + SUM_RTOL * 448
    return ok
