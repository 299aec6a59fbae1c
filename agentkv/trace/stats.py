"""Trace statistics: sizes, token and gap percentiles, context growth, and the prefix-cache hit ceiling.

Pure functions over `Trace`s; the CLI renders the `StatsReport` (see `stats_view`). The ceiling is
what an unbounded prefix cache could reuse: for each request in time order, the longest leading run
of its hash ids that all appeared in earlier requests, times the block size, capped at its input.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from agentkv.trace.ceiling import trace_hits
from agentkv.trace.model import Trace

COMPACTION_DROP = 0.7  # a request whose input is below 70% of its predecessor's restarted its context


class Dist(msgspec.Struct, frozen=True):
    """Percentiles of one quantity (linear interpolation); all zero when `count == 0`."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray) -> Dist:
        a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
        if a.size == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.sort(a)  # np.percentile's "linear" method, without its per-call overhead
        pos = np.array((0.50, 0.90, 0.99)) * (a.size - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, a.size - 1)
        p50, p90, p99 = (a[lo] + (a[hi] - a[lo]) * (pos - lo)).tolist()
        return cls(int(a.size), p50, p90, p99, float(a.mean()), float(a[-1]))


class TraceStats(msgspec.Struct, kw_only=True):
    """One trace's figures. `growth` is the input delta between consecutive requests of a session."""

    id: str
    source: str
    format: str
    block_size: int
    hash_id_scope: str
    requests: int
    sessions: int  # root session plus sub-agents
    subagents: int
    root_requests: int  # requests of the root session alone (turns of the main agent)
    side_calls: int  # requests of kind "s"
    compactions: int  # requests whose input fell below COMPACTION_DROP x the previous one's
    first_input: int  # input tokens of the root session's first request
    input_tokens: int
    output_tokens: int
    hit_tokens: int  # tokens an unbounded prefix cache could serve
    ceiling: float  # hit_tokens / input_tokens
    duration: float  # s, from the first arrival to the last known end
    input: Dist
    output: Dist
    growth: Dist
    gap: Dist  # think/tool gap before each request but a session's first


class Totals(msgspec.Struct, kw_only=True):
    """All traces together: counts summed, percentiles pooled over every request, ceiling summed."""

    traces: int
    requests: int
    sessions: int
    subagents: int
    side_calls: int
    compactions: int
    input_tokens: int
    output_tokens: int
    hit_tokens: int
    ceiling: float  # sum of hit tokens / sum of input tokens
    duration: float  # sum of the traces' durations (s)
    input: Dist
    output: Dist
    growth: Dist
    gap: Dist
    requests_per_trace: Dist
    root_requests_per_trace: Dist
    first_input: Dist
    trace_duration: Dist


class StatsReport(msgspec.Struct):
    """What `agentkv trace stats --json` prints."""

    traces: list[TraceStats]
    total: Totals


class _Samples(NamedTuple):
    """One trace's raw per-request samples, kept to pool percentiles across traces."""

    input: np.ndarray
    output: np.ndarray
    growth: np.ndarray
    gap: np.ndarray


def _trace_stats(tr: Trace, hit_tokens: int) -> tuple[TraceStats, _Samples]:
    timeline = tr.timeline()
    inputs = np.fromiter((x.request.input_tokens for x in timeline), dtype=np.int64, count=len(timeline))
    outputs = np.fromiter((x.request.output_tokens for x in timeline), dtype=np.int64, count=len(timeline))
    growth: list[int] = []
    gaps: list[float] = []
    compactions = 0
    sessions = list(tr.session.walk())
    if tr.replay == "session":  # timestamp-replayed traces (Mooncake) have no session order to follow
        for _, _, s in sessions:
            for prev, cur in itertools.pairwise(s.requests):
                growth.append(cur.input_tokens - prev.input_tokens)
                gaps.append(cur.think_time)
                compactions += cur.input_tokens < COMPACTION_DROP * prev.input_tokens
    ends = [x.time + (x.request.api_time or 0.0) for x in timeline]
    ends += [start + s.duration for start, _, s in sessions if s.duration is not None]
    duration = max(ends) - timeline[0].time if timeline else 0.0
    total_in = int(inputs.sum())
    root = tr.session.requests
    st = TraceStats(
        id=tr.id,
        source=tr.source,
        format=tr.format,
        block_size=tr.block_size,
        hash_id_scope=tr.hash_id_scope,
        requests=len(timeline),
        sessions=len(sessions),
        subagents=len(sessions) - 1,
        root_requests=len(root),
        side_calls=sum(x.request.kind == "s" for x in timeline),
        compactions=compactions,
        first_input=root[0].input_tokens if root else 0,
        input_tokens=total_in,
        output_tokens=int(outputs.sum()),
        hit_tokens=hit_tokens,
        ceiling=hit_tokens / total_in if total_in else 0.0,
        duration=duration,
        input=Dist.of(inputs),
        output=Dist.of(outputs),
        growth=Dist.of(growth),
        gap=Dist.of(gaps),
    )
    return st, _Samples(
        inputs, outputs, np.asarray(growth, dtype=np.int64), np.asarray(gaps, dtype=np.float64)
    )


def compute(traces: Sequence[Trace]) -> StatsReport:
    """Per-trace statistics and the totals over all of them."""
    hits = trace_hits(traces)
    pairs = [_trace_stats(tr, h) for tr, h in zip(traces, hits, strict=True)]
    rows = [p[0] for p in pairs]

    def pool(field: str) -> Dist:
        parts = [getattr(p[1], field) for p in pairs]
        return Dist.of(np.concatenate(parts) if parts else np.empty(0))

    def total(field: str) -> int:
        return sum(getattr(r, field) for r in rows)

    total_in, total_hit = total("input_tokens"), total("hit_tokens")
    return StatsReport(
        rows,
        Totals(
            traces=len(rows),
            requests=total("requests"),
            sessions=total("sessions"),
            subagents=total("subagents"),
            side_calls=total("side_calls"),
            compactions=total("compactions"),
            input_tokens=total_in,
            output_tokens=total("output_tokens"),
            hit_tokens=total_hit,
            ceiling=total_hit / total_in if total_in else 0.0,
            duration=float(sum(r.duration for r in rows)),
            input=pool("input"),
            output=pool("output"),
            growth=pool("growth"),
            gap=pool("gap"),
            requests_per_trace=Dist.of(r.requests for r in rows),
            root_requests_per_trace=Dist.of(r.root_requests for r in rows),
            first_input=Dist.of(r.first_input for r in rows if r.root_requests),
            trace_duration=Dist.of(r.duration for r in rows),
        ),
    )


def ceiling(traces: Sequence[Trace]) -> float:
    """The prefix-cache hit ceiling of all traces together (hit tokens / input tokens)."""
    total_in = sum(x.request.input_tokens for tr in traces for x in tr.timeline())
    return sum(trace_hits(traces)) / total_in if total_in else 0.0
