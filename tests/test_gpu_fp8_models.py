"""FP8 transformers models on one GPU (issue 68; marker gpu): DeepSeek-V3-like and
Qwen3-MoE-like configs in FineGrainedFP8 (tests/fp8_models.py), random weights, two
decoder layers at the real MoE widths, patched with comet (its fused FP8 layer) against
the same FP8 model unpatched and against the bf16 model it was quantized from.

transformers runs FP8 only through kernels downloaded from the hub, so the unpatched FP8
model runs its W8A8 recipe in torch (``emulate_fp8``; it rounds h to bf16 before
quantizing it, comet quantizes the fp32 h: the bounds of tests/test_integrations_fp8.py).
Against the bf16 model, the patched FP8 model is no farther than the unpatched FP8 model
is (calc_diff x 1.1): comet adds nothing to the recipe's own cost.

Greedy generation: random weights give near-flat logits, so two correct FP8 runs may part
at a near tie. The check is on the unpatched model's greedy tokens: the patched model
picks the same token at every step where the unpatched model's top-2 margin exceeds twice
the two models' largest logit difference there (where it cannot be a tie).
"""

from __future__ import annotations

import pytest
import torch

from comet.integrations import count_patched, patch_model
from comet.integrations.local_experts import Fp8TransformersExperts
from comet.quant import calc_diff
from fp8_models import bf16_model, emulate_fp8, fp8_model

pytestmark = pytest.mark.gpu

#: Two layers at the real MoE widths; the attention stays tiny (it is not comet's).
REAL = {
    "deepseek_v3": dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=64,
                        num_experts_per_tok=8, n_group=8, topk_group=4,
                        first_k_dense_replace=1, intermediate_size=2048),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, intermediate_size=2048),
}
BATCH, SEQ, NEW = 4, 64, 16
DEVICE = "cuda"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture(scope="module", params=list(REAL))
def models(request):
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    family = request.param
    fp8 = fp8_model(family, device=DEVICE, **REAL[family])
    patched = fp8_model(family, device=DEVICE, **REAL[family])
    patch_model(patched, max_tokens=BATCH * SEQ)
    bf16 = bf16_model(family, device=DEVICE, **REAL[family])
    yield family, fp8, patched, bf16
    del fp8, patched, bf16
    torch.cuda.empty_cache()


def _prompt(seq: int = SEQ, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 256, (batch, seq), generator=g).to(DEVICE)


def test_the_patched_fp8_model_runs_comet_in_fp8(models):
    family, _, patched, _ = models
    assert count_patched(patched) >= 1
    experts = [m for m in patched.modules() if isinstance(m, Fp8TransformersExperts)]
    assert experts and all(e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert all(e.gate_up_proj.device.type == DEVICE for e in experts)


def test_logits_match_the_unpatched_fp8_model_and_the_bf16_one(models):
    family, fp8, patched, bf16 = models
    ids = _prompt()
    with emulate_fp8(), torch.no_grad():
        want = fp8(ids).logits.float()
        got = patched(ids).logits.float()
        ref = bf16(ids).logits.float()
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 6e-2, _rel(got, want)
    assert calc_diff(got, want) < 2e-3
    assert calc_diff(got, ref) <= 1.1 * calc_diff(want, ref), (calc_diff(got, ref),
                                                              calc_diff(want, ref))


def test_greedy_generation_follows_the_unpatched_fp8_model(models):
    family, fp8, patched, _ = models
    prompt = _prompt(seq=32, batch=2)
    with emulate_fp8(), torch.no_grad():
        tokens = fp8.generate(prompt, max_new_tokens=NEW, do_sample=False,
                              min_new_tokens=NEW, pad_token_id=0)
        # Both models score the unpatched model's sequence (teacher forcing).
        want = fp8(tokens).logits[:, prompt.shape[1] - 1:-1].float()
        got = patched(tokens).logits[:, prompt.shape[1] - 1:-1].float()
        patched_tokens = patched.generate(prompt, max_new_tokens=NEW, do_sample=False,
                                          min_new_tokens=NEW, pad_token_id=0)
    top2 = want.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    gap = (got - want).abs().amax(dim=-1)
    decisive = margin > 2 * gap
    agree = got.argmax(-1) == want.argmax(-1)
    assert decisive.any(), "no step with a clear winner: the check would test nothing"
    assert agree[decisive].all(), (margin[decisive & ~agree], gap[decisive & ~agree])
    # The free-running generations agree up to the first step without a clear winner.
    new = prompt.shape[1]
    for row in range(prompt.shape[0]):
        first_tie = int((~decisive[row]).nonzero()[0]) if (~decisive[row]).any() else NEW
        assert torch.equal(patched_tokens[row, new:new + first_tie],
                           tokens[row, new:new + first_tie])
