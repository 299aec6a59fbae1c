"""A wide-EP decode pool behind a disaggregated prefill pool: each pool's TP, DP and EP, the decode
ranks priced as an aggregated wide-EP rank, hit rates against an aggregated wide-EP run, and
one-line errors for bad pool specs (the what-if rack rows: tests/test_whatif_deploy.py)."""

import math
from dataclasses import replace

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.sim.cluster import Cluster, SimConfig, simulate
from agentkv.sim.deploy import pool_engine, total_gpus
from agentkv.sim.disagg import DisaggCluster
from agentkv.trace.formats import bundled_sample, load_paths

V3 = EngineConfig(model="deepseek-v3", max_model_len=200_000)
RACK = "gb300-nvl72"
BATCHES = [((), [4096] * 32), ((), [60_000] * 4), (((2048, 0),), [8192] * 8)]


@pytest.fixture(scope="module")
def sample():
    return load_paths(bundled_sample())


def _wide_decode(dp: int, decode: int = 8, ep: bool = True, **kw) -> SimConfig:
    """TP 8 prefill engines feeding `decode` ranks of a `dp`-rank decode group (TP 1)."""
    pools = dict(prefill_workers=1, decode_workers=decode, prefill_tensor_parallel_size=8)
    pools.update(
        decode_tensor_parallel_size=1, decode_data_parallel_size=dp, decode_enable_expert_parallel=ep
    )
    return SimConfig(**{"engine": V3, "system": RACK, "lanes": 2, "max_requests": 10, **pools, **kw})


def _agg_rank_cost(sample, dp: int):
    """The cost model of one rank of an aggregated `-tp 1 -dp dp -ep` run (the --wide-ep slice)."""
    eng = replace(V3, data_parallel_size=dp, enable_expert_parallel=True)
    cfg = SimConfig(engine=eng, system=RACK, lanes=1)
    return Cluster(sample, cfg).workers[0].engine.cost


def test_decode_ranks_step_like_an_aggregated_wide_ep_rank(sample):
    """Each decode engine is one rank of its DP group: its step time is the aggregated wide-EP
    rank's, the all-to-all per token grows with the group, and 8 engines of a 72-rank group (a
    slice) are priced over all 72. The TP 8 prefill engines keep no all-to-all."""
    a2a = []
    for dp in (8, 24, 72):
        c = DisaggCluster(sample, _wide_decode(dp))
        dec, pre = c.workers[-1].engine.cost, c.workers[0].engine.cost
        ref = _agg_rank_cost(sample, dp)
        for prefills, decodes in BATCHES:
            assert dec.step_time(prefills, decodes) == ref.step_time(prefills, decodes)
        assert (dec.tp, dec.dp, dec.ep) == (1, dp, True) and (pre.tp, pre.dp, pre.ep) == (8, 1, False)
        assert pre.terms().a2a_tok == 0.0 and total_gpus(c.cfg) == 8 + 8
        a2a.append(dec.terms().a2a_tok)
    assert a2a[0] < a2a[1] < a2a[2]
    # --no-decode-enable-expert-parallel: experts split by width, no all-to-all
    flat = DisaggCluster(sample, _wide_decode(8, ep=False)).workers[-1].engine.cost
    assert flat.terms().a2a_tok == 0.0 and not flat.ep


def test_pools_default_to_the_global_dp_and_ep():
    """Without pool flags both pools take -dp/-ep (as the TP flags default to -tp)."""
    eng = EngineConfig(model="deepseek-v3", data_parallel_size=16, enable_expert_parallel=True)
    cfg = SimConfig(engine=eng, prefill_workers=2, decode_workers=16, decode_data_parallel_size=32)
    p, d = pool_engine(cfg, eng, "prefill"), pool_engine(cfg, eng, "decode")
    assert (p.data_parallel_size, p.enable_expert_parallel) == (16, True)
    assert (d.data_parallel_size, d.enable_expert_parallel) == (32, True)


def test_free_transfer_matches_the_aggregated_wide_ep_hit_rate(sample):
    """Free KV moves, session routing on both: the decode pool of 4 wide-EP ranks (behind a TP 8
    prefill engine) holds what an aggregated run of the same 4 ranks holds, block for block, and
    hits as it does; the prefill engine's hit rate matches too. Its summary names the pools."""
    eng = replace(V3, data_parallel_size=4, enable_expert_parallel=True)
    base = dict(engine=eng, lanes=6, max_requests=120, system=RACK)
    agg = simulate(sample, SimConfig(**base, workers=4, router="session")).summary
    dis_cfg = _wide_decode(
        4, decode=4, **{**base, "engine": V3}, kv_link_gbps=math.inf, decode_router="session"
    )
    dis = simulate(sample, dis_cfg).summary
    assert dis.succeeded == agg.succeeded == 120 and dis.failed == 0
    assert dis.config["decode_num_gpu_blocks"] == agg.config["num_gpu_blocks"]
    assert dis.disagg.decode_hit_rate == pytest.approx(agg.cache.metrics, abs=1e-12)
    assert dis.disagg.prefill_hit_rate == pytest.approx(agg.cache.metrics, abs=1e-12)
    assert dis.config["gpus"] == 8 + 4 and agg.config["gpus"] == 4
    assert dis.config["decode_data_parallel_size"] == 4 and dis.config["decode_enable_expert_parallel"]
    assert dis.config["prefill_data_parallel_size"] == 1 and not dis.config["prefill_enable_expert_parallel"]
    assert "1x prefill (tp=8) + 4x decode (tp=1, dp=4, ep)" in dis.target


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--disagg", "prefill=1,decode=5", "--decode-data-parallel-size", "4"], "--disagg decode=5"),
        (["--disagg", "1p1d", "--decode-data-parallel-size", "0"], "--decode-data-parallel-size"),
        (["--disagg", "prefill=3,decode=1", "--prefill-data-parallel-size", "2"], "--disagg prefill=3"),
        (["--disagg", "1p1d", "--prefill-data-parallel-size", "-2"], "--prefill-data-parallel-size"),
        (["--disagg", "1p1d", "--decode-enable-expert-parallel"], "--decode-enable-expert-parallel"),
    ],
)
def test_bad_pool_specs_are_one_line_errors(argv, needle, capsys):
    assert main(["simulate", "-q", "--max-requests", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
