"""Builders shared by the replay-plan tests (tests/test_plan*.py)."""

from __future__ import annotations

from agentkv.trace.model import Request, Session, Trace


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
