"""Summaries of a run from its per-request records: latency distributions, throughput, cache hits,
goodput and per-session roll-ups. One versioned schema for `bench` and `simulate`, so runs compare."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import msgspec
import numpy as np

from agentkv import __version__
from agentkv.errors import UserError
from agentkv.metrics.dist import DEFAULT_PERCENTILES, Dist, latency_dists
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.validity import (
    DEFAULT_MAX_FAILURE_RATE,
    ErrorGroup,
    contamination_note,
    excess,
    invalid_reasons,
    top_errors,
)

SCHEMA = "agentkv.summary/1"
LATENCY_FIGURES = ("ttft", "tpot", "itl", "e2e")


class Throughput(msgspec.Struct):
    input_tokens_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    output_tokens_per_s_per_gpu: float | None = None
    total_tokens_per_s_per_gpu: float | None = None
    million_total_tokens_per_s_per_mw: float | None = None


class CacheHits(msgspec.Struct, omit_defaults=True):
    """Token hit rates three ways, each in [0, 1] or None when unknown: reported per request (the
    server's token counts), from server metrics, and the ceiling (the trace's token counts)."""

    reported: float | None = None  # sum(cached_tokens) / sum(input_tokens), when the server reports it
    metrics: float | None = None  # delta vllm:prefix_cache_hits_total / queries_total
    ceiling: float | None = None  # unbounded prefix cache over the succeeded requests
    by_tier: dict[str, float] = msgspec.field(default_factory=dict)
    clipped: int = 0  # requests whose reported cached tokens fell outside 0..prompt tokens (clipped)
    contaminated: bool = False  # reported or server-metric hits above the ceiling (+ tolerance)
    reported_over_ceiling: float | None = None  # reported - ceiling, when contaminated
    metrics_over_ceiling: float | None = None  # metrics - ceiling, when contaminated


class Goodput(msgspec.Struct):
    slo: dict[str, float]
    fraction: float | None  # requests meeting every SLO / all requests (None: no request)
    requests_per_s: float


class SessionRollup(msgspec.Struct):
    session: str
    trace: str
    turns: int
    sub_requests: int  # requests of its sub-agents
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    hit_rate: float | None
    ttft_p50: float | None
    failed: int


class Sample(msgspec.Struct, array_like=True):
    """One point of a time series: (t, in-flight requests, KV usage, running, waiting, prefix-cache
    hit and query counters as the server's metrics had them, for hit rate over time)."""

    t: float
    in_flight: int
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None


class DisaggStats(msgspec.Struct):
    """A disaggregated run's two pools: each pool's prefix-cache hit rate (its engines' hits /
    queries) and the KV moved from prefill to decode workers (seconds per transfer, GB, links used)."""

    prefill_workers: int
    decode_workers: int
    prefill_hit_rate: float | None
    decode_hit_rate: float | None
    kv_transfer_s: Dist
    kv_transferred_gb: float
    transfers_nvlink: int
    transfers_rdma: int


class Interactivity(msgspec.Struct):
    """A run against an interactivity tier (p50 output tok/s per user >= tier_tps and TTFT p90 <=
    tier_ttft_p90): when met, `agents` (concurrent session trees) per GPU and per provisioned MW."""

    tier_tps: float
    tier_ttft_p90: float
    tps_per_user_p50: float | None
    ttft_p90: float | None
    met: bool
    sessions: int  # concurrent session trees (lanes) the run offered
    agents: float | None  # when met: session trees in progress on average (<= sessions; lanes may run dry)
    agents_per_gpu: float | None
    agents_per_mw: float | None
    power_basis: str = ""
    mean_trees: float | None = None  # session trees in progress, time-averaged over the run


class Summary(msgspec.Struct, kw_only=True):
    schema: str = SCHEMA
    kind: str  # "bench" or "simulate"
    agentkv_version: str = __version__
    created: str = ""
    target: str = ""
    config: dict[str, Any] = msgspec.field(default_factory=dict)  # the run's settings struct, as JSON
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    top_errors: list[ErrorGroup] = msgspec.field(default_factory=list)  # (count, status, message, hint)
    duration_s: float = 0.0
    ttft: Dist = msgspec.field(default_factory=Dist)
    tpot: Dist = msgspec.field(default_factory=Dist)
    itl: Dist = msgspec.field(default_factory=Dist)
    e2e: Dist = msgspec.field(default_factory=Dist)
    input_tokens: int = 0
    output_tokens: int = 0
    throughput: Throughput | None = None
    cache: CacheHits = msgspec.field(default_factory=CacheHits)
    goodput: Goodput | None = None
    preemptions: int = 0
    warmup_requests: int = 0  # bench --warmup: requests sent first and left out of every figure here
    sessions: list[SessionRollup] = msgspec.field(default_factory=list)
    timeline: list[Sample] = msgspec.field(default_factory=list)
    valid: bool = True
    invalid_reason: str = ""  # the reasons below, joined
    invalid_reasons: list[str] = msgspec.field(default_factory=list)
    gpu: dict[str, Any] | None = None  # NVML figures, or None when no GPU was monitored
    notes: list[str] = msgspec.field(default_factory=list)
    # the clock each figure was read on (ttft, tpot, itl, e2e, duration): "engine" (the target's own
    # timestamps), "client" (wall x time scale), "virtual" (simulate) or "mixed"; {} in older summaries
    clocks: dict[str, str] = msgspec.field(default_factory=dict)
    disagg: DisaggStats | None = None  # disaggregated simulate runs only
    interactivity: Interactivity | None = None  # simulate: this run against its tier


SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "itl": "itl_max"}


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=2s,tpot=50ms` -> {"ttft": 2.0, "tpot": 0.05}; UserError on an unknown key or value."""
    from agentkv.units import parse_duration

    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise UserError(f"--slo: expected key=duration with key in {', '.join(SLO_KEYS)}, got {part!r}")
        out[key] = parse_duration(val.strip(), f"--slo {key}")
    return out


def _meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    for key, limit in slo.items():
        v = getattr(r, SLO_KEYS[key])
        if v is not None and v > limit:
            return False
        if v is None and key == "ttft":
            return False
    return True


def slo_fraction(records: list[RequestRecord], slo: dict[str, float]) -> float | None:
    """The share of `records` meeting every SLO of `slo` (a failed request never does); None if none."""
    return sum(1 for r in records if _meets(r, slo)) / len(records) if records else None


def session_rollups(records: list[RequestRecord]) -> list[SessionRollup]:
    """Per live session tree: turns, time span, tokens and hit rate (sub-agents folded into the root)."""
    groups: dict[tuple[str, str], list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[(r.trace, r.tree or r.session)].append(r)
    out = []
    for (trace, sess), rs in sorted(groups.items()):
        inp = sum(r.input_tokens for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        has_cache = any(r.cached_tokens is not None for r in rs)
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        out.append(
            SessionRollup(
                session=sess,
                trace=trace,
                turns=sum(1 for r in rs if r.depth == 0),
                sub_requests=sum(1 for r in rs if r.depth > 0),
                duration_s=max(r.end for r in rs) - min(r.scheduled for r in rs),
                input_tokens=inp,
                output_tokens=sum(r.output_tokens for r in rs),
                cached_tokens=cached,
                hit_rate=(cached / inp if inp and has_cache else None),
                ttft_p50=float(np.median(ttfts)) if ttfts else None,
                failed=sum(1 for r in rs if not r.ok),
            )
        )
    return out


def _error_counts(records: list[RequestRecord]) -> dict[str, int]:
    """Failed requests per reason, in the order reasons first appear."""
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] += 1
    return dict(errors)


def _throughput(
    inp: int, out: int, done: int, dur: float, gpus: int | None, power_w: float | None
) -> Throughput:
    """Tokens and requests per second over `dur`; per GPU and per megawatt when those are known."""
    tp = Throughput(inp / dur, out / dur, (inp + out) / dur, done / dur)
    if gpus:
        tp.output_tokens_per_s_per_gpu = out / dur / gpus
        tp.total_tokens_per_s_per_gpu = (inp + out) / dur / gpus
        if power_w:
            tp.million_total_tokens_per_s_per_mw = (inp + out) / dur / (gpus * power_w / 1e6) / 1e6
    return tp


def _trace_in(r: RequestRecord) -> int:
    """The trace's input tokens of a record (records written before the field: the measured ones)."""
    return r.trace_input_tokens or r.input_tokens


def _cache_hits(
    ok: list[RequestRecord], metrics_hit_rate: float | None, by_tier: dict[str, float] | None
) -> tuple[CacheHits, list[str]]:
    """Hit rates over the succeeded requests: reported on the server's token counts (clipped to the
    prompt), the ceiling on the trace's, server metrics when in [0, 1]; and notes on what was odd."""
    notes = []
    rep = [r for r in ok if r.cached_tokens is not None]
    rep_in = sum(r.input_tokens for r in rep)
    cached = sum(min(max(r.cached_tokens, 0), r.input_tokens) for r in rep)  # type: ignore[type-var]
    clipped = sum(1 for r in rep if r.cached_reported is not None or r.cached_tokens > r.input_tokens)
    trace_in = sum(_trace_in(r) for r in ok)
    metrics = metrics_hit_rate
    if metrics is not None and not 0.0 <= metrics <= 1.0:
        notes.append(f"server-metric hit rate {metrics:.1%} is outside 0-100% (counters reset?): unknown")
        metrics = None
    c = CacheHits(
        reported=cached / rep_in if rep_in else None,
        metrics=metrics,
        ceiling=sum(min(r.ceiling_tokens, _trace_in(r)) for r in ok) / trace_in if trace_in else None,
        by_tier=by_tier or {},
        clipped=clipped,
    )
    if clipped:
        notes.append(
            f"{clipped} requests reported cached tokens outside 0..their prompt tokens: clipped into "
            "it (the server's figures are in requests.jsonl, field cached_reported)"
        )
    server_in = sum(r.input_tokens for r in ok)
    if trace_in and server_in != trace_in:
        notes.append(
            f"the server counted {server_in:,} prompt tokens where the trace has {trace_in:,} "
            f"({(server_in - trace_in) / trace_in:+.1%}: a chat template, or the server's own tokenizer): "
            "reported and server-metric hit rates are over the server's counts, the ceiling over the trace's"
        )
    if c.ceiling is not None:
        c.reported_over_ceiling = excess(c.reported, c.ceiling)
        c.metrics_over_ceiling = excess(c.metrics, c.ceiling)
        if c.reported_over_ceiling is not None or c.metrics_over_ceiling is not None:
            c.contaminated = True
            notes.append(contamination_note(c.reported_over_ceiling, c.metrics_over_ceiling, c.ceiling))
    return c, notes


def _goodput(records: list[RequestRecord], slo: dict[str, float] | None, dur: float) -> Goodput | None:
    """The share (and rate) of requests meeting every SLO; None when no SLO was given."""
    if not slo:
        return None
    good = sum(1 for r in records if _meets(r, slo))
    return Goodput(slo, good / len(records) if records else None, good / dur)


def with_percentiles(s: Summary, records: list[RequestRecord], itl_values, percentiles) -> Summary:
    """`s` with its latency distributions recomputed at `percentiles` (--percentiles); ITL kept as
    it was when the token gaps (`itl_values`) are not at hand; warm-up records are left out."""
    ok = [r for r in records if r.ok and not r.warmup]
    dists = latency_dists(ok, itl_values, percentiles)
    if itl_values is None:
        dists.pop("itl")
    return msgspec.structs.replace(s, **dists)


def summarize(
    records: list[RequestRecord],
    *,
    kind: str,
    target: str = "",
    config: msgspec.Struct | None = None,
    duration_s: float | None = None,
    itl_values=None,
    slo: dict[str, float] | None = None,
    metrics_hit_rate: float | None = None,
    timeline: list[Sample] | None = None,
    gpus: int | None = None,
    power_w: float | None = None,
    gpu: dict | None = None,
    preemptions: int = 0,
    by_tier: dict[str, float] | None = None,
    notes: list[str] | None = None,
    max_failure_rate: float = DEFAULT_MAX_FAILURE_RATE,
    clocks: dict[str, str] | None = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> Summary:
    """Build the summary of one run; `duration_s` defaults to first scheduled -> last end."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = (max(r.end for r in records) - min(r.scheduled for r in records)) if records else 0.0
    errors = _error_counts(records)
    inp, out, dur = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok), max(duration_s, 1e-9)
    invalid = invalid_reasons(
        len(records), len(records) - len(ok), errors.get("context_overflow", 0), max_failure_rate
    )
    cache, cache_notes = _cache_hits(ok, metrics_hit_rate, by_tier)
    return Summary(
        kind=kind,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        target=target,
        config=msgspec.to_builtins(config) if config is not None else {},
        requests=len(records),
        succeeded=len(ok),
        failed=len(records) - len(ok),
        errors=errors,
        top_errors=top_errors(records),
        duration_s=duration_s,
        **latency_dists(ok, itl_values, percentiles),
        input_tokens=inp,
        output_tokens=out,
        throughput=_throughput(inp, out, len(ok), dur, gpus, power_w) if duration_s > 0 else None,
        cache=cache,
        goodput=_goodput(records, slo, dur),
        preemptions=preemptions,
        sessions=session_rollups(records),
        timeline=timeline or [],
        valid=not invalid,
        invalid_reason="; ".join(invalid),
        invalid_reasons=invalid,
        gpu=gpu,
        notes=[*(notes or []), *cache_notes],
        clocks=clocks or {},
    )


def write_summary(summary: Summary, path) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(summary), indent=2))


def read_summary(path) -> Summary:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        s = msgspec.json.decode(data, type=Summary)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise UserError(f"{path}: not an agentkv summary ({e})") from None
    if not s.schema.startswith("agentkv.summary/"):
        raise UserError(f"{path}: unknown summary schema {s.schema!r}")
    return s
