"""The real-time runner on the shared replay plan, against the local streaming test server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.errors import UserError
from agentkv.metrics.records import read_records
from agentkv.trace.model import Request, Session, Trace


def turns(
    sid: str,
    n: int,
    *,
    base: int = 0,
    gap: float = 0.0,
    out: int = 3,
    start_blocks: int = 4,
    grow: int = 2,
    bs: int = 16,
) -> list[Request]:
    """A session of `n` turns whose context grows by `grow` blocks per turn (each turn extends the last)."""
    reqs = []
    for i in range(n):
        k = start_blocks + grow * i
        reqs.append(
            Request(
                t=i * 0.001,
                input_tokens=k * bs,
                output_tokens=out,
                hash_ids=list(range(base, base + k)),
                think_time=gap if i else 0.0,
            )
        )
    return reqs


def trace(tid: str, n: int = 3, **kw) -> Trace:
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=turns(tid, n, **kw)))


def run(cfg: BenchConfig, traces, out: Path | None = None, **server_kw):
    async def go():
        async with StreamTestServer(**server_kw) as srv:
            cfg.target = srv.url
            res = await BenchRun(cfg, traces, out=out).run()
            return res, srv

    return asyncio.run(go())


def cfg(**kw) -> BenchConfig:
    kw.setdefault("duration", None)
    kw.setdefault("idle_gap_cap", None)
    kw.setdefault("sample_every", 0.05)
    return BenchConfig(target="", **kw)


def test_replays_sessions_with_growing_cache_hits(tmp_path):
    traces = [trace("a", 4), trace("b", 3, base=1000)]
    res, srv = run(cfg(lanes=2), traces, out=tmp_path)
    recs = res.records
    assert len(recs) == 7 and all(r.ok for r in recs)
    a = sorted((r for r in recs if r.trace == "a"), key=lambda r: r.index)
    assert [r.cached_tokens for r in a] == [0, 64, 96, 128]  # each turn hits the previous turn's blocks
    assert [r.ceiling_tokens for r in a] == [0, 64, 96, 128]
    assert all(r.output_tokens == 3 == r.expected_output_tokens for r in recs)
    # prompts are the trace's exact token blocks: same lengths, shared prefixes
    bodies = [b for b in srv.seen if len(b["prompt"]) == 64]
    assert len(bodies) == 2 and bodies[0]["prompt"] != bodies[1]["prompt"]  # two traces, different blocks
    on_disk = read_records(tmp_path / "requests.jsonl")
    assert sorted(r.id for r in on_disk) == sorted(r.id for r in recs)
    s = res.summary
    assert s.kind == "bench" and s.requests == 7 and s.failed == 0 and s.valid
    assert s.cache.reported == pytest.approx(s.cache.ceiling)
    assert s.cache.metrics == pytest.approx(s.cache.reported)  # the /metrics counters' delta agrees
    assert {x.session for x in s.sessions} == {"a#0", "b#0"}
    assert len(s.timeline) >= 2 and s.timeline[-1].prefix_queries is not None


def test_think_gaps_are_honoured_from_the_previous_end():
    res, _ = run(cfg(lanes=1), [trace("a", 3, gap=0.2)])
    a = sorted(res.records, key=lambda r: r.index)
    for prev, r in zip(a, a[1:], strict=False):
        assert prev.end + 0.2 <= r.scheduled < prev.end + 0.3  # due one gap after the end (plus loop latency)
        assert r.sent >= r.scheduled


def test_time_scale_reports_target_seconds():
    res, _ = run(cfg(lanes=1, time_scale=4.0), [trace("a", 2, gap=0.4)])
    a = sorted(res.records, key=lambda r: r.index)
    # the gap was replayed as 0.1 s of wall time and is reported as the trace's 0.4 s
    assert 0.4 <= a[1].scheduled - a[0].end < 0.6
    assert any("time scale 4" in n for n in res.summary.notes)


def test_latency_counts_from_the_scheduled_time_when_the_server_queues():
    # four sessions due at t=0, a server that serves one request at a time, 0.15 s each
    traces = [trace(f"t{i}", 1, base=100 * i) for i in range(4)]
    res, _ = run(cfg(lanes=4), traces, serial=True, behave=lambda b, n: Behaviour(ttft=0.15))
    recs = sorted(res.records, key=lambda r: r.ttft)
    assert len({r.scheduled for r in recs}) == 1  # all due at the start
    for i, r in enumerate(recs):
        assert r.ttft >= 0.15 * (i + 1) * 0.9  # queueing behind earlier requests is counted


def test_latency_counts_from_the_scheduled_time_when_the_client_is_late():
    traces = [trace(f"t{i}", 1, base=100 * i) for i in range(3)]
    res, _ = run(cfg(lanes=3, max_connections=1), traces, behave=lambda b, n: Behaviour(ttft=0.1))
    recs = sorted(res.records, key=lambda r: r.end)
    assert len({r.scheduled for r in recs}) == 1  # all due at the start
    assert recs[-1].ttft >= 0.2  # it waited for a connection behind two 0.1 s requests


def test_errors_are_recorded_and_the_run_goes_on(tmp_path):
    def behave(body, n):
        return [Behaviour(), Behaviour(status=500), Behaviour(reset_after=1)][n % 3]

    res, _ = run(cfg(lanes=2), [trace("a", 4), trace("b", 4, base=500)], out=tmp_path, behave=behave)
    s = res.summary
    assert s.requests == 8  # failures still advance their sessions
    assert s.errors.get("http_500", 0) >= 2 and s.errors.get("reset", 0) >= 2
    assert s.failed == s.errors["http_500"] + s.errors["reset"]
    assert s.succeeded == 8 - s.failed
    assert all(r.error for r in res.records if not r.ok)


def test_context_overflow_above_one_percent_marks_the_run_invalid():
    long = Trace(
        id="long",
        block_size=16,
        session=Session(
            id="long",
            requests=[
                Request(t=0, input_tokens=64, output_tokens=2, hash_ids=[1, 2, 3, 4]),
                Request(t=0.001, input_tokens=400, output_tokens=2, hash_ids=list(range(1, 26))),
            ],
        ),
    )
    res, _ = run(cfg(lanes=1), [long], max_model_len=128)
    s = res.summary
    assert s.errors == {"context_overflow": 1}
    assert not s.valid and "context overflow" in s.invalid_reason


def test_duration_and_max_requests_stop_releasing():
    res, _ = run(cfg(lanes=1, max_requests=2), [trace("a", 5)])
    assert len(res.records) == 2
    res, _ = run(cfg(lanes=1, duration=0.3), [trace("a", 50, gap=0.1)])
    assert 1 <= len(res.records) < 50


def overlaps(records) -> bool:
    """True when some sub-agent request was in flight while a main-session request was."""
    main = [r for r in records if r.depth == 0]
    return any(s.sent < m.end and m.sent < s.end for s in records if s.depth > 0 for m in main)


def subagent_trace() -> Trace:
    """Spawned right after turn 0 and running 5 s: the parent's turns 1-2 are not gated on it."""
    sub = Session(id="a/sub", t=0.0005, requests=turns("sub", 2, base=900), duration=5.0)
    return Trace(id="a", block_size=16, session=Session(id="a", requests=turns("a", 3), subagents=[sub]))


def test_subagents_run_beside_their_parent():
    res, _ = run(cfg(lanes=1), [subagent_trace()], behave=lambda b, n: Behaviour(itl=0.02))
    assert sorted(r.depth for r in res.records) == [0, 0, 0, 1, 1]
    assert all(r.tree == "a#0" for r in res.records)
    assert overlaps(res.records)


def test_chat_needs_text_prompts():
    with pytest.raises(UserError, match="--prompt-mode text"):
        BenchRun(cfg(api="chat"), [trace("a")])


def test_text_mode_with_builtin_tokenizer_is_exact():
    res, srv = run(cfg(lanes=1, prompt_mode="text"), [trace("a", 2)])
    from agentkv.trace.tokens import encode

    assert [len(encode(b["prompt"])) for b in srv.seen] == [64, 96]
    assert "built-in tokenizer" in res.summary.notes[0]


def test_summary_json_roundtrip(tmp_path):
    from agentkv.metrics.summary import read_summary, write_summary

    res, _ = run(cfg(lanes=1, slo={"ttft": 5.0}), [trace("a", 2)], out=tmp_path)
    write_summary(res.summary, tmp_path / "summary.json")
    s = read_summary(tmp_path / "summary.json")
    assert s.goodput is not None and s.goodput.fraction == 1.0
    assert json.loads((tmp_path / "summary.json").read_text())["schema"].startswith("agentkv.summary/")


def test_a_bug_mid_run_still_leaves_records_and_a_summary(tmp_path, monkeypatch):
    real = BenchRun._record

    def flaky(self, d, res, ceil, max_tokens):
        if d.item.index == 2:
            raise RuntimeError("boom")
        return real(self, d, res, ceil, max_tokens)

    monkeypatch.setattr(BenchRun, "_record", flaky)
    res, _ = run(cfg(lanes=1), [trace("a", 5)], out=tmp_path)
    assert [r.index for r in read_records(tmp_path / "requests.jsonl")] == [0, 1]
    assert res.summary.requests == 2
    assert any("internal error (RuntimeError: boom)" in n for n in res.summary.notes)


def test_driver_counts_the_next_gap_from_the_end_send_reports():
    """`send` may return (ok, end): the plan arms the next turn `gap` after that end, not after now
    (the bench passes the target's own end time, so client time does not pile up turn after turn)."""
    from agentkv.trace.plan import ReplayPlan
    from agentkv.trace.realtime import drive

    t = Trace(id="g", block_size=16, session=Session(id="g", requests=turns("g", 3, gap=0.2)))
    plan = ReplayPlan([t], lanes=1, idle_gap_cap=None)
    dues = []

    async def main():
        loop = asyncio.get_running_loop()

        async def send(d):
            dues.append(d.due)
            await asyncio.sleep(0.05)
            return True, d.due + 0.01  # "ended" 10 ms after it was due, 40 ms before now

        await drive(plan, send, clock=loop.time)

    asyncio.run(main())
    assert [b - a for a, b in zip(dues, dues[1:], strict=False)] == pytest.approx([0.21, 0.21], abs=1e-6)
