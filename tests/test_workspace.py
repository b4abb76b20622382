"""Workspace sizing on the CPU: what ``workspace_bytes`` promises is what is allocated."""


import pytest
import torch

from comet.config import MoEConfig, TileConfig
from comet.runtime.strategies import ColumnReduce, Scatter, strategies_of
from comet.runtime.workspace import _tensors_of, allocate_virtual, workspace_bytes


@pytest.mark.parametrize("scatter, split_k", [(False, 1), (True, 1), (True, 2)])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_workspace_bytes_is_what_a_rank_allocates(world, scatter, split_k):
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.float16, max_tokens=40)
    tile = TileConfig.small().with_fields(layer1_scatter=scatter,
                                          layer1_split_k=split_k)
    ws = allocate_virtual(cfg, world, "cpu", tile)[0]
    storage = ws._keepalive[0]             # one symmetric allocation per rank
    local = [ws.h, ws.out1, ws.counters, ws.epoch, ws.timeout, *_tensors_of(ws.plan)]
    local += [ws.l1_partial] if split_k > 1 else []
    assert workspace_bytes(cfg, world, tile) == storage.nbytes + sum(t.nbytes for t in local)
    assert ws.l0_partial is None     # layer0's 16-column items are two dots: no stream-K
    assert ("pair_out" in ws.local.names()) == scatter
    # layer1's K-split scratch is local (no peer writes it): 4 MiB and a counter per slot.
    assert (ws.l1_partial is not None) == (split_k > 1)
    assert ws.count.arrived.numel() == (256 if split_k > 1 else 0)
    assert ws.count.split.numel() == tile.n_splits_max(cfg.hidden_size)


def test_layer0_stream_k_scratch_is_local_and_only_where_it_can_run():
    """Two partial boxes per program (fp32, 32 rows x 2 * block_n0) and a counter per
    item, no peer writes them; shared by stream-K and the tail split (either keeps
    them); none without both, or without one-dot layer0 items."""
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=256,
                    dtype=torch.float16, max_tokens=40)
    on = TileConfig()                                                  # both on by default
    off = on.with_fields(layer0_stream_k=False, layer0_tail_split=1)
    extra = workspace_bytes(cfg, 2, on) - workspace_bytes(cfg, 2, off)
    assert extra == 2 * 256 * (32 * 2 * 128 * 4 + 4)
    ws = allocate_virtual(cfg, 2, "cpu", on)[0]
    assert ws.count.l0_arrived.numel() == 512 and "l0_partial" not in ws.local.names()
    assert allocate_virtual(cfg, 2, "cpu", off)[0].l0_partial is None
    for one in (on.with_fields(layer0_stream_k=False),
                on.with_fields(layer0_tail_split=1)):
        assert workspace_bytes(cfg, 2, one) == workspace_bytes(cfg, 2, on)
    narrow = on.with_fields(block_n0=64)
    assert allocate_virtual(cfg, 2, "cpu", narrow)[0].l0_partial is None


def test_the_scatter_epilogue_costs_one_row_per_slot():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.bfloat16, max_tokens=512)
    reduce = TileConfig().with_fields(layer1_scatter=False)
    extra = workspace_bytes(cfg, 2, TileConfig()) - workspace_bytes(cfg, 2, reduce)
    pair_out = cfg.max_tokens * cfg.top_k * cfg.hidden_size * 2
    assert pair_out <= extra < pair_out + 4 * 8 * 1024   # + row_home, row_weight per row


def test_each_layer1_strategy_owns_its_buffers():
    """The reduce's ``comb`` is always there (the backward and the decomposed modes run
    it); the scatter's buffers only where the tile enables it."""
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.float16, max_tokens=40)
    for scatter in (False, True):
        tile = TileConfig.small().with_fields(layer1_scatter=scatter)
        ws = allocate_virtual(cfg, 2, "cpu", tile)[0]
        assert strategies_of(tile) == ([ColumnReduce, Scatter] if scatter else [ColumnReduce])
        for strategy in (ColumnReduce, Scatter):
            names = {spec.name for spec in strategy.specs(cfg, 2)}
            assert names <= ws.local.names() if strategy in strategies_of(tile) \
                else not names & ws.local.names()
