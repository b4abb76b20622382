"""Configuration of an expert-parallel MoE layer, validated once at construction.

Four dataclasses describe everything the rest of comet needs:

* :class:`MoEConfig` -- the shape of the layer (experts, top-k, sizes, router, shared
  experts, dtype, and ``max_tokens``, the per-rank token capacity that sizes every
  workspace and device table).
* :class:`ParallelConfig` -- the expert-parallel layout (world size and this rank).
* :class:`TileConfig` -- tiles and launch shapes of the fused kernels; the host sizes
  buffers from it and the kernels take it as constexprs. Its :class:`GemmConfig` -- the
  GEMM tiles (block sizes, warps, stages, the order of layer0's work queue, the decode
  tile). Its :class:`CommConfig` -- the dispatch's chunks and return entries, the
  copy, reduce and combine tiles. Its :class:`Variant` -- the
  algorithm a call runs (layer1's scatter or reduce, layer0's gather, the small-call
  variants): the Selector picks one per call, and it keys the call's graph, launch
  cache and tuned table.

Invalid values raise :class:`ValueError` whose message names the offending field, so a
user reading a traceback knows which argument to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from comet.activation import SILU, GatedActivation
from comet.quant import GROUP, Fp8
from comet.weights import GATE_UP_BLOCK

RouterKind = Literal["softmax", "sigmoid"]

#: Sizes must be multiples of this so GEMM tiles and 16-byte vector accesses line up.
SIZE_ALIGNMENT = 16

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer.

    Args:
        num_experts: E, routed experts in the whole layer (over all ranks).
        top_k: experts chosen per token.
        hidden_size: H, model width (input and output rows are ``[*, H]``).
        intermediate_size: F, FFN width of one routed expert (W13 is ``[H, 2F]``).
        router: ``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3) scoring.
        renormalize: rescale the chosen top-k weights to sum to one.
        n_group: expert groups for grouped top-k (DeepSeek-V3); 1 disables grouping.
        topk_group: groups kept per token when ``n_group > 1``.
        routed_scaling_factor: multiplies the final routing weights (DeepSeek-V3).
        score_correction_bias: the router has a per-expert bias added to the scores
            for *selection only* (DeepSeek-V3 ``e_score_correction_bias``).
        num_shared_experts: dense experts every token goes through (0 for none).
        shared_intermediate_size: FFN width of the shared expert block (all shared
            experts fused into one MLP); defaults to ``num_shared_experts * F``.
        shared_expert_gate: the shared expert output is scaled by
            ``sigmoid(x @ w_gate)`` (Qwen2-MoE).
        dtype: parameter and activation dtype.
        activation: the experts' gated activation (:class:`comet.activation.GatedActivation`:
            SiLU by default; GELU-tanh, clamped and GPT-OSS-style SwiGLU).
        expert_bias: the routed experts' projections have biases (``b13 [E, 2F]`` added
            to gate/up, ``b2 [E, H]`` to each expert's output before its routing weight;
            GPT-OSS).
        max_tokens: most tokens one rank may pass to a single forward call; sizes the
            symmetric workspaces and device tables (no host sync reads live counts).
        rank_slots: most of one token's ``top_k`` slots that can route to a single rank
            (None: all of them). Set by :meth:`comet.mesh.MeshLayout.kernel_config` for the
            kernels' view of a tensor-parallel layout, whose tokens have ``k * tp`` slots
            of which at most ``k`` land on one rank: it sizes the received rows.
        fp8: the routed experts in W8A8 FP8 (:class:`comet.quant.Fp8`: e4m3 weights with
            block scales, token rows quantized per 128 values on their home rank; forward
            only, bf16 in and out), or None for experts in ``dtype``. Needs ``dtype``
            bf16 and ``hidden_size`` a multiple of :data:`comet.quant.GROUP`.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    router: RouterKind = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    dtype: torch.dtype = torch.bfloat16
    max_tokens: int = 4096
    activation: GatedActivation = SILU
    expert_bias: bool = False
    rank_slots: int | None = None
    fp8: Fp8 | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size",
                     "n_group", "topk_group", "max_tokens"):
            _check_positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % SIZE_ALIGNMENT:
                raise ValueError(
                    f"{name} must be a multiple of {SIZE_ALIGNMENT}, got {getattr(self, name)}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts in topk_group ({self.topk_group}) "
                f"groups of {self.num_experts // self.n_group}")
        if self.num_shared_experts < 0:
            raise ValueError(
                f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_intermediate_size is not None:
            _check_positive("shared_intermediate_size", self.shared_intermediate_size)
            if self.num_shared_experts == 0:
                raise ValueError(
                    "shared_intermediate_size is set but num_shared_experts is 0")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {self.dtype}")
        if not isinstance(self.activation, GatedActivation):
            raise ValueError("activation must be a comet.activation.GatedActivation, got "
                             f"{self.activation!r}")
        if self.rank_slots is not None:
            _check_positive("rank_slots", self.rank_slots)
            if self.rank_slots > self.top_k:
                raise ValueError(f"rank_slots ({self.rank_slots}) must not exceed top_k "
                                 f"({self.top_k})")
        if not self.routed_scaling_factor > 0:
            raise ValueError(
                f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        if self.fp8 is not None:
            if not isinstance(self.fp8, Fp8):
                raise ValueError(f"fp8 must be a comet.quant.Fp8 or None, got {self.fp8!r}")
            if self.dtype != torch.bfloat16:
                raise ValueError(f"fp8 layers take and return bf16 rows: dtype must be "
                                 f"torch.bfloat16, got {self.dtype}")
            if self.hidden_size % GROUP:
                raise ValueError(f"fp8 quantizes token rows in whole groups of {GROUP}: "
                                 f"hidden_size must be a multiple of {GROUP}, got "
                                 f"{self.hidden_size}")

    @property
    def slots_per_rank(self) -> int:
        """Most of a token's slots that one rank can receive (``rank_slots`` or
        ``top_k``): with ``max_tokens`` and the world, what sizes received rows."""
        return self.top_k if self.rank_slots is None else self.rank_slots

    @property
    def shared_size(self) -> int:
        """FFN width of the fused shared-expert MLP (0 when there is none)."""
        if self.num_shared_experts == 0:
            return 0
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared_experts * self.intermediate_size

    def replace(self, **changes) -> "MoEConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParallelConfig:
    """Expert-parallel layout: ``world_size`` ranks, experts split evenly and contiguously.

    Rank ``r`` owns global experts ``[r * El, (r + 1) * El)`` with ``El = E / world_size``.
    """

    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        _check_positive("world_size", self.world_size)
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size={self.world_size}), got {self.rank!r}")

    @classmethod
    def from_group(cls, group=None) -> "ParallelConfig":
        """The layout of a process group (None: the world when torch.distributed is
        initialised, else a single rank)."""
        import torch.distributed as dist
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(1, 0)
        g = group if group is not None else dist.group.WORLD
        return cls(dist.get_world_size(g), dist.get_rank(g))

    def local_experts(self, moe: MoEConfig) -> int:
        """El, the experts on each rank; raises if the world does not divide E."""
        check_layout(moe, self)
        return moe.num_experts // self.world_size

    def expert_range(self, moe: MoEConfig) -> range:
        """The global expert ids owned by this rank."""
        el = self.local_experts(moe)
        return range(self.rank * el, (self.rank + 1) * el)


def check_layout(moe: MoEConfig, par: ParallelConfig) -> None:
    """Raise ValueError if the expert-parallel group cannot shard ``moe``'s experts."""
    if moe.num_experts % par.world_size:
        raise ValueError(
            f"num_experts ({moe.num_experts}) must be divisible by the expert-parallel "
            f"world_size ({par.world_size})")


#: Named model shapes used by the benchmark, the tuner and the tests.
PRESETS: dict[str, MoEConfig] = {
    "mixtral": MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "qwen2-moe": MoEConfig(num_experts=64, top_k=4, hidden_size=2048, intermediate_size=1408),
    "phi3.5-moe": MoEConfig(num_experts=16, top_k=2, hidden_size=4096, intermediate_size=6400),
    "deepseek-v3-like": MoEConfig(num_experts=256, top_k=8, hidden_size=7168,
                                  intermediate_size=2048, router="sigmoid", n_group=8,
                                  topk_group=4, routed_scaling_factor=2.5,
                                  score_correction_bias=True),
}


def preset(name: str, **changes) -> MoEConfig:
    """A named shape from :data:`PRESETS`, optionally with fields changed."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; known: {sorted(PRESETS)}") from None
    return cfg.replace(**changes) if changes else cfg


#: :class:`GemmConfig` fields a tuned table may set per token bucket (``comet tune``
#: searches them once the block split is chosen), with the smallest valid value of each. They change
#: only the order in which a rank runs its own work -- no buffer size, nothing a peer
#: reads -- so each call may use its own.
TUNABLE_TILE_FIELDS = {"group_m": 1, "local_head_tiles": 0}


def tile_field_error(name: str, value) -> str | None:
    """Why ``name = value`` cannot be a per-call tile choice, or None if it can."""
    if name not in TUNABLE_TILE_FIELDS:
        return f"{name!r} is not a per-call tile field (those are {sorted(TUNABLE_TILE_FIELDS)})"
    low = TUNABLE_TILE_FIELDS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return f"tile field {name!r} must be an integer >= {low}, got {value!r}"
    return None


VariantName = Literal["layer1_scatter", "layer0_gather", "layer0_own_in_place",
                      "layer0_live_rows", "layer0_stream_k", "layer0_tail_split",
                      "layer1_split_k", "small_plan_blocks", "fp8_ws_min_rows",
                      "fp8_ws_paired_rows"]


@dataclass(frozen=True)
class Variant:
    """The algorithm a call runs: which of the kernels' alternatives are compiled in.

    A layer's :class:`TileConfig` holds the variant it may run; per call the Selector
    (comet.runtime.selection) turns off the small-call ones a call is too large for, and
    the variant so chosen keys the call's graph and launch cache. The non-default fields
    key the tuned tables (:meth:`TileConfig.table_variant`). Measurements behind each
    default: docs/benchmarks.md, docs/notebook.md (also the variants taken out).

    Fields:
        layer1_split_k: K (= F) splits of layer1's scatter GEMM in calls whose work items
            leave programs idle (1: none). Each split streams ``F / layer1_split_k`` rows
            of an expert's W2, so a 1-token call keeps that many times more weight bytes
            in flight; the last split of an item to finish adds the partial tiles in
            split order (bitwise the same output whoever finishes last) and sends the
            rows home. Decided on the device per call, by the rank alone
            (comet.kernels.layer1.KSplit; the decode tile's column blocks only); a local
            scratch of 4 MiB when on. On by default: it shortens 1-token calls and leaves
            calls with no room as they were (docs/notebook.md, "Small calls").
        layer0_stream_k: layer0's gated GEMM as stream-K in calls whose work items would
            leave programs idle: the call's K steps cut into one equal run per program,
            a work item's parts summed in program order by the last to finish (bitwise
            the same output whoever is last), then bias and activation. Compiled in only
            for calls whose expected items make fewer than two rounds of the programs
            (the host's gate, comet.runtime.selection.Selector.stream_k_by_rule), then
            decided on the device per call, by the rank alone
            (comet.kernels.layer0.stream_k_pays; one-dot tiles, ``block_n0`` = the W13
            interleave block, or an FP8 layer's items); a local scratch of 2 x 256
            partial boxes (16 MiB at 128 columns). On by default: it pays for 1-token
            calls whose items it cuts and costs nothing where the gate keeps it out
            (docs/notebook.md, "Small calls").
        layer0_tail_split: most K splits of each item of layer0's last partial round of
            work items, in calls whose last round fills at most half the programs and
            whose m-tiles have at most 64 rows (comet.kernels.layer0.tail_split, decided
            on the device per call, by the rank alone): the queue hands out the whole
            rounds as before, then the last round's items as K splits, each split's fp32
            box summed in split order by the item's last split to arrive (bitwise the
            same output whoever is last). Compiled in only for calls whose expected
            items leave such a round (the host's gate,
            comet.runtime.selection.Selector.tail_split_by_rule). Uses stream-K's
            scratch. 4 by default: it shortens calls whose last round is a few items and
            leaves the others as they were (docs/notebook.md, "Small calls").
        layer1_scatter: fused calls send each layer1 output row, weighted, straight from
            the GEMM epilogue into its token's home, and the combine sums a token's top-k
            rows -- instead of the paper's column-split reduce, whose comm blocks sum a
            token's rows per rank and send one row per (token, rank) after each split.
            More bytes cross the link when a token has several experts on one rank; no
            reduce pass. The other modes and the backward keep the reduce
            (comet.runtime.strategies), and so does the default tile of a ``(tp, 1)``
            replicated layout (comet.runtime.layer.default_tile), where every one of a
            token's k rows is on every rank.
        layer0_gather: layer0's dispatch sends each token's row once per destination
            (with the first of its pairs there, in send order), and every pair only as
            an index entry (``a0_src``, with its row home); the GEMM reads its A rows
            through that index (``tl.load`` of gathered rows, not a TMA box). The link
            carries one row per (token, destination) instead of one per pair, and no
            rank writes ``k`` copies of a token into its shared tensor. Needs one-dot
            layer0 items (``block_n0`` = the W13 interleave block); the forward only (the
            backward keeps rows placed per pair). Off in ``TileConfig()``; a layer's
            default tile turns it on where a token has at least four of its slots per
            rank (comet.runtime.strategies.gather_pays, which says why).
        layer0_own_in_place: with ``layer0_gather``, this rank's own tokens are not
            copied into its shared tensor: their index entries name rows of the caller's
            x, which the GEMM reads in place. The dispatch then copies rows only to
            peers, and the tiles of the local head wait for index entries, not for a
            copy of every local row, one comm program per 256-row chunk, which held the
            GEMM's start. On by default: faster or even at every size measured
            (docs/notebook.md, "Large calls").
        layer0_live_rows: with ``layer0_gather``, the GEMM loads only a tile's own A
            rows (masked loads; the others, the next expert's rows or padding, are
            zeros) in calls whose experts' rows, as the decode rule expects them, fill at
            most an eighth of an m-tile (the host's gate,
            comet.runtime.selection.Selector.live_rows_by_rule); larger calls run the
            kernel without the masks, which slow full tiles. On by default: it shortens
            layer0 at a few rows per expert (docs/notebook.md, "Small calls").
        small_plan_blocks: calls of at most this many of the plan's token blocks
            (comet.kernels.plan.plan_block_tokens: 64 slots, e.g. 8 tokens at top-8) plan
            in two launches instead of seven: one program opens the call, stages and
            counts the routing and pushes the counts (comet.kernels.plan.open_kernel;
            a step of several blocks at a time, so only a few steps pay), and the layout
            kernel's programs place the send list, a block each (the host's gate, which
            also bounds the steps: comet.runtime.selection.Selector.small_plan_by_rule;
            0: never).
        fp8_ws_min_rows: an FP8 layer's calls of at least this many rows per expert
            (expected under even routing; 0: none) run layer0's and layer1's GEMMs on the
            warp-specialized Gluon kernel (comet.kernels.fp8_ws: a TMA producer warp,
            the fp32 promotion of one K step under the next step's wgmma) as launches of
            their own after the dispatch, instead of the ``tl`` K loop inside the fused
            kernels, whose synchronous dots stall on each promotion (docs/precision.md).
            The kernel waits for no peer, so an FP8 layer keeps it only where it has none
            and its weights' scale blocks fit the kernel, on a GPU
            (comet.runtime.layer.fp8_tile); the Selector turns it off for smaller calls
            (comet.runtime.selection.Selector.ws_gemm_by_rule);
            fused forward calls with the scatter epilogue only. A bf16 layer ignores it.
            4 by default: the rows from which it is GPU-tested against the accuracy
            bound (docs/precision.md).
        fp8_ws_paired_rows: calls on the warp-specialized kernel with at least this many
            rows per expert (expected as for ``fp8_ws_min_rows``; 0: none) run both
            GEMMs on paired m-tiles: an item is 128 rows (the plan's tiles, paired per
            expert by comet.kernels.plan.paired_tiles), each consumer on 64 of them, times
            one 128-column box of B at a time (layer0: its gate box over K, then its up
            box, the gate tile parked in shared memory), so a K step moves 32 KiB from
            L2 where the 64-row item's two B boxes move 40 for the same FLOPs: the K loop
            is bound by those moves, not by the tensor cores (docs/precision.md).
            layer0 keeps 64-row items after a gathered dispatch (``layer0_gather``). The
            Selector turns it off for smaller calls (Selector.ws_paired_by_rule). 0 by
            default: on one H100 the whole FP8 call took 0.94-1.00x the time at 16384
            tokens and 1.03-1.06x at 4096 (four presets, one run; docs/precision.md).
    """

    layer1_scatter: bool = True
    layer0_gather: bool = False
    layer0_own_in_place: bool = True
    layer0_live_rows: bool = True
    layer0_stream_k: bool = True
    layer0_tail_split: int = 4
    layer1_split_k: int = 4
    small_plan_blocks: int = 16
    fp8_ws_min_rows: int = 4
    fp8_ws_paired_rows: int = 0

    def __post_init__(self):
        if self.layer1_split_k < 1:
            raise ValueError(f"layer1_split_k must be >= 1, got {self.layer1_split_k}")
        if self.layer0_tail_split < 0:
            raise ValueError(f"layer0_tail_split must be >= 0, got {self.layer0_tail_split}")
        if self.small_plan_blocks < 0:
            raise ValueError(f"small_plan_blocks must be >= 0, got {self.small_plan_blocks}")
        if self.fp8_ws_min_rows < 0:
            raise ValueError(f"fp8_ws_min_rows must be >= 0, got {self.fp8_ws_min_rows}")
        if self.fp8_ws_paired_rows < 0:
            raise ValueError(f"fp8_ws_paired_rows must be >= 0, got "
                             f"{self.fp8_ws_paired_rows}")

    def without(self, names: tuple[VariantName, ...]) -> "Variant":
        """This variant with the fields ``names`` off (False, or 0)."""
        return dataclasses.replace(self, **{n: type(getattr(self, n))(0) for n in names})


#: The names of :class:`Variant`'s fields (set in a tile by :meth:`TileConfig.with_fields`).
VARIANT_FIELDS = tuple(f.name for f in dataclasses.fields(Variant))


@dataclass(frozen=True)
class GemmConfig:
    """The GEMM tiles and launch shapes of layer0's and layer1's grouped GEMMs, held by
    :class:`TileConfig` as ``gemm`` (measurements behind each default: docs/notebook.md).
    The flat names (``block_m``, ``group_m``, ...) stay those of ``comet bench --tile``,
    the tuned tables and probe files (:meth:`TileConfig.with_fields`,
    :meth:`TileConfig.flat`). Not :class:`comet.kernels.group_gemm.GemmTile`, the
    constexpr group the launchers build from it per layer.

    Fields:
        block_m: rows of an m-tile (both layers share the tile table).
        block_n0: columns of a layer0 work item, per half (gate and up); divides
            :data:`comet.weights.GATE_UP_BLOCK`, and one dot computes both halves when
            equal to it.
        block_n1: columns of a layer1 work item.
        block_k: K step (shrunk to divide H and F where needed, :meth:`k_step`).
        num_warps, num_stages: of the GEMM kernels.
        group_m: m-tiles of layer0's table that sweep the column blocks together, so an
            expert's W13 block comes from HBM once per group (tunable per bucket).
        local_head_tiles: m-tiles of this rank's own rows that open layer0's tile table,
            work for the GEMM while the first remote rows are in flight (tunable).
        lane_head_rounds / lane_tail_rounds: rounds of layer0's work queue handed out one
            item per take at its start and its end, the rest in lanes of
            ``kernels.layer0.LANE_ITEMS`` items (:func:`kernels.group_gemm.lane_shape`).
        decode_block_n1: layer1's column block in calls too small to give it a work item
            per SM with ``block_n1`` (:meth:`TileConfig.decode_tile`; 0: none).
        small_block_m: rows of an FP8 layer's m-tiles in calls of a few rows per expert
            that still give layer0 a round of work items
            (:meth:`TileConfig.small_rows_tile`; 0: none; a bf16 layer ignores it).
    """

    block_m: int = 128
    block_n0: int = GATE_UP_BLOCK
    block_n1: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    local_head_tiles: int = 16
    lane_head_rounds: int = 0
    lane_tail_rounds: int = 1
    decode_block_n1: int = 128
    small_block_m: int = 16

    def __post_init__(self):
        # A layer0 tile must not straddle two blocks of the interleaved W13.
        if GATE_UP_BLOCK % self.block_n0:
            raise ValueError(f"block_n0 must divide the W13 interleave block "
                             f"({GATE_UP_BLOCK}), got {self.block_n0}")

    def k_step(self, k: int) -> int:
        """Largest power-of-two step <= block_k dividing ``k`` (B rows must not cross into
        the next expert's weights)."""
        step = self.block_k
        while k % step:
            step //= 2
        return step


#: The names of :class:`GemmConfig`'s fields (set in a tile by :meth:`TileConfig.with_fields`).
GEMM_FIELDS = tuple(f.name for f in dataclasses.fields(GemmConfig))


@dataclass(frozen=True)
class CommConfig:
    """The units of the communication protocol and the tiles of the kernels that move
    rows (dispatch, layer1's reduce, combine), held by :class:`TileConfig` as ``comm``.
    ``comm_rows`` and ``dispatch_entries`` size the dispatch's chunks (a flag each) and
    the return entries they carry, so every rank of a layer must use the same; the rest
    are the copy and reduce tiles. No tuned table sets them (they are fixed when a layer
    is built); they are not module constants because :meth:`TileConfig.small` (the
    interpreter's) and probes (``comet bench --tile comm_entries=16``) change them. Flat
    names as :class:`GemmConfig`'s (:meth:`TileConfig.with_fields`).

    Fields:
        comm_rows: rows of a dispatch chunk, the unit a destination waits for (a flag
            each); dispatch_entries: return entries per dispatch chunk.
        comm_copy_rows / comm_block_h: tile of the dispatch copy (rows x columns).
        dispatch_parts: most parts a dispatch chunk's copy is cut into, in calls with
            fewer chunks than comm blocks (1: one program copies each chunk). The sender's
            choice alone, made on the device per call (comet.kernels.layer0.dispatch_role):
            the chunks, each with its flag, stay what a destination waits for, and the
            chunk's last part publishes it. Parts because a small call's rows to a
            destination are one chunk, too slow for one program to copy while the GEMM
            waits (docs/design.md; docs/notebook.md, "Small calls").
        comm_entries: return entries per step of the layer1 reduce, and the copy tile of
            return entries in the dispatch.
        reduce_step_elements: elements a reduce step loads at once: ``comm_entries`` x
            the slots an entry holds (the top-k; in a (tp, ep) layout one shard's, ``k``
            of ``k * tp``; rounded up to a power of two) x as many columns as fit, at
            most ``comm_block_c`` in a layer over several GPUs, ``local_comm_block_c`` on
            one (comet.kernels.layer1.reduce_tile). Every slot of a step is one gather,
            whose loads a thread issues together: a load per slot kept only one slot's
            rows in flight (docs/notebook.md, "Large calls").
        comm_block_c / local_comm_block_c: most columns of a reduce step where its sums
            cross to a peer / stay in HBM: narrower where the stores cross the link, which
            wide steps slowed; alone, wider steps stream HBM (docs/notebook.md, "Large
            calls").
        reduce_item: return entries per item of layer1's reduce queue (rounded up to a
            multiple of the reduce tile's entries): one queue atomic per item.
        combine_rows / combine_block_h / combine_warps: tile of the final combine, a pure
            HBM stream.
    """

    comm_rows: int = 256
    comm_copy_rows: int = 32
    dispatch_parts: int = 8
    comm_block_h: int = 512
    dispatch_entries: int = 1024
    comm_entries: int = 32
    reduce_item: int = 32
    comm_block_c: int = 128
    local_comm_block_c: int = 256
    reduce_step_elements: int = 32768
    combine_rows: int = 1
    combine_block_h: int = 4096
    combine_warps: int = 8

    def __post_init__(self):
        if self.dispatch_parts < 1:
            raise ValueError(f"dispatch_parts must be >= 1, got {self.dispatch_parts}")


#: The names of :class:`CommConfig`'s fields (set in a tile by :meth:`TileConfig.with_fields`).
COMM_FIELDS = tuple(f.name for f in dataclasses.fields(CommConfig))


@dataclass(frozen=True)
class TileConfig:
    """Tiles and launch shapes of the fused kernels (measurements behind each default:
    docs/notebook.md): the GEMM tiles :attr:`gemm` (:class:`GemmConfig`), the
    communication units and tiles :attr:`comm` (:class:`CommConfig`), layer1's column
    splits, and the algorithm :attr:`variant` (:class:`Variant`).
    :meth:`with_fields` and :meth:`flat` name every field by its flat name.

    Fields:
        gemm: the GEMM tiles (:class:`GemmConfig`).
        comm: the communication kernels' units and tiles (:class:`CommConfig`).
        splits: target number of layer1 column splits (the reduce role's unit of
            waiting); every split reads layer1's A rows again, so few.

    Algorithm: :attr:`variant` (:class:`Variant`), the choices a call may run.
    """

    gemm: GemmConfig = GemmConfig()
    comm: CommConfig = CommConfig()
    splits: int = 2
    variant: Variant = Variant()

    def __post_init__(self) -> None:
        # A call's tile keys the layer's call and graph caches several times per call;
        # hashing the nested dataclasses each time cost a few us of host time.
        object.__setattr__(self, "_hash", hash((self.gemm, self.comm, self.splits,
                                                self.variant)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt, not restored: a hash cached in another process may differ.
        return (TileConfig, (self.gemm, self.comm, self.splits, self.variant))

    def with_overrides(self, overrides: Mapping[str, int]) -> "TileConfig":
        """This configuration with some :data:`TUNABLE_TILE_FIELDS` set (a tuned table's
        per-bucket choice, or a call's override); ValueError for any other field or a
        value below the field's minimum."""
        for name, value in overrides.items():
            if (why := tile_field_error(name, value)) is not None:
                raise ValueError(why)
        return self.with_fields(**overrides)

    def with_fields(self, **changes) -> "TileConfig":
        """A copy with fields changed by their flat names -- this class's,
        :class:`GemmConfig`'s, :class:`CommConfig`'s and :class:`Variant`'s, as ``comet
        bench --tile``, the tuned tables and probe files name them (validated again)."""
        for group, names in (("gemm", GEMM_FIELDS), ("comm", COMM_FIELDS),
                             ("variant", VARIANT_FIELDS)):
            part = {n: changes.pop(n) for n in list(changes) if n in names}
            if part:
                changes[group] = dataclasses.replace(getattr(self, group), **part)
        return dataclasses.replace(self, **changes) if changes else self

    def table_variant(self) -> dict[str, int | bool]:
        """The flat fields (tiles and :class:`Variant`) in which this configuration
        differs from the default one, except the per-bucket :data:`TUNABLE_TILE_FIELDS`:
        what a tuned table records and a lookup matches, so splits tuned on one variant
        never serve another."""
        return {name: value for name, value in self.flat().items()
                if name not in TUNABLE_TILE_FIELDS and value != _DEFAULT_FLAT[name]}

    def flat(self) -> dict[str, int | bool]:
        """Every field by its flat name (:class:`GemmConfig`'s, ``splits``,
        :class:`CommConfig`'s, then :class:`Variant`'s)."""
        return ({n: getattr(self.gemm, n) for n in GEMM_FIELDS} | {"splits": self.splits}
                | {n: getattr(self.comm, n) for n in COMM_FIELDS}
                | {n: getattr(self.variant, n) for n in VARIANT_FIELDS})

    def decode_tile(self) -> "TileConfig | None":
        """The tile configuration of small calls: this one with layer1's column block
        ``decode_block_n1`` (everything else unchanged, so both share one workspace and
        one tile table), or None."""
        gemm = self.gemm
        if not gemm.decode_block_n1 or gemm.decode_block_n1 == gemm.block_n1:
            return None
        return self.with_fields(block_n1=gemm.decode_block_n1, decode_block_n1=0)

    def small_rows_tile(self) -> "TileConfig | None":
        """This configuration on m-tiles of ``small_block_m`` rows, or None where those are
        no smaller. The FP8 `tl` kernels compute every row of an m-tile, live or not, and
        promote each product into fp32: a 64-row tile of a call with a row or two per
        expert is mostly zeros (docs/precision.md). The plan builds the tile table per
        call, so both share one workspace (sized for the smaller tiles,
        :meth:`plan_block_m`)."""
        gemm = self.gemm
        if not gemm.small_block_m or gemm.small_block_m >= gemm.block_m:
            return None
        return self.with_fields(block_m=gemm.small_block_m)

    def plan_block_m(self, fp8: bool) -> int:
        """Rows of the smallest m-tile a call of a layer on this configuration may plan
        (FP8 layers: :meth:`small_rows_tile`'s too), which sizes its tile table."""
        small = self.small_rows_tile() if fp8 else None
        return (small or self).gemm.block_m

    def n_splits_max(self, hidden: int) -> int:
        """Most layer1 column splits any call may use (sizes the split counters)."""
        decode = self.decode_tile()
        return max(self.n_splits(hidden), decode.n_splits(hidden) if decode else 0)

    def layer1_items(self, rows_per_expert: int, local_experts: int, hidden: int) -> int:
        """layer1's work items (m-tiles x column blocks) when each local expert gets
        ``rows_per_expert`` rows."""
        m_tiles = local_experts * -(-rows_per_expert // self.gemm.block_m)
        return m_tiles * -(-hidden // self.gemm.block_n1)

    def decode_pays(self, rows_per_expert: int, local_experts: int, hidden: int,
                    programs: int) -> bool:
        """Whether layer1 should run on :meth:`decode_tile`, by a rule (a tuned table
        overrides it): when this tile gives layer1 fewer work items than ``programs``
        (part of the GPU idle) *and* the decode tile gives fewer columns per program --
        waves of items over the programs times the columns of an item. Both halves were
        measured to matter (docs/notebook.md): narrower items in two waves made a call
        with nearly an item per SM slower, and waves alone picked the decode tile for
        large calls whose last wave was ragged."""
        decode = self.decode_tile()
        if decode is None:
            return False
        items = self.layer1_items(rows_per_expert, local_experts, hidden)
        decode_items = decode.layer1_items(rows_per_expert, local_experts, hidden)
        return (items < programs and -(-decode_items // programs) * decode.gemm.block_n1
                < -(-items // programs) * self.gemm.block_n1)

    @staticmethod
    def small() -> "TileConfig":
        """Tiny tiles for the interpreter and unit tests."""
        gemm = GemmConfig(block_m=16, block_n0=16, block_n1=32, block_k=16, num_warps=4,
                        num_stages=1, local_head_tiles=2, decode_block_n1=0)
        comm = CommConfig(comm_rows=16, comm_copy_rows=8, comm_block_h=32,
                          dispatch_entries=16, comm_entries=8, reduce_item=16,
                          comm_block_c=16, local_comm_block_c=32, reduce_step_elements=512,
                          combine_rows=8, combine_block_h=32, combine_warps=4)
        return TileConfig(gemm=gemm, comm=comm, splits=2)

    def blocks_per_split(self, hidden: int) -> int:
        n_blocks = -(-hidden // self.gemm.block_n1)
        return max(1, -(-n_blocks // self.splits))

    def n_splits(self, hidden: int) -> int:
        n_blocks = -(-hidden // self.gemm.block_n1)
        return -(-n_blocks // self.blocks_per_split(hidden))


#: :meth:`TileConfig.flat` of the default configuration.
_DEFAULT_FLAT = TileConfig().flat()
