"""Synthetic inputs for the benchmark: routing, tokens and expert weights.

Routing kinds (every token picks ``top_k`` distinct experts; weights are a softmax of
random logits over the chosen ones):

* ``uniform`` -- each token's experts are a uniformly random ``top_k``-subset.
* ``skewed`` -- one hot expert (global expert 0, on rank 0): each token picks it with
  probability :data:`HOT_FRACTION` (1/2), its other slots uniformly from the rest. Expert 0
  then gets half of all tokens (uniform would give it ``top_k / E`` of them: 1/4 for
  Mixtral, 1/32 for DeepSeek-V3), and rank 0 receives the most rows and does the most work,
  which is what a real hot expert does to an EP layer.

Everything is drawn from seeds derived from (seed, config, tokens, routing, rank, set), so
every variant sees the same inputs, reruns see the same inputs, and each config gets its
own fresh routing.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from comet.config import MoEConfig
from comet.quant import Fp8Weight, quantize_weight

ROUTINGS = ("uniform", "skewed")
HOT_EXPERT = 0
HOT_FRACTION = 0.5


def derive_seed(seed: int, *parts) -> int:
    """A stable 63-bit seed from ``seed`` and any printable parts."""
    return (seed * 1_000_003 + zlib.crc32(repr(parts).encode())) % (2 ** 63)


def make_routing(tokens: int, num_experts: int, top_k: int, kind: str,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [tokens, k] int64, topk_weights [tokens, k] fp32)`` on the CPU."""
    scores = torch.rand(tokens, num_experts, generator=generator)
    if kind == "skewed":
        hot = torch.rand(tokens, generator=generator) < HOT_FRACTION
        # Above every uniform score when hot, below every one otherwise.
        scores[:, HOT_EXPERT] = torch.where(hot, 2.0, -1.0)
    elif kind != "uniform":
        raise ValueError(f"unknown routing {kind!r}; known: {list(ROUTINGS)}")
    ids = scores.topk(top_k, dim=1).indices
    weights = torch.randn(tokens, top_k, generator=generator).softmax(dim=1)
    return ids, weights


@dataclass
class InputSet:
    """One rank's inputs for one call: ``x [M, H]``, ``topk_ids``/``topk_weights [M, k]``."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def make_input_sets(cfg: MoEConfig, config_name: str, tokens: int, routing: str, n_sets: int,
                    rank: int, seed: int, device: torch.device) -> list[InputSet]:
    """``n_sets`` independent input sets of this rank (rotated through by the timing loop)."""
    sets = []
    for s in range(n_sets):
        g = torch.Generator().manual_seed(derive_seed(seed, config_name, tokens, routing,
                                                      rank, s))
        ids, weights = make_routing(tokens, cfg.num_experts, cfg.top_k, routing, g)
        gx = torch.Generator(device=device).manual_seed(
            derive_seed(seed, config_name, tokens, routing, rank, s, "x"))
        x = torch.randn(tokens, cfg.hidden_size, generator=gx, device=device, dtype=cfg.dtype)
        sets.append(InputSet(x, ids.to(device), weights.to(device)))
    return sets


def make_expert_weights(cfg: MoEConfig, local_experts: int, config_name: str, rank: int,
                        seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(w13 [El, H, 2F], w2 [El, F, H])``, scaled like
    :class:`comet.moe.LocalExperts` so activations keep a sane magnitude."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device=device).manual_seed(
        derive_seed(seed, config_name, "weights", rank))
    # Drawn in the model dtype: an fp32 draw of DeepSeek-V3's 256 experts would need 45 GB.
    w13 = torch.randn(local_experts, h, 2 * f, generator=g, device=device, dtype=cfg.dtype)
    w2 = torch.randn(local_experts, f, h, generator=g, device=device, dtype=cfg.dtype)
    return w13.mul_(h ** -0.5), w2.mul_(f ** -0.5)


#: Experts quantized at once: the recipe works on fp32 copies, which for a whole preset
#: (DeepSeek-V3's 256 experts: 45 GB) would not fit beside the bf16 experts.
QUANT_CHUNK = 8


def quantize_expert_weights(w13: torch.Tensor, w2: torch.Tensor, chunk: int = QUANT_CHUNK
                            ) -> tuple[Fp8Weight, Fp8Weight]:
    """The FP8 form of :func:`make_expert_weights`' experts, in the layout the FP8 layer
    takes: ``gate_up [El, 2F, H]`` (gate rows, then up rows: their own block grids) and
    ``down [El, H, F]``, by :func:`comet.quant.quantize_weight`'s recipe, ``chunk``
    experts at a time."""
    def quantized(w: torch.Tensor, parts: int) -> Fp8Weight:
        pieces = [quantize_weight(w[i:i + chunk].transpose(1, 2), parts=parts)
                  for i in range(0, w.shape[0], chunk)]
        return Fp8Weight(torch.cat([p.weight for p in pieces]),
                         torch.cat([p.scale_inv for p in pieces]), pieces[0].blocks, parts)
    return quantized(w13, 2), quantized(w2, 1)
