"""Every MoE family of the installed transformers: converted with matching output, or
refused with a reason that names what comet does not compute yet.

How the families are found -- no list of them is kept anywhere:
:mod:`comet.integrations.coverage` reads the source of every model package under
``transformers/models`` and takes those whose modeling code defines a class named
``*Experts*``, ``*MoE*`` or ``*Moe*``. For each it builds a tiny random-initialised fp32
CPU model from the package's own configuration class (a generic shrink: width 64, two
layers, 8 experts, top-2; per-family config overrides only where a config needs more),
finds the MoE blocks by structure (:func:`comet.integrations.find_moe_blocks`), and either
patches the model -- whose output must then match the original's within a relative 1e-4
-- or records why comet refuses (:func:`comet.integrations.refusal`). A family added to
transformers is picked up by itself, and fails here until it converts or is refused with a
reason.

docs/models.md shows the table these rows make (``python -m comet.integrations.coverage``);
:func:`test_docs_table_is_current` keeps the two from drifting.
"""

from __future__ import annotations

import pathlib
import re

import pytest

transformers = pytest.importorskip("transformers")

from comet.integrations import (  # noqa: E402
    EXPERTS_BACKEND_REGISTERED, count_patched, coverage, find_moe_blocks, from_module,
    patch_model)

if not EXPERTS_BACKEND_REGISTERED:
    pytest.skip("the coverage of every family is for transformers 5.x (fused registry "
                "experts); with 4.x only the five FAMILIES classes convert, checked in "
                "tests/test_integrations.py", allow_module_level=True)

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "models.md"
FAMILIES = coverage.discover_families()

#: What a refusal says: the unsupported variant, or what the experts module is instead.
REASON = re.compile(r"not supported yet|is not SiLU or GELU-tanh|neither dispatched"
                    r"|has no `experts` module|are not gated MLPs")


@pytest.fixture(scope="module")
def rows():
    return {r.family: r for r in coverage.coverage_rows()}


def test_discovery_finds_moe_families_and_only_those():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"} <= set(FAMILIES)
    assert not {"llama", "mistral", "qwen2", "bert"} & set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_converted_or_refused_with_a_reason(family, rows):
    row = rows[family]
    if row.status == "not checked" and row.reason.startswith(coverage.NOT_BUILT):
        # transformers' own config validation rejected the generic shrink: nothing about
        # comet is known yet (an OVERRIDES entry makes the family checkable).
        pytest.skip(f"{family}: not checked: {row.reason}")
    assert row.status in ("converted", "refused"), f"{family}: {row.status}: {row.reason}"
    if row.status == "converted":
        assert row.rel_diff <= coverage.RTOL, row
    else:
        assert REASON.search(row.reason), row.reason


def test_refusals_are_typed_errors_and_replace_nothing(rows):
    """For every refused family: patch_model raises TypeError naming the block class and
    the reason, before replacing anything; from_module raises TypeError (not an MoE block
    comet recognises) or NotImplementedError (an expert variant comet does not compute)."""
    refused = [f for f, r in rows.items() if r.status == "refused"]
    assert refused
    for family in refused:
        model = coverage.build_tiny_model(family)
        with pytest.raises(TypeError, match="is not supported") as info:
            patch_model(model)
        assert REASON.search(str(info.value)), family
        assert count_patched(model) == 0, family
        _, block = find_moe_blocks(model)[0]
        with pytest.raises((TypeError, NotImplementedError)) as info:
            from_module(block)
        assert REASON.search(str(info.value)), (family, str(info.value))


@pytest.mark.parametrize("family, expected", [
    # The five families comet started with, and families issue 38 names.
    ("mixtral", None), ("qwen2_moe", None), ("qwen3_moe", None), ("olmoe", None),
    ("deepseek_v3", None), ("phimoe", None), ("glm4_moe", None), ("qwen3_next", None),
    ("qwen3_5_moe", None), ("llama4", None), ("deepseek_v2", None), ("ernie4_5_moe", None),
    ("dots1", None),
    # Expert variants: GPT-OSS clamped SwiGLU with biases (alternating gate/up columns in
    # gpt_oss), clamped SiLU, GELU-tanh.
    ("gpt_oss", None), ("openai_privacy_filter", None), ("minimax_m3_vl", None),
    ("deepseek_v4", None), ("glm5_next", None), ("hy_v4", None), ("hy_v4_vl", None),
    ("gemma4", None), ("diffusion_gemma", None),
    # Stacked 2-D experts ([E*F, H] gate/up/down tensors).
    ("dbrx", None),
    # Identity ('zero-computation') experts: since transformers 5.25 the block adds them
    # itself and hands its experts only real ids (refused under 5.24, when the experts
    # module computed them).
    ("longcat_flash", None),
    # Variants comet does not compute.
    ("inkling2", r"soft-capped SwiGLU"), ("muse_spark", r"a norm after each expert"),
    ("nemotron_h", r"ungated experts"),
])
def test_named_families(family, expected, rows):
    """A named family that converts keeps converting; one comet refuses is refused for
    the named reason -- or converts, on a newer transformers whose family changed so that
    comet computes it (the docs-table check then asks for the table to be regenerated)."""
    if family not in rows:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    row = rows[family]
    if expected is None or row.status == "converted":
        assert row.status == "converted", row
    else:
        assert row.status == "refused" and re.search(expected, row.reason), row


def test_docs_table_is_current():
    """docs/models.md shows exactly the table the code produces, for the transformers
    version it names (another installed version is a skip, not a failure: the rows above
    still check that version family by family)."""
    text = DOCS.read_text()
    assert coverage.BEGIN in text and coverage.END in text
    documented = re.search(r"Generated with transformers (\S+?) by", text)
    assert documented, "docs/models.md does not say which transformers its table is for"
    if documented.group(1) != transformers.__version__:
        pytest.skip(f"docs/models.md's table is for transformers {documented.group(1)}, "
                    f"{transformers.__version__} is installed")
    documented_rows = set(coverage.table_in(str(DOCS)).splitlines())
    changed = [r.markdown() for r in coverage.coverage_rows()
               if r.markdown() not in documented_rows]
    assert not changed and coverage.table_in(str(DOCS)) == coverage.markdown_table(), (
        f"docs/models.md's table is out of date for transformers {transformers.__version__} "
        f"({len(changed)} rows changed, e.g. {changed[:3]}): regenerate it with "
        "python -m comet.integrations.coverage and paste it between the coverage markers")
    assert coverage.main(["--check", str(DOCS)]) == 0
