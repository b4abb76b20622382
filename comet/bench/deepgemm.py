"""DeepGEMM's grouped FP8 GEMMs on the rows comet's FP8 layer multiplies: the peer of
``comet bench --dtype fp8 --peers deepgemm`` (issue 68: comet's FP8 GEMM phases against
DeepGEMM's grouped FP8 GEMM throughput on the same rows).

DeepGEMM (github.com/deepseek-ai/DeepGEMM, built from source by
``scripts/device/build_peers.sh``; it compiles its kernels with the machine's nvcc at run
time) multiplies W8A8 e4m3 operands with the recipe comet's FP8 layer uses: rows with one
fp32 scale per 128 K values (:class:`comet.quant.Fp8Rows`), experts ``[E, N, K]`` K-major
with fp32 128 x 128 block scales (:class:`comet.quant.Fp8Weight`), fp32 accumulation, bf16
out. Its two M-grouped forms take the rows laid out differently:

* **contiguous** (:func:`contiguous_layout`) -- the rows of each expert in one run,
  padded to DeepGEMM's M alignment (128 on SM90), and ``m_indices [M]`` naming each row's
  expert, ``-1`` for padding; the prefill form, rows known to the host;
* **masked** (:func:`masked_layout`) -- ``[E, max_m, K]`` with ``masked_m [E]`` rows
  live per expert and an ``expected_m`` hint; the decode form (CUDA-graph friendly).

The row scales go in the layout its SM90 kernels read through TMA (:func:`mn_major_scales`:
M contiguous, each column padded to 16 bytes); laid out before the timed calls, as a
quantizer that writes them so would. The weights need no change (:func:`weight_operand`).
Only this module imports ``deep_gemm``, inside :func:`load_deepgemm`.

``python -m comet.bench.deepgemm`` (on the GPU machine, after build_peers.sh) runs one
small grouped GEMM of each layout against the fp32 emulation and exits 1 if either is off.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import math
import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from comet.bench.peers import Peer, PeerUnavailable
from comet.quant import E4M3, GROUP, Fp8Rows, Fp8Weight, calc_diff
from comet.reference import grouped_gemm_fp8

#: The registry name of the peer (``--peers deepgemm``).
NAME = "deepgemm"
#: DeepGEMM's M-grouped FP8 entry points at the pinned commit (scripts/fetch_peer_sources.sh).
CONTIGUOUS_FN = "m_grouped_fp8_gemm_nt_contiguous"
MASKED_FN = "m_grouped_fp8_gemm_nt_masked"
#: Rows per expert of a contiguous layout are padded to this on SM90 (DeepGEMM's
#: ``get_mk_alignment_for_contiguous_layout()`` default; the loaded package is asked).
M_ALIGN = 128
#: TMA reads rows of 16-byte multiples: a column of fp32 row scales is padded to 4 rows.
TMA_ALIGN_BYTES = 16
#: Up to these tokens per rank (issue 68's decode sizes) the masked layout is timed beside
#: the contiguous one and the faster kept; above, its ``[E, max_m, K]`` rows grow with the
#: busiest expert and only the contiguous one is timed.
MASKED_MAX_TOKENS = 128
#: ``calc_diff`` against the fp32 emulation over which DeepGEMM's output is wrong (its own
#: FP8 tests' bound; a right GEMM differs by bf16 rounding, ~1e-5).
MAX_DIFF = 1e-3
LAYOUTS = ("contiguous", "masked")


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def tma_aligned_rows(rows: int, element_size: int = 4) -> int:
    """``rows`` rounded up so that a column of them is a whole number of TMA's 16 bytes."""
    return _align(rows, TMA_ALIGN_BYTES // element_size)


def mn_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row scales ``[..., M, S]`` with the same values and shape in DeepGEMM's SM90 layout:
    M contiguous (stride 1), a column every ``tma_aligned_rows(M)`` values, and per group
    (a leading dim) ``S`` such columns. DeepGEMM passes a tensor so laid out through as is;
    any other it would copy into this layout inside every call."""
    *lead, m, s = scale.shape
    columns = scale.new_zeros(*lead, s, tma_aligned_rows(m, scale.element_size()))
    columns[..., :m] = scale.transpose(-1, -2)
    return columns.transpose(-1, -2)[..., :m, :]


def _counts(a: Fp8Rows, expert_rows: Sequence[int]) -> torch.Tensor:
    """``expert_rows`` on ``a``'s device, once checked against ``a`` (its rows, its groups:
    DeepGEMM's recipe)."""
    if any(n < 0 for n in expert_rows):
        raise ValueError(f"rows per expert must be >= 0, got {list(expert_rows)}")
    if sum(expert_rows) != a.data.shape[0] or a.group != GROUP:
        raise ValueError(f"{sum(expert_rows)} rows per expert for {a.data.shape[0]} rows in "
                         f"groups of {a.group} (DeepGEMM's recipe: {GROUP})")
    return torch.tensor(list(expert_rows), dtype=torch.int64, device=a.data.device)


def _scatter_rows(data: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """``data [R, K]`` (e4m3) into zeros ``[total, K]`` at ``rows`` (through bytes: indexed
    stores of float8 are not on every backend)."""
    out = torch.zeros(total, data.shape[1], dtype=torch.uint8, device=data.device)
    out[rows] = data.view(torch.uint8)
    return out.view(E4M3)


@dataclass
class ContiguousRows:
    """Rows in DeepGEMM's contiguous layout (:func:`contiguous_layout`).

    data: e4m3 ``[Mp, K]``, each expert's rows in one run padded to the alignment (padding
        rows zero); scale: fp32 ``[Mp, S]`` in :func:`mn_major_scales`' layout (padding 0);
    m_indices: int32 ``[Mp]``, each row's expert, -1 for padding; rows: int64 ``[R]``, the
        padded row of each input row (to read the output back).
    """

    data: torch.Tensor
    scale: torch.Tensor
    m_indices: torch.Tensor
    rows: torch.Tensor

    def output(self, n: int) -> torch.Tensor:
        """The bf16 ``[Mp, n]`` output DeepGEMM writes."""
        return torch.empty(self.data.shape[0], n, dtype=torch.bfloat16, device=self.data.device)


@dataclass
class MaskedRows:
    """Rows in DeepGEMM's masked layout (:func:`masked_layout`).

    data: e4m3 ``[E, max_m, K]`` (rows past an expert's count zero); scale: fp32
        ``[E, max_m, S]``, each expert's in :func:`mn_major_scales`' layout; masked_m: int32
        ``[E]``, live rows per expert; expected_m: the rows per expert DeepGEMM's heuristics
        plan for; rows: int64 ``[R]``, each input row's index in ``[E * max_m]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int
    rows: torch.Tensor

    def output(self, n: int) -> torch.Tensor:
        """The bf16 ``[E, max_m, n]`` output DeepGEMM writes."""
        e, m, _ = self.data.shape
        return torch.empty(e, m, n, dtype=torch.bfloat16, device=self.data.device)


Layout = ContiguousRows | MaskedRows


def contiguous_layout(a: Fp8Rows, expert_rows: Sequence[int], align: int = M_ALIGN
                      ) -> ContiguousRows:
    """``a``'s rows (``expert_rows[e]`` rows of expert ``e`` after those of ``e - 1``) in
    DeepGEMM's contiguous layout, each expert's run padded to ``align`` rows."""
    dev = a.data.device
    counts = _counts(a, expert_rows)
    padded = [_align(n, align) for n in expert_rows]
    total = sum(padded)
    starts = torch.tensor([0, *padded[:-1]], dtype=torch.int64, device=dev).cumsum(0)
    first = counts.cumsum(0) - counts
    # Row r of expert e moves from first[e] + i to starts[e] + i.
    rows = (torch.arange(a.data.shape[0], device=dev)
            + torch.repeat_interleave(starts - first, counts))
    m_indices = torch.full((total,), -1, dtype=torch.int32, device=dev)
    m_indices[rows] = torch.repeat_interleave(
        torch.arange(len(expert_rows), dtype=torch.int32, device=dev), counts)
    scale = a.scale.new_zeros(total, a.scale.shape[1])
    scale[rows] = a.scale
    return ContiguousRows(_scatter_rows(a.data, rows, total), mn_major_scales(scale),
                          m_indices, rows)


def masked_layout(a: Fp8Rows, expert_rows: Sequence[int], align: int = M_ALIGN
                  ) -> MaskedRows:
    """``a``'s rows (grouped by expert as for :func:`contiguous_layout`) in DeepGEMM's
    masked layout, ``max_m`` the busiest expert's rows rounded up to ``align``, and
    ``expected_m`` the mean rows per expert (what a decode caller knows)."""
    dev = a.data.device
    counts = _counts(a, expert_rows)
    e, k = len(expert_rows), a.data.shape[1]
    max_m = _align(max(max(expert_rows, default=0), 1), align)
    first = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=dev), counts)
    # Row r of expert e (its i-th) goes to slot e * max_m + i.
    rows = expert * max_m + torch.arange(a.data.shape[0], device=dev) - first[expert]
    scale = a.scale.new_zeros(e * max_m, a.scale.shape[1])
    scale[rows] = a.scale
    data = _scatter_rows(a.data, rows, e * max_m).view(e, max_m, k)
    return MaskedRows(data, mn_major_scales(scale.view(e, max_m, -1)),
                      counts.to(torch.int32), max(1, math.ceil(sum(expert_rows) / e)), rows)


def layout_rows(layout: str, a: Fp8Rows, expert_rows: Sequence[int], align: int = M_ALIGN
                ) -> Layout:
    """``a`` in the named layout (:data:`LAYOUTS`)."""
    if layout == "contiguous":
        return contiguous_layout(a, expert_rows, align)
    if layout == "masked":
        return masked_layout(a, expert_rows, align)
    raise ValueError(f"DeepGEMM layouts are {LAYOUTS}, not {layout!r}")


def gathered(rows: Layout, out: torch.Tensor) -> torch.Tensor:
    """The output rows of the input rows, in their order: ``[R, N]``."""
    return out.reshape(-1, out.shape[-1]).index_select(0, rows.rows)


def weight_operand(w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [E, N, K], scale_inv [E, N / 128, K / 128])``, DeepGEMM's B operand: comet's
    experts as they are. PeerUnavailable where DeepGEMM's 128 x 128 block recipe cannot
    express them: other blocks, K not a multiple of 128 (its kernels step K by 128), or a
    gate/up stack whose halves are not whole blocks (each half has its own grid)."""
    bn, bk = w.block_shape()
    rows = w.n // w.parts
    if (bn, bk) != (GROUP, GROUP) or w.k % GROUP or rows % GROUP:
        raise PeerUnavailable(
            f"DeepGEMM's grouped FP8 GEMM takes {GROUP}x{GROUP} weight blocks over K and N "
            f"in multiples of {GROUP}; these experts are [{w.n}, {w.k}] in {bn}x{bk} blocks"
            + (f", {w.parts} parts of {rows} rows" if w.parts > 1 else ""))
    return w.weight, w.scale_inv.contiguous()


@dataclass
class DeepGemm:
    """The loaded ``deep_gemm`` package: what it is (``backend``, for the records) and the
    contiguous layout's M alignment it asks for."""

    module: types.ModuleType
    align: int
    backend: str

    def launch(self, rows: Layout, weight: tuple[torch.Tensor, torch.Tensor],
               out: torch.Tensor) -> None:
        """``out = rows @ weight^T`` per expert (scales kept in fp32: no UE8M0 rounding,
        which SM90's kernels do not use)."""
        if isinstance(rows, ContiguousRows):
            getattr(self.module, CONTIGUOUS_FN)((rows.data, rows.scale), weight, out,
                                                rows.m_indices, disable_ue8m0_cast=True)
        else:
            getattr(self.module, MASKED_FN)((rows.data, rows.scale), weight, out,
                                            rows.masked_m, rows.expected_m,
                                            disable_ue8m0_cast=True)

    def operand(self, layout: str, a: Fp8Rows, expert_rows: Sequence[int], n: int
                ) -> tuple[Layout, torch.Tensor]:
        """``a`` in ``layout`` and the output a GEMM of it with ``n`` columns writes: what
        :meth:`launch` takes, made before any timed call."""
        rows = layout_rows(layout, a, expert_rows, self.align)
        return rows, rows.output(n)

    def gemm(self, rows: Layout, w: Fp8Weight) -> torch.Tensor:
        """``rows`` times ``w`` per expert, read back in the input rows' order: bf16
        ``[R, N]``."""
        out = rows.output(w.n)
        self.launch(rows, weight_operand(w), out)
        return gathered(rows, out)


def bind(module: types.ModuleType) -> DeepGemm | str:
    """``module`` (``deep_gemm``, or a stand-in) as a :class:`DeepGemm`, or why it cannot
    serve: an entry point missing."""
    missing = [n for n in (CONTIGUOUS_FN, MASKED_FN) if not hasattr(module, n)]
    if missing:
        return (f"this deep_gemm has no {', '.join(missing)} "
                "(scripts/fetch_peer_sources.sh pins one that has)")
    align = (module.get_mk_alignment_for_contiguous_layout()
             if hasattr(module, "get_mk_alignment_for_contiguous_layout") else M_ALIGN)
    try:
        version = importlib.metadata.version("deep_gemm")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(module, "__version__", "version unknown")
    return DeepGemm(module, align, f"DeepGEMM {version}: {CONTIGUOUS_FN} (rows padded to "
                    f"{align} per expert) or {MASKED_FN}, fp32 scales, bf16 out")


def share_libstdcxx() -> list[str]:
    """Puts the libstdc++ this process loaded into the global symbol scope (Linux; the paths
    promoted), so that a module loaded later binds its libstdc++ symbols to it.

    Why, for ``deep_gemm``: its module, built from source, carries its own definitions of
    some libstdc++ data (the locale facet ids). Loaded after torch, whose libraries keep
    libstdc++ in their local scope, it binds to those copies, which libstdc++ never
    initialized, and its JIT's first ``std::regex`` segfaults (found with torch 2.11+cu130
    and a wheel built there by scripts/device/build_peers.sh; an LD_PRELOAD of the same
    libstdc++ made it run)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps if "/libstdc++.so" in line]
    except OSError:
        return []
    promoted = []
    for path in sorted({f[5].strip() for f in fields if len(f) == 6}):
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:     # replaced on disk since it was mapped ("... (deleted)")
            continue
        promoted.append(path)
    return promoted


def import_deep_gemm(device: torch.device, kernels: str, build: str
                     ) -> types.ModuleType | str:
    """The installed ``deep_gemm`` for an SM90 ``device``, or why not (``kernels``: what
    of it runs on Hopper only; ``build``: how to get it, for the reason)."""
    if device.type != "cuda":
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"{kernels} run on SM90 (Hopper); this GPU is sm_{major}{minor}"
    # Its JIT finds nvcc through CUDA_HOME (else PATH): the toolkit torch builds with.
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME:
        os.environ.setdefault("CUDA_HOME", CUDA_HOME)
    share_libstdcxx()
    try:
        import deep_gemm
    except ImportError as err:
        return f"deep_gemm does not import ({err}): {build}"
    return deep_gemm


def load_deepgemm(device: torch.device) -> DeepGemm | str:
    """The installed ``deep_gemm`` for ``device``, or why it cannot run there."""
    module = import_deep_gemm(device, "DeepGEMM's grouped FP8 GEMMs with fp32 scales",
                              "build and install it with scripts/device/build_peers.sh")
    return module if isinstance(module, str) else bind(module)


#: The ``--peers`` names that time GEMMs beside comet's FP8 layer rather than a whole layer:
#: :func:`comet.bench.peers.load_peers` with ``registry=FP8_PEERS`` loads them (each
#: ``load`` returns a :class:`DeepGemm`, or why not).
FP8_PEERS = {NAME: Peer(NAME, lambda device, world: load_deepgemm(device))}


def check_layout(dg: DeepGemm, layout: str, a: Fp8Rows, w: Fp8Weight,
                 expert_rows: Sequence[int]) -> float:
    """``calc_diff`` of DeepGEMM's grouped GEMM of ``a`` (in ``layout``) and ``w`` against
    the fp32 emulation (:func:`comet.reference.grouped_gemm_fp8`; 0: equal, a right GEMM
    ~1e-5, :data:`MAX_DIFF` the bound)."""
    y = dg.gemm(layout_rows(layout, a, expert_rows, dg.align), w)
    return calc_diff(y.float(), grouped_gemm_fp8(a, w, expert_rows))


def layouts_for(tokens: int) -> tuple[str, ...]:
    """The layouts timed for a call of ``tokens`` per rank (:data:`MASKED_MAX_TOKENS`)."""
    return LAYOUTS if tokens <= MASKED_MAX_TOKENS else ("contiguous",)


def load_for_smoke(name: str, load):
    """``load(cuda)`` for a ``python -m`` smoke check, its backend printed; None, after
    printing why, where it cannot run."""
    peer = load(torch.device("cuda")) if torch.cuda.is_available() else "needs a CUDA GPU"
    if isinstance(peer, str):
        print(f"{name} unavailable: {peer}")
        return None
    print(peer.backend)
    return peer


def _smoke() -> int:
    """One small grouped GEMM per layout and shape (gate/up stacked in two parts, then a
    down projection), against the emulation; 1 if any is off or cannot run."""
    from comet.kernels.fp8_gemm import quantize_rows_triton
    from comet.quant import quantize_weight
    dg = load_for_smoke("deepgemm", load_deepgemm)
    if dg is None:
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    expert_rows = [0, 5, 130, 64, 1]   # an empty expert, partial and whole blocks
    ok = True
    for name, n, k, parts in (("gate_up", 768, 512, 2), ("down", 512, 384, 1)):
        w = quantize_weight(torch.randn(len(expert_rows), n, k, device=dev), parts=parts)
        a = quantize_rows_triton(torch.randn(sum(expert_rows), k, device=dev,
                                             dtype=torch.bfloat16))
        for layout in LAYOUTS:
            diff = check_layout(dg, layout, a, w, expert_rows)
            ok &= diff <= MAX_DIFF
            print(f"{name} [{n}, {k}] {layout}: calc_diff {diff:.2e} "
                  f"({'ok' if diff <= MAX_DIFF else f'OFF: > {MAX_DIFF:g}'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_smoke())
