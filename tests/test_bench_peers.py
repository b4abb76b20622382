"""`comet bench --peers` on the CPU: peers that cannot run here, fake peers in the
registry (columns, output check, best peer), ranks agreeing on every verdict, and the
DeepEP adapter's expert math around a stand-in for DeepEP's buffer."""

import glob
import subprocess
import sys

import pytest
import torch

from comet.baseline import ep_moe_forward
from comet.bench import peers
from comet.bench import records as rec
from comet.bench import report
from comet.bench.runner import Fused
from comet.bench.timing import PhaseClock
from comet.cli import bench
from test_bench import SMALL, FakeFusedMoE


# --------------------------------------------------------------------------- fakes
class Calls:
    """How often each fake peer's layer and close ran."""

    def __init__(self):
        self.layer: dict[str, int] = {}
        self.closed: dict[str, int] = {}


def fake_peer(name: str, calls: Calls, output: str = "right", build_error: str | None = None,
              rank_wrong: int | None = None) -> peers.Peer:
    """A registry entry whose layer is comet's unfused baseline (``output="right"``), zeros
    (``"wrong"``; on rank ``rank_wrong`` only, if given) or an exception (``"raise"``);
    ``build_error`` makes every build refuse the config."""
    def load(device, world):
        def build(cfg, w13, w2, group, device):
            if build_error is not None:
                raise peers.PeerUnavailable(build_error)

            def layer(x, topk_ids, topk_weights):
                calls.layer[name] = calls.layer.get(name, 0) + 1
                if output == "raise":
                    raise RuntimeError("kernel exploded")
                y = ep_moe_forward(x, topk_ids, topk_weights, w13, w2, group).to(x.dtype)
                wrong = output == "wrong" and rank_wrong in (None, _rank())
                return torch.zeros_like(y) if wrong else y

            def close():
                calls.closed[name] = calls.closed.get(name, 0) + 1
            return peers.PeerLayer(name, layer, f"{name} backend", close)
        return build
    return peers.Peer(name, load)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_initialized() else 0


@pytest.fixture
def fake_fused(monkeypatch):
    def build(cfg, w13, w2, group, device):
        return Fused(FakeFusedMoE(cfg, w13, w2, group), lambda: PhaseClock(device)), None
    monkeypatch.setattr(bench, "_build_fused", build)


# --------------------------------------------------------------------------- the CLI
def test_peers_that_cannot_run_here_show_a_dash_and_why(tmp_path, capsys):
    argv = SMALL + ["--layers", "layer0", "moe", "--peers", "deepep", "megatron",
                    "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "note: peer deepep unavailable: needs a CUDA GPU" in out
    assert "note: peer megatron unavailable: needs a CUDA GPU" in out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    for r in rec.read_json(path):
        assert r["peer_deepep_us"] is None and r["peer_megatron_us"] is None
        assert r["best_peer"] is None and r["speedup_vs_best_peer"] is None
        assert r["peers"]["deepep"] == {"status": "unavailable", "reason": "needs a CUDA GPU"}
    md = open(path[:-5] + ".md").read()
    assert "## Against the peers" in md and "| deepep us | megatron us |" in md
    assert "| cpu-tiny | 16 | uniform | - | " in md
    assert "- peer megatron unavailable: needs a CUDA GPU" in md


def test_without_peers_no_peer_columns(tmp_path, capsys):
    assert bench.main(SMALL + ["--layers", "moe", "--output-dir", str(tmp_path)]) == 0
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    [r] = rec.read_json(path)
    assert "peers" not in r and not rec.peer_names(r) and r["best_peer"] is None
    assert "Against the peers" not in open(path[:-5] + ".md").read()


def test_fake_peers_are_checked_then_timed(tmp_path, capsys, monkeypatch, fake_fused):
    calls = Calls()
    for name, kw in {"good": {}, "bad": {"output": "wrong"}, "boom": {"output": "raise"},
                     "picky": {"build_error": "no bf16 here"}}.items():
        monkeypatch.setitem(peers.PEERS, name, fake_peer(name, calls, **kw))
    iters, warmup = 2, 0
    argv = SMALL + ["--layers", "layer0", "moe", "--peers", "good", "bad", "boom", "picky",
                    "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    [path] = glob.glob(str(tmp_path / "bench-ep1-*.json"))
    layer0, moe = rec.read_json(path)
    # good: checked once, then timed (warm-up and timed iterations), whole layer only
    assert calls.layer["good"] == 1 + warmup + iters
    assert moe["peer_good_us"] > 0 and layer0["peer_good_us"] is None
    assert moe["peers"]["good"]["status"] == "timed"
    assert moe["peers"]["good"]["backend"] == "good backend"
    assert moe["max_rel_err"]["peer_good"] < 1e-6
    # bad: a wrong output is reported and never timed
    assert calls.layer["bad"] == 1 and moe["peer_bad_us"] is None
    assert moe["peers"]["bad"]["status"] == "wrong"
    assert moe["max_rel_err"]["peer_bad"] == pytest.approx(1.0)
    # boom: a peer that raises is reported, the sweep goes on
    assert calls.layer["boom"] == 1 and moe["peer_boom_us"] is None
    assert moe["peers"]["boom"] == {"backend": "boom backend", "max_rel_err": None,
                                    "status": "failed",
                                    "reason": "RuntimeError: kernel exploded"}
    # picky: refused at build time
    assert "picky" not in calls.layer
    assert moe["peers"]["picky"] == {"status": "unavailable", "reason": "no bf16 here"}
    assert calls.closed == {"good": 1, "bad": 1, "boom": 1}       # once per config
    # the best peer is the only one timed
    assert moe["best_peer"] == "good" and moe["best_peer_us"] == moe["peer_good_us"]
    assert moe["speedup_vs_best_peer"] == pytest.approx(moe["peer_good_us"] / moe["fused_us"])
    assert layer0["best_peer"] is None
    assert "best peer/b" in out and "note: peer good: good backend" in out
    assert "torch GEMM us" in out and "HBM floor us" in out     # the ratio's bounds
    assert "note: peer bad wrong (cpu-tiny, 16 tokens/rank, uniform), not timed: max " \
           "relative error 1 > 0.02" in out
    md = open(path[:-5] + ".md").read()
    assert "geomean best peer/b at >= 4096 tokens/rank - (target 1.2), at <= 128 " \
           "tokens/rank " in md


def test_unknown_peer_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--peers", "unknown"])
    err = capsys.readouterr().err
    assert "argument --peers: invalid choice: 'unknown'" in err and "deepep" in err


def test_comet_never_imports_the_peers():
    """The peers' packages are optional: importing comet, its bench CLI and the peer
    registry imports neither them nor (from comet itself) the registry."""
    code = ("import sys, comet; assert 'comet.bench.peers' not in sys.modules; "
            "import comet.cli.bench, comet.bench.peers; "
            "assert not {m.split('.')[0] for m in sys.modules} & {'deep_ep', 'megatron'}")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- records
def test_best_peer_is_the_fastest_timed_one():
    r = rec.derive(dict(fused_us=100.0, peer_a_us=300.0, peer_b_us=150.0, peer_c_us=None))
    assert rec.peer_names(r) == ["a", "b", "c"]
    assert (r["best_peer"], r["best_peer_us"]) == ("b", 150.0)
    assert r["speedup_vs_best_peer"] == pytest.approx(1.5)
    r = rec.derive(dict(fused_us=100.0, peer_a_us=None))
    assert r["best_peer"] is None and r["speedup_vs_best_peer"] is None
    r = rec.derive(dict(fused_us=None, peer_a_us=300.0))
    assert r["best_peer"] == "a" and r["speedup_vs_best_peer"] is None


def test_summary_holds_comet_to_the_best_peer():
    def record(tokens, best_over_b):
        return rec.derive(dict(config="mixtral", tokens_per_rank=tokens, routing="uniform",
                               layer="moe", baseline_us=2000.0, fused_us=1000.0,
                               peer_x_us=1000.0 * best_over_b))
    records = [record(128, 2.0), record(4096, 1.1), record(16384, 1.1 * 1.21)]
    [line] = report.summary(records)
    assert "geomean best peer/b at >= 4096 tokens/rank 1.21 (target 1.2), at <= 128 " \
           "tokens/rank 2.00 (target 1.5)" in line


# --------------------------------------------------------------------------- ranks agree
def _peer_ranks_worker(rank, world, store, results):
    import torch.distributed as dist
    torch.set_num_threads(1)  # forked: keep clear of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from comet.bench.inputs import make_expert_weights
        from comet.bench.runner import Case, Settings, run_case
        calls = Calls()
        peers.PEERS.update(
            good=fake_peer("good", calls),
            half=fake_peer("half", calls, output="wrong", rank_wrong=1),
            # refuses on rank 1 only: every rank must drop it
            odd=fake_peer("odd", calls, build_error="rank 1 says no") if rank == 1
            else fake_peer("odd", calls))
        cfg = bench.CONFIGS[bench.CPU_CONFIG].replace(dtype=torch.float32, max_tokens=16)
        device = torch.device("cpu")
        w13, w2 = make_expert_weights(cfg, cfg.num_experts // world, "cpu-tiny", rank, 0,
                                      device)
        loaded = peers.load_peers(["good", "half", "odd"], device, world)
        built = peers.build_peers(loaded, cfg, w13, w2, None, device)
        st = Settings(device=device, world=world, rank=rank, iters=2, warmup=0, n_sets=2)
        records = run_case(Case("cpu-tiny", cfg, 16, "uniform"), st, w13, w2,
                           layers=("moe",), peers=built)
        built.close()
        results.put((rank, "ok", records, calls.layer))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", repr(err), None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
def test_ranks_agree_on_every_peer_verdict(tmp_path):
    """A peer wrong on one rank is wrong on all, one refused on one rank is unavailable on
    all, and only the peer right everywhere is timed -- on every rank alike (a rank that
    timed a peer alone would wait in its collectives forever)."""
    import gloo_ranks
    codes, items = gloo_ranks.fork(_peer_ranks_worker, 2, tmp_path / "store", (), expected=2)
    assert codes == [0, 0], items
    for _, _, [moe], layer_calls in items:
        assert {n: s["status"] for n, s in moe["peers"].items()} == {
            "good": "timed", "half": "wrong", "odd": "unavailable"}
        assert moe["peers"]["odd"]["reason"] == "rank 1 says no"
        assert moe["max_rel_err"]["peer_half"] == pytest.approx(1.0)
        assert moe["peer_good_us"] > 0 and moe["peer_half_us"] is None
        assert layer_calls == {"good": 3, "half": 1}


# --------------------------------------------------------------------------- DeepEP
class StandInBuffer:
    """DeepEP's v1 ``Buffer`` interface on one process, as rank 0 of ``ranks``: dispatch
    keeps the tokens with an expert of rank 0 (its ids made local, other ranks' slots
    ``-1`` with weight 0, as DeepEP's intranode kernel writes them) and counts the rows
    per local expert; combine puts the rows back in their tokens' places."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def get_dispatch_layout(self, topk_ids, num_experts):
        self.local = num_experts // self.ranks
        in_rank = ((topk_ids >= 0) & (topk_ids < self.local)).any(dim=1)
        return None, None, None, in_rank, None

    def dispatch(self, x, *, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights):
        sent = is_token_in_rank.nonzero().squeeze(1)
        ids, weights = topk_idx[sent], topk_weights[sent]
        mine = ids < self.local
        recv_ids = torch.where(mine, ids, -1)
        counts = [int((recv_ids == e).sum()) for e in range(self.local)]
        return (x[sent], recv_ids, torch.where(mine, weights, 0.0), counts,
                (sent, x.shape[0]), None)

    def combine(self, y, handle):
        sent, tokens = handle
        return y.new_zeros(tokens, y.shape[1]).index_copy_(0, sent, y), None, None


@pytest.mark.parametrize("ranks", [1, 2])
def test_deepep_adapter_matches_the_baseline_on_its_experts(ranks):
    """The adapter's permutation, grouped GEMMs, weighted SiLU-gate and per-token sum on
    what DeepEP's dispatch hands a rank: rank 0's share of the layer, which the unfused
    baseline computes by dropping the ids of other ranks' experts."""
    from comet.bench.inputs import make_expert_weights, make_routing
    from comet.config import MoEConfig
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128,
                    dtype=torch.float32)
    el = cfg.num_experts // ranks
    w13, w2 = make_expert_weights(cfg, el, "deepep", 0, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids, weights = make_routing(48, cfg.num_experts, cfg.top_k, "skewed", g)
    x = torch.randn(48, cfg.hidden_size, generator=g)
    layer = peers.DeepEPLayer(StandInBuffer(ranks), w13, w2, cfg.num_experts, torch.int64)
    got = layer(x, ids, weights)
    want = ep_moe_forward(x, ids, weights, w13, w2)      # ids >= El dropped
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if ranks > 1:   # tokens with no expert on rank 0 get nothing from it
        assert (got[~(ids < el).any(dim=1)] == 0).all()


def test_weighted_silu_mul():
    gu = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    w = torch.tensor([0.5])
    want = torch.nn.functional.silu(gu[:, :2]) * gu[:, 2:] * 0.5
    torch.testing.assert_close(peers.weighted_silu_mul(gu, w), want)
    assert peers.weighted_silu_mul(gu.bfloat16(), w).dtype == torch.bfloat16


def test_fp8_records_with_a_peer_get_the_peer_table_with_a_dtype_column_when_mixed():
    def record(dtype, peer, us):
        return {"config": "mixtral", "tokens_per_rank": 8, "routing": "uniform",
                "layer": "moe", "dtype": dtype, "fused_us": 100.0, f"peer_{peer}_us": us,
                "best_peer": peer, "speedup_vs_best_peer": us / 100.0}
    fp8 = record("fp8", "mega-moe", 93.0)
    bf16 = record("bf16", "deepep", 120.0)
    dense = dict(fp8, layer="layer0")
    assert report.peer_rows([fp8, dense]) == [fp8]
    alone = report.text_table([fp8], report.peer_columns([fp8]))
    assert "mega-moe us" in alone and "dtype" not in alone and "0.93" in alone
    mixed = report.text_table([bf16, fp8], report.peer_columns([bf16, fp8]))
    assert "dtype" in mixed and "deepep us" in mixed and "mega-moe us" in mixed
    assert [line.split()[3] for line in mixed.splitlines()[2:]] == ["bf16", "fp8"]
