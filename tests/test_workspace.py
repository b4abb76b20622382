"""Workspace sizing on the CPU: what ``workspace_bytes`` promises is what is allocated."""

import dataclasses

import pytest
import torch

from comet.config import MoEConfig
from comet.kernels.launch import TileConfig
from comet.runtime.workspace import allocate_virtual, workspace_bytes


@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_workspace_bytes_is_what_a_rank_allocates(world, scatter):
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.float16, max_tokens=40)
    tile = dataclasses.replace(TileConfig.small(), layer1_scatter=scatter)
    ws = allocate_virtual(cfg, world, "cpu", tile)[0]
    storage = ws._keepalive[0]             # one symmetric allocation per rank
    local = [ws.h, ws.out1, ws.counters, ws.epoch, ws.timeout, *ws.plan.values()]
    assert workspace_bytes(cfg, world, tile) == storage.nbytes + sum(t.nbytes for t in local)
    assert ("pair_out" in ws.buffers) == scatter


def test_the_scatter_epilogue_costs_one_row_per_slot():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.bfloat16, max_tokens=512)
    reduce = dataclasses.replace(TileConfig(), layer1_scatter=False)
    extra = workspace_bytes(cfg, 2, TileConfig()) - workspace_bytes(cfg, 2, reduce)
    pair_out = cfg.max_tokens * cfg.top_k * cfg.hidden_size * 2
    assert pair_out <= extra < pair_out + 4 * 8 * 1024   # + row_home, row_weight per row


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_copy_dispatch_costs_every_sources_input(world):
    """``copy_dispatch``: a copy of every rank's whole input (and send list) per rank;
    the peer views a host copies into are every rank's own buffers."""
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96,
                    dtype=torch.bfloat16, max_tokens=512)
    copy = dataclasses.replace(TileConfig(), copy_dispatch=True)
    extra = workspace_bytes(cfg, world, copy) - workspace_bytes(cfg, world, TileConfig())
    rows = world * cfg.max_tokens * cfg.hidden_size * 2
    send_list = world * cfg.max_tokens * cfg.top_k * 12
    assert rows + send_list <= extra < rows + send_list + 6 * 256 + 8 * world * (world + 2)
    spaces = allocate_virtual(cfg, world, "cpu", copy)
    for ws in spaces:
        assert [p["x_recv"].data_ptr() for p in ws.peers] == \
            [s.x_recv.data_ptr() for s in spaces]
    assert "x_recv" not in allocate_virtual(cfg, world, "cpu", TileConfig())[0].buffers
