"""Configuration of an expert-parallel MoE layer, validated once at construction.

Two dataclasses describe everything the rest of comet needs:

* :class:`MoEConfig` -- the shape of the layer (experts, top-k, sizes, router, shared
  experts, dtype, and ``max_tokens``, the per-rank token capacity that sizes every
  workspace and device table).
* :class:`ParallelConfig` -- the expert-parallel layout (world size and this rank).

Invalid values raise :class:`ValueError` whose message names the offending field, so a
user reading a traceback knows which argument to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

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
        max_tokens: most tokens one rank may pass to a single forward call; sizes the
            symmetric workspaces and device tables (no host sync reads live counts).
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
        if not self.routed_scaling_factor > 0:
            raise ValueError(
                f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

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
