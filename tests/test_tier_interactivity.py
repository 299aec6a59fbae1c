"""The interactivity tier's arithmetic for runs without a lane cap (open loop) and runs whose GPU
count or power is unknown (a bench target): figures it cannot know are None, not numbers."""

from __future__ import annotations

import pytest

from agentkv.metrics.summary import Dist, Summary
from agentkv.metrics.tier import interactivity
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.formats import bundled_sample, load_paths

TIER = (20.0, 10.0)


def _summary(tpot_p50=0.04, ttft_p90=3.0):
    return Summary(kind="bench", tpot=Dist(p50=tpot_p50), ttft=Dist(p90=ttft_p90))


def test_no_lane_cap_offers_the_trees_in_progress():
    i = interactivity(_summary(), None, 8, 1000.0, TIER, mean_trees=3.4)
    assert i.met and i.sessions == 4 and i.agents == pytest.approx(3.4)
    assert i.agents_per_gpu == pytest.approx(3.4 / 8) and i.agents_per_mw == pytest.approx(3.4 / 0.008)
    none = interactivity(_summary(), None, 8, 1000.0, TIER)  # nothing sampled: one tree
    assert none.sessions == 1 and none.agents == 1.0
    capped = interactivity(_summary(), 2, 8, 1000.0, TIER, mean_trees=3.4)
    assert capped.sessions == 2 and capped.agents == 2.0  # never more agents than lanes


@pytest.mark.parametrize("gpus, power", [(None, 700.0), (8, None), (None, None), (0, 700.0)])
def test_unknown_gpus_or_power_give_no_per_gpu_or_per_mw_figure(gpus, power):
    i = interactivity(_summary(), 16, gpus, power, TIER, mean_trees=12.0)
    assert i.met and i.agents == 12.0 and i.agents_per_mw is None
    assert (i.agents_per_gpu is None) == (not gpus)
    if gpus:
        assert i.agents_per_gpu == pytest.approx(12.0 / gpus)


def test_uncapped_simulate_run_reports_its_mean_trees():
    traces = load_paths(bundled_sample())
    cfg = SimConfig(lanes=None, session_rate=0.05, max_requests=60, idle_gap_cap=None)
    i = simulate(traces, cfg).summary.interactivity
    assert i.mean_trees is not None and i.mean_trees > 0
    assert i.sessions == max(1, -int(-i.mean_trees // 1))  # the trees in progress, rounded up
    assert not i.met or i.agents == pytest.approx(i.mean_trees)


def test_trees_in_progress_is_the_time_mean_of_open_trees():
    from agentkv.metrics.records import RequestRecord
    from agentkv.metrics.tier import trees_in_progress

    def rec(tree, due, end):
        return RequestRecord(id=0, trace="t", session=tree, tree=tree, scheduled=due, end=end)

    # tree a from 0 to 10 (a think gap between its turns counts), tree b from 5 to 10: 15 / 10
    recs = [rec("a", 0, 2), rec("a", 6, 10), rec("b", 5, 10)]
    assert trees_in_progress(recs) == pytest.approx(1.5)
    assert trees_in_progress([]) is None and trees_in_progress([rec("a", 3, 3)]) is None


def test_bench_sweep_tier_knee_is_the_highest_load_meeting_the_tier():
    from agentkv.bench.sweep_view import tier_knee

    def row(met, agents, mw):
        return {
            "meets_tier": met,
            "agents": agents,
            "agents_per_gpu": None if agents is None else agents / 8,
            "agents_per_mw": mw,
            "tier": [20.0, 10.0],
            "power_basis": "DGX H200 provisioned 10.2 kW / 8 GPUs",
        }

    at, line = tier_knee([row(True, 2.0, 196.0), row(True, 3.9, 382.0), row(False, None, None)])
    assert at == 1 and "3.9 agents, 0.49 per GPU, 382 per MW (DGX H200" in line and "at least" not in line
    assert tier_knee([row(False, None, None)]) == (None, "tier: no point meets the interactivity tier")


def test_tier_marks_a_line_at_the_tier_and_rings_only_points_meeting_it():
    from agentkv.metrics.report_sweep import tier_marks

    line, rings = tier_marks(
        20.0, [10.0, 30.0, None, 45.0], [100.0, 50.0, 10.0, 80.0], [False, True, True, True]
    )
    assert (line.kind, line.xs, line.ys, line.dash) == ("line", [20.0, 20.0], [50.0, 100.0], True)
    assert (rings.kind, rings.xs, rings.ys) == ("rings", [30.0, 45.0], [50.0, 80.0])  # no x: not drawn
    assert (
        len(tier_marks(20.0, [10.0], [5.0], [False])) == 1 and tier_marks(20.0, [None], [1.0], [True]) == []
    )
