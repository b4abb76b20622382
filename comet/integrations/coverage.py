"""Which MoE families of the installed transformers comet converts, and why not the others.

Run ``python -m comet.integrations.coverage`` for the markdown table that docs/models.md
shows (``--check docs/models.md`` exits 1 when the file's table differs).

How families are found (no list of them is kept here): every model package under
``transformers/models`` whose modeling source defines a class named ``*Experts*``,
``*MoE*`` or ``*Moe*`` is a candidate. For each, a tiny random-initialised model (fp32,
CPU, no download) is built from the package's own configuration class, preferring a
text-only causal LM (else the text model of a multimodal family): the config's sizes are
shrunk by a generic rule (:data:`TINY`: width 64, two layers, 8 experts, top-2, ...), with
per-family :data:`OVERRIDES` where a config needs more (hybrid layer patterns, sub-configs,
validators). In the model, :func:`comet.integrations.find_moe_blocks` finds the MoE blocks
by structure; each is either converted by :func:`comet.patch_model` -- and then the patched
model's output must match the original's (relative difference <= 1e-4) -- or refused with
the reason :func:`comet.integrations.refusal` gives.

A family added to transformers shows up here by itself; if its tiny model cannot be built
with the generic rule, its row says "not checked" with transformers' reason (a skip in
tests/test_model_coverage.py, not a failure of comet) until an override is added.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from comet.integrations.blocks import CometMoEBlock
from comet.integrations.patch import find_moe_blocks, patch_model, refusal

#: Relative difference (max |patched - original| / max |original|) allowed in fp32.
RTOL = 1e-4

_CANDIDATE = re.compile(r"^class \w*(?:Experts|MoE|Moe)\w*\(", re.M)

#: The generic shrink: applied to every field the family's config has.
TINY: dict = dict(
    vocab_size=256, hidden_size=64, d_model=64, intermediate_size=64, ffn_dim=64, d_ff=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, num_hidden_layers=2, num_layers=2,
    num_decoder_layers=2, encoder_layers=2, decoder_layers=2, num_attention_heads=4,
    num_key_value_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, head_dim=16,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, top_k=2, moe_k=2,
    max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0,
    n_group=4, num_expert_group=4, topk_group=2, n_shared_experts=1, num_dense_layers=1,
    first_k_dense_replace=1, decoder_sparse_step=1, mlp_only_layers=[], sliding_window=64,
    top_k_experts=2,
    # A clamp bound the tiny models' gate/up values reach (the defaults, 7 or 10, they do
    # not), so that a converted clamped SwiGLU is checked with its clamps active.
    swiglu_limit=1.0,
)

#: Per-family additions to :data:`TINY` (configs the generic rule cannot shrink alone).
OVERRIDES: dict[str, dict] = {
    "dbrx": dict(n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config=dict(kv_n_heads=4, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                                 hidden_size=64)),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "doge": dict(is_moe=True, num_experts=16),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[32, 32],
                            rope_parameters=dict(rope_theta=500000.0, rope_type="default",
                                                 mrope_section=[3, 3, 2])),
    "gemma4": dict(enable_moe_block=True, vocab_size_per_layer_input=256,
                   hidden_size_per_layer_input=16, per_layer_config={}),
    "glm4v_moe": dict(rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5,
                                           rope_type="default", mrope_section=[2, 1, 1])),
    "glm5_next": dict(qk_rope_head_dim=0, head_dim=0, index_head_dim=16, index_n_heads=2,
                      linear_head_dim=16, linear_num_heads=4),
    "granitemoehybrid": dict(layer_types=["full_attention", "full_attention"]),
    "hy_v4_vl": dict(rope_parameters=dict(rope_theta=10000.0, rope_type="default",
                                          mrope_section=[4, 2, 2]),
                     index_head_dim=16, index_n_heads=2),
    "jamba": dict(attn_layer_period=1, attn_layer_offset=0, expert_layer_period=1,
                  expert_layer_offset=0),
    "kolibri1_1": dict(num_key_value_heads=1, index_num_heads=2),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"]),
    "longcat_flash": dict(expert_ffn_hidden_size=32, zero_expert_num=4),
    "mistral4": dict(head_dim=32),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=8, indexer_compress_ratio=2),
    "vitpose_backbone": dict(num_experts=2, part_features=16),
    "zaya": dict(num_experts_per_tok=1),
}

_INPUT_TOKENS = (2, 8)

#: How a "not checked" row whose tiny model transformers would not build begins: the
#: family's config rejected the generic shrink, so nothing about comet is known yet.
NOT_BUILT = "tiny model not built"


@dataclass(frozen=True)
class Row:
    """One family's line of the coverage table.

    Attributes:
        family: the transformers model package (``mixtral``).
        blocks: MoE block classes found (with their experts class).
        status: ``"converted"``, ``"refused"`` or ``"not checked"``.
        reason: why refused or not checked ('' when converted).
        rel_diff: converted: max |patched - original| / max |original| of the output.
        model: the tiny model class that was built.
    """

    family: str
    blocks: str
    status: str
    reason: str = ""
    rel_diff: float | None = None
    model: str = ""

    def markdown(self) -> str:
        result = "converted" if self.status == "converted" else f"{self.status}: {self.reason}"
        return f"| {self.family} | {self.blocks} | {result} |"


# --------------------------------------------------------------------------- discovery
def _models_dir() -> str:
    import transformers.models
    return os.path.dirname(transformers.models.__file__)


def discover_families() -> list[str]:
    """Model packages of the installed transformers whose modeling code defines a class
    named ``*Experts*``, ``*MoE*`` or ``*Moe*`` (read from the source, nothing imported)."""
    root, found = _models_dir(), []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        for file in os.listdir(folder):
            if file.startswith("modeling_") and file.endswith(".py"):
                with open(os.path.join(folder, file), encoding="utf-8") as fh:
                    if _CANDIDATE.search(fh.read()):
                        found.append(name)
                        break
    return found


def _package_classes(family: str, prefix: str, base: type) -> list[type]:
    """Subclasses of ``base`` defined in the family package's ``{prefix}*.py`` modules."""
    package = f"transformers.models.{family}"
    folder = os.path.join(_models_dir(), family)
    out = []
    for file in sorted(os.listdir(folder)):
        if file.startswith(prefix) and file.endswith(".py"):
            module = importlib.import_module(f"{package}.{file[:-3]}")
            out += [c for c in vars(module).values() if inspect.isclass(c)
                    and issubclass(c, base) and c.__module__ == module.__name__]
    return out


def model_class(family: str) -> type:
    """The model class a family's tiny model is built from: a text-only causal LM if the
    package has one, else its text model, else its first model class."""
    from transformers import PretrainedConfig, PreTrainedModel
    configs = _package_classes(family, "configuration_", PretrainedConfig)
    models = [m for m in _package_classes(family, "modeling_", PreTrainedModel)
              if getattr(m, "config_class", None) in configs]
    if not models:
        raise LookupError(f"no model class with a {family} config")

    def preference(m: type):
        name = m.__name__
        return (not getattr(m.config_class, "sub_configs", None), name.endswith("ForCausalLM"),
                "Text" in name, name.endswith("Model") and "PreTrained" not in name, -len(name))
    return max(models, key=preference)


# --------------------------------------------------------------------------- tiny models
def _layer_lists(defaults: dict, layers: int) -> dict:
    """Per-layer pattern lists of the default config, cut to ``layers`` entries: every
    layer an attention layer (a full-attention type where the pattern has one) and an MoE
    layer ("sparse")."""
    out = {}
    for key in ("layer_types", "mlp_layer_types"):
        values = defaults.get(key)
        if not isinstance(values, list) or not values:
            continue
        if key == "mlp_layer_types":
            pick = "sparse" if "sparse" in values else values[-1]
        else:
            full = [v for v in values if isinstance(v, str) and "full" in v]
            attention = [v for v in values if isinstance(v, str) and "attention" in v
                         and "linear" not in v]
            pick = (full or attention or values)[0]
        out[key] = [pick] * layers
    return out


def tiny_config(family: str, cls: type | None = None):
    """The family's config, shrunk by :data:`TINY` and :data:`OVERRIDES`."""
    cls = cls or model_class(family)
    config_cls = cls.config_class
    defaults = config_cls().to_dict()
    kwargs = {k: v for k, v in TINY.items() if k in defaults}
    kwargs.update(_layer_lists(defaults, kwargs.get("num_hidden_layers", 2)))
    kwargs.update(OVERRIDES.get(family, {}))
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    return config


def build_tiny_model(family: str, seed: int = 0) -> nn.Module:
    """A seeded random-initialised fp32 CPU model of ``family`` (see the module doc), in
    eval mode. Tensors that start at zero get small random values, so that they matter:
    buffers that only steer routing (score-correction biases) and the experts' biases
    (GPT-OSS initialises ``gate_up_proj_bias`` / ``down_proj_bias`` to zero)."""
    cls = model_class(family)
    config = tiny_config(family, cls)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("correction_bias") and buf.is_floating_point():
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("bias") and not param.any():
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.float().eval()


def model_output(model: nn.Module, seed: int = 0) -> torch.Tensor:
    """The model's main output (logits, else last hidden state) on fixed tokens, fp32."""
    ids = torch.randint(3, 256, _INPUT_TOKENS, generator=torch.Generator().manual_seed(seed))
    kwargs = {}
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    with torch.no_grad():
        out = model(input_ids=ids, **kwargs)
    value = getattr(out, "logits", None)
    if value is None:
        value = getattr(out, "last_hidden_state", None)
    if value is None:
        value = out[0]
    return value.float()


# --------------------------------------------------------------------------- checking
def _short(message: str) -> str:
    """An exception message as a table cell: one line, no module paths or prefixes."""
    message = re.sub(r"transformers\.models\.\w+\.modeling_\w+\.", "", message)
    message = re.sub(r"^comet cannot run the experts of \w+: ", "", message)
    return " ".join(message.split()).replace("|", "\\|")


def _describe(blocks: list[tuple[str, nn.Module]]) -> str:
    names = []
    for _, block in blocks:
        experts = block._modules.get("experts")
        name = type(block).__name__ + (f" ({type(experts).__name__})" if experts is not None
                                       else "")
        if name not in names:
            names.append(name)
    return ", ".join(f"`{n}`" for n in names)


def check_family(family: str) -> Row:
    """Build the family's tiny model, patch it and report (never raises)."""
    try:
        model = build_tiny_model(family)
    except Exception as err:  # noqa: BLE001 - reported in the row
        return Row(family, "", "not checked",
                   _short(f"{NOT_BUILT}: {type(err).__name__}: {err}")[:200])
    blocks = find_moe_blocks(model)
    if not blocks:
        return Row(family, "", "not checked",
                   f"no MoE block found in the tiny {type(model).__name__}",
                   model=type(model).__name__)
    described = _describe(blocks)
    reasons = []
    for _, block in blocks:
        try:
            err = refusal(block)
        except Exception as bug:  # noqa: BLE001 - the checks themselves failed: reported
            return Row(family, described, "not checked",
                       _short(f"check failed: {type(bug).__name__}: {bug}")[:200],
                       model=type(model).__name__)
        if err is not None:
            why = _short(str(err))
            if why not in reasons:
                reasons.append(why)
    if reasons:
        return Row(family, described, "refused", " / ".join(reasons), model=type(model).__name__)
    try:
        want = model_output(model)
        patched = patch_model(copy.deepcopy(model))
        got = model_output(patched)
    except Exception as err:  # noqa: BLE001 - a converted family must run: reported
        return Row(family, described, "not checked",
                   _short(f"patched model failed: {type(err).__name__}: {err}")[:200],
                   model=type(model).__name__)
    converted = sum(isinstance(m, CometMoEBlock) for m in patched.modules())
    rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    if converted != len(blocks) or not rel <= RTOL:
        return Row(family, described, "not checked",
                   f"converted {converted} of {len(blocks)} blocks, relative difference "
                   f"{rel:.1e}", rel, type(model).__name__)
    return Row(family, described, "converted", rel_diff=rel, model=type(model).__name__)


@functools.lru_cache(maxsize=None)
def coverage_rows() -> tuple[Row, ...]:
    """:func:`check_family` of every discovered family (computed once per process)."""
    import transformers
    transformers.logging.set_verbosity_error()
    return tuple(check_family(f) for f in discover_families())


TABLE_HEADER = ("| family | MoE block (experts) | comet |\n"
                "| --- | --- | --- |")


def markdown_table(rows=None) -> str:
    """The docs table: one row per discovered family."""
    rows = coverage_rows() if rows is None else rows
    return "\n".join([TABLE_HEADER] + [r.markdown() for r in rows])


#: Markers around the generated table in docs/models.md.
BEGIN = "<!-- coverage table: python -m comet.integrations.coverage -->"
END = "<!-- end of coverage table -->"


def table_in(path: str) -> str:
    """The generated table as it stands in a markdown file (between :data:`BEGIN` and
    :data:`END`)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0:
        raise ValueError(f"{path} has no coverage table markers ({BEGIN!r} ... {END!r})")
    return text[start + len(BEGIN):end].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="comet's coverage of transformers MoE families")
    parser.add_argument("--check", metavar="MARKDOWN",
                        help="compare with the table in this file; exit 1 if it differs")
    parser.add_argument("--details", action="store_true",
                        help="also print each family's model class and output difference")
    args = parser.parse_args(argv)
    import transformers
    table = markdown_table()
    if args.details:
        for r in coverage_rows():
            diff = "" if r.rel_diff is None else f"{r.rel_diff:.1e}"
            print(f"{r.family:24s} {r.status:12s} {r.model:34s} {diff}", file=sys.stderr)
    if args.check:
        ok = table_in(args.check) == table
        print(f"{args.check}: table {'matches' if ok else 'DIFFERS from'} transformers "
              f"{transformers.__version__}")
        if not ok:
            print(table)
        return 0 if ok else 1
    print(f"comet coverage of transformers {transformers.__version__} MoE families\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
