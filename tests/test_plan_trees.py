"""The replay plan's rules on random session trees and on the shared real traces."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planutil import by_key, recorded, req

from agentkv.trace.model import Session, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule


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
