"""decompose(): the symbolic answers, and a numeric cross-check against real torch consumers.

The numeric check does not use the access model at all: it perturbs one slice of the
shared tensor at a time, runs a plain torch implementation of the consumer and counts how
many slices along a dim each output element depends on. A dim is independent when that
count never exceeds the number of times the consumer reads the shared tensor.
"""

from __future__ import annotations

import pytest
import torch

from comet.scheduler.shared_tensor import (
    Affine, Op, Pipeline, RankOffset, access, all_gather, all_to_all_dispatch, analyze,
    decompose, elementwise, gemm, index_add, indirect, moe_layer0, moe_layer1,
    reduce_scatter, silu_mul, topk_reduce, transpose,
)


# --------------------------------------------------------------------------- required results
def test_layer0_splits_token_rows():
    p = moe_layer0()
    assert p.shared == "S" and p.producer.out.dims == ("m", "h")
    assert decompose(*p) == ("m",)


def test_layer1_splits_columns():
    p = moe_layer1()
    assert p.producer.out.dims == ("m", "n")
    assert p.decompose() == ("n",)


def test_all_gather_then_gemm_splits_rows():
    assert decompose(all_gather("X", "G"), gemm("G", "W", "C"), "G") == ("m",)


def test_gemm_then_reduce_scatter_splits_both():
    # The sum runs over ranks (the rank selector), not over a dim of C.
    assert decompose(gemm("A", "B", "C"), reduce_scatter("C", "Y"), "C") == ("m", "n")


# --------------------------------------------------------------------------- edge cases
def test_gemm_consumer_reducing_over_columns_gives_rows_only():
    assert decompose(gemm("A", "B", "C"), gemm("C", "W", "D"), "C") == ("m",)


def test_shared_as_right_operand_gives_columns_only():
    assert decompose(gemm("A", "B", "C"), gemm("P", "C", "D"), "C") == ("n",)


def test_transpose_consumer_keeps_both_dims_under_producer_names():
    assert decompose(gemm("A", "B", "C"), transpose("C", "CT"), "C") == ("m", "n")


def test_silu_mul_reads_two_columns_per_output_but_stays_independent():
    verdicts = analyze(gemm("X", "W13", "GU", grouped=True), silu_mul("GU"), "GU")
    assert [v.independent for v in verdicts] == [True, True]
    assert "group" in verdicts[1].reason


def test_plain_topk_reduce_splits_columns_only():
    verdicts = analyze(gemm("X", "W", "S"), topk_reduce("S"), "S")
    assert [v.independent for v in verdicts] == [False, True]
    assert "j" in verdicts[0].reason


def test_dropping_the_reduction_makes_rows_independent():
    # Same row indirection as the top-k reduce, but every (token, choice) gets its own
    # output: the answer must change, which shows it is derived from the access.
    gather = Op("topk_gather", out=access("Y", "t", "j", "n"),
                ins=(access("S", indirect("row", "t", "j", injective=True), "n"),))
    assert decompose(gemm("X", "W", "S"), gather, "S") == ("m", "n")


def test_many_to_one_gather_without_reduction_is_still_independent():
    # Several tokens may read one row; each output still needs only that row.
    gather = Op("gather", out=access("Y", "t", "n"),
                ins=(access("S", indirect("src_row", "t"), "n"),))
    assert decompose(gemm("X", "W", "S"), gather, "S") == ("m", "n")


def test_producer_scatter_add_blocks_its_rows():
    verdicts = analyze(index_add("X", "Y"), elementwise("Y", "Z"), "Y")
    assert [v.independent for v in verdicts] == [False, True]
    assert "producer" in verdicts[0].reason and "t" in verdicts[0].reason


def test_producer_colliding_scatter_blocks_its_rows():
    bucket = Op("bucket_copy", out=access("S", indirect("bucket", "t"), "n"),
                ins=(access("X", "t", "n"),))
    v = analyze(bucket, elementwise("S", "Z"), "S")
    assert [x.independent for x in v] == [False, True]
    assert "collide" in v[0].reason


def test_dispatch_alone_is_fully_decomposable():
    # A copy consumer exposes the producer side only: the dispatch writes each row once.
    assert decompose(all_to_all_dispatch("X", "S"), elementwise("S", "Z"), "S") == ("m", "h")


# --------------------------------------------------------------------------- model checks
def test_undeclared_reduction_is_refused():
    with pytest.raises(ValueError, match="not declared reduced"):
        Op("bad_gemm", out=access("C", "m", "n"),
           ins=(access("A", "m", "k"), access("B", "k", "n")))


def test_unknown_reduced_variable_is_refused():
    with pytest.raises(ValueError, match="not iteration"):
        Op("bad", out=access("C", "m"), ins=(access("A", "m"),), reduced={"z"})


def test_mismatched_pipelines_are_refused():
    with pytest.raises(ValueError, match="writes C, not S"):
        decompose(gemm("A", "B", "C"), elementwise("S", "Z"), "S")
    with pytest.raises(ValueError, match="does not read"):
        decompose(gemm("A", "B", "C"), elementwise("Q", "Z"), "C")
    with pytest.raises(ValueError, match="dims"):
        decompose(gemm("A", "B", "C"), Op("sum3", out=access("Z", "i"),
                                        ins=(access("C", "i", "j", "l"),),
                                        reduced={"j", "l"}), "C")


def test_index_expressions_render_and_report_vars():
    assert str(Affine("f", offset="F")) == "f+F" and Affine("m", 0).injective is False
    assert RankOffset("r", "m", "M").vars == ("r", "m") and str(RankOffset("r", "m", "M")) == "r*M+m"
    c = moe_layer1().consumer
    assert c.reduced == {"j"} and "src" in c.parallel
    assert "sum_{j}" in str(c) and "slot[src,t,j]" in str(c)


# --------------------------------------------------------------------------- numeric cross-check
def _footprint_bound(consume, s: torch.Tensor, axis: int) -> int:
    """Most slices along ``axis`` that one output element of ``consume(s)`` depends on."""
    base = consume(s)
    counts = torch.zeros(base.shape, dtype=torch.int64)
    for i in range(s.shape[axis]):
        s2 = s.clone()
        s2.select(axis, i).add_(1.0)
        counts += (consume(s2) != base).long()
    return int(counts.max())


def _numeric_case(name: str):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5

    if name == "layer0":       # grouped GEMM over received rows sorted by expert
        expert = torch.tensor([0, 0, 1, 1, 1, 2])
        w = rnd(3, 5, 4)
        return moe_layer0(), rnd(6, 5), 0, lambda s: torch.stack(
            [s[r] @ w[expert[r]] for r in range(s.shape[0])])
    if name == "layer1":       # top-k reduce + combine over W=2 ranks' expert outputs
        world, tokens, k = 2, 3, 2
        dest = torch.randint(0, world, (world, tokens, k), generator=g)
        slot = torch.zeros_like(dest)
        fill = [0] * world
        for src in range(world):
            for t in range(tokens):
                for j in range(k):
                    slot[src, t, j] = fill[dest[src, t, j]]
                    fill[dest[src, t, j]] += 1
        wts = rnd(world, tokens, k)

        def combine(s):
            return torch.stack([torch.stack([
                sum(wts[src, t, j] * s[dest[src, t, j], slot[src, t, j]] for j in range(k))
                for t in range(tokens)]) for src in range(world)])
        # Capacity: every copy may land on one rank; unused rows stay untouched.
        return moe_layer1(), rnd(world, world * tokens * k, 4), 1, combine
    if name == "all_gather_gemm":
        w = rnd(5, 3)
        return Pipeline(all_gather("X", "G"), gemm("G", "W", "C"), "G"), rnd(6, 5), 0, \
            lambda s: s @ w
    if name == "gemm_reduce_scatter":   # C lives on W=2 ranks: [src, W*M, N]
        world, m = 2, 3
        return Pipeline(gemm("A", "B", "C"), reduce_scatter("C", "Y"), "C"), \
            rnd(world, world * m, 4), 1, \
            lambda s: torch.stack([s[:, r * m:(r + 1) * m].sum(0) for r in range(world)])
    if name == "gemm_gemm":
        w = rnd(4, 3)
        return Pipeline(gemm("A", "B", "C"), gemm("C", "W", "D"), "C"), rnd(5, 4), 0, \
            lambda s: s @ w
    if name == "gemm_gemm_rhs":
        a = rnd(3, 5)
        return Pipeline(gemm("A", "B", "C"), gemm("P", "C", "D"), "C"), rnd(5, 4), 0, \
            lambda s: a @ s
    if name == "transpose":
        return Pipeline(gemm("A", "B", "C"), transpose("C", "CT"), "C"), rnd(3, 4), 0, \
            lambda s: s.t().contiguous()
    if name == "silu_mul":
        f = 3
        return Pipeline(gemm("X", "W13", "GU", grouped=True), silu_mul("GU"), "GU"), \
            rnd(4, 2 * f), 0, \
            lambda s: torch.nn.functional.silu(s[:, :f]) * s[:, f:]
    if name == "topk_reduce":
        tokens, k = 4, 3
        row = torch.randperm(tokens * k, generator=g).view(tokens, k)
        wts = rnd(tokens, k)
        return Pipeline(gemm("X", "W", "S"), topk_reduce("S"), "S"), rnd(tokens * k, 4), 0, \
            lambda s: (s[row] * wts.unsqueeze(-1)).sum(1)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["layer0", "layer1", "all_gather_gemm", "gemm_reduce_scatter",
                                  "gemm_gemm", "gemm_gemm_rhs", "transpose", "silu_mul",
                                  "topk_reduce"])
def test_decompose_matches_measured_dependencies(name):
    pipeline, s, first_axis, consume = _numeric_case(name)
    reads = len(pipeline.consumer.reads(pipeline.shared))
    measured = tuple(
        dim for i, dim in enumerate(pipeline.producer.out.dims)
        if _footprint_bound(consume, s, first_axis + i) <= reads)
    assert decompose(*pipeline) == measured
    # The check is not vacuous: every case has a dim of extent > reads.
    assert all(s.shape[first_axis + i] > reads for i in range(len(pipeline.producer.out.dims)))


@pytest.mark.parametrize("convention", ["sequence", "replicated"])
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4)])
def test_tensor_parallel_and_hybrid_layouts_split_layer0_rows_and_layer1_columns(
        tp, ep, convention):
    """The analyzer per (tp, ep) layout: layer0's shared tensor (written by the dispatch
    and/or the TP all-gather) splits along rows, layer1's (read by the combine and the
    TP reduce-scatter or all-reduce) along columns -- what the kernels decompose."""
    from comet.mesh import MeshLayout
    from comet.runtime.forward import kernel_decomposition
    from comet.scheduler.shared_tensor import layer_pipelines, layout_decomposition
    mesh = MeshLayout(tp=tp, ep=ep)
    found = layout_decomposition(mesh, convention)
    pipes = layer_pipelines(mesh, convention)
    gathers = tp > 1 and convention == "sequence"
    assert len(pipes["layer0"]) == (ep > 1) + gathers
    assert found["layer0"] == (("m",) if pipes["layer0"] else ("m", "n"))
    assert found["layer1"] == ("n",)
    assert kernel_decomposition(mesh, convention) == found


def test_a_layout_the_kernels_cannot_decompose_is_refused(monkeypatch):
    """Were layer1's reader to sum over columns (a GEMM consumer of the shared tensor as
    left operand), the analysis would allow rows only and the kernels' column splits would
    be unsound: refused, naming the layer."""
    from comet.mesh import MeshLayout
    from comet.runtime.forward import kernel_decomposition
    from comet.scheduler import shared_tensor as st
    original = st.layer_pipelines

    def column_reducing(mesh, convention="sequence"):
        pipes = original(mesh, convention)
        pipes["layer1"] = [st.Pipeline(st.gemm("Hact", "W2", "S", grouped=True),
                                       st.gemm("S", "W", "Z"), "S")]
        return pipes
    monkeypatch.setattr(st, "layer_pipelines", column_reducing)
    with pytest.raises(NotImplementedError, match="layer1"):
        kernel_decomposition(MeshLayout(tp=1, ep=2))
