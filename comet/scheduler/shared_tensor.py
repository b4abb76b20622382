"""Which dims of a shared tensor can be cut so the consumer starts on a piece early.

A *shared tensor* sits between a producer op and a consumer op (a communication and a
GEMM, in either order). The consumer can overlap the producer only if it can finish some
of its output from part of the shared tensor. This module derives *which* dims allow that
from a description of each op's index access, instead of hard-coding "layer0 splits rows,
layer1 splits columns".

The model, in one paragraph: an :class:`Op` iterates over named *iteration variables*;
each tensor it touches is read or written through an :class:`Access`, which gives, per
tensor dim, an index expression over those variables (and, for tensors spread over
ranks, which rank's copy is touched). Some variables are *reduced*: they do not index the
op's output, the op sums (or otherwise folds) over them. Three kinds of index expression
cover the MoE pipelines:

* :class:`Affine` -- ``scale * v + offset``; the identity is ``Affine("v")``.
* :class:`RankOffset` -- ``r * extent + v``: a rank's block inside a gathered tensor.
* :class:`Indirect` -- ``table[v1, v2, ...]``: a data-dependent gather or scatter
  through an index table (the routing plan), one-to-one or not.

:func:`decompose` then says, per dim of the shared tensor, whether pieces along it are
independent. See ``docs/shared_tensor.md`` for the worked MoE examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union

from comet.mesh import Convention, MeshLayout

__all__ = [
    "Affine", "RankOffset", "Indirect", "IndexExpr", "Access", "Op", "DimVerdict",
    "Pipeline", "access", "indirect", "analyze", "decompose",
    "gemm", "silu_mul", "transpose", "elementwise", "topk_reduce", "index_add",
    "all_to_all_dispatch", "all_gather", "reduce_scatter", "moe_layer0", "moe_layer1",
]


# --------------------------------------------------------------------------- index expressions
@dataclass(frozen=True)
class Affine:
    """``scale * var + offset``; ``offset`` may be a symbolic extent such as ``"F"``."""

    var: str
    scale: int = 1
    offset: int | str = 0

    @property
    def vars(self) -> tuple[str, ...]:
        return (self.var,)

    @property
    def injective(self) -> bool:
        return self.scale != 0

    def __str__(self) -> str:
        s = self.var if self.scale == 1 else f"{self.scale}*{self.var}"
        return s if self.offset == 0 else f"{s}+{self.offset}"


@dataclass(frozen=True)
class RankOffset:
    """``rank * extent + var`` with ``0 <= var < extent``: block ``rank`` of a tensor that
    concatenates one block per rank (all-gather output, reduce-scatter input)."""

    rank: str
    var: str
    extent: str

    @property
    def vars(self) -> tuple[str, ...]:
        return (self.rank, self.var)

    @property
    def injective(self) -> bool:
        # var stays below extent, so distinct (rank, var) pairs never land on one index.
        return True

    def __str__(self) -> str:
        return f"{self.rank}*{self.extent}+{self.var}"


@dataclass(frozen=True)
class Indirect:
    """``table[args...]``: an index read from a table built at run time (routing).

    ``injective`` states whether distinct argument tuples always give distinct indices
    (a slot assignment is; an expert id per row is not). It cannot be checked
    symbolically, so whoever builds the op asserts it.
    """

    table: str
    args: tuple[str, ...]
    injective: bool = False

    @property
    def vars(self) -> tuple[str, ...]:
        return self.args

    def __str__(self) -> str:
        return f"{self.table}[{','.join(self.args)}]"


IndexExpr = Union[Affine, RankOffset, Indirect]


def _expr(e: IndexExpr | str) -> IndexExpr:
    return Affine(e) if isinstance(e, str) else e


def indirect(table: str, *args: str, injective: bool = False) -> Indirect:
    """``table[args...]``; see :class:`Indirect`."""
    return Indirect(table, tuple(args), injective)


# --------------------------------------------------------------------------- accesses and ops
@dataclass(frozen=True)
class Access:
    """How an op touches one tensor.

    index: one expression per tensor dim, in dim order.
    dims:  names of the tensor's dims (default: the variable of a plain ``Affine`` index,
           else ``d<i>``). Only the producer's names are reported by :func:`decompose`;
           the two sides of a shared tensor are matched by position.
    rank:  which rank's copy is touched, for tensors that live on every rank (symmetric
           buffers); ``None`` means the executing rank's own copy.
    """

    tensor: str
    index: tuple[IndexExpr, ...]
    dims: tuple[str, ...] = ()
    rank: IndexExpr | None = None

    def __post_init__(self) -> None:
        index = tuple(_expr(e) for e in self.index)
        object.__setattr__(self, "index", index)
        if not self.dims:
            names = tuple(e.var if isinstance(e, Affine) else f"d{i}"
                          for i, e in enumerate(index))
            object.__setattr__(self, "dims", names)
        if len(self.dims) != len(index):
            raise ValueError(f"{self.tensor}: {len(self.dims)} dim names for "
                             f"{len(index)} index expressions")
        if self.rank is not None:
            object.__setattr__(self, "rank", _expr(self.rank))

    @property
    def vars(self) -> tuple[str, ...]:
        exprs = self.index + ((self.rank,) if self.rank is not None else ())
        return _ordered(v for e in exprs for v in e.vars)

    def __str__(self) -> str:
        where = "" if self.rank is None else f"@{self.rank}"
        return f"{self.tensor}{where}[{', '.join(map(str, self.index))}]"


def access(tensor: str, *index: IndexExpr | str, dims: tuple[str, ...] = (),
           rank: IndexExpr | str | None = None) -> Access:
    """Build an :class:`Access`; a plain string index means the identity on that variable."""
    return Access(tensor, tuple(index), tuple(dims), rank)


@dataclass(frozen=True)
class Op:
    """One operator: ``out`` is written from ``ins``, folding over ``reduced`` variables.

    Every iteration variable that is not reduced must appear in ``out`` (in an index or
    its rank), otherwise the op silently folds over it and the analysis would be wrong;
    the constructor refuses such an op.
    """

    name: str
    out: Access
    ins: tuple[Access, ...]
    reduced: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ins", tuple(self.ins))
        object.__setattr__(self, "reduced", frozenset(self.reduced))
        unknown = self.reduced - set(self.iter_vars)
        if unknown:
            raise ValueError(f"op {self.name}: reduced {sorted(unknown)} are not iteration "
                             f"variables of it ({', '.join(self.iter_vars)})")
        folded = set(self.iter_vars) - self.reduced - set(self.out.vars)
        if folded:
            raise ValueError(f"op {self.name}: {sorted(folded)} do not index the output "
                             f"{self.out} but are not declared reduced")

    @property
    def iter_vars(self) -> tuple[str, ...]:
        return _ordered(v for a in (self.out, *self.ins) for v in a.vars)

    @property
    def parallel(self) -> frozenset[str]:
        """Iteration variables that index the output (one output element per value)."""
        return frozenset(self.iter_vars) - self.reduced

    def reads(self, tensor: str) -> tuple[Access, ...]:
        return tuple(a for a in self.ins if a.tensor == tensor)

    def __str__(self) -> str:
        fold = f"sum_{{{','.join(sorted(self.reduced))}}} " if self.reduced else ""
        return f"{self.out} = {fold}{self.name}({', '.join(map(str, self.ins))})"


def _ordered(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --------------------------------------------------------------------------- the analysis
@dataclass(frozen=True)
class DimVerdict:
    """Whether the shared tensor may be cut along ``dim`` (position ``axis``), and why."""

    dim: str
    axis: int
    independent: bool
    reason: str


def _producer_side(op: Op, e: IndexExpr) -> str | None:
    """Why the producer cannot finish slices along this dim one at a time, or None."""
    if not e.vars:
        return f"producer {op.name} writes it at a fixed index"
    folded = [v for v in e.vars if v in op.reduced]
    if folded:
        # The write index moves with a variable the producer accumulates over, so any
        # slice may still receive contributions until the whole reduction has run.
        return (f"producer {op.name} accumulates into it through reduced "
                f"{', '.join(folded)} (index {e})")
    if not e.injective:
        return f"producer {op.name} writes it through non-one-to-one {e}: slices collide"
    return None


def _consumer_side(op: Op, e: IndexExpr) -> str | None:
    """Why one consumer output element needs more than one slice along this dim, or None."""
    if not e.vars:
        return f"consumer {op.name} reads it at a fixed index"
    folded = [v for v in e.vars if v in op.reduced]
    if folded:
        # Each output element sums over these variables, so it reads many indices along
        # this dim: no piece smaller than the whole dim completes an output element.
        return (f"consumer {op.name} reduces over {', '.join(folded)} (index {e}), so one "
                f"output element reads many slices")
    # Every variable in e is fixed by the output element, so it reads exactly one index.
    # Injectivity does not matter here: several outputs sharing one slice is harmless.
    return None


def analyze(producer: Op, consumer: Op, shared: str) -> tuple[DimVerdict, ...]:
    """Per dim of ``shared``: can it be cut there? See :func:`decompose` for the rule."""
    out = producer.out
    if out.tensor != shared:
        raise ValueError(f"producer {producer.name} writes {out.tensor}, not {shared}")
    reads = consumer.reads(shared)
    if not reads:
        raise ValueError(f"consumer {consumer.name} does not read {shared}")
    for r in reads:
        if len(r.index) != len(out.index):
            raise ValueError(f"{shared} has {len(out.index)} dims in {producer.name} but "
                             f"{len(r.index)} in {consumer.name}")
    verdicts = []
    for axis, dim in enumerate(out.dims):
        why = _producer_side(producer, out.index[axis])
        for r in reads:
            why = why or _consumer_side(consumer, r.index[axis])
        if why is None:
            read_at = _ordered(str(r.index[axis]) for r in reads)
            # Reads at different indices (gate column f and up column f+F) still leave
            # each output needing a fixed handful of slices; a piece must hold them all.
            extra = "" if len(read_at) == 1 else " (a piece must group these slices)"
            read_at = ", ".join(read_at)
            why = (f"{producer.name} writes slice {out.index[axis]} on its own and each "
                   f"{consumer.name} output reads it at {read_at}{extra}")
            verdicts.append(DimVerdict(dim, axis, True, why))
        else:
            verdicts.append(DimVerdict(dim, axis, False, why))
    return tuple(verdicts)


def decompose(producer: Op, consumer: Op, shared: str) -> tuple[str, ...]:
    """Dims of ``shared`` along which it can be split into independently consumed pieces.

    A dim qualifies when both hold:

    * producer: the write index along it uses only the producer's non-reduced variables,
      one-to-one, so a slice is final as soon as its own iterations ran;
    * consumer: every read of ``shared`` indexes it only with the consumer's non-reduced
      variables, so each output element needs a single index along it (per read) and can
      be computed as soon as that slice exists.

    Returns the producer's names of the qualifying dims, in dim order.
    """
    return tuple(v.dim for v in analyze(producer, consumer, shared) if v.independent)


class Pipeline(NamedTuple):
    """A producer, a consumer and the tensor between them; unpacks into :func:`decompose`."""

    producer: Op
    consumer: Op
    shared: str

    def decompose(self) -> tuple[str, ...]:
        return decompose(*self)

    def analyze(self) -> tuple[DimVerdict, ...]:
        return analyze(*self)


# --------------------------------------------------------------------------- op constructors
def gemm(a: str = "A", b: str = "B", out: str = "C", *, grouped: bool = False,
         name: str | None = None) -> Op:
    """``out[m, n] = sum_k a[m, k] b[k, n]``.

    ``grouped``: a GroupGEMM, ``b`` is ``[experts, k, n]`` and row ``m`` uses the weights
    of ``expert[m]`` (rows sorted by expert, as the routing plan lays them out).
    """
    w_index = (indirect("expert", "m"), "k", "n") if grouped else ("k", "n")
    w_dims = ("e", "k", "n") if grouped else ("k", "n")
    return Op(name or ("group_gemm" if grouped else "gemm"),
              out=access(out, "m", "n"),
              ins=(access(a, "m", "k"), access(b, *w_index, dims=w_dims)),
              reduced={"k"})


def silu_mul(x: str = "GU", out: str = "Hact", *, half: str = "F") -> Op:
    """``out[m, f] = silu(x[m, f]) * x[m, f + F]``: the gated activation on [gate | up]."""
    return Op("silu_mul", out=access(out, "m", "f"),
              ins=(access(x, "m", "f", dims=("m", "n")),
                   access(x, "m", Affine("f", offset=half), dims=("m", "n"))))


def transpose(x: str = "X", out: str = "XT") -> Op:
    """``out[n, m] = x[m, n]``."""
    return Op("transpose", out=access(out, "n", "m"), ins=(access(x, "m", "n"),))


def elementwise(x: str = "X", out: str = "Y", *, name: str = "elementwise") -> Op:
    """``out[m, n] = f(x[m, n])`` (scale, cast, bias, ...)."""
    return Op(name, out=access(out, "m", "n"), ins=(access(x, "m", "n"),))


def topk_reduce(s: str = "S", w: str = "topk_weights", out: str = "Y", *,
                combine: bool = False) -> Op:
    """``out[t, n] = sum_j w[t, j] * s[row[t, j], n]``: weighted sum of a token's k rows.

    ``combine``: the rows live on other ranks (on rank ``dest[t, j]`` at ``slot[src, t,
    j]``) and the result is written back on the token's home rank ``src``, as layer1 of
    the MoE does. ``row``/``slot`` are one-to-one -- every (token, choice) has its own row
    -- which does not help: ``j`` is summed over, so an output reads k rows.
    """
    if combine:
        row = indirect("slot", "src", "t", "j", injective=True)
        s_acc = access(s, row, "n", dims=("m", "n"), rank=indirect("dest", "t", "j"))
        return Op("topk_reduce_combine", out=access(out, "t", "n", rank="src"),
                  ins=(s_acc, access(w, "t", "j", rank="src")), reduced={"j"})
    row = indirect("row", "t", "j", injective=True)
    return Op("topk_reduce", out=access(out, "t", "n"),
              ins=(access(s, row, "n", dims=("m", "n")), access(w, "t", "j")),
              reduced={"j"})


def index_add(x: str = "X", out: str = "Y", *, table: str = "index") -> Op:
    """``out[index[t], n] += x[t, n]``: scatter-add (the unfused combine's ``index_add_``)."""
    return Op("index_add", out=access(out, indirect(table, "t"), "n", dims=("m", "n")),
              ins=(access(x, "t", "n"),), reduced={"t"})


def all_to_all_dispatch(x: str = "X", out: str = "S") -> Op:
    """Send copy ``j`` of token ``t`` of rank ``src`` to rank ``dest[t, j]``, row
    ``slot[src, t, j]``: ``out@dest[slot[src, t, j], h] = x@src[t, h]``.

    ``slot`` is one-to-one (each copy gets its own row on its destination); nothing is
    summed.
    """
    row = indirect("slot", "src", "t", "j", injective=True)
    return Op("all_to_all_dispatch",
              out=access(out, row, "h", dims=("m", "h"), rank=indirect("dest", "t", "j")),
              ins=(access(x, "t", "h", rank="src"),))


def all_gather(x: str = "X", out: str = "G", *, extent: str = "M") -> Op:
    """``out@dst[src * M + m, k] = x@src[m, k]`` for every pair of ranks."""
    return Op("all_gather",
              out=access(out, RankOffset("src", "m", extent), "k", dims=("m", "k"),
                         rank="dst"),
              ins=(access(x, "m", "k", rank="src"),))


def reduce_scatter(x: str = "C", out: str = "Y", *, extent: str = "M") -> Op:
    """``out@r[m, n] = sum_src x@src[r * M + m, n]``: the sum runs over ranks, which is not
    a dim of ``x``, so for ``x`` this is elementwise."""
    return Op("reduce_scatter", out=access(out, "m", "n", rank="r"),
              ins=(access(x, RankOffset("r", "m", extent), "n", dims=("m", "n"),
                          rank="src"),),
              reduced={"src"})


# --------------------------------------------------------------------------- the MoE pipelines
def moe_layer0() -> Pipeline:
    """Dispatch -> GroupGEMM with W13. Shared tensor ``S``: received rows ``[M*topk, H]``."""
    return Pipeline(all_to_all_dispatch("X", "S"), gemm("S", "W13", "GU", grouped=True), "S")


def moe_layer1() -> Pipeline:
    """GroupGEMM with W2 -> top-k weighted reduce + combine. Shared tensor ``S``: expert
    outputs ``[M*topk, N]``."""
    return Pipeline(gemm("Hact", "W2", "S", grouped=True),
                    topk_reduce("S", "topk_weights", "Y", combine=True), "S")


def all_reduce(x: str = "C", out: str = "Y") -> Op:
    """``out@r[m, n] = sum_src x@src[m, n]`` on every rank: the replicated convention's
    sum of a TP group's partial products (the rank sum is not a dim of ``x``)."""
    return Op("all_reduce", out=access(out, "m", "n", rank="r"),
              ins=(access(x, "m", "n", rank="src"),), reduced={"src"})


# --------------------------------------------------------------------------- per layout
def layer_pipelines(mesh: MeshLayout, convention: Convention = "sequence"
                    ) -> dict[str, list[Pipeline]]:
    """The producer -> consumer pairs around each layer's GroupGEMM in a (tp, ep) layout:
    layer0's shared tensor is written by the EP dispatch (``ep > 1``) and, in the
    sequence-parallel convention, by the TP all-gather (``tp > 1``); layer1's is read by
    the top-k reduce and combine (``ep > 1``, or the plain top-k reduce) and by the TP
    group's reduce-scatter (sequence) or all-reduce (replicated)."""
    gemm0 = gemm("S", "W13", "GU", grouped=True)
    gemm1 = gemm("Hact", "W2", "S", grouped=True)
    layer0 = [Pipeline(all_to_all_dispatch("X", "S"), gemm0, "S")] if mesh.ep > 1 else []
    if mesh.tp > 1 and convention == "sequence":
        layer0.append(Pipeline(all_gather("X", "S"), gemm0, "S"))
    layer1 = [Pipeline(gemm1, topk_reduce("S", "topk_weights", "Y", combine=mesh.ep > 1),
                       "S")]
    if mesh.tp > 1:
        layer1.append(Pipeline(gemm1, reduce_scatter("S", "Y") if convention == "sequence"
                               else all_reduce("S", "Y"), "S"))
    return {"layer0": layer0, "layer1": layer1}


def layout_decomposition(mesh: MeshLayout, convention: Convention = "sequence"
                         ) -> dict[str, tuple[str, ...]]:
    """Per layer, the dims of its shared tensor every one of the layer's producer ->
    consumer pairs can split (:func:`decompose` of each, intersected): what the fused
    kernels of that layout must decompose along. A layer with no communication (one
    rank) is free along both (``("m", "n")``)."""
    out = {}
    for layer, pipes in layer_pipelines(mesh, convention).items():
        dims = ("m", "n")
        for pipe in pipes:
            found = set(pipe.decompose())
            dims = tuple(d for d in dims if d in found)
        out[layer] = dims
    return out
