import pytest
import torch

from comet.config import (COMM_FIELDS, GEMM_FIELDS, VARIANT_FIELDS, CommConfig, GemmConfig,
                          MoEConfig, ParallelConfig, TileConfig, Variant, check_layout,
                          preset)


def test_presets_are_valid_and_named():
    cfg = preset("mixtral")
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (8, 2, 4096, 14336)
    assert preset("deepseek-v3-like").router == "sigmoid"
    with pytest.raises(ValueError, match="unknown config"):
        preset("nope")


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=9), "top_k"),
    (dict(hidden_size=100), "hidden_size"),
    (dict(intermediate_size=24), "intermediate_size"),
    (dict(router="relu"), "router"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(shared_intermediate_size=64), "shared_intermediate_size"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_invalid_fields_are_named(kwargs, field):
    base = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        MoEConfig(**base)


def test_grouped_topk_needs_enough_experts():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=8, top_k=4, hidden_size=64, intermediate_size=32, n_group=4,
                  topk_group=1)


def test_parallel_layout():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    par = ParallelConfig(world_size=4, rank=3)
    assert par.local_experts(cfg) == 2
    assert list(par.expert_range(cfg)) == [6, 7]
    with pytest.raises(ValueError, match="divisible"):
        check_layout(cfg, ParallelConfig(world_size=3, rank=0))
    with pytest.raises(ValueError, match="rank"):
        ParallelConfig(world_size=2, rank=2)


def test_shared_size_defaults():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                    num_shared_experts=2)
    assert cfg.shared_size == 64
    assert cfg.replace(num_shared_experts=0).shared_size == 0


def test_tile_fields_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="block_n0 must divide"):
        TileConfig().with_fields(block_n0=96)
    with pytest.raises(ValueError, match="layer1_split_k must be >= 1"):
        TileConfig().with_fields(layer1_split_k=0)
    assert TileConfig().with_fields(layer1_split_k=2).table_variant() == {"layer1_split_k": 2}


def test_the_variant_is_its_own_object_set_by_flat_names():
    """The algorithm choices live in a frozen :class:`Variant` of the tile; flat field
    names (``comet bench --tile``, tuned tables) reach both; ``without`` turns fields
    off the way the Selector does for calls too large for them."""
    tile = TileConfig().with_fields(layer1_scatter=False, group_m=4)
    assert tile.variant == Variant(layer1_scatter=False) and tile.gemm.group_m == 4
    assert tile.flat()["layer1_scatter"] is False and tile.flat()["group_m"] == 4
    assert set(TileConfig().flat()) == ({f for f in TileConfig.__dataclass_fields__}
                                        - {"gemm", "comm", "variant"}
                                        | set(GEMM_FIELDS) | set(COMM_FIELDS)
                                        | set(VARIANT_FIELDS))
    off = Variant().without(("layer0_stream_k", "small_plan_blocks"))
    assert (off.layer0_stream_k, off.small_plan_blocks) == (False, 0)
    assert off.layer1_split_k == Variant().layer1_split_k
    with pytest.raises(ValueError, match="small_plan_blocks"):
        Variant(small_plan_blocks=-1)
    with pytest.raises(TypeError):
        TileConfig().with_fields(not_a_field=1)


def test_the_gemm_tiles_are_their_own_object_set_by_flat_names():
    """The GEMM tiles live in a frozen :class:`GemmConfig` of the tile; flat names (``comet
    bench --tile``, tuned tables, a call's per-bucket overrides) reach it, and the decode
    tile changes only its layer1 column block."""
    tile = TileConfig().with_fields(block_m=64, comm_rows=128)
    assert tile.gemm == GemmConfig(block_m=64) and tile.comm == CommConfig(comm_rows=128)
    assert tile.flat()["block_m"] == 64 and tile.table_variant() == {"block_m": 64,
                                                                     "comm_rows": 128}
    assert TileConfig().with_overrides({"group_m": 2}).gemm.group_m == 2
    decode = TileConfig().decode_tile()
    assert decode.gemm == GemmConfig(block_n1=128, decode_block_n1=0)
    assert TileConfig.small().with_fields(decode_block_n1=0).decode_tile() is None
    with pytest.raises(ValueError, match="block_n0 must divide"):
        GemmConfig(block_n0=96)
    with pytest.raises(ValueError, match="dispatch_parts must be >= 1"):
        TileConfig().with_fields(dispatch_parts=0)


def test_the_reduce_tile_depends_on_whether_its_sums_cross_to_a_peer():
    """Layer1's reduce step is ``comm_entries`` x the top-k's power of two x as many
    columns as ``reduce_step_elements`` allows, at most ``comm_block_c`` in a layer over
    several GPUs and ``local_comm_block_c`` on one, never under 16; its queue items are
    ``reduce_item`` rounded up to whole steps."""
    from comet.kernels.layer1 import reduce_tile

    def shape(tile, world, top_k):
        r = reduce_tile(tile, True, False, world, top_k)
        return r.ENTRIES.value, r.ITEM.value, r.SLOTS.value, r.BLOCK_C.value

    tile = TileConfig()
    assert tile.comm.reduce_step_elements == 32 * 8 * 128
    assert shape(tile, 2, 8) == (32, tile.comm.reduce_item, 8, 128)
    assert shape(tile, 1, 8) == (32, tile.comm.reduce_item, 8, 128)     # the budget binds
    assert shape(tile, 2, 4) == (32, tile.comm.reduce_item, 4, 128)     # the peer cap binds
    assert shape(tile, 1, 4) == (32, tile.comm.reduce_item, 4, 256)
    assert shape(tile, 1, 2)[3] == tile.comm.local_comm_block_c
    assert shape(tile, 2, 6)[2:] == (8, 128)                       # slots padded
    assert shape(tile, 2, 16)[3] == 64 and shape(tile, 2, 64)[3] == 16
    assert shape(tile, 2, 256)[3] == 16                            # never under 16
    odd = TileConfig().with_fields(comm_entries=32, reduce_item=40)
    assert shape(odd, 4, 2)[1] == 64 and shape(odd, 1, 2)[1] == 64
