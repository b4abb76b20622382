"""Benchmark machinery behind ``comet bench`` (docs/benchmarks.md has the protocol).

* :mod:`~comet.bench.timing` -- device clocks, phase timers, the timed loop (warm-up, L2
  flush, cross-rank alignment) and the cross-rank aggregation (max over ranks, median).
* :mod:`~comet.bench.inputs` -- synthetic routing (uniform, skewed), tokens and weights.
* :mod:`~comet.bench.runner` -- times every variant of one (config, tokens, routing) case.
* :mod:`~comet.bench.records` -- the JSON record schema and the derived ratios.
* :mod:`~comet.bench.report` -- console and markdown tables, the speedup plot.
* :mod:`~comet.bench.trace` -- per-block timelines as a Chrome/Perfetto trace and a PNG.
* :mod:`~comet.bench.cutlass_ref` -- a CUTLASS Hopper grouped GEMM on the same rows (built
  with nvcc at first use, loaded with ctypes), the second compute reference.
"""
