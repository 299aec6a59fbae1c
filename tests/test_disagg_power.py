"""Systems, provisioned power and agents per MW: the arithmetic the per-MW figures rest on, and the
engine hook that admits a request whose prompt KV arrived from elsewhere."""

import json

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.hardware import SYSTEMS, get_gpu, get_system
from agentkv.errors import UserError
from agentkv.metrics.summary import Dist, Summary
from agentkv.metrics.tier import interactivity, knee, parse_tier, power_mw
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.formats import bundled_sample, load_paths


def test_racks_are_72_gpus_in_one_nvlink_domain_with_sourced_power():
    for name, gpu in (("gb300-nvl72", "GB300"), ("vr-nvl72", "Rubin VR200")):
        s = get_system(name)
        assert s.gpus == s.nvlink_domain == 72 and get_gpu(s.gpu).name == gpu
        assert "kW" in s.source and s.power_kw > 100
    assert get_system("GB300 NVL72").power_w_per_gpu == pytest.approx(142_000 / 72)
    assert all(s.source and get_gpu(s.gpu) for s in SYSTEMS)
    for part in ("b200", "b300", "mi355x"):
        assert get_gpu(part).power_w >= 1000
    with pytest.raises(UserError, match="GB300 NVL72"):
        get_system("nvl-nothing")


def _summary(tpot_p50, ttft_p90, valid=True):
    return Summary(kind="simulate", tpot=Dist(p50=tpot_p50), ttft=Dist(p90=ttft_p90), valid=valid)


def test_agents_per_gpu_and_per_mw_arithmetic():
    """64 sessions on one 72-GPU rack of 142 kW meeting the tier: 64/72 per GPU, 64/0.142 per MW."""
    assert power_mw(72, 142_000 / 72) == pytest.approx(0.142)
    i = interactivity(_summary(0.04, 3.0), 64, 72, 142_000 / 72, (20.0, 10.0))
    assert i.met and i.tps_per_user_p50 == pytest.approx(25.0)
    assert i.agents_per_gpu == pytest.approx(64 / 72) and i.agents_per_mw == pytest.approx(64 / 0.142)
    slow = interactivity(_summary(0.06, 3.0), 128, 72, 1972.2, (20.0, 10.0))  # 16.7 tok/s per user
    late = interactivity(_summary(0.04, 11.0), 96, 72, 1972.2, (20.0, 10.0))  # TTFT p90 over 10 s
    bad = interactivity(_summary(0.04, 1.0, valid=False), 200, 72, 1972.2, (20.0, 10.0))
    assert not (slow.met or late.met or bad.met) and slow.agents_per_mw is None
    assert knee([slow, i, late, bad]) is i and knee([slow]) is None


def test_parse_tier():
    assert parse_tier("tps=20,ttft_p90=10s") == (20.0, 10.0)
    assert parse_tier("ttft_p90=500ms") == (20.0, 0.5)
    for bad in ("tps=-1", "tps=", "ttft_p90=0", "speed=3", "tps=1e400x"):
        with pytest.raises(UserError, match="--tier"):
            parse_tier(bad)


def test_per_mw_uses_the_systems_provisioned_share():
    """With --system the per-MW figures divide by the system's nameplate share per GPU."""
    traces = load_paths(bundled_sample())
    cfg = SimConfig(engine=EngineConfig(max_model_len=200_000), lanes=4, max_requests=40, system="dgx-h200")
    s = simulate(traces, cfg).summary
    share = 10_200 / 8
    assert s.config["power_w_per_gpu"] == pytest.approx(share) and s.config["engine"]["gpu"] == "h200"
    tp = s.throughput
    assert tp.million_total_tokens_per_s_per_mw == pytest.approx(tp.total_tokens_per_s / (share / 1e6) / 1e6)
    i = s.interactivity
    assert i.sessions == 4 and 0 < i.mean_trees <= 4
    assert not i.met or i.agents_per_mw == pytest.approx(i.mean_trees / (share / 1e6))


def test_external_tokens_are_allocated_not_computed():
    """A request whose prompt KV arrived: its first step computes one token, yet holds the whole prompt."""
    eng = Engine(EngineConfig(max_model_len=8192, num_gpu_blocks_override=1000))
    eng.add_request("a", max_tokens=3, prompt_len=1000, block_hashes=list(range(62)), external_tokens=999)
    res = eng.step()
    assert res.num_prefill_tokens == 1 and eng.stats.prompt_tokens == 1
    assert eng.active_blocks >= 1000 // 16 and len(res.outputs) == 1
    cold = Engine(EngineConfig(max_model_len=8192, num_gpu_blocks_override=1000))
    cold.add_request("a", max_tokens=3, prompt_len=1000, block_hashes=list(range(62)))
    assert cold.step().end > 2 * (res.end - res.start)  # 1,000 tokens of prefill vs one
    with pytest.raises(ValueError, match="external_tokens"):
        eng.add_request("b", max_tokens=1, prompt_len=10, external_tokens=10)


def test_lanes_sweep_reports_the_knee(capsys):
    """A lanes sweep names the most lanes meeting the tier, per GPU and per MW of the named system;
    a tier nothing meets says so."""
    from agentkv.cli import main

    base = ["simulate", "-q", "--max-requests", "12", "--max-model-len", "200000", "--system", "dgx-h200"]
    assert main([*base, "--sweep", "lanes=1,2"]) == 0
    out = capsys.readouterr().out
    out = " ".join(out.split())
    assert "knee (all points): at least 2 lanes" in out and "agents/MW" in out and "10.2 kW" in out
    assert main([*base, "--sweep", "lanes=1,2", "--tier", "tps=100000"]) == 0
    assert "no point meets the tier" in capsys.readouterr().out
    assert main([*base, "--sweep", "lanes=1..3", "--json"]) == 0  # the search: 1, 3 (met), done
    points = json.loads(capsys.readouterr().out)
    assert [p["overrides"]["lanes"] for p in points] == ["1", "3"]
    assert all(p["summary"]["interactivity"]["met"] for p in points)


def test_bisection_finds_the_knee_within_tolerance():
    """Met up to 37 lanes: the search brackets 37 within 10% in a handful of runs, and says when
    even the bottom of the range misses or the top still meets."""
    from agentkv.sim.knee import bisect_lanes, split_range

    def run_for(limit):
        ran = []

        def run(lanes):
            ran.append(lanes)
            s = _summary(0.04 if lanes <= limit else 0.08, 1.0)
            s.interactivity = interactivity(s, lanes, 8, 1275.0, (20.0, 10.0))
            return s

        return run, ran

    run, ran = run_for(37)
    pts = bisect_lanes(run, 1, 512)
    best = max(n for n, s in pts if 1.0 / s.tpot.p50 >= 20)
    assert 34 <= best <= 37 and len(ran) <= 12 and ran[:2] == [1, 512]
    assert all((1.0 / s.tpot.p50 >= 20) == (n <= 37) for n, s in pts)
    run, ran = run_for(0)
    assert [n for n, _ in bisect_lanes(run, 1, 512)] == [1]
    assert split_range(["lanes=2..64", "router=kv_aware"]) == (["router=kv_aware"], (2, 64))
    for bad in ("lanes=64..2", "lanes=0..4", "lanes=a..b"):
        with pytest.raises(UserError, match="--sweep lanes"):
            split_range([bad])


def test_cycle_needs_an_end_and_agents_count_trees_in_progress():
    """--cycle without --duration would never end; a run's agents are the trees it kept in progress
    (a bundled sample of a few traces cannot keep 64 lanes busy without --cycle)."""
    with pytest.raises(UserError, match="--cycle"):
        SimConfig(cycle=True)
    traces = load_paths(bundled_sample())
    eng = EngineConfig(max_model_len=200_000)
    dry = simulate(traces, SimConfig(engine=eng, lanes=64, max_requests=60, system="dgx-h200")).summary
    busy = simulate(
        traces, SimConfig(engine=eng, lanes=64, cycle=True, duration=120.0, system="dgx-h200")
    ).summary
    n_traces = len(traces)
    assert dry.interactivity.mean_trees <= n_traces < 64
    assert busy.interactivity.mean_trees > 0.9 * 64
