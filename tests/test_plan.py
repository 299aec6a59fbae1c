"""The replay plan: gaps, lanes, sub-agents and joins, idle caps, warm start, timestamps, determinism."""

from __future__ import annotations

from collections import Counter

import pytest
from planutil import by_key, example, recorded, req, sub, trace

from agentkv.errors import UserError
from agentkv.trace.plan import ReplayPlan, simulate_schedule


# ---- gaps -------------------------------------------------------------------------------------
def test_think_gaps_are_end_to_start_and_exact():
    t = trace("g", [req(0), req(3, think=2), req(10, think=6)])
    got = by_key(simulate_schedule(ReplayPlan([t], lanes=1), lambda it: 2.0))
    assert got == {("g", 0): (0.0, 2.0), ("g", 1): (4.0, 6.0), ("g", 2): (12.0, 14.0)}
    half = by_key(simulate_schedule(ReplayPlan([t], lanes=1, time_scale=0.5), lambda it: 2.0))
    assert [half[("g", i)][0] for i in range(3)] == [0.0, 3.0, 8.0]


def test_gaps_derived_from_t_when_trace_has_no_think_times():
    t = trace("d", [req(0, api=1.5), req(4, api=None), req(6)])  # gaps: 4-0-1.5, then 6-4 (no api)
    got = by_key(simulate_schedule(ReplayPlan([t], lanes=1), lambda it: 1.0, start=100.0))
    assert [got[("d", i)][0] for i in range(3)] == [100.0, 103.5, 106.5]


# ---- sub-agents -------------------------------------------------------------------------------
def test_example_with_recorded_service_times_reproduces_the_recording():
    got = by_key(simulate_schedule(ReplayPlan([example()], lanes=1, idle_gap_cap=None), recorded))
    assert {k: v[0] for k, v in got.items()} == {
        ("P", 0): 0,
        ("P", 1): 5,
        ("P", 2): 9,
        ("P", 3): 16,
        ("P/A", 0): 8,
        ("P/A", 1): 13,
    }


def test_subagent_overlaps_parent_and_parent_joins_it():
    slow_a = lambda it: recorded(it) * (2 if it.depth else 1)  # noqa: E731  the sub-agent runs 2x slower
    spans = simulate_schedule(ReplayPlan([example()], lanes=1, idle_gap_cap=None), slow_a)
    got = by_key(spans)
    assert got[("P/A", 0)] == (8.0, 14.0)  # spawned 1 s after r1 ended (7), as recorded (8 - 5 - 2)
    assert got[("P", 2)] == (9.0, 10.0)  # r2 runs while A runs: A's recorded end (14) is after t=9
    assert got[("P/A", 1)] == (16.0, 18.0)
    assert got[("P", 3)] == (18.0, 19.0)  # r3 (t=16 >= A's end 14) waits for A: max(10 + 6, 18)
    assert all(s.item.tree_key == "P#0" for s in spans)
    assert {s.item.session_key for s in spans} == {"P#0", "P/A#0"}


def test_docs_worked_timeline():
    """The table in docs/replay.md, row by row."""
    q = trace("Q", [req(0, api=1), req(40, api=1, think=39)])
    slow_a = lambda it: recorded(it) * (2 if it.depth else 1)  # noqa: E731
    spans = simulate_schedule(ReplayPlan([example(), q], lanes=1), slow_a)
    rows = [(s.item.id, s.item.session_key, s.item.index, s.start, s.end) for s in spans]
    assert rows == [
        (0, "P#0", 0, 0, 2),
        (1, "P#0", 1, 5, 7),
        (2, "P/A#0", 0, 8, 14),
        (3, "P#0", 2, 9, 10),
        (4, "P/A#0", 1, 16, 18),
        (5, "P#0", 3, 18, 19),
        (6, "Q#0", 0, 19, 20),
        (7, "Q#0", 1, 30, 31),
    ]


def test_lane_pulls_next_trace_only_after_whole_tree_drains():
    bg = sub("T1/bg", 1.5, [req(0, api=20)])  # outlives its parent: recorded end 21.5, gates nothing
    t1 = trace("T1", [req(0, api=1), req(2, think=1)], [bg])
    t2, t3 = trace("T2", [req(0), req(5, think=4)]), trace("T3", [req(0)])
    spans = simulate_schedule(ReplayPlan([t1, t2, t3], lanes=2, idle_gap_cap=None), recorded)
    got = by_key(spans)
    assert got[("T1", 1)] == (2.0, 3.0)  # the root is done at 3 ...
    assert got[("T1/bg", 0)] == (1.5, 21.5)
    assert got[("T2", 1)][1] == 6.0  # lane 1 drains at 6 and pulls T3, not lane 0 (busy until 21.5)
    t3_item = next(s for s in spans if s.item.trace.id == "T3")
    assert (t3_item.start, t3_item.item.lane) == (6.0, 1)


def test_failed_requests_still_advance_their_session():
    plan = ReplayPlan([example()], lanes=1, idle_gap_cap=None)
    spans = simulate_schedule(plan, recorded, ok=lambda it: it.index % 2 == 0)
    assert len(spans) == 6 and plan.failed == 3 and plan.completed == 6 and plan.done


def test_warm_start_skips_subagents_anchored_before_the_cut():
    t = trace("W", [req(0), req(5, think=4), req(20, think=14)], [sub("W/A", 6.5, [req(0)])])
    cuts = {}
    for seed in range(30):
        spans = simulate_schedule(ReplayPlan([t], lanes=1, warm_start=True, seed=seed), recorded)
        first = spans[0].item
        cuts[seed] = first.index
        assert spans[0].start == 0.0 and first.resumed == (first.index > 0)
        assert [s.item.index for s in spans if s.item.depth == 0] == list(range(first.index, 3))
        assert any(s.item.depth for s in spans) == (first.index <= 1)  # A hangs off request 1
    assert set(cuts.values()) == {0, 1, 2}
    again = simulate_schedule(ReplayPlan([t], lanes=1, warm_start=True, seed=7), recorded)
    assert again[0].item.index == cuts[7]


def test_warm_start_only_cuts_each_lanes_first_trace():
    ts = [trace(f"w{i}", [req(j * 3.0, think=2) for j in range(8)]) for i in range(4)]
    spans = simulate_schedule(ReplayPlan(ts, lanes=2, warm_start=True, seed=3), recorded)
    firsts = {}
    for s in spans:
        firsts.setdefault(s.item.trace.id, s.item.index)
    assert firsts["w2"] == firsts["w3"] == 0
    assert sum(1 for s in spans if s.item.resumed) == sum(1 for k in ("w0", "w1") if firsts[k])


# ---- idle caps --------------------------------------------------------------------------------
def test_plan_idle_cap_shortens_gaps_only_when_nothing_is_in_flight():
    t = trace("I", [req(0, api=1), req(101, think=100)])
    assert by_key(simulate_schedule(ReplayPlan([t], lanes=1), recorded))[("I", 1)][0] == 11.0
    assert (
        by_key(simulate_schedule(ReplayPlan([t], lanes=1, idle_gap_cap=None), recorded))[("I", 1)][0] == 101.0
    )
    busy = trace("B", [req(0, api=200)])  # another lane keeps a request in flight: no shift
    got = by_key(simulate_schedule(ReplayPlan([t, busy], lanes=2), recorded))
    assert got[("I", 1)][0] == 101.0


def test_lane_idle_cap_shortens_a_lanes_gap_even_when_others_are_busy():
    t = trace("I", [req(0, api=1), req(101, think=100), req(103, think=1)])
    busy = trace("B", [req(0, api=200)])
    got = by_key(simulate_schedule(ReplayPlan([t, busy], lanes=2, lane_idle_gap_cap=5.0), recorded))
    assert [got[("I", i)][0] for i in range(3)] == [0.0, 6.0, 8.0]


# ---- timestamp mode ---------------------------------------------------------------------------
def test_timestamp_mode_follows_arrivals_not_completions():
    t = trace("mc", [req(0), req(0.5), req(0.5), req(2.0), req(300.0)], replay="timestamp")
    slow = lambda it: 5.0  # noqa: E731
    starts = [s.start for s in simulate_schedule(ReplayPlan([t], lanes=1, idle_gap_cap=None), slow)]
    assert starts == [0.0, 0.5, 0.5, 2.0, 300.0]
    fast = simulate_schedule(ReplayPlan([t], lanes=1, time_scale=0.5), slow)
    assert [s.start for s in fast] == [0.0, 0.25, 0.25, 1.0, 16.0]  # 150 s idle after 6.0 -> 10 s cap
    assert {s.item.lane for s in fast} == {-1} and [s.item.index for s in fast] == list(range(5))


def test_timestamp_and_session_traces_mix():
    stamped = trace("mc", [req(0.0), req(3.0)], replay="timestamp")
    sess = trace("s", [req(0, api=2), req(3, think=1)])
    spans = simulate_schedule(ReplayPlan([stamped, sess], lanes=4), lambda it: 2.0)
    assert sorted((s.item.lane, s.item.trace.id, s.start) for s in spans) == [
        (-1, "mc", 0.0),
        (-1, "mc", 3.0),
        (0, "s", 0.0),
        (0, "s", 3.0),
    ]


# ---- queue, cycling, limits, determinism ------------------------------------------------------
def test_cycle_with_max_requests_and_unique_replay_keys():
    ts = [trace("a", [req(0), req(2, think=1)]), trace("b", [req(0)])]
    plan = ReplayPlan(ts, lanes=2, cycle=True, max_requests=9)
    spans = simulate_schedule(plan, recorded)
    assert len(spans) == 9 and plan.done and plan.released == 9
    trees = Counter(s.item.tree_key for s in spans)
    assert {"a#0", "a#1", "b#0", "b#1"} <= set(trees)
    assert len({(s.item.session_key, s.item.index) for s in spans}) == 9
    with pytest.raises(ValueError, match="cycling"):
        simulate_schedule(ReplayPlan(ts, cycle=True), recorded)


def test_same_seed_same_schedule_and_shuffle_depends_on_seed():
    ts = [trace(f"s{i}", [req(0, api=1 + i % 3), req(4, think=2)]) for i in range(12)]

    def run(seed):
        plan = ReplayPlan(ts, lanes=3, seed=seed, shuffle=True, warm_start=True)
        return [(s.item.tree_key, s.item.index, s.start) for s in simulate_schedule(plan, recorded)]

    assert run(1) == run(1)
    orders = {tuple(dict.fromkeys(k for k, _, _ in run(seed))) for seed in range(4)}
    assert len(orders) > 1


def test_stop_and_until_end_the_run():
    ts = [trace("a", [req(0, api=1), req(2, think=1)])]
    spans = simulate_schedule(ReplayPlan(ts, lanes=4, cycle=True), recorded, until=10.0)
    assert spans and all(s.start <= 10.0 for s in spans)
    plan = ReplayPlan(ts, lanes=1)
    plan.start(0.0)
    (d,) = plan.pop_due(0.0)
    plan.stop()
    assert not plan.done and plan.in_flight == 1
    plan.complete(d.item.id, 1.0)
    assert plan.done and plan.next_due() is None


def test_bad_input_gives_clear_errors():
    t = trace("x", [req(0)])
    for kw in ({"lanes": 0}, {"time_scale": -1}, {"idle_gap_cap": -1}, {"max_requests": 0}):
        with pytest.raises(UserError, match=next(iter(kw))):
            ReplayPlan([t], **kw)
    with pytest.raises(UserError, match="replay must be"):
        ReplayPlan([trace("y", [req(0)], replay="fast")])
    with pytest.raises(UserError, match="no requests"):
        ReplayPlan([trace("z", [])])
    plan = ReplayPlan([t])
    plan.start(0.0)
    with pytest.raises(ValueError, match="not in flight"):
        plan.complete(42, 1.0)
