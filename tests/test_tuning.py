"""Tuned block-split tables: lookup, nearest bucket, bad files; the comet tune CLI on CPU."""

import json
import logging
import warnings

import pytest
import torch

from comet.cli import tune
from comet.config import MoEConfig, TileConfig, Variant, preset
from comet.constants import kernel_identity
from comet.kernels.fp8_roles import packed_row_bytes
from comet.mesh import MeshLayout
from comet.scheduler import search, tuned
from comet.scheduler.split import analytic_split, layer_work, predicted_time

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)


def _write(folder, cfg=CFG, world=4, device="cpu", buckets=None, meta=None, tile=None):
    meta = meta or tuned.expected_meta(cfg, world, device, tile)
    buckets = buckets or {"128": {"layer0": 4, "layer1": 8}, "1024": {"layer0": 12, "layer1": 24}}
    path = folder / tuned.file_name(cfg, world, device)
    path.write_text(json.dumps({"meta": meta, "buckets": buckets}))
    return path


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    tuned._load.cache_clear()
    monkeypatch.delenv(tuned.ENV_FOLDER, raising=False)


def test_file_name_is_vllm_style():
    name = tuned.file_name(preset("mixtral"), 4, "NVIDIA_H200")
    assert name == "E=8,H=4096,F=14336,topk=2,ep=4,device_name=NVIDIA_H200,dtype=bf16.json"


def test_lookup_takes_the_nearest_bucket_in_log_scale(tmp_path):
    _write(tmp_path)
    assert tuned.lookup(CFG, 4, 128, None, tmp_path).splits == (4, 8)
    # Geometric midpoint of 128 and 1024 is 362: below it the small bucket, above the
    # large one; never an interpolated split that was not measured.
    assert tuned.lookup(CFG, 4, 350, None, tmp_path).splits == (4, 8)
    assert tuned.lookup(CFG, 4, 380, None, tmp_path).splits == (12, 24)
    assert tuned.lookup(CFG, 4, 576, None, tmp_path).splits == (12, 24)
    assert tuned.lookup(CFG, 4, 0, None, tmp_path).splits == (4, 8)
    assert tuned.lookup(CFG, 4, 10_000, None, tmp_path).splits == (12, 24)
    assert tuned.nearest_bucket({128: (1, 1), 512: (2, 2)}, 256) == (2, 2)  # tie: larger


def test_user_folder_wins_over_env(tmp_path, monkeypatch):
    user, env = tmp_path / "user", tmp_path / "env"
    user.mkdir(), env.mkdir()
    _write(user, buckets={"64": {"layer0": 1, "layer1": 2}})
    _write(env, buckets={"64": {"layer0": 7, "layer1": 7}})
    monkeypatch.setenv(tuned.ENV_FOLDER, str(env))
    assert tuned.lookup(CFG, 4, 64, None, user).splits == (1, 2)
    assert tuned.lookup(CFG, 4, 64, None, None).splits == (7, 7)


def test_untuned_logs_once_and_returns_none(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="comet"):
        assert tuned.lookup(CFG.replace(hidden_size=96), 4, 64, None, tmp_path) is None
        assert tuned.lookup(CFG.replace(hidden_size=96), 4, 64, None, tmp_path) is None
    assert sum("no tuned block split" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("content, why", [
    ("{not json", "Expecting"),
    (json.dumps({"buckets": {}}), "meta"),
    (json.dumps({"meta": {}, "buckets": {"1": {"layer0": 1}}}), "meta"),
])
def test_bad_files_warn_and_fall_back(tmp_path, content, why):
    (tmp_path / tuned.file_name(CFG, 4, "cpu")).write_text(content)
    with pytest.warns(UserWarning, match="ignoring tuning file"):
        assert tuned.lookup(CFG, 4, 64, None, tmp_path) is None


def test_a_table_for_another_device_is_refused(tmp_path):
    meta = tuned.expected_meta(CFG, 4, "NVIDIA_H100")
    _write(tmp_path, meta=meta)       # file named for cpu, content says H100
    with pytest.warns(UserWarning, match="device_name"):
        assert tuned.lookup(CFG, 4, 64, None, tmp_path) is None


def test_bad_bucket_values_are_refused():
    meta = tuned.expected_meta(CFG, 4, "cpu")
    with pytest.raises(tuned.TunedTableError, match="integer"):
        tuned.parse_table({"meta": meta, "buckets": {"1": {"layer0": "x", "layer1": 2}}}, meta)
    with pytest.raises(tuned.TunedTableError, match="negative"):
        tuned.parse_table({"meta": meta, "buckets": {"1": {"layer0": -1, "layer1": 2}}}, meta)
    with pytest.raises(tuned.TunedTableError, match="decode_tile"):
        tuned.parse_table({"meta": meta, "buckets": {
            "1": {"layer0": 1, "layer1": 2, "decode_tile": "yes"}}}, meta)


def test_a_bucket_may_carry_the_layer1_tile(tmp_path):
    """``decode_tile`` is optional per bucket: tables written before it existed (and
    layers without a decode tile) keep the rule's choice."""
    _write(tmp_path, buckets={"128": {"layer0": 4, "layer1": 8, "decode_tile": True},
                              "1024": {"layer0": 12, "layer1": 24}})
    assert tuned.lookup(CFG, 4, 128, None, tmp_path) == tuned.Choice(4, 8, True)
    assert tuned.lookup(CFG, 4, 1024, None, tmp_path).decode_tile is None


def test_a_bucket_may_set_tile_fields(tmp_path):
    """``tile`` is optional per bucket and names per-call tile fields; the layer runs a
    bucket's calls with them (and a call may override them), other buckets keep the
    layer's own TileConfig, and every variant is among those a preload compiles."""
    cfg = CFG.replace(max_tokens=64)
    _write(tmp_path, cfg=cfg, world=1, buckets={
        "8": {"layer0": 1, "layer1": 2, "decode_tile": True,
              "tile": {"group_m": 16, "local_head_tiles": 0}},
        "64": {"layer0": 1, "layer1": 2, "decode_tile": False}}, tile=_cpu_tile(16))
    assert tuned.lookup(cfg, 1, 8, None, tmp_path, _cpu_tile(16)).tile == (("group_m", 16),
                                                           ("local_head_tiles", 0))
    layer = _cpu_layer(tmp_path, decode_block_n1=16)
    small = layer.selection.tile_for(8)
    assert (small.gemm.group_m, small.gemm.local_head_tiles, small.gemm.block_n1) == (16, 0, 16)
    assert layer.selection.tile_for(64) is layer.tile
    assert layer.selection.tile_for(8, overrides={}).gemm.block_n1 == 16      # still decode
    assert layer.selection.tile_for(8, overrides={}).gemm.group_m == layer.tile.gemm.group_m
    assert layer.selection.tile_for(64, overrides={"group_m": 4}).gemm.group_m == 4
    assert layer.selection.tile_for(8) is small                                 # built once
    variants = layer.selection.tile_variants()
    assert layer.tile in variants and small in variants and len(variants) == 4
    with pytest.raises(ValueError, match="not a per-call tile field"):
        layer.selection.tile_for(64, overrides={"block_m": 64})


@pytest.mark.parametrize("tile, why", [
    ({"block_m": 64}, "not a per-call tile field"),
    ({"group_m": 0}, "integer >= 1"),
    ({"local_head_tiles": True}, "integer >= 0"),
    ({"group_m": 8.0}, "integer >= 1"),
    ([16], "must be an object"),
])
def test_bad_tile_fields_warn_and_fall_back(tmp_path, tile, why):
    """A table whose bucket sets a field that is not per-call (one that sizes buffers),
    or a bad value, is ignored as a whole with a warning: the layer runs the analytic
    split on its own tiles, never fails a call."""
    _write(tmp_path, buckets={"128": {"layer0": 4, "layer1": 8, "tile": tile}})
    with pytest.warns(UserWarning, match=why):
        assert tuned.lookup(CFG, 4, 128, None, tmp_path) is None


def test_analytic_split_balances_comm_and_compute():
    w0, w1 = layer_work(4096, 4, 2, 4096, 14336)
    n = analytic_split(w0, 132)
    assert 0 <= n <= 66
    assert predicted_time(w0, n, 132) <= predicted_time(w0, 0, 132)
    # A layer with (almost) no GEMM has nothing to hide its communication behind: moving
    # the rows with every block first is at least as fast as any split.
    comm_only = layer_work(4096, 4, 2, 4096, 16)[0]
    assert predicted_time(comm_only, 0, 132) <= 1.01 * min(predicted_time(comm_only, k, 132)
                                                           for k in range(1, 67))


def test_tune_cli_parses_configs(tmp_path):
    parser = tune.build_parser()
    args = parser.parse_args(["--config", "qwen2-moe"])
    assert tune.resolve_config(args, parser).num_experts == 64
    cfg_json = tmp_path / "config.json"
    cfg_json.write_text(json.dumps({"num_local_experts": 8, "num_experts_per_tok": 2,
                                    "hidden_size": 4096, "intermediate_size": 14336}))
    args = parser.parse_args(["--config-json", str(cfg_json)])
    assert tune.resolve_config(args, parser) == preset("mixtral")
    with pytest.raises(SystemExit):
        tune.resolve_config(parser.parse_args(["--config", "mixtral", "--experts", "8"]),
                            parser)
    cfg_json.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SystemExit):
        tune.resolve_config(parser.parse_args(["--config-json", str(cfg_json)]), parser)


def test_tune_resumes_and_refuses_foreign_tables(tmp_path):
    meta = tuned.expected_meta(CFG, 4, "cpu")
    path = _write(tmp_path)
    table = tune.load_existing(str(path), meta)
    assert set(table["buckets"]) == {"128", "1024"}          # resumed, not remeasured
    other = tuned.expected_meta(CFG.replace(top_k=1), 4, "cpu")
    with pytest.raises(tuned.TunedTableError):
        tune.load_existing(str(path), other)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_tune_without_gpu_says_so(capsys):
    assert tune.main(["--config", "mixtral", "--tokens", "16"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_fp8_layer_sends_its_packed_rows_and_runs_a_faster_gemm():
    """FP8: layer0 sends 0.52x the bf16 bytes at H = 7168 and both GEMMs count half their
    FLOPs; layer1's rows stay bf16. The layer's dispatch is the same share of a cheaper
    GEMM, so the chosen split must still be one of the model's best."""
    bf0, bf1 = layer_work(4096, 8, 8, 7168, 2048)
    f0, f1 = layer_work(4096, 8, 8, 7168, 2048, dispatch_row_bytes=packed_row_bytes(7168))
    assert f0.comm_bytes / bf0.comm_bytes == pytest.approx(7392 / 14336)
    assert f0.flops == bf0.flops / 2 and f1.flops == bf1.flops / 2
    assert f1.comm_bytes == bf1.comm_bytes
    n = analytic_split(f0, 132)
    assert predicted_time(f0, n, 132) <= 1.01 * min(predicted_time(f0, k, 132)
                                                    for k in range(67))


def test_analytic_split_with_no_tokens_and_few_programs():
    """A rank with no tokens (uneven batches) still gets a split, and it stays in range."""
    for tokens in (0, 1):
        for work in layer_work(tokens, 4, 8, 7168, 2048):
            for programs in (2, 8, 132):
                assert 0 <= analytic_split(work, programs) <= programs // 2


def test_analytic_split_prefers_filling_the_link_among_ties():
    """Comm blocks join the GEMM when done, so layer0 counts that all keep the GEMM fed
    cost the same; the choice is then the count that fills the link, not the smallest."""
    w0, _ = layer_work(16384, 2, 2, 4096, 14336)
    n = analytic_split(w0, 132)
    assert n >= 16
    assert predicted_time(w0, n, 132) <= 1.01 * min(predicted_time(w0, k, 132)
                                                    for k in range(67))


def test_a_table_of_other_kernels_is_used_and_reported_naming_both(tmp_path, caplog):
    """A table measured on other kernels (another hash, or an old file's hand-kept
    revision) still serves, with one log line naming its kernels and these."""
    for theirs, named in (({"kernels": "kernels-000000000000"}, "kernels-000000000000"),
                          ({"kernel_revision": 10}, "revision 10")):
        tuned._load.cache_clear()
        caplog.clear()
        meta = tuned.expected_meta(CFG, 4, "cpu")
        del meta["kernels"]
        _write(tmp_path, meta={**meta, **theirs})
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="comet"):
            warnings.simplefilter("error")
            assert tuned.lookup(CFG, 4, 128, None, tmp_path).splits == (4, 8)
        lines = [r.message for r in caplog.records if "tuned on kernels" in r.message]
        assert len(lines) == 1 and named in lines[0] and kernel_identity() in lines[0]


def test_a_table_of_these_kernels_is_not_reported(tmp_path, caplog):
    _write(tmp_path)
    with caplog.at_level(logging.INFO, logger="comet"):
        assert tuned.lookup(CFG, 4, 128, None, tmp_path) is not None
    assert "tuned on kernels" not in caplog.text


def test_kernel_identity_is_a_hash_of_the_kernel_sources(tmp_path, monkeypatch):
    """Same sources, same identity, wherever the tree lies; any edit of a kernel file
    (or a new one) gives another."""
    import shutil

    from comet import constants
    ours = kernel_identity()
    assert ours.startswith("kernels-") and len(ours) == len("kernels-") + 12
    copy = tmp_path / "elsewhere" / "kernels"
    shutil.copytree(constants.KERNELS_DIR, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))

    def identity_of(folder):
        monkeypatch.setattr(constants, "KERNELS_DIR", folder)
        constants.kernel_identity.cache_clear()
        try:
            return constants.kernel_identity()
        finally:
            constants.kernel_identity.cache_clear()
    assert identity_of(copy) == ours
    (copy / "sync.py").write_text((copy / "sync.py").read_text() + "# edited\n")
    edited = identity_of(copy)
    (copy / "extra.py").write_text("")
    assert len({ours, edited, identity_of(copy)}) == 3


def test_a_written_table_carries_these_kernels_and_its_provenance(tmp_path, caplog):
    """What `comet tune` writes names the kernels it was measured on, and a layer loading
    it on these kernels reports nothing."""
    path = tmp_path / tuned.file_name(CFG, 4, "cpu")
    table = {"meta": tuned.expected_meta(CFG, 4, "cpu"),
             "buckets": {"128": {"layer0": 4, "layer1": 8}}}
    tune.write_table(str(path), table, "cpu")
    meta = json.loads(path.read_text())["meta"]
    assert meta["kernels"] == kernel_identity() and "kernel_revision" not in meta
    assert meta["device"] == "cpu" and meta["commit"] and meta["command"]
    with caplog.at_level(logging.INFO, logger="comet"):
        assert tuned.lookup(CFG, 4, 128, None, tmp_path).splits == (4, 8)
    assert "tuned on kernels" not in caplog.text


def test_tune_measures_a_table_of_other_kernels_again(tmp_path, capsys):
    meta = tuned.expected_meta(CFG, 4, "cpu")
    for theirs in ({"kernels": "kernels-000000000000"}, {"kernel_revision": 10}):
        old = {k: v for k, v in meta.items() if k != "kernels"}
        path = _write(tmp_path, meta={**old, **theirs})
        table = tune.load_existing(str(path), meta)
        assert table == {"meta": meta, "buckets": {}}
        assert "tuned on kernels" in capsys.readouterr().err


def test_tune_measures_a_table_of_another_variant_again(tmp_path, capsys):
    """A table tuned before the layout's default tile changed (here: before layer0's
    gathered dispatch) is measured again for the new variant, not refused."""
    gathered = TileConfig().with_fields(layer0_gather=True)
    meta = tuned.expected_meta(CFG, 4, "cpu", gathered)
    path = _write(tmp_path)                           # tuned on the default variant
    assert tune.load_existing(str(path), meta) == {"meta": meta, "buckets": {}}
    assert "TileConfig variant" in capsys.readouterr().err


def _cpu_tile(decode_block_n1=0):
    """Interpreter tiles, with a decode tile of ``decode_block_n1`` columns if nonzero."""
    return TileConfig.small().with_fields(decode_block_n1=decode_block_n1)


def _cpu_layer(folder, decode_block_n1=0, tile=None):
    """A layer of CFG on the CPU (``tile``, default :func:`_cpu_tile`)."""
    from comet.runtime.layer import FusedMoE
    cfg = CFG.replace(max_tokens=64)
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    return FusedMoE(cfg, torch.zeros(e, h, 2 * f, dtype=cfg.dtype),
                    torch.zeros(e, f, h, dtype=cfg.dtype), tuned_config_folder=folder,
                    tile=tile or _cpu_tile(decode_block_n1))


def test_a_table_serves_only_the_tile_variant_it_was_tuned_for(tmp_path, caplog):
    """A table records its layer's TileConfig variant; a layer of another variant (here
    layer1's reduce instead of the scatter) falls back to the analytic model instead of
    using splits tuned for the other kernels, saying so in the log (no warning: a
    layout's default tile may change under a shipped table) -- and one of the same
    variant uses it."""
    cfg = CFG.replace(max_tokens=64)
    scatter, reduce = _cpu_tile(), _cpu_tile().with_fields(layer1_scatter=False)
    assert scatter.table_variant() != reduce.table_variant()
    assert "layer1_scatter" in reduce.table_variant()
    assert "group_m" not in reduce.table_variant()
    _write(tmp_path, cfg=cfg, world=1, buckets={"32": {"layer0": 1, "layer1": 2}},
           tile=scatter)
    assert _cpu_layer(tmp_path, tile=scatter).selection.comm_blocks(32) == (1, 2)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="comet"):
        warnings.simplefilter("error")
        other = _cpu_layer(tmp_path, tile=reduce)
        assert other.selection.comm_blocks(32) == other.selection.analytic(32)
    assert "TileConfig variant" in caplog.text
    # The default variant writes no "tile" at all: the shipped tables stay valid.
    assert "tile" not in tuned.expected_meta(cfg, 1, "cpu")
    assert tuned.expected_meta(cfg, 1, "cpu", reduce)["tile"] == reduce.table_variant()


def test_a_variant_table_names_its_variant_and_old_names_still_load(tmp_path):
    """A table of a non-default variant carries the variant's hash in its file name, so
    two variants' tables of one shape sit side by side, each serving its own layer; a
    table named without it (written before) still loads for the variant it records."""
    cfg = CFG.replace(max_tokens=64)
    scatter, reduce = _cpu_tile(), _cpu_tile().with_fields(layer1_scatter=False)
    names = {tuned.file_name(cfg, 1, "cpu", tile=t) for t in (scatter, reduce)}
    assert len(names) == 2 and tuned.file_name(cfg, 1, "cpu") not in names
    assert tuned.file_name(cfg, 1, "cpu", tile=TileConfig()) == tuned.file_name(cfg, 1, "cpu")
    assert "variant=" in tuned.file_name(cfg, 1, "cpu", tile=reduce)
    for tile, splits in ((scatter, (1, 2)), (reduce, (2, 1))):
        meta = tuned.expected_meta(cfg, 1, "cpu", tile)
        (tmp_path / tuned.file_name(cfg, 1, "cpu", tile=tile)).write_text(json.dumps(
            {"meta": meta, "buckets": {"32": {"layer0": splits[0], "layer1": splits[1]}}}))
    assert _cpu_layer(tmp_path, tile=scatter).selection.comm_blocks(32) == (1, 2)
    assert _cpu_layer(tmp_path, tile=reduce).selection.comm_blocks(32) == (2, 1)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    _write(legacy, cfg=cfg, world=1, buckets={"32": {"layer0": 3, "layer1": 3}}, tile=reduce)
    tuned._load.cache_clear()
    assert _cpu_layer(legacy, tile=reduce).selection.comm_blocks(32) == (3, 3)


def test_a_table_split_that_does_not_fit_falls_back_to_the_model(tmp_path):
    """A split beyond this GPU's programs (a hand-edited table) must not raise in a
    forward: warning, then the analytic choice."""
    cfg = CFG.replace(max_tokens=64)
    _write(tmp_path, cfg=cfg, world=1, buckets={"32": {"layer0": 1, "layer1": 2},
                                                "64": {"layer0": 500, "layer1": 2}},
           tile=_cpu_tile())
    layer = _cpu_layer(tmp_path)
    assert layer.selection.comm_blocks(32) == (1, 2)
    with pytest.warns(UserWarning, match="does not fit"):
        assert layer.selection.comm_blocks(64) == layer.selection.analytic(64)


def test_check_report_compares_each_pick_with_the_best():
    times = {(0, False, ()): (100.0, 50.0), (4, False, ()): (80.0, 55.0),
             (16, False, ()): (90.0, 60.0), (0, True, ()): (101.0, 45.0),
             (4, True, ()): (81.0, 58.0), (16, True, ()): (91.0, 61.0)}
    picks = {"tuned": (4, 0, True, ()), "fixed": (16, 16, False, ()),
             "analytic": (0, 4, False, ())}
    rows = tune.check_rows(times, picks)
    l0, l1, both = rows
    assert (l0["best"], l1["best"], l1["best_decode_tile"]) == (4, 0, True)
    assert l0["tuned_over_best"] == 1.0 + 1 / 80 and l1["tuned_over_best"] == 1.0
    assert l0["fixed_us"] == 90.0 and l1["fixed_over_best"] == pytest.approx(60 / 45)
    assert both["analytic_us"] == 155.0 and both["best_us"] == 125.0
    text = tune.format_check([{"tokens": 128, **r} for r in rows],
                             ["tuned", "fixed", "analytic"])
    assert "| 128 | layer0 | 81 (4d) | 90 (16) | 100 (0) | 80 (4) | 1.012 | 1.125 | 1.250 |" in text
    assert "| 128 | layer1 | 45 (0d) | 60 (16) | 55 (4) | 45 (0d) |" in text
    assert "| 128 | both | 126 | 150 | 155 | 125 | 1.008 | 1.200 | 1.240 |" in text


def test_check_pools_layer1_where_its_split_changes_nothing():
    """With the scatter epilogue every split runs the same layer1 program: its timings
    are pooled per tile, so no pick loses to the luckiest of identical runs."""
    times = {(0, False, ()): (100.0, 50.0), (4, False, ()): (80.0, 44.0),
             (16, False, ()): (90.0, 56.0), (0, True, ()): (101.0, 60.0),
             (4, True, ()): (81.0, 62.0), (16, True, ()): (91.0, 61.0)}
    pooled = tune.pool_split_free(times)
    assert {k: v[1] for k, v in pooled.items() if k[1] is False} == {
        (0, False, ()): 50.0, (4, False, ()): 50.0, (16, False, ()): 50.0}
    assert pooled[(4, True, ())] == (81.0, 61.0)
    rows = tune.check_rows(pooled, {"tuned": (4, 0, False, ()), "fixed": (16, 16, True, ())})
    assert rows[1]["tuned_over_best"] == 1.0
    assert rows[1]["fixed_over_best"] == pytest.approx(61 / 50)
    assert rows[0]["tuned_over_best"] == 1.0     # layer0's splits stay apart


def test_check_counts_the_tables_tile_fields_among_the_candidates():
    """A pick with tile fields is timed with them at its split; such a time can be the
    best, and the report marks the pick (``*``) and names its fields."""
    g16 = (("group_m", 16),)
    times = {(4, None, ()): (80.0, 50.0), (8, None, ()): (85.0, 52.0),
             (4, None, g16): (76.0, 50.0)}
    rows = tune.check_rows(times, {"tuned": (4, 4, None, g16), "fixed": (8, 8, None, ())})
    l0 = rows[0]
    assert l0["best_tile"] == {"group_m": 16} and l0["tuned_over_best"] == 1.0
    assert l0["tuned_tile"] == {"group_m": 16} and l0["fixed_tile"] == {}
    text = tune.format_check([{"tokens": 4096, **r} for r in rows], ["tuned", "fixed"])
    assert "| 4096 | layer0 | 76 (4*) | 85 (8) | 76 (4*) |" in text


def test_check_finds_the_table_a_layer_would_load(tmp_path, monkeypatch):
    env = tmp_path / "env"
    env.mkdir()
    assert tune.find_table(CFG, 4, "cpu", str(tmp_path / "none")) is None
    path = _write(env)
    monkeypatch.setenv(tuned.ENV_FOLDER, str(env))
    assert tune.find_table(CFG, 4, "cpu", str(tmp_path / "none")) == str(path)


def _valley(best0, best1):
    """A layer time per split with one minimum per layer (what the sweeps measured)."""
    calls = []

    def evaluate(n):
        calls.append(n)
        return 100.0 + abs(n - best0) ** 1.5, 50.0 + 2.0 * abs(n - best1)
    return evaluate, calls


def test_climb_finds_each_layers_best_with_fewer_calls():
    cands = list(tune.DEFAULT_CANDIDATES)
    evaluate, calls = _valley(24, 2)
    timed = search.climb(evaluate, cands, [(10, 0), (10, 0)])
    assert search.best_splits(timed) == (24, 2)
    assert len(calls) == len(set(calls)) == len(timed)   # each split timed once
    assert len(timed) < len(cands)


def test_climb_escapes_a_far_off_model_through_the_zero_start():
    # The model says 48 but layer1 is best at 0, behind a bump at 32 that stops a climb
    # from 48; the start at 0 still finds it.
    cands = list(tune.DEFAULT_CANDIDATES)

    def evaluate(n):
        layer1 = {0: 10.0, 2: 11.0, 32: 30.0, 48: 20.0, 64: 25.0}.get(n, 15.0)
        return 1.0, layer1
    timed = search.climb(evaluate, cands, [(48,), (48, 0)])
    assert search.best_splits(timed)[1] == 0


def test_climb_snaps_starts_and_handles_one_candidate():
    assert search.nearest([0, 4, 8], 6) == 1 and search.nearest([0, 4, 8], 7) == 2
    assert search.nearest([0, 4, 8], 99) == 2 and search.nearest([0, 4, 8], -3) == 0
    timed = search.climb(lambda n: (1.0, 2.0), [16], [(3, 0), (40,)])
    assert timed == {16: (1.0, 2.0)}
    with pytest.raises(ValueError):
        search.climb(lambda n: (1.0, 1.0), [], [(0,)])


class _Layer:
    """What sweep_bucket asks of a layer, without a decode tile."""

    class tile:
        variant = Variant(layer1_scatter=False)

        @staticmethod
        def decode_tile():
            return None

    @property
    def selection(self):
        return self

    def analytic(self, tokens):
        return 12, 4


def _decode_layer(rule: bool, scatter: bool = False):
    """A layer with a decode tile, which its rule picks when ``rule``."""
    class Layer(_Layer):
        class tile:
            variant = Variant(layer1_scatter=scatter)

            @staticmethod
            def decode_tile():
                return "a decode tile"

        def decode_by_rule(self, tokens):
            return rule
    return Layer()


def test_local_search_bucket_entry_records_what_it_timed(monkeypatch):
    evaluate, calls = _valley(16, 0)
    monkeypatch.setattr(tune, "bucket_timer", lambda *a: evaluate)
    Layer = _Layer
    args = tune.build_parser().parse_args(["--config", "mixtral"])
    entry = tune.sweep_bucket(Layer(), None, 4096, list(tune.DEFAULT_CANDIDATES), args,
                              None, 0)
    assert (entry["layer0"], entry["layer1"], entry["search"]) == (16, 0, "local")
    assert sorted(map(int, entry["sweep_us"])) == sorted(set(calls))
    args.search = "exhaustive"
    calls.clear()
    entry = tune.sweep_bucket(Layer(), None, 4096, [0, 8, 16], args, None, 0)
    assert calls == [0, 8, 16] and entry["layer0"] == 16
    assert "decode_tile" not in entry


@pytest.mark.parametrize("rule, decode_faster", [(False, True), (False, False),
                                                 (True, True), (True, False)])
def test_the_bucket_keeps_the_faster_layer1_tile(monkeypatch, rule, decode_faster):
    """The split is searched on the rule's tile, layer1 then climbed on the other from
    the best split; the entry keeps whichever tile was faster, and says so."""
    timers = {}

    def bucket_timer(layer, cfg, tokens, args, device, rank, decode_tile=None):
        base, _ = _valley(16, 4)
        gain = 0.8 if decode_tile == decode_faster else 1.0
        timers[decode_tile] = []

        def evaluate(n):
            timers[decode_tile].append(n)
            t0, t1 = base(n)
            return t0, t1 * gain
        return evaluate
    monkeypatch.setattr(tune, "bucket_timer", bucket_timer)

    args = tune.build_parser().parse_args(["--config", "mixtral"])
    entry = tune.sweep_bucket(_decode_layer(rule), None, 128, list(tune.DEFAULT_CANDIDATES),
                              args, None, 0)
    assert entry["decode_tile"] is decode_faster and entry["layer1"] == 4
    assert entry["layer1_us"] == pytest.approx(50.0 * 0.8)
    # The other tile was climbed for layer1 only, from the best split.
    assert sorted(timers[not rule]) == [2, 4, 8]
    assert sorted(map(int, entry["sweep_us_other_tile"])) == [2, 4, 8]


@pytest.mark.parametrize("gain, kept", [(0.95, True), (0.995, False)])
def test_the_bucket_keeps_a_tile_candidate_only_if_it_clearly_pays(monkeypatch, gain, kept):
    """search_tile times the layer's own tile fields and each candidate at the entry's
    split and layer1 tile; a candidate replaces them only when the call is TILE_MARGIN
    faster with it."""
    timed = []

    def bucket_timer(layer, cfg, tokens, args, device, rank, decode_tile=None,
                     tile_overrides=None):
        def evaluate(split):
            timed.append((split, decode_tile, tune.tile_label(tile_overrides)))
            f = gain if tile_overrides == {"group_m": 16} else 1.0
            return 100.0 * f, 50.0 * f
        return evaluate
    monkeypatch.setattr(tune, "bucket_timer", bucket_timer)
    args = tune.build_parser().parse_args(["--config", "mixtral"])
    entry = {"layer0": 24, "layer1": 0, "layer0_us": 99.0, "layer1_us": 49.0,
             "decode_tile": True}
    entry = tune.search_tile(None, None, 4096, entry, args, None, 0)
    labels = ["default"] + [tune.tile_label(c) for c in tune.TILE_CANDIDATES]
    assert timed == [((24, 0), True, label) for label in labels]
    assert list(entry["tile_sweep_us"]) == labels
    if kept:
        assert entry["tile"] == {"group_m": 16} and entry["layer0_us"] == 95.0
    else:
        assert "tile" not in entry and entry["layer0_us"] == 99.0


def test_a_scattering_layer1_has_no_split_to_search(monkeypatch):
    """With the scatter epilogue layer1's split is ignored: only layer0 climbs, the
    entry's layer1 is 0, and the other layer1 tile is timed once, at layer0's best."""
    timers = {}

    def bucket_timer(layer, cfg, tokens, args, device, rank, decode_tile=None):
        base, _ = _valley(16, 4)
        timers[decode_tile] = []

        def evaluate(n):
            timers[decode_tile].append(n)
            return base(n)[0], 50.0 if decode_tile else 60.0
        return evaluate
    monkeypatch.setattr(tune, "bucket_timer", bucket_timer)

    args = tune.build_parser().parse_args(["--config", "mixtral"])
    entry = tune.sweep_bucket(_decode_layer(False, scatter=True), None, 128,
                              list(tune.DEFAULT_CANDIDATES), args, None, 0)
    assert (entry["layer0"], entry["layer1"], entry["decode_tile"]) == (16, 0, True)
    assert entry["layer1_us"] == 50.0 and timers[True] == [16]
    assert sorted(set(timers[False])) == sorted(map(int, entry["sweep_us"]))


def test_tune_says_how_to_load_a_table_from_an_unsearched_folder(tmp_path, monkeypatch):
    assert not tune._searched(str(tmp_path))
    monkeypatch.setenv(tuned.ENV_FOLDER, str(tmp_path))
    assert tune._searched(str(tmp_path))


def test_a_tuned_tile_overrides_the_rule_and_an_argument_overrides_both(tmp_path):
    cfg = CFG.replace(max_tokens=64)
    _write(tmp_path, cfg=cfg, world=1, buckets={
        "8": {"layer0": 1, "layer1": 2, "decode_tile": True},
        "64": {"layer0": 1, "layer1": 2, "decode_tile": False}}, tile=_cpu_tile(16))
    layer = _cpu_layer(tmp_path, decode_block_n1=16)
    decode = layer.tile.decode_tile()
    assert layer.selection.tile_for(8).gemm.block_n1 == decode.gemm.block_n1
    assert layer.selection.tile_for(64) is layer.tile
    assert layer.selection.tile_for(64, decode_tile=True).gemm.block_n1 == decode.gemm.block_n1
    assert layer.selection.tile_for(8, decode_tile=False) is layer.tile
    untuned = _cpu_layer(tmp_path / "none", decode_block_n1=16)
    assert (untuned.selection.tile_for(8) is not untuned.tile) == untuned.selection.decode_by_rule(8)


def test_forcing_a_decode_tile_the_layer_lacks_is_refused(tmp_path):
    layer = _cpu_layer(tmp_path)
    assert layer.selection.tile_for(8) is layer.tile
    with pytest.raises(ValueError, match="no decode tile"):
        layer.selection.tile_for(8, decode_tile=True)


@pytest.mark.parametrize("name, world, tokens, programs, decode", [
    ("mixtral", 4, 128, 132, True),        # 32 items: 128-column blocks fill twice as many SMs
    ("phi3.5-moe", 4, 128, 132, True),
    ("qwen2-moe", 4, 128, 132, False),     # 120 items: two waves of narrower ones
    ("mixtral", 2, 16384, 132, False),     # ragged last wave, but thousands of items
    ("mixtral", 4, 4096, 132, False),
])
def test_the_decode_rule_at_model_sizes(name, world, tokens, programs, decode):
    """The rule's picks at the presets' sizes: decode only where the default leaves SMs
    idle and the decode tile uses them (measured both ways: TileConfig.decode_pays)."""
    from comet.config import TileConfig
    cfg = preset(name)
    rows = -(-tokens * world * cfg.top_k // cfg.num_experts)
    assert TileConfig().decode_pays(rows, cfg.num_experts // world, cfg.hidden_size,
                                    programs) is decode


@pytest.mark.parametrize("name, world, tokens, decode", [
    ("mixtral", 1, 0, False),
    ("mixtral", 1, 1, True),     # 2 experts with a row: 32 wide items, 64 decode ones
    ("mixtral", 1, 8, False),    # 8 experts with rows: 128 items already fill the SMs
    ("mixtral", 2, 8, True),     # 4 experts with rows: 64 items
    ("qwen2-moe", 2, 1, True),   # 4 of 30 experts: 32 items of 2048 columns
])
def test_the_decode_rule_counts_only_the_experts_with_rows(name, world, tokens, decode):
    """A small call's items are those of the experts it reaches: a 1-token Mixtral call
    reaches 2 experts, whatever the rank holds (Selector.decode_by_rule)."""
    from comet.runtime.selection import Selector
    selection = Selector(preset(name), world, TileConfig(), 132, torch.device("cpu"),
                         folder=None)
    assert selection.decode_by_rule(tokens) is decode


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "phi3.5-moe", "deepseek-v3-like"])
def test_the_stream_k_gate_compiles_it_in_only_for_calls_it_may_cut(name):
    """With ``layer0_stream_k``, a call runs the kernel with the stream-K variant only
    where its expected layer0 items (EP=2, 132 SMs) make fewer than two rounds -- every
    preset at 1 token (44-224 items) -- and the tile without it from 8 tokens on
    (330-1024 items: measured, the compiled-in variant cost those calls 2-6%)."""
    from comet.runtime.selection import Selector
    tile = TileConfig()                                                # on by default
    assert tile.variant.layer0_stream_k
    selection = Selector(preset(name), 2, tile, 132, torch.device("cpu"), folder=None)
    small = selection.tile_for(1)                 # on the decode tile, where it has one
    assert small.variant.layer0_stream_k
    for tokens in (8, 128, 4096):
        whole = selection.tile_for(tokens)
        assert not whole.variant.layer0_stream_k, tokens
        # the same tile otherwise (the small plan as the call's blocks say), built once
        full = whole.with_fields(layer0_stream_k=True,
                                 layer0_tail_split=tile.variant.layer0_tail_split,
                                 small_plan_blocks=tile.variant.small_plan_blocks)
        assert whole is selection.without(full, selection.too_large_for(tokens))
    assert selection.tile_for(1, overrides={"group_m": 4}).variant.layer0_stream_k
    assert not selection.tile_for(8, overrides={"group_m": 4}).variant.layer0_stream_k
    # every tile a call may run is warmed up before the first call
    assert {small, selection.tile_for(8), selection.tile_for(4096)} <= set(
        selection.tile_variants())
    off = Selector(preset(name), 2, tile.with_fields(layer0_stream_k=False), 132,
                   torch.device("cpu"), folder=None)
    assert not off.tile_for(1).variant.layer0_stream_k
    assert all(not t.variant.layer0_stream_k for t in off.tile_variants())
    # items of two dots (block_n0 64): no scratch, no variant to compile or swap out
    # (neither stream-K nor the tail split, which shares its scratch)
    narrow_tile = tile.with_fields(block_n0=64)
    narrow = Selector(preset(name), 2, narrow_tile, 132, torch.device("cpu"), folder=None)
    assert not narrow.may_stream_k and not narrow.may_tail_split
    assert narrow.tile_for(4096) is narrow.without(narrow_tile, ("small_plan_blocks",))
    plain = Selector(preset(name), 2, tile.with_fields(layer0_stream_k=False,
                                                       layer0_tail_split=1),
                     132, torch.device("cpu"), folder=None)
    assert len(narrow.tile_variants()) == len(plain.tile_variants())


@pytest.mark.parametrize("name, cut", [
    ("mixtral", (2, 128)),           # 4 local experts x 112 column blocks: 448, 52 last
    ("phi3.5-moe", (3, 256)),        # 8 x 50: 400 items, 4 in the last round
    ("qwen2-moe", None),             # 32 x 11: 352 items, 88 last (more than half)
    ("deepseek-v3-like", None),      # 128 x 16: 2048 items, 68 last
])
def test_the_tail_split_gate_compiles_it_in_only_where_the_last_round_is_nearly_empty(
        name, cut):
    """With ``layer0_tail_split`` (on by default), a call runs the kernel with the K
    splits of layer0's last round compiled in only where its expected items (EP=2, 132
    SMs, uniform rows) make a whole round and a last one of at most 66 items, on m-tiles
    of at most 64 rows: mixtral's and phi3.5-moe's 8-128-token calls, never qwen2-moe's
    352 items from 8 tokens on nor deepseek-v3-like's. Every tile a call may run is
    warmed up."""
    from comet.runtime.selection import Selector
    tile = TileConfig()
    assert tile.variant.layer0_tail_split > 1
    selection = Selector(preset(name), 2, tile, 132, torch.device("cpu"), folder=None)
    assert selection.may_tail_split
    on = [t for t in range(0, 1100) if selection.tile_for(t).variant.layer0_tail_split > 1]
    if cut is None:
        assert not on or max(on) < 8, on
    else:
        assert on == list(range(cut[0], cut[1] + 1))
    assert {selection.tile_for(t) for t in range(0, 1100)} <= set(selection.tile_variants())
    every = {(selection.too_large_for(t), selection.small_rows_by_rule(t))
             for t in range(selection.cfg.max_tokens + 1)}
    assert selection._reachable_shapes() == sorted(every)
    off = Selector(preset(name), 2, TileConfig().with_fields(layer0_tail_split=1), 132,
                   torch.device("cpu"), folder=None)
    assert not off.may_tail_split
    assert all(t.variant.layer0_tail_split == 1 for t in off.tile_variants())


@pytest.mark.parametrize("name, world, mesh, last_live, first_full", [
    ("qwen2-moe", 2, None, 128, 129),                # 32 local experts, T / 8 rows each
    ("deepseek-v3-like", 2, None, 256, 257),         # 128 local experts, T / 16 rows each
    ("qwen2-moe", 2, MeshLayout(tp=2, ep=1), 128, 129),   # (2,1): 64 F/2 shards, 2T * 4 / 64
])
def test_the_live_row_gate_masks_a_gathered_gemm_only_in_small_calls(name, world, mesh,
                                                                     last_live, first_full):
    """A gathered layer0 loads only its tiles' own A rows (``layer0_live_rows``) in calls
    whose experts' rows, expected under uniform routing, fill at most an eighth of an
    m-tile (16 of 128 rows); larger calls run the kernel without the masks. Every tile a call may run is
    warmed up; a layer that does not gather never swaps the variant."""
    from comet.runtime.selection import Selector
    cfg = preset(name)
    layout = None
    if mesh is not None:
        cfg, world, layout = mesh.kernel_config(cfg), mesh.world, mesh.table_layout("sequence")
    tile = TileConfig().with_fields(layer0_gather=True)
    selection = Selector(cfg, world, tile, 132, torch.device("cpu"), folder=None,
                         layout=layout)
    assert selection.may_live_rows
    for tokens, live in ((1, True), (16, True), (last_live, True), (first_full, False),
                         (4096, False), (16384, False)):
        assert selection.tile_for(tokens).variant.layer0_live_rows is live, tokens
    # a call that stream-K may cut keeps the live rows, and every pick is warmed up
    variants = selection.tile_variants()
    assert selection.tile_for(1).variant.layer0_stream_k
    assert {selection.tile_for(t) for t in range(1, 5000, 7)} <= set(variants)
    # exactly the small-call variants some token count gets (found by the rules' ends)
    every = {(selection.too_large_for(t), selection.small_rows_by_rule(t))
             for t in range(cfg.max_tokens + 1)}
    assert selection._reachable_shapes() == sorted(every)
    assert len(variants) == len(set(variants)) == 2 * len(every)    # the tile and decode
    off = Selector(cfg, world, tile.with_fields(layer0_live_rows=False), 132,
                   torch.device("cpu"), folder=None, layout=layout)
    assert not off.may_live_rows and not off.tile_for(1).variant.layer0_live_rows
    placed = Selector(cfg, world, TileConfig(), 132, torch.device("cpu"), folder=None,
                      layout=layout)
    assert not placed.may_live_rows
    assert all(t.variant.layer0_live_rows for t in placed.tile_variants())


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3-like"])
def test_the_warp_specialized_fp8_gemm_serves_large_calls_only(name):
    """An FP8 layer that may run its GEMMs on the warp-specialized kernel
    (``Variant.fp8_ws_min_rows``) does so in calls of at least that many expected rows
    per expert, and keeps the fused kernels below; every tile a call may pick is
    warmed up, and a layer without the variant never gets it."""
    from comet.quant import Fp8
    from comet.runtime.layer import fp8_tile
    from comet.runtime.selection import Selector
    rows = 128
    cfg = preset(name).replace(fp8=Fp8(), max_tokens=16384)
    tile = fp8_tile(TileConfig().with_fields(fp8_ws_min_rows=rows), warp_specialized=True)
    selection = Selector(cfg, 1, tile, 132, torch.device("cpu"), folder=None)
    first = next(t for t in range(1, 16385) if selection.ws_gemm_by_rule(t))
    per_expert = -(-first * cfg.top_k // cfg.num_experts)
    assert per_expert >= rows > -(-(first - 1) * cfg.top_k // cfg.num_experts)
    for tokens, ws in ((1, False), (128, False), (first - 1, False), (first, True),
                       (4096, True), (16384, True)):
        assert (selection.tile_for(tokens).variant.fp8_ws_min_rows == rows) is ws, tokens
    every = {(selection.too_large_for(t), selection.small_rows_by_rule(t))
             for t in range(cfg.max_tokens + 1)}
    assert selection._reachable_shapes() == sorted(every)
    assert {selection.tile_for(t) for t in range(1, 16385, 97)} <= set(
        selection.tile_variants())
    for off in (fp8_tile(TileConfig().with_fields(fp8_ws_min_rows=rows)),
                fp8_tile(TileConfig().with_fields(fp8_ws_min_rows=0), warp_specialized=True)):
        plain = Selector(cfg, 1, off, 132, torch.device("cpu"), folder=None)
        assert not any(t.variant.fp8_ws_min_rows for t in plain.tile_variants())
    # a gathered dispatch keeps the kernel (it reads A's rows through the index)
    gathered = fp8_tile(TileConfig().with_fields(fp8_ws_min_rows=rows, layer0_gather=True),
                        warp_specialized=True)
    assert Selector(cfg, 1, gathered, 132, torch.device("cpu"), folder=None).tile_for(
        16384).variant.fp8_ws_min_rows == rows
    # a bf16 layer's Selector carries the field as it is and no call turns it
    bf16 = Selector(cfg.replace(fp8=None), 1, TileConfig().with_fields(fp8_ws_min_rows=rows),
                    132, torch.device("cpu"), folder=None)
    assert all(t.variant.fp8_ws_min_rows == rows for t in bf16.tile_variants())


@pytest.mark.parametrize("name, small, wide", [
    ("qwen2-moe", (8, 32), (1, 4096)),         # 1 token: 4 experts x 11 items
    ("phi3.5-moe", (8,), (1, 32)),             # 1 token 2 x 50; 32: 4 rows per expert,
    ("deepseek-v3-like", (8, 32), (1, 4096)),  # the warp-specialized GEMM's; 1 token 8 x 16
    ("mixtral", (1, 8), (32, 4096)),           # 2 x 112 items from 1 token
])
def test_small_fp8_calls_run_on_16_row_m_tiles_where_their_items_fill_a_round(
        name, small, wide):
    """An FP8 call on the `tl` kernels (below the warp-specialized GEMM's rows per
    expert) whose expected layer0 items make at least a round of the programs runs on
    16-row m-tiles (``small_block_m``), the rest on the layer's 64; the tile table is
    sized for the smaller tiles, every pick is warmed up, and neither a layer with
    ``small_block_m=0`` nor a bf16 one ever switches."""
    from comet.config import GemmConfig
    from comet.quant import Fp8
    from comet.runtime.layer import fp8_tile
    from comet.runtime.selection import Selector
    cfg = preset(name).replace(fp8=Fp8(), max_tokens=4096)
    tile = fp8_tile(TileConfig(), warp_specialized=True)
    assert tile.gemm.block_m == 64 and tile.plan_block_m(True) == 16
    selection = Selector(cfg, 1, tile, 132, torch.device("cpu"), folder=None)
    for tokens, rows in [(t, 16) for t in small] + [(t, 64) for t in wide] + [(0, 64)]:
        assert selection.tile_for(tokens).gemm.block_m == rows, tokens
    for tokens in range(0, 4097, 37):
        rule = (tokens > 0 and not selection.ws_gemm_by_rule(tokens)
                and selection._expected_items(tokens) >= 132)
        picked = selection.tile_for(tokens)
        assert (picked.gemm.block_m == 16) is rule, tokens
        assert picked.gemm.block_m == 64 or not picked.variant.fp8_ws_min_rows, tokens
    assert {selection.tile_for(t) for t in range(0, 4097, 13)} <= set(
        selection.tile_variants())
    off = Selector(cfg, 1, tile.with_fields(small_block_m=0), 132, torch.device("cpu"),
                   folder=None)
    assert off.tile_for(small[0]).gemm.block_m == 64 and not off.may_small_rows
    assert all(t.gemm.block_m == 64 for t in off.tile_variants())
    assert tile.with_fields(small_block_m=0).plan_block_m(True) == 64
    bf16 = Selector(cfg.replace(fp8=None), 1, TileConfig(), 132, torch.device("cpu"),
                    folder=None)
    assert not bf16.may_small_rows and TileConfig().plan_block_m(False) == 128
    assert all(t.gemm.block_m == GemmConfig.block_m for t in bf16.tile_variants())


def test_the_decode_rule_keeps_large_calls_on_the_default_tile():
    # DBRX sizes, EP=1, 3000 tokens: 2304 default items in 17.5 waves, 4608 decode items
    # in 34.9 -- fewer columns per program, but the decode tile measured 1.45x slower.
    from comet.config import TileConfig
    assert not TileConfig().decode_pays(750, 16, 6144, 132)
    assert not TileConfig().with_fields(decode_block_n1=0).decode_pays(16, 2, 4096, 132)


SHIPPED_TABLES = sorted(tuned.SHIPPED.glob("*.json"))
HOPPER_SMS = 132                     # H100 SXM and H200: a split must leave GEMM blocks


def test_tables_are_shipped_for_the_presets():
    """H200 tables ship for every preset (world size 2 so far) and are found by default."""
    names = {p.name for p in SHIPPED_TABLES}
    for name in ("mixtral", "qwen2-moe", "phi3.5-moe", "deepseek-v3-like"):
        assert tuned.file_name(preset(name), 2, "NVIDIA_H200") in names, name


@pytest.mark.parametrize("path", SHIPPED_TABLES, ids=lambda p: p.name)
def test_each_shipped_table_is_current_and_matches_its_name(path):
    """A shipped table must load for the shape its name gives, for the TileConfig variant
    it records (a gathered layer's, e.g.). Tables of other kernels still load (and say
    so when a layer loads them): re-tune them on the device when the kernels change."""
    meta = json.loads(path.read_text())["meta"]
    cfg = MoEConfig(num_experts=meta["E"], top_k=meta["top_k"], hidden_size=meta["H"],
                    intermediate_size=meta["F"], dtype=torch.bfloat16)
    layout = meta.get("layout")
    tile = TileConfig().with_fields(**meta.get("tile", {}))
    assert path.name in tuned.file_names(cfg, meta["world_size"], meta["device_name"],
                                         layout, tile)
    expect = tuned.expected_meta(cfg, meta["world_size"], meta["device_name"], tile=tile,
                                 layout=layout)
    table = tuned.parse_table(json.loads(path.read_text()), expect)
    if layout is None:      # the presets' expert-parallel tables: every default bucket
        assert sorted(table) == list(tune.DEFAULT_TOKENS)
    else:                   # a TP layout's: the buckets it was tuned at (docs/tuning.md)
        assert set(table) <= set(tune.DEFAULT_TOKENS) and len(table) >= 4
    assert all(max(c.layer0, c.layer1) < HOPPER_SMS for c in table.values())


def test_a_split_is_timed_on_every_routing_of_the_mix(monkeypatch):
    """bucket_timer times each routing (the slowest rank's median) and returns the mean:
    a split that ties on uniform routing but loses on a hot expert is not chosen."""
    timed_on = []
    cost = {"uniform": {0: (100.0, 50.0), 32: (99.0, 50.0)},
            "skewed": {0: (120.0, 60.0), 32: (140.0, 60.0)}}

    def make_input_sets(cfg, name, tokens, routing, n, rank, seed, device):
        from types import SimpleNamespace
        return [SimpleNamespace(x=routing, topk_ids=None, topk_weights=None)] * n

    monkeypatch.setattr(tune, "make_input_sets", make_input_sets)
    args = tune.build_parser().parse_args(["--config", "mixtral", "--routings", "uniform",
                                           "skewed"])

    class Layer:
        from comet.mesh import MeshLayout
        mesh, convention = MeshLayout(), "sequence"

        def __call__(self, x, ids, weights, comm_blocks, timer, decode_tile, tile_overrides):
            # Explicit tile fields: what is timed never depends on installed tables.
            assert tile_overrides == {}
            timed_on.append((x, comm_blocks))
            timer.seen = (x, comm_blocks)

    def fake_time_calls(call, n_sets, iters, warmup, device, make_timer):
        timer = type("T", (), {})()
        call(0, timer)
        routing, n = timer.seen
        t0, t1 = cost[routing][n]
        return {"layer0": [t0], "layer1": [t1]}
    monkeypatch.setattr(tune, "time_calls", fake_time_calls)
    monkeypatch.setattr(tune, "reduce_over_ranks", lambda series: series)
    timer = tune.bucket_timer(Layer(), None, 4096, args, None, 0)
    assert timer(0) == (110.0, 55.0) and timer(32) == (119.5, 55.0)
    assert [r for r, _ in timed_on] == ["uniform", "skewed"] * 2
    args = tune.build_parser().parse_args(["--config", "mixtral"])      # default: uniform
    assert tune.bucket_timer(Layer(), None, 4096, args, None, 0)(32) == (99.0, 50.0)


def test_resuming_with_another_routing_mix_measures_again(tmp_path, capsys):
    meta = tuned.expected_meta(CFG, 4, "cpu")
    path = _write(tmp_path)                        # no "routings": a uniform-only table
    assert set(tune.load_existing(str(path), meta, ["uniform"])["buckets"]) == {"128", "1024"}
    assert tune.load_existing(str(path), meta, ["uniform", "skewed"])["buckets"] == {}
    assert "measuring every bucket again" in capsys.readouterr().err


def test_tensor_parallel_tables_are_keyed_by_the_kernels_shape():
    """A (tp, ep) layer selects from the table of its kernels' shard-expert shape
    (E * tp experts F / tp wide, k * tp slots), which ``comet tune --tp`` writes."""
    from comet.mesh import MeshLayout
    from comet.runtime.virtual import virtual_group
    mesh = MeshLayout(tp=2, ep=1)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=64,
                    dtype=torch.float32, max_tokens=8)
    shards = [mesh.shard(r, torch.zeros(8, 64, 128), torch.zeros(8, 64, 64)) for r in range(2)]
    layers = virtual_group(cfg, [s["w13"] for s in shards],
                           [s["w2"] for s in shards], mesh=mesh, use_graphs=False)
    assert layers[0].selection.cfg == mesh.kernel_config(cfg) == layers[0].ws.cfg
    assert layers[0].selection.layout == "tp2-sequence"
    assert tuned.file_name(layers[0].ws.cfg, 2, "gpu", "tp2-sequence").startswith(
        "E=16,H=64,F=32,topk=4,ep=2,layout=tp2-sequence,")
    args = tune.build_parser().parse_args(["--config", "mixtral", "--tp", "2"])
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        tune.tuned_layer(cfg, args, torch.device("cpu"), 1, 0)


def test_tensor_parallel_tables_are_kept_apart_by_layout(tmp_path):
    """The two conventions of a TP layout, and an expert-parallel layer of the same
    kernel shape, each load only their own table: the best splits differ (qwen2-moe at
    TP=2 on 2x H200: the sequence table's splits were 1.02-1.07x slower than the analytic
    model's for the replicated convention, docs/tuning.md)."""
    from comet.mesh import MeshLayout
    mesh = MeshLayout(tp=2, ep=1)
    seq, repl = mesh.table_layout("sequence"), mesh.table_layout("replicated")
    assert (seq, repl, MeshLayout(tp=1, ep=2).table_layout("sequence")) == (
        "tp2-sequence", "tp2-replicated", None)
    data = {"meta": tuned.expected_meta(CFG, 4, "cpu", layout=seq),
            "buckets": {"128": {"layer0": 8, "layer1": 0}}}
    (tmp_path / tuned.file_name(CFG, 4, "cpu", seq)).write_text(json.dumps(data))
    assert tuned.lookup(CFG, 4, 100, "cpu", tmp_path, layout=seq).splits == (8, 0)
    assert tuned.lookup(CFG, 4, 100, "cpu", tmp_path, layout=repl) is None
    assert tuned.lookup(CFG, 4, 100, "cpu", tmp_path) is None
    # The same table under the expert-parallel name is refused by its meta.
    (tmp_path / tuned.file_name(CFG, 4, "cpu")).write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="tuned for the layout tp2-sequence, this layer is ep"):
        assert tuned.lookup(CFG, 4, 100, "cpu", tmp_path) is None


@pytest.mark.parametrize("name, last_small", [("mixtral", 512), ("qwen2-moe", 256),
                                              ("deepseek-v3-like", 32)])
def test_the_small_plan_gate_counts_the_plans_token_blocks(name, last_small):
    """A call plans in two launches (open_kernel, the layout placing) while its tokens make
    at most ``small_plan_blocks`` (16) of the plan's blocks of 64 slots in at most two of
    the opening's steps: 512 tokens at top-2 (16 blocks, one step of 16 at 8 experts),
    256 at top-4 (16 blocks, two steps of 8 at 64 experts), 32 at top-8 (4 blocks, two
    steps of 2 at 256 experts); one more token and it plans in seven. The rule is the
    rank's own -- no peer reads which plan a rank ran -- and every pick is warmed up."""
    from comet.runtime.selection import Selector
    selection = Selector(preset(name), 2, TileConfig(), 132, torch.device("cpu"), folder=None)
    for tokens, small in ((0, True), (1, True), (last_small, True), (last_small + 1, False),
                          (4096, False)):
        assert (selection.tile_for(tokens).variant.small_plan_blocks > 0) is small, tokens
    assert {selection.tile_for(t) for t in range(0, 600)} <= set(selection.tile_variants())
    never = Selector(preset(name), 2, TileConfig().with_fields(small_plan_blocks=0), 132,
                     torch.device("cpu"), folder=None)
    assert not never.may_small_plan and never.tile_for(1).variant.small_plan_blocks == 0
    with pytest.raises(ValueError, match="small_plan_blocks"):
        TileConfig().with_fields(small_plan_blocks=-1)
