"""Open-loop session arrivals (`--session-rate`, `--arrivals`): count and spacing of arrivals with a
seed, lanes as a cap on trees at once, and the same arrivals over real HTTP."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentkv.bench.load import LoadConfig, load_notes
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.errors import UserError
from agentkv.trace.plan import ReplayPlan, simulate_schedule
from tests.planutil import req, trace


def many(n: int, turns: int = 1, think: float = 0.0) -> list:
    return [
        trace(f"s{i}", [req(j * 0.001, api=None, think=think if j else 0.0) for j in range(turns)])
        for i in range(n)
    ]


def starts(plan: ReplayPlan, service: float = 0.01, until: float | None = None) -> np.ndarray:
    """When each tree's first request was released (= its arrival when a lane was free)."""
    spans = simulate_schedule(plan, lambda it: service, until=until)
    return np.array(sorted(s.start for s in spans if s.item.index == 0 and s.item.depth == 0))


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    t = starts(ReplayPlan(many(3000), lanes=None, session_rate=20.0, seed=1))
    assert len(t) == 3000 and t[0] == 0.0
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / 20) < 0.05 / 20 * 2  # mean 50 ms within 5%
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # coefficient of variation of an exponential: 1
    assert abs(np.mean(gaps < np.log(2) / 20) - 0.5) < 0.03  # the median gap is ln 2 / rate
    # in a window, the count is about rate x window
    assert abs(np.sum(t < 50.0) - 1000) < 100


def test_arrivals_are_seeded_and_constant_ones_are_even():
    a = starts(ReplayPlan(many(50), lanes=None, session_rate=5.0, seed=7))
    b = starts(ReplayPlan(many(50), lanes=None, session_rate=5.0, seed=7))
    c = starts(ReplayPlan(many(50), lanes=None, session_rate=5.0, seed=8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    k = starts(ReplayPlan(many(50), lanes=None, session_rate=5.0, arrivals="constant"))
    assert np.allclose(np.diff(k), 0.2)
    # until stops arrivals: 2 s at 5/s is 11 trees (t = 0, 0.2, ..., 2.0)
    assert (
        len(starts(ReplayPlan(many(50), lanes=None, session_rate=5.0, arrivals="constant"), until=2.0)) == 11
    )


def test_lanes_cap_trees_at_once_and_late_trees_wait_for_a_free_one():
    # 10 trees of 3 turns, each turn 1 s, arriving every 0.1 s: at most 2 run at once
    plan = ReplayPlan(many(10, turns=3), lanes=2, session_rate=10.0, arrivals="constant", idle_gap_cap=None)
    spans = simulate_schedule(plan, lambda it: 1.0)
    assert len(spans) == 30
    assert {s.item.lane for s in spans} == {0, 1}
    for t in np.arange(0, 15, 0.05):
        assert len({s.item.tree_key for s in spans if s.start <= t < s.end}) <= 2
    a = plan.arrivals
    assert a.arrived == 10 and a.delayed == 8 and a.backlog == 0
    first = sorted(s.start for s in spans if s.item.index == 0)
    assert first[:2] == [0.0, 0.1] and first[2] == pytest.approx(
        3.002
    )  # the third waits for lane 0 (3 turns of 1 s + 1 ms gaps)
    # without a cap, every tree starts on arrival on its own lane
    free = ReplayPlan(many(10, turns=3), lanes=None, session_rate=10.0, arrivals="constant")
    assert np.allclose(starts(free, service=1.0), np.arange(10) * 0.1)


def test_idle_cap_does_not_move_arrivals():
    # a slow rate with long think gaps: the plan-wide idle cap shortens the gaps, not the arrivals
    plan = ReplayPlan(
        many(4, turns=2, think=30.0), lanes=None, session_rate=0.1, arrivals="constant", idle_gap_cap=1.0
    )
    spans = simulate_schedule(plan, lambda it: 0.5)
    firsts = sorted(s.start for s in spans if s.item.index == 0)
    assert np.allclose(firsts, [0, 10, 20, 30])
    seconds = {s.item.tree_key: s.start for s in spans if s.item.index == 1}
    assert seconds["s0#0"] == pytest.approx(1.5)  # ended at 0.5, idle cap 1 s instead of a 30 s gap


def test_bad_rates_and_arrival_kinds_are_one_line_errors():
    for kw, what in (
        ({"session_rate": 0.0}, "session_rate"),
        ({"session_rate": float("nan")}, "session_rate"),
        ({"session_rate": 1.0, "arrivals": "bursty"}, "arrivals"),
        ({"session_rate": 1.0, "lanes": 0}, "lanes"),
        ({"lanes": None}, "lanes"),
    ):
        with pytest.raises(UserError, match=what):
            ReplayPlan(many(2), **kw)


def test_session_rate_over_http_starts_trees_on_time():
    """Real HTTP: 1 s at 10 trees/s, constant: 10 or 11 trees, first requests ~100 ms apart."""
    traces = many(40, turns=2)

    async def go():
        async with StreamTestServer(behave=lambda b, n: Behaviour(itl=0.002)) as srv:
            cfg = BenchConfig(
                srv.url, lanes=None, session_rate=10.0, arrivals="constant", duration=1.0, monitor_gpu=False
            )
            return await BenchRun(cfg, traces).run()

    res = asyncio.run(go())
    firsts = sorted(r.scheduled for r in res.records if r.index == 0)
    assert len(firsts) in (10, 11)
    assert np.allclose(np.diff(firsts), 0.1, atol=0.01)
    assert res.summary.config["session_rate"] == 10.0 and res.summary.config["arrivals"] == "constant"
    assert any("session trees arrived (constant, 10/s" in n for n in res.summary.notes)
    assert all(r.ok for r in res.records) and len({r.lane for r in res.records}) >= 1


def test_the_session_rate_is_in_target_seconds_like_every_reported_figure():
    cfg = BenchConfig("http://127.0.0.1:9", lanes=None, session_rate=3.0, time_scale=4.0)
    assert BenchRun(cfg, many(2)).plan.arrivals.rate == 12.0  # a target 4x faster: 12 a wall second


def test_a_session_rate_over_timestamp_traces_says_it_had_no_effect():
    stamped = [trace("m", [req(0.0), req(0.5)], replay="timestamp")]
    plan = ReplayPlan(stamped, lanes=None, session_rate=5.0)
    spans = simulate_schedule(plan, lambda it: 0.1)
    assert [s.start for s in spans] == [0.0, 0.5] and plan.arrivals.arrived == 0  # their own timeline
    notes = load_notes(LoadConfig(lanes=None, session_rate=5.0), plan, 0)
    assert any(n.startswith("--session-rate had no effect: timestamp-mode traces") for n in notes)
