"""The replay plan: gaps, lanes, sub-agents and joins, idle caps, warm start, timestamps, determinism."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import UserError
from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule


def req(t: float, api: float | None = 1.0, think: float = 0.0) -> Request:
    return Request(t=t, input_tokens=100, output_tokens=10, api_time=api, think_time=think)


def sub(sid: str, t: float, requests: list[Request], subagents=(), duration=None) -> Session:
    return Session(id=sid, t=t, requests=requests, subagents=list(subagents), duration=duration)


def trace(tid: str, requests: list[Request], subagents=(), replay: str = "session") -> Trace:
    return Trace(
        id=tid,
        block_size=16,
        replay=replay,
        session=Session(id=tid, requests=requests, subagents=list(subagents)),
    )


def recorded(item) -> float:
    return item.request.api_time or 1.0


def by_key(spans) -> dict[tuple[str, int], tuple[float, float]]:
    return {(s.item.session.id, s.item.index): (s.start, s.end) for s in spans}


def example() -> Trace:
    """The docs/replay.md example: sub-agent A overlaps parent request r2 and gates r3."""
    a = sub("P/A", 8.0, [req(0, api=3), req(5, api=1, think=2)])
    return trace(
        "P", [req(0, api=2), req(5, api=2, think=3), req(9, api=1, think=2), req(16, api=1, think=6)], [a]
    )


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
    for kw in ({"lanes": 0}, {"time_scale": 0}, {"idle_gap_cap": -1}, {"max_requests": 0}):
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


# ---- invariants on random session trees -------------------------------------------------------
@st.composite
def trees(draw):
    def session(sid: str, depth: int) -> Session:
        n = draw(st.integers(0 if depth else 1, 4))
        reqs, t = [], 0.0
        for i in range(n):
            api = draw(st.sampled_from([0.5, 1.0, 3.0]))
            think = draw(st.sampled_from([0.0, 1.0, 4.0])) if i else 0.0
            reqs.append(req(t, api=api, think=think))
            t += api + draw(st.sampled_from([0.0, 1.0, 4.0]))
        kids = [session(f"{sid}/c{k}", depth + 1) for k in range(draw(st.integers(0, 2 if depth < 2 else 0)))]
        for k in kids:
            k.t = draw(st.sampled_from([0.0, 1.0, 2.5, 6.0, 12.0]))
        return Session(id=sid, requests=reqs, subagents=kids)

    return [
        Trace(id=f"h{i}", block_size=16, session=session(f"h{i}", 0)) for i in range(draw(st.integers(1, 4)))
    ]


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(1, 3), st.sampled_from([None, 2.0]))
def test_random_trees_keep_every_rule(ts, lanes, cap):
    plan = ReplayPlan(ts, lanes=lanes, idle_gap_cap=cap, lane_idle_gap_cap=cap)
    spans = simulate_schedule(plan, lambda it: 0.5 + (it.id * 7 % 5) / 2)
    assert plan.done and len(spans) == sum(t.num_requests for t in ts)
    assert len({(s.item.session.id, s.item.index) for s in spans}) == len(spans)
    per_session = defaultdict(list)
    for s in spans:
        per_session[s.item.session.id].append(s)
    for runs in per_session.values():
        assert [s.item.index for s in runs] == list(range(len(runs)))
        for a, b in zip(runs, runs[1:], strict=False):
            assert b.start >= a.end - 1e-9
    trees_ = defaultdict(list)
    for s in spans:
        trees_[(s.item.lane, s.item.tree_key)].append(s)
    spans_by_lane = defaultdict(list)
    for (lane, _), runs in trees_.items():
        spans_by_lane[lane].append((min(s.start for s in runs), max(s.end for s in runs)))
    assert len(spans_by_lane) <= lanes
    for iv in spans_by_lane.values():
        iv.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(iv, iv[1:], strict=False))
    if cap is None:
        for t in ts:
            check_exact_rules(t.session, by_key(spans))


def drain(s: Session, got) -> float | None:
    """When a session's whole subtree ended in the replay (None: it sent nothing)."""
    ends = [got[(s.id, i)][1] for i in range(len(s.requests))]
    ends += [e for c in s.subagents if (e := drain(c, got)) is not None]
    return max(ends, default=None)


def check_exact_rules(s: Session, got) -> None:
    """Spawn = anchor end + recorded slack; request i = max(previous end + gap, its joins' drain)."""
    rs = s.requests
    thinks = any(r.think_time > 0 for r in rs[1:])
    gates = defaultdict(list)
    for c in s.subagents:
        j = max((i for i, r in enumerate(rs) if r.t <= c.t), default=-1)
        if c.requests and j >= 0:
            slack = max(0.0, c.t - rs[j].t - rs[j].api_time)
            assert got[(c.id, 0)][0] == pytest.approx(got[(s.id, j)][1] + slack + c.requests[0].t)
        end = c.t + max([r.t + r.api_time for r in c.requests] + [k.t for k in c.subagents], default=0.0)
        if c.subagents:  # a nested child's recorded end needs its own length; keep the check simple
            continue
        gate = next((i for i in range(j + 1, len(rs)) if rs[i].t >= end), None)
        if gate is not None:
            gates[gate].append(c)
    for i in range(1, len(rs)):
        gap = rs[i].think_time if thinks else max(0.0, rs[i].t - rs[i - 1].t - rs[i - 1].api_time)
        ready = got[(s.id, i - 1)][1] + gap
        joined = [d for c in gates[i] if (d := drain(c, got)) is not None]
        if not any(c.subagents for c in s.subagents):
            assert got[(s.id, i)][0] == pytest.approx(max([ready, *joined]))
        assert got[(s.id, i)][0] >= max([ready, *joined]) - 1e-9
    for c in s.subagents:
        check_exact_rules(c, got)


# ---- real traces ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_traces(shared_dir):
    from agentkv.trace.formats import load_paths

    return load_paths([shared_dir / "traces" / "claude-code"])


def test_every_shared_request_dispatched_once_with_64_lanes(real_traces):
    plan = ReplayPlan(real_traces, lanes=64, shuffle=True, seed=5)
    spans = simulate_schedule(plan, recorded)
    assert len(real_traces) == 119 and plan.done
    assert len(spans) == sum(t.num_requests for t in real_traces)
    assert len({(s.item.session.id, s.item.index) for s in spans}) == len(spans)
    first, last = {}, {}  # a tree is live from its first start to its last end
    for s in spans:
        k = s.item.tree_key
        first[k] = min(first.get(k, s.start), s.start)
        last[k] = max(last.get(k, s.end), s.end)
    events = sorted([(t, 1) for t in first.values()] + [(t, -1) for t in last.values()])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 64


def test_real_subagent_spawns_overlaps_and_joins_as_specified(real_traces):
    t = next(x for x in real_traces if x.id == "trace_0014")
    root = t.session
    (a,) = root.subagents
    got = by_key(simulate_schedule(ReplayPlan([t], lanes=1, idle_gap_cap=None), recorded))
    j = max(i for i, r in enumerate(root.requests) if r.t <= a.t)
    anchor = root.requests[j]
    spawn = got[(root.id, j)][1] + max(0.0, a.t - anchor.t - anchor.api_time)
    assert got[(a.id, 0)][0] == pytest.approx(spawn)
    a_end = max(got[(a.id, i)][1] for i in range(len(a.requests)))
    rec_end = a.t + a.duration
    gate = next(i for i in range(j + 1, len(root.requests)) if root.requests[i].t >= rec_end)
    for i in range(j + 1, gate):  # parent requests before the join run alongside the sub-agent
        assert got[(root.id, i)][0] == pytest.approx(got[(root.id, i - 1)][1] + root.requests[i].think_time)
    assert any(got[(root.id, i)][0] < a_end for i in range(j + 1, gate)) or gate == j + 1
    ready = got[(root.id, gate - 1)][1] + root.requests[gate].think_time
    assert got[(root.id, gate)][0] == pytest.approx(max(ready, a_end))


def test_many_idle_shifts_with_inexact_floats_never_stall():
    """Due times compare the same way in next_due and pop_due, so rounding cannot stall a driver."""
    reqs = [req(i * 10.0, api=0.1, think=th) for i, th in enumerate([0.0, 0.3, 1.7, 1.7, 0.3])]
    plan = ReplayPlan([trace("f", reqs)], lanes=1, cycle=True, max_requests=2000, idle_gap_cap=0.7)
    plan.start(0.0)
    released, ends = 0, []
    for _ in range(20_000):  # each turn completes or releases something; a stall would spin here
        due = plan.next_due()
        if ends and (due is None or ends[0][0] <= due):
            end, item_id = heapq.heappop(ends)
            plan.complete(item_id, end)
        elif due is None:
            break
        else:
            batch = plan.pop_due(due)
            assert batch, f"nothing released at next_due() = {due!r}"
            released += len(batch)
            for d in batch:
                heapq.heappush(ends, (due + 0.1 + d.item.id % 7 * 0.013, d.item.id))
    assert released == 2000 and plan.done


def test_real_fan_out_once_spawn_offsets_are_converted(real_traces):
    """kv-cache-tester stamps a sub-agent at its end; the reader turns that into a spawn offset
    (t - duration), so the three Explore agents of trace_0254 fan out together right after the
    parent request that launched them."""
    t = next(x for x in real_traces if x.id == "trace_0254")
    root = t.session
    got = by_key(simulate_schedule(ReplayPlan([t], lanes=1, idle_gap_cap=None), recorded))
    firsts = [got[(a.id, 0)] for a in root.subagents[:3]]
    assert max(f[0] for f in firsts) - min(f[0] for f in firsts) < 1e-6  # launched together
    r1, a = root.requests[1], root.subagents[0]  # r1 (t 30) is the latest parent request before them
    assert max(i for i, r in enumerate(root.requests) if r.t <= a.t) == 1
    assert firsts[0][0] == pytest.approx(got[(root.id, 1)][1] + a.t - r1.t - r1.api_time)
    assert all(f[0] < g[1] for f in firsts for g in firsts)  # and run side by side


# ---- the real-time driver ---------------------------------------------------------------------
def test_realtime_driver_sends_every_item_once_in_session_order():
    import asyncio

    from agentkv.trace.realtime import drive

    sent = []

    async def send(d):
        sent.append(d)
        await asyncio.sleep(recorded(d.item) * 0.002)
        return d.item.index != 1

    plan = ReplayPlan([example(), trace("Q", [req(0), req(5, think=3)])], lanes=2, time_scale=0.002)
    asyncio.run(drive(plan, send))
    assert plan.done and len(sent) == 8 and plan.failed == 3
    keys = [(d.item.session.id, d.item.index) for d in sent]
    assert sorted(keys) == sorted(
        by_key(
            simulate_schedule(
                ReplayPlan([example(), trace("Q", [req(0), req(5, think=3)])], lanes=2), recorded
            )
        )
    )
    for sid in {k[0] for k in keys}:
        assert [i for s, i in keys if s == sid] == sorted(i for s, i in keys if s == sid)
    a0 = next(d for d in sent if d.item.session.id == "P/A" and d.item.index == 0)
    r1 = next(d for d in sent if d.item.session.id == "P" and d.item.index == 1)
    assert a0.due > r1.due  # the spawn waits for its anchor's completion


def test_realtime_driver_until_and_send_errors():
    import asyncio

    from agentkv.trace.realtime import drive

    async def fine(d):
        await asyncio.sleep(0.001)
        return True

    plan = ReplayPlan([trace("c", [req(0, api=0.001), req(1, think=0.001)])], lanes=2, cycle=True)

    async def main():
        clock = asyncio.get_running_loop().time
        await drive(plan, fine, clock=clock, until=clock() + 0.05)  # cycling: only `until` ends it

    asyncio.run(main())
    assert plan.done and plan.released > 2 and plan.failed == 0

    async def boom(d):
        raise RuntimeError("send broke")

    plan = ReplayPlan([example()], lanes=1)
    with pytest.raises(RuntimeError, match="send broke"):
        asyncio.run(drive(plan, boom))
    assert plan.done and plan.failed == 1


def test_realtime_driver_is_cancelled_even_when_a_completion_wakes_it_at_once():
    """Ctrl-C cancels the driving task. If that cancel lands just as a completion wakes the driver,
    the driver must still stop (Python 3.11's wait_for swallowed it: the bench ran on to the end)."""
    import asyncio

    from agentkv.trace.realtime import drive

    sent = []

    async def main():
        task = asyncio.current_task()

        async def send(d):
            sent.append(d)
            if len(sent) == 1:  # queued before this send's completion wakes the driver
                asyncio.get_running_loop().call_soon(task.cancel)
            return True

        plan = ReplayPlan([trace("c", [req(0, api=0.001), req(1, think=0.001)])], lanes=1, cycle=True)
        clock = asyncio.get_running_loop().time
        await drive(plan, send, clock=clock, until=clock() + 60)  # `until`: the driver waits with a timeout

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asyncio.wait_for(main(), 5))
    assert len(sent) <= 2
