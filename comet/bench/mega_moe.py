"""DeepGEMM's SM90 FP8 Mega MoE as a whole-layer peer of comet's fused FP8 layer (issue 68:
one GPU, EP=1, Hopper).

The Mega MoE is DeepGEMM's fused MoE layer -- dispatch, the gate/up GEMM, SwiGLU, the down
GEMM and the combine in one persistent kernel (one pair of kernels in some versions) --
called as ``deep_gemm.fp8_mega_moe(y, l1, l2, buffer, ...)``. DeepGEMM's main branch has it
for SM100 only; its SM90 FP8 form is in pull requests (scripts/fetch_peer_sources.sh says
which ref to stage). What it takes, and how comet's operands become it:

* **token rows** -- staged before each call into the buffer's input views: e4m3 ``x [T, H]``
  with fp32 scales ``[T, H / 128]`` (one per row and 128 values, K-major), ``topk_idx [T,
  k]`` int64 and ``topk_weights [T, k]`` fp32. Staging is part of the timed call (comet's
  layer quantizes its bf16 rows inside its call too): DeepGEMM's own one-launch
  ``mega_moe_pre_dispatch_sm90`` where the package has it, else comet's dispatch quantizer
  writing into the views and two copies (:meth:`MegaMoELayer.stage`).
* **gate/up** -- ``l1 = (w [E, 2F, H] e4m3, sf [E, 2F / 128, H / 128] fp32)``: comet's
  ``gate_up`` rows (gate rows, then up rows) interleaved in groups of :data:`GATE_UP_GRAN`
  rows (gate 0-7, up 0-7, gate 8-15, ...); the scales stay in block order, gate blocks then
  up blocks (:func:`l1_operand`).
* **down** -- ``l2 = (w [E, H, F] e4m3, sf [E, H / 128, F / 128] fp32)``: comet's ``down``
  as it is (:func:`l2_operand`). Weight scales are fp32 on a 128 x 128 grid (no UE8M0);
  coarser grids are re-indexed onto it exactly, finer ones refused (:func:`block_scales`).
* **buffer** -- DeepGEMM lays its workspace, the staged inputs, both GEMMs' activation pools
  and the combine rows out in one "symmetric" byte buffer. Across ranks that is PyTorch
  symmetric memory over a process group; on one rank the kernel maps no peer pointer (its
  ``SymBuffer::map`` returns the pointer itself), so plain device memory serves, as
  DeepGEMM's own SM100 ``SymmBuffer`` does for a group of one. :class:`OneRankBuffer`
  allocates it without a process group (``comet bench`` at EP=1 has none).

Its numerics differ from comet's recipe in the middle of the layer: ``h = silu(gate) * up``
is multiplied by the routing weight *before* it is quantized, per 64 values with
power-of-two scales (``2^ceil(log2(amax / 448))``), and each (token, slot) output is
rounded to bf16 before the top-k sum (fp32, then bf16). :func:`emulate_recipe` computes
that in fp32; :func:`check_layer` holds the kernel to it and reports its distance from
comet's emulation (:func:`comet.reference.expert_mlp_fp8`), which these recipe differences
alone put well above comet's own 5e-3.

Only this module imports ``deep_gemm`` for the Mega MoE, inside :func:`load_mega_moe`.
``python -m comet.bench.mega_moe`` (GPU machine, DeepGEMM built) runs one small layer
against both emulations and exits 1 if it is off.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
from dataclasses import dataclass

import torch

from comet.activation import SILU, GatedActivation, gated
from comet.bench.deepgemm import import_deep_gemm, load_for_smoke
from comet.bench.peers import Peer, PeerLayer, PeerUnavailable
from comet.config import MoEConfig
from comet.quant import E4M3, E4M3_MAX, GROUP, SCALE_PER_AMAX, Fp8Rows, Fp8Weight, quantize_rows
from comet.reference import expert_mlp_fp8

#: The registry name of the peer.
NAME = "mega-moe"
#: DeepGEMM's SM90 FP8 Mega MoE entry point (the same Python signature in every version
#: that has it).
ENTRY = "fp8_mega_moe"
#: Its one-launch staging kernel (quantize rows, copy the routing), where the package has it.
PRE_DISPATCH = "mega_moe_pre_dispatch_sm90"
#: The buffer-size functions of DeepGEMM's extension, SM90-specific name first (the generic
#: one of versions with both has the SM100 signature).
SIZE_FNS = ("get_symm_buffer_size_for_sm90_mega_moe", "get_symm_buffer_size_for_mega_moe")
#: Rows of gate, then of up, side by side in the kernel's gate/up weight.
GATE_UP_GRAN = 8
#: Values per scale of ``h`` (the down GEMM's input) in the kernel's gate/up epilogue.
H_GROUP = 64
#: Widest F: the kernel marks each 64-wide block of ``h`` that has landed in one bit of a
#: 64-bit mask.
MAX_FFN = 64 * H_GROUP
#: Most top-k slots: a token's slots are one warp's lanes.
MAX_TOPK = 32
#: Tokens per rank are padded to this (DeepGEMM's ``get_token_alignment_for_mega_moe``: the
#: LCM of its candidate block M; the loaded package is asked).
TOKEN_ALIGN = 384
#: rel L2 against :func:`emulate_recipe` over which the kernel is wrong. Provisional (not yet
#: measured on a GPU): comet's own fused layer sits 3-4e-3 from its emulation, from the
#: tensor cores' summation and a 128-K promotion interval, which this kernel has too.
MAX_REL_L2 = 1e-2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- operands
def interleave_gate_up_rows(w: torch.Tensor, gran: int = GATE_UP_GRAN) -> torch.Tensor:
    """``w [E, 2F, ...]`` (gate rows, then up rows) with its rows in the kernel's order:
    ``gran`` gate rows, then the same ``gran`` up rows, and so on (a new contiguous tensor;
    one row copy per element, no temporary the size of ``w``)."""
    e, n = w.shape[:2]
    f, rest = n // 2, w.shape[2:]
    if n % 2 or f % gran:
        raise ValueError(f"gate/up rows must be 2 x a multiple of {gran}, got {n}")
    # e4m3 copies go through bytes: not every backend copies float8 into strided views.
    src = w.contiguous().view(torch.uint8) if w.dtype == E4M3 else w.contiguous()
    out = torch.empty_like(src)
    slots = out.view(e, f // gran, 2, gran, *rest)
    slots[:, :, 0] = src[:, :f].reshape(e, f // gran, gran, *rest)
    slots[:, :, 1] = src[:, f:].reshape(e, f // gran, gran, *rest)
    return out.view(E4M3) if w.dtype == E4M3 else out


def _regrid(scale: torch.Tensor, block: int, size: int, dim: int, what: str) -> torch.Tensor:
    """``scale`` along ``dim`` (blocks of ``block`` over ``size`` values) on the 128 grid:
    each 128 block takes its old block's scale. PeerUnavailable where a 128 block would
    straddle two old blocks (a finer grid: per-channel, 64-wide TP shards)."""
    if block % GROUP and block < size:
        raise PeerUnavailable(f"DeepGEMM's Mega MoE takes {GROUP}x{GROUP} weight blocks; "
                              f"{what} has {block}-wide blocks over {size}")
    idx = torch.arange(0, size, GROUP, device=scale.device) // block
    return scale.index_select(dim, idx)


def block_scales(w: Fp8Weight) -> torch.Tensor:
    """``w``'s scales as the kernel reads them: fp32 ``[E, N / 128, K / 128]`` row-major, a
    part's rows after the previous part's (gate blocks, then up blocks). Exact for 128 x 128
    blocks (as they are), whole-dimension and 128-multiple blocks (repeated); PeerUnavailable
    for a finer grid or a part or K that is not a multiple of 128."""
    rows = w.n // w.parts
    if rows % GROUP or w.k % GROUP:
        raise PeerUnavailable(f"DeepGEMM's Mega MoE needs N and K in multiples of {GROUP}: "
                              f"weight [{w.n}, {w.k}] in {w.parts} part(s) of {rows} rows")
    bn, bk = w.block_shape()
    grids = [_regrid(_regrid(p, bn, rows, 1, "N"), bk, w.k, 2, "K")
             for p in w.scale_inv.chunk(w.parts, dim=1)]
    return torch.cat(grids, dim=1).float().contiguous()


def l1_operand(gate_up: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """comet's ``gate_up [E, 2F, H]`` (gate rows, then up rows; ``parts`` 1 or 2) as the
    kernel's ``(w [E, 2F, H] e4m3 rows interleaved by interleave_gate_up_rows, sf [E, 2F /
    128, H / 128] fp32 in block order)``."""
    if gate_up.parts not in (1, 2) or gate_up.n % 2:
        raise PeerUnavailable(f"gate_up must be [E, 2F, H] in 1 or 2 parts, got "
                              f"{list(gate_up.weight.shape)} in {gate_up.parts}")
    if (gate_up.n // 2) % GROUP:
        # Also with one grid over both halves: a block would hold gate and up rows.
        raise PeerUnavailable(f"DeepGEMM's Mega MoE needs F in multiples of {GROUP}, got "
                              f"{gate_up.n // 2}")
    return interleave_gate_up_rows(gate_up.weight), block_scales(gate_up)


def l2_operand(down: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """comet's ``down [E, H, F]`` as the kernel's ``(w [E, H, F] e4m3, sf [E, H / 128, F /
    128] fp32)``: the same bytes, contiguous."""
    return down.weight.contiguous(), block_scales(down)


def activation_clamp(act: GatedActivation) -> float | None:
    """The kernel's ``activation_clamp`` for ``act``: None for plain SwiGLU, ``limit`` for
    the clamped one (``silu(min(g, L)) * clamp(u, -L, L)``, DeepSeek-V4's); PeerUnavailable
    for the others (it runs SwiGLU only)."""
    if act.kind == "silu" and act.alpha == 1.0 and act.up_offset == 0.0:
        return act.limit
    raise PeerUnavailable(f"DeepGEMM's Mega MoE runs (clamped) SwiGLU only, not "
                          f"{act.describe()}")


def shape_reason(hidden: int, ffn: int, experts: int, top_k: int, world: int = 1
                 ) -> str | None:
    """Why the kernel's host code refuses this layer, or None. These are its checks on every
    call; a shape its per-call tile choice cannot tile fails later, in its JIT compile
    (an exception from the call)."""
    if hidden % GROUP or ffn % GROUP:
        return f"H and F must be multiples of {GROUP}, got H = {hidden}, F = {ffn}"
    if ffn > MAX_FFN:
        return (f"F = {ffn} is over {MAX_FFN}: the kernel tracks h's {H_GROUP}-wide blocks in "
                "one 64-bit mask per token block")
    if top_k > MAX_TOPK:
        return f"top_k = {top_k} is over {MAX_TOPK} (a token's slots are one warp's lanes)"
    if experts % world:
        return f"{experts} experts do not split over {world} ranks"
    return None


# --------------------------------------------------------------------------- buffer
class _OneRank:
    """The process-group surface the entry point reads: rank 0 of 1."""

    @staticmethod
    def rank() -> int:
        return 0

    @staticmethod
    def size() -> int:
        return 1

    def barrier(self) -> None:
        """Nothing to wait for."""


def _as_torch(t, dtype: torch.dtype) -> torch.Tensor:
    """A buffer view as a torch tensor of ``dtype``: tvm-ffi builds return DLPack tensors,
    their e4m3 views as int8 bytes."""
    if not isinstance(t, torch.Tensor):
        t = torch.utils.dlpack.from_dlpack(t)
    return t if t.dtype == dtype else t.view(dtype)


@dataclass
class OneRankBuffer:
    """DeepGEMM's Mega MoE buffer for one rank, in plain device memory (module docstring).

    buffer: int8 ``[bytes]``, zeroed once (the kernel leaves its workspace clean);
    handle.buffer_ptrs: ``[buffer.data_ptr()]``; group: rank 0 of 1 -- what the entry point
    reads, with ``num_max_tokens_per_rank`` (aligned), ``num_experts`` and ``num_topk``.
    x: e4m3 ``[Tmax, H]``, x_sf: fp32 ``[Tmax, H / 128]``, topk_idx: int64 ``[Tmax, k]``,
    topk_weights: fp32 ``[Tmax, k]``: the input views a call stages into.
    """

    buffer: torch.Tensor
    handle: types.SimpleNamespace
    group: _OneRank
    num_max_tokens_per_rank: int
    num_experts: int
    num_topk: int
    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    @classmethod
    def allocate(cls, size_fn, experts: int, max_tokens: int, top_k: int, hidden: int,
                 ffn: int, device: torch.device) -> "OneRankBuffer":
        """``size_fn`` (DeepGEMM's buffer-size function: ``(ranks, experts, tokens, top_k, H,
        F, fp8 dispatch, activation) -> (bytes, slice)``) sized and sliced for one rank."""
        nbytes, slice_views = size_fn(1, experts, max_tokens, top_k, hidden, ffn, True,
                                      "swiglu")
        buffer = torch.zeros(int(nbytes), dtype=torch.int8, device=device)
        views = slice_views(buffer)
        x, x_sf, idx, wts = (_as_torch(v, d) for v, d in zip(
            views[:4], (E4M3, torch.float32, torch.int64, torch.float32)))
        return cls(buffer, types.SimpleNamespace(buffer_ptrs=[buffer.data_ptr()]), _OneRank(),
                   max_tokens, experts, top_k, x, x_sf, idx, wts)


# --------------------------------------------------------------------------- the layer
def _quantize_into(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """``x``'s FP8 rows written into ``data`` / ``scale`` by comet's recipe: one launch of
    the dispatch quantizer on a GPU; torch's quantizer elsewhere (the interpreter's e4m3
    casts differ from torch's, and the CPU tests compare with torch)."""
    if x.is_cuda:
        from comet.kernels.fp8_roles import quantize_dispatch
        quantize_dispatch(x, out=Fp8Rows(data, scale))
    else:
        rows = quantize_rows(x)
        data.view(torch.uint8).copy_(rows.data.view(torch.uint8))
        scale.copy_(rows.scale)


class MegaMoELayer:
    """One configured Mega MoE on one rank: ``layer(x [T, H] bf16, topk_ids [T, k],
    topk_weights [T, k]) -> y [T, H] bf16`` (:data:`comet.bench.peers.Layer`), the staging
    of the rows and the kernel: the whole layer, as comet's fused call is."""

    def __init__(self, module: types.ModuleType, l1: tuple[torch.Tensor, torch.Tensor],
                 l2: tuple[torch.Tensor, torch.Tensor], buffer: OneRankBuffer,
                 clamp: float | None, pre_dispatch: bool):
        """``l1`` / ``l2``: :func:`l1_operand` / :func:`l2_operand`; ``pre_dispatch``: stage
        with DeepGEMM's own kernel (else comet's quantizer and two copies)."""
        self.module, self.l1, self.l2, self.buffer = module, l1, l2, buffer
        self.clamp, self.pre_dispatch = clamp, pre_dispatch
        self.hidden = l2[0].shape[1]

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        self.stage(x, topk_ids, topk_weights)
        y = torch.empty(x.shape[0], self.hidden, dtype=torch.bfloat16, device=x.device)
        if x.shape[0]:
            getattr(self.module, ENTRY)(y, self.l1, self.l2, self.buffer, None,
                                        recipe=(GROUP, GROUP, GROUP), activation="swiglu",
                                        activation_clamp=self.clamp, fast_math=True)
        return y

    def stage(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
              ) -> None:
        """The call's rows into the buffer: FP8 rows with their scales, ids, weights."""
        b, t = self.buffer, x.shape[0]
        if t > b.num_max_tokens_per_rank or x.shape[1] != self.hidden or \
                tuple(topk_ids.shape) != (t, b.num_topk):
            raise ValueError(f"the layer takes x [<= {b.num_max_tokens_per_rank}, "
                             f"{self.hidden}] and top-{b.num_topk} routing, got x "
                             f"{list(x.shape)}, topk_ids {list(topk_ids.shape)}")
        if self.pre_dispatch:
            # DeepGEMM's kernel reads int32 ids (and writes -1 past row t).
            getattr(self.module, PRE_DISPATCH)(
                x.contiguous(), topk_ids.to(torch.int32).contiguous(),
                topk_weights.float().contiguous(), b.x, b.x_sf, b.topk_idx, b.topk_weights, t)
        else:
            _quantize_into(x.contiguous(), b.x[:t], b.x_sf[:t])
            b.topk_idx[:t].copy_(topk_ids)
            b.topk_weights[:t].copy_(topk_weights)

    def staged_rows(self, tokens: int) -> Fp8Rows:
        """The FP8 rows the last call staged (copies): what the kernel multiplied."""
        return Fp8Rows(self.buffer.x[:tokens].clone(), self.buffer.x_sf[:tokens].clone())

    def close(self) -> None:
        """Release the buffer and the converted weights."""
        self.buffer = self.l1 = self.l2 = None


@dataclass
class MegaMoE:
    """The loaded package (``deep_gemm`` with the SM90 FP8 Mega MoE), and a
    :data:`comet.bench.peers.Builder` of its layer over comet's FP8 experts.

    module: the package; size_fn: its buffer-size function (:data:`SIZE_FNS`); align: its
    token alignment; pre_dispatch: it has :data:`PRE_DISPATCH`; backend: what runs, in
    words.
    """

    module: types.ModuleType
    size_fn: object
    align: int
    pre_dispatch: bool
    backend: str

    def layer(self, gate_up: Fp8Weight, down: Fp8Weight, top_k: int, max_tokens: int,
              activation: GatedActivation = SILU, device: torch.device | None = None
              ) -> MegaMoELayer:
        """The layer over all of ``gate_up [E, 2F, H]`` / ``down [E, H, F]`` for calls of up
        to ``max_tokens`` rows (rounded up to :attr:`align`: the kernel is compiled for it);
        operands converted and buffer allocated here, outside any timed call.
        PeerUnavailable for what it cannot run."""
        if gate_up.experts != down.experts or gate_up.n != 2 * down.k or gate_up.k != down.n:
            raise PeerUnavailable(f"gate_up {list(gate_up.weight.shape)} and down "
                                  f"{list(down.weight.shape)} do not make one MLP")
        e, h, f = down.experts, down.n, down.k
        why = shape_reason(h, f, e, top_k)
        if why:
            raise PeerUnavailable(f"DeepGEMM's SM90 Mega MoE: {why}")
        clamp = activation_clamp(activation)
        l1, l2 = l1_operand(gate_up), l2_operand(down)
        buffer = OneRankBuffer.allocate(self.size_fn, e, _cdiv(max_tokens, self.align) *
                                        self.align, top_k, h, f, device or down.device)
        return MegaMoELayer(self.module, l1, l2, buffer, clamp, self.pre_dispatch)

    def __call__(self, cfg: MoEConfig, w13, w2, group, device: torch.device) -> PeerLayer:
        """The Builder: the layer for ``cfg`` at EP=1 on comet's FP8 experts ``w13`` /
        ``w2`` (:class:`comet.quant.Fp8Weight`: all ``cfg.num_experts``)."""
        if not isinstance(w13, Fp8Weight) or not isinstance(w2, Fp8Weight):
            raise PeerUnavailable("the Mega MoE peer runs FP8 experts (comet.quant.Fp8Weight)")
        if cfg.expert_bias:
            raise PeerUnavailable("DeepGEMM's Mega MoE has no expert biases")
        if group is not None and group_size(group) != 1:
            raise PeerUnavailable("the Mega MoE peer runs one rank (EP=1)")
        if w13.experts != cfg.num_experts:
            raise PeerUnavailable(f"one rank holds all {cfg.num_experts} experts at EP=1, "
                                  f"got {w13.experts}")
        layer = self.layer(w13, w2, cfg.top_k, cfg.max_tokens, cfg.activation, device)
        mib = layer.buffer.buffer.numel() / 2**20
        return PeerLayer(NAME, layer, f"{self.backend}; {mib:.0f} MiB buffer for "
                         f"{layer.buffer.num_max_tokens_per_rank} tokens", layer.close)


def group_size(group) -> int:
    """Ranks of a torch.distributed group (1 where torch.distributed is not running)."""
    import torch.distributed as dist
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _version(module: types.ModuleType) -> str:
    for dist_name in ("deep_gemm", "sgl-deep-gemm"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return getattr(module, "__version__", "version unknown")


def bind(module: types.ModuleType) -> MegaMoE | str:
    """``module`` (``deep_gemm``, or a stand-in) as a :class:`MegaMoE`, or why it cannot
    serve: no SM90 FP8 Mega MoE in it (DeepGEMM's main branch), or no buffer-size function."""
    if not hasattr(module, ENTRY):
        return (f"this deep_gemm has no {ENTRY} (DeepGEMM's main branch has the Mega MoE for "
                "SM100 only): stage a ref with the SM90 one, DEEPGEMM_REF=refs/pull/352/head "
                "(scripts/fetch_peer_sources.sh names the others)")
    ext = getattr(module, "_C", None)
    size_fn = next((getattr(ext, n) for n in SIZE_FNS if hasattr(ext, n)), None)
    if size_fn is None:
        return f"this deep_gemm's extension has none of {', '.join(SIZE_FNS)}"
    align = int(ext.get_token_alignment_for_mega_moe()) \
        if hasattr(ext, "get_token_alignment_for_mega_moe") else TOKEN_ALIGN
    pre = hasattr(module, PRE_DISPATCH)
    staging = PRE_DISPATCH if pre else "comet's dispatch quantizer + 2 copies"
    return MegaMoE(module, size_fn, align, pre,
                   f"DeepGEMM {_version(module)} {ENTRY} (SM90, one rank, plain-memory "
                   f"buffer), staged by {staging}, fast_math")


def load_mega_moe(device: torch.device, world: int = 1) -> MegaMoE | str:
    """The installed ``deep_gemm``'s SM90 Mega MoE for ``device``, or why it cannot run."""
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if world != 1:
        return (f"runs one rank (EP=1); at {world} ranks DeepGEMM's buffer is symmetric "
                "memory over the group, which this peer does not set up")
    module = import_deep_gemm(device, "DeepGEMM's SM90 FP8 Mega MoE kernels",
                              "stage DeepGEMM with its SM90 Mega MoE "
                              "(scripts/fetch_peer_sources.sh) and build it on the GPU machine")
    return module if isinstance(module, str) else bind(module)


#: The whole-layer FP8 peers: :func:`comet.bench.peers.load_peers` with ``registry=`` this,
#: then :func:`comet.bench.peers.build_peers` with the FP8 experts (``Fp8Weight``s).
FP8_LAYER_PEERS = {NAME: Peer(NAME, load_mega_moe)}


# --------------------------------------------------------------------------- correctness
def quantize_pow2(h: torch.Tensor, group: int = H_GROUP) -> torch.Tensor:
    """``h [R, F]`` (fp32) through e4m3 as the kernel's gate/up epilogue stores it: per row
    and ``group`` values a power-of-two scale ``2^ceil(log2(amax * (1/448)))``, the values
    divided by it (exact), saturated and rounded to e4m3; returned dequantized (fp32)."""
    r, f = h.shape
    g = h.view(r, f // group, group)
    scaled = g.abs().amax(dim=2) * SCALE_PER_AMAX
    mant, exp = torch.frexp(scaled)
    # ceil(log2(s)): frexp's exponent, one less where s is a power of two (mantissa 0.5).
    scale = torch.ldexp(torch.ones_like(scaled), torch.where(mant == 0.5, exp - 1, exp))
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
    return (q * scale[..., None]).view(r, f)


def _expert(w: Fp8Weight, e: int) -> Fp8Weight:
    return Fp8Weight(w.weight[e:e + 1], w.scale_inv[e:e + 1], w.blocks, w.parts)


def emulate_recipe(rows: Fp8Rows, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   gate_up: Fp8Weight, down: Fp8Weight, activation: GatedActivation = SILU
                   ) -> torch.Tensor:
    """The Mega MoE's recipe in fp32 on the FP8 rows it was given: ``[T, H]`` (bf16 values).
    Per (token, expert): dequantized products summed in fp32, ``gated(gate, up) * weight``,
    :func:`quantize_pow2`, the down GEMM, rounded to bf16; the slots summed in fp32 and
    rounded to bf16. One expert dequantized at a time (a preset's would not fit)."""
    x, f = rows.dequantize(), down.k
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.experts):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            gu = x[tok] @ _expert(gate_up, e).dequantize()[0].T
            h = gated(gu[:, :f], gu[:, f:], activation) * topk_weights[tok, slot, None].float()
            y = quantize_pow2(h) @ _expert(down, e).dequantize()[0].T
            out.index_add_(0, tok, y.to(torch.bfloat16).float())
    return out.to(torch.bfloat16).float()


def emulate_comet(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: Fp8Weight, down: Fp8Weight, activation: GatedActivation = SILU
                  ) -> torch.Tensor:
    """comet's FP8 layer emulated (:func:`comet.reference.expert_mlp_fp8` per expert, the
    weighted sum in fp32): ``[T, H]`` fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.experts):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = expert_mlp_fp8(x[tok], _expert(gate_up, e), _expert(down, e), 0, activation)
            out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out


def rel_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``|y - ref| / |ref|`` (L2 norms, fp64)."""
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass(frozen=True)
class MegaCheck:
    """A Mega MoE output against the emulations.

    rel_l2: from comet's FP8 emulation (the recipes differ: not a pass/fail number);
    rel_l2_recipe: from :func:`emulate_recipe` on the rows it staged (:data:`MAX_REL_L2`).
    """

    rel_l2: float
    rel_l2_recipe: float

    @property
    def ok(self) -> bool:
        return self.rel_l2_recipe <= MAX_REL_L2      # NaN is not <=: wrong too


def check_layer(layer: MegaMoELayer, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight,
                activation: GatedActivation = SILU) -> MegaCheck:
    """One call of ``layer`` on ``x [T, H]`` and the routing, against both emulations."""
    y = layer(x, topk_ids, topk_weights).float()
    rows = layer.staged_rows(x.shape[0])
    return MegaCheck(
        rel_l2(y, emulate_comet(x, topk_ids, topk_weights, gate_up, down, activation)),
        rel_l2(y, emulate_recipe(rows, topk_ids, topk_weights, gate_up, down, activation)))


def _smoke() -> int:
    """One small layer against both emulations, and the gate/up conversion against the
    package's own ``transform_weights_for_mega_moe_sm90`` where it has one; 1 if off."""
    from comet.quant import quantize_weight
    mm = load_for_smoke("mega-moe", load_mega_moe)
    if mm is None:
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    e, k, h, f, t = 8, 2, 512, 512, 96
    gate_up = quantize_weight(torch.randn(e, 2 * f, h, device=dev) * h ** -0.5, parts=2)
    down = quantize_weight(torch.randn(e, h, f, device=dev) * f ** -0.5)
    ok = True
    transform = getattr(mm.module, "transform_weights_for_mega_moe_sm90", None)
    if transform is not None:
        (w1, s1), _ = transform((gate_up.weight, gate_up.scale_inv), (down.weight,
                                                                      down.scale_inv))
        ours = l1_operand(gate_up)
        same = torch.equal(w1.view(torch.uint8), ours[0].view(torch.uint8)) and \
            torch.equal(s1, ours[1])
        ok &= same
        print(f"gate/up operand equals transform_weights_for_mega_moe_sm90's: {same}")
    layer = mm.layer(gate_up, down, k, t)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, device=dev), dim=1)
    c = check_layer(layer, x, ids, wts, gate_up, down)
    ok &= c.ok
    print(f"rel L2 from its recipe {c.rel_l2_recipe:.2e} ({'ok' if c.ok else 'OFF'}), "
          f"from comet's emulation {c.rel_l2:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_smoke())
