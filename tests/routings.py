"""Routing generators shared by the tests: random, skewed, empty experts, idle ranks."""

from __future__ import annotations

import torch

KINDS = ("random", "skewed", "empty_expert", "zero_token_rank", "one_expert")


def make_ids(kind: str, tokens: list[int], num_experts: int, top_k: int,
             gen: torch.Generator) -> list[torch.Tensor]:
    """Distinct top-k expert ids per token for each rank, ``[M_r, k]`` int64."""
    out = []
    for r, m in enumerate(tokens):
        if kind == "zero_token_rank" and r == len(tokens) - 1:
            m = 0
        scores = torch.rand(m, num_experts, generator=gen)
        if kind == "skewed":
            scores[:, 0] += 0.9          # one hot expert takes most first choices
        elif kind == "empty_expert":
            scores[:, num_experts - 1] = -1.0   # the last expert never chosen
        elif kind == "one_expert":
            scores[:, 1] += 2.0          # every token's first choice is expert 1
        out.append(scores.topk(top_k, dim=1).indices)
    return out


def make_tokens(kind: str, world: int, max_tokens: int, gen: torch.Generator) -> list[int]:
    tokens = torch.randint(1, max_tokens + 1, (world,), generator=gen).tolist()
    if kind == "zero_token_rank":
        tokens[-1] = 0
    return tokens
