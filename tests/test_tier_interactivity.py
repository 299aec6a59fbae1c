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
