"""Tiny random-initialised transformers models of a few families (no downloads).

Used by ``examples/patch_tiny_models.py`` and tests/test_integrations.py: sizes are
multiples of 16, two decoder layers, a handful of experts, so a forward pass takes
milliseconds on a CPU. The five families comet started with, plus three that show the
range of what the general converter takes over: Phi-3.5-MoE (sparsemixer router), GLM-4.5
(sigmoid router with correction bias, group-limited, scaled, shared experts) and Llama-4
(router scores applied to the experts' inputs, dense experts call, shared expert, tuple
return). :mod:`comet.integrations.coverage` builds one of *every* MoE family the
installed transformers has.
"""

from __future__ import annotations

import copy

import torch

from comet.integrations.patch import patch_model

# initializer_range well above the usual 0.02 so the experts move the logits visibly.
_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: family -> (transformers config class, causal-LM class, config overrides)
TINY_MODELS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                         n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                      n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                      n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, head_dim=16)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                    num_experts_per_tok=1, head_dim=16, interleave_moe_layer_step=1)),
}

#: MoE layers of each tiny model where not every layer is one (first_k_dense_replace=1).
MOE_LAYERS = {"deepseek_v3": 1, "glm4_moe": 1}


def available_families(convertible: bool = True) -> list[str]:
    """The families of :data:`TINY_MODELS` the installed transformers provides -- with
    ``convertible``, only those whose blocks comet converts there (with transformers 4.x,
    Phi-3.5-MoE and GLM-4.5 have per-expert ``ModuleList`` experts that only the five
    original classes are converted from)."""
    import transformers
    from comet.integrations.patch import find_moe_blocks, refusal
    names = [name for name, (cfg, lm, _) in TINY_MODELS.items()
             if hasattr(transformers, cfg) and hasattr(transformers, lm)]
    if convertible:
        names = [n for n in names
                 if all(refusal(b) is None for _, b in find_moe_blocks(build_tiny_model(n)))]
    return names


def build_tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                     device: str | torch.device = "cpu") -> torch.nn.Module:
    """A seeded random-initialised causal LM of ``family`` (same weights for the same seed
    on every process), in eval mode.

    Score-correction biases (``e_score_correction_bias``, zero at init) get small random
    values so that the biased group selection is exercised.
    """
    import transformers
    cfg_name, lm_name, overrides = TINY_MODELS[family]
    config = getattr(transformers, cfg_name)(**{**_COMMON, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, lm_name)(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=generator))
    return model.to(device=device, dtype=dtype).eval()


def patched_copy(model: torch.nn.Module, group=None, **kwargs) -> torch.nn.Module:
    """A deep copy of ``model`` with its MoE blocks replaced by comet's."""
    return patch_model(copy.deepcopy(model), group, **kwargs)
