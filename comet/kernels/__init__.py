"""The Triton kernels of a comet call, each with its host launcher (docs/design.md has the
pipeline), in the order a call runs them:

* :mod:`~comet.kernels.plan` -- the routing plan and the tile table (count, scan, layout,
  place), and :mod:`~comet.kernels.exchange` -- the count exchange that opens a call;
* :mod:`~comet.kernels.layer0` -- dispatch + GroupGEMM(W13) + SiLU*up;
* :mod:`~comet.kernels.layer1` -- GroupGEMM(W2) + reduce-and-send, or the scatter
  epilogue; :mod:`~comet.kernels.combine` -- each token's output on its home rank;
* the backward's helpers: :mod:`~comet.kernels.grad_rows`,
  :mod:`~comet.kernels.act_backward`.

Shared building blocks: :mod:`~comet.kernels.sync` (every spin and flag),
:mod:`~comet.kernels.group_gemm` (the GEMM work item and work orders),
:mod:`~comet.kernels.roles`, :mod:`~comet.kernels.address`, :mod:`~comet.kernels.shape`.
Kernels take argument groups (named tuples, each documented where it is defined) by
keyword; they decide nothing the scheduler or the runtime can decide.
"""
