"""The report's run-wide charts: TTFT and TPOT over time, latency distributions, cache hits and load.

Every chart aggregates (time bins with p50/p90/p99, histograms) rather than drawing one mark per
request, so a run of 8,000 requests reads as well as one of 50; latencies spanning decades get a
log scale.
"""

from __future__ import annotations

import numpy as np

from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import Sample, Summary
from agentkv.metrics.svg import LOG_SPAN, Chart, Series

DOTS_UP_TO = 400  # requests: draw each one as a dot up to this many
LINES_FROM = 60  # requests: p50/p90/p99 per time slice from this many on (fewer: too few per slice)
SKEW = 10.0  # a histogram gets log bins when its max is this many times its median (long tail)
MAX_SAMPLES = 300  # timeline samples drawn as they are; more are averaged into this many slices


def _bins(n: int) -> int:
    return int(min(60, max(6, n // 12)))


def binned_percentiles(ts, vs, bins: int) -> tuple[list[float], dict[int, list[float]], list[int]]:
    """Bin (t, v) pairs into `bins` equal time slices: slice centres, p50/p90/p99 per slice and
    the count per slice (empty slices left out)."""
    t, v = np.asarray(ts, dtype=float), np.asarray(vs, dtype=float)
    edges = np.linspace(t.min(), t.max() if t.max() > t.min() else t.min() + 1, bins + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    mids, counts, pcts = [], [], {50: [], 90: [], 99: []}
    for b in range(bins):
        sel = v[which == b]
        if sel.size:
            mids.append(float((edges[b] + edges[b + 1]) / 2))
            counts.append(int(sel.size))
            for p, q in zip(pcts, np.percentile(sel, list(pcts)), strict=True):
                pcts[p].append(float(q))
    return mids, pcts, counts


def over_time_chart(records: list[RequestRecord], field: str, title: str, ylabel: str) -> Chart:
    """A latency (ms) against the time each request was due: p50/p90/p99 per time slice, plus
    one dot per request when there are few."""
    ok = [r for r in records if r.ok and getattr(r, field) is not None]
    c = Chart(title, "time the request was due (s)", ylabel, ylog=None)
    if not ok:
        return c
    ts = [r.scheduled for r in ok]
    vs = [getattr(r, field) * 1000 for r in ok]
    if len(ok) <= DOTS_UP_TO:
        tips = [
            f"#{r.id} {r.session}: {v:,.1f} ms at {r.scheduled:,.1f} s" for r, v in zip(ok, vs, strict=True)
        ]
        color = "#9ca3af" if len(ok) >= LINES_FROM else "#2563eb"  # grey under percentile lines
        c.add(Series("each request", ts, vs, "dots", color=color, tips=tips))
    if len(ok) < LINES_FROM:
        return c
    mids, pcts, counts = binned_percentiles(ts, vs, _bins(len(ok)))
    for (p, ys), color in zip(pcts.items(), ("#2563eb", "#ea580c", "#dc2626"), strict=True):
        tips = [f"p{p} {y:,.1f} ms over {n} requests" for y, n in zip(ys, counts, strict=True)]
        c.add(Series(f"p{p} per slice", mids, ys, "line", color=color, tips=tips, dash=p == 99))
    return c


def histogram(values, max_bins: int = 40) -> tuple[list[float], list[float], list[float], bool]:
    """Bar edges and counts of `values`: log-spaced bins when positive values span 100x or more,
    or have a long tail (max >= 10x the median). Returns (lefts, rights, counts, log)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return [], [], [], False
    lo, hi = float(v.min()), float(v.max())
    log = lo > 0 and (hi / lo >= LOG_SPAN or hi / float(np.median(v)) >= SKEW)
    n = min(max_bins, max(5, int(np.sqrt(v.size)) + 1))
    if hi <= lo:  # one value: a bar in the middle of a small range around it
        lo, hi, n = lo - 0.05 * abs(lo) - 0.5, hi + 0.05 * abs(hi) + 0.5, 5
    edges = np.geomspace(lo, hi, n + 1) if log else np.linspace(lo, hi, n + 1)
    counts, edges = np.histogram(v, bins=edges)
    return edges[:-1].tolist(), edges[1:].tolist(), counts.astype(float).tolist(), log


def dist_chart(values_ms, title: str, xlabel: str, marks: dict[str, float | None]) -> Chart:
    """A histogram of latencies in ms (log x when they span decades), percentiles marked."""
    lefts, rights, counts, log = histogram(values_ms)
    c = Chart(title, xlabel, "requests" if "ITL" not in title else "token gaps", ymin=0, xlog=log)
    if counts:
        tips = [f"{a:,.2f}-{b:,.2f} ms: {int(n):,}" for a, b, n in zip(lefts, rights, counts, strict=True)]
        c.add(Series("count", lefts, counts, "bars", x2s=rights, tips=tips))
        c.marks = [(v, k) for k, v in marks.items() if v is not None]
    return c


def distribution_charts(s: Summary, records: list[RequestRecord], itl_values=None) -> list[Chart]:
    """TTFT, TPOT, ITL and E2E histograms with p50 and p99 marked. ITL: every token gap when the
    run kept them, else each request's longest gap (said in the title)."""
    ok = [r for r in records if r.ok]

    def ms(vals):
        return [v * 1000 for v in vals if v is not None]

    def marks(d):
        return {"p50": d.p50 and d.p50 * 1000, "p99": d.p99 and d.p99 * 1000}

    if itl_values is not None and len(itl_values):
        itl, itl_title = ms(itl_values), "ITL distribution (every token gap)"
    else:
        itl, itl_title = ms(r.itl_max for r in ok), "ITL distribution (longest gap per request)"
    return [
        dist_chart(ms(r.ttft for r in ok), "TTFT distribution", "TTFT (ms)", marks(s.ttft)),
        dist_chart(ms(r.tpot for r in ok), "TPOT distribution", "TPOT (ms per output token)", marks(s.tpot)),
        dist_chart(itl, itl_title, "inter-token latency (ms)", marks(s.itl)),
        dist_chart(ms(r.e2e for r in ok), "E2E latency distribution", "E2E (ms)", marks(s.e2e)),
    ]


def _interval_hits(s: Summary) -> tuple[list[float], list[float]]:
    """Server-metric hit rate (%) per sampling interval, from the counters' deltas."""
    xs, ys = [], []
    for a, b in zip(s.timeline, s.timeline[1:], strict=False):
        if None in (a.prefix_hits, a.prefix_queries, b.prefix_hits, b.prefix_queries):
            continue
        dq = b.prefix_queries - a.prefix_queries
        if dq > 0:
            xs.append(b.t)
            ys.append(100 * (b.prefix_hits - a.prefix_hits) / dq)
    return xs, ys


def cache_chart(records: list[RequestRecord], s: Summary) -> Chart:
    """Token hit rate over time: per time slice and cumulative (reported), the cumulative ceiling
    and the server's metrics per sampling interval."""
    c = Chart("Cache hit rate over time", "time (s)", "token hit rate (%)", ymin=0, ymax=100)
    done = sorted((r for r in records if r.ok), key=lambda r: r.end)
    rep = [r for r in done if r.cached_tokens is not None and r.input_tokens]
    if rep:
        t = np.asarray([r.end for r in rep])
        cached = np.asarray([r.cached_tokens for r in rep], dtype=float)
        inp = np.asarray([r.input_tokens for r in rep], dtype=float)
        bins = _bins(len(rep))
        edges = np.linspace(t.min(), t.max() if t.max() > t.min() else t.min() + 1, bins + 1)
        which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
        sc, si = np.bincount(which, cached, bins), np.bincount(which, inp, bins)
        keep = si > 0
        mids = ((edges[:-1] + edges[1:]) / 2)[keep]
        c.add(
            Series("per time slice (reported)", mids.tolist(), (100 * sc[keep] / si[keep]).tolist(), "step")
        )
        c.add(
            Series(
                "cumulative (reported)",
                t.tolist(),
                (100 * np.cumsum(cached) / np.cumsum(inp)).tolist(),
                "line",
            )
        )
    if done:  # the ceiling counts the trace's tokens (the server's may differ: a chat template)
        cum_ceil = np.cumsum([r.ceiling_tokens for r in done])
        cum_in = np.cumsum([max(1, r.trace_input_tokens or r.input_tokens) for r in done])
        c.add(
            Series(
                "cumulative ceiling",
                [r.end for r in done],
                (100 * cum_ceil / cum_in).tolist(),
                "line",
                dash=True,
            )
        )
    xs, ys = _interval_hits(s)
    if xs:
        c.add(Series("server metrics (per interval)", xs, ys, "step"))
    return c


def slice_means(tl: list[Sample], n: int) -> list[Sample]:
    """`tl` averaged into `n` consecutive slices (None stays None when a slice has no value)."""
    out = []
    for part in np.array_split(np.arange(len(tl)), n):
        ps = [tl[i] for i in part]

        def mean(field: str, ps=ps):
            vals = [getattr(p, field) for p in ps if getattr(p, field) is not None]
            return float(np.mean(vals)) if vals else None

        out.append(Sample(ps[-1].t, mean("in_flight"), mean("kv_usage"), mean("running"), mean("waiting")))
    return out


def load_chart(s: Summary) -> Chart:
    """Requests running, waiting and in flight, and KV usage, over the sampled timeline."""
    tl = s.timeline
    c = Chart(
        "In-flight requests and KV usage over time",
        "time (s)",
        "requests",
        "KV cache usage (%)",
        ymin=0,
        y2min=0,
        y2max=100,
    )
    if len(tl) > MAX_SAMPLES:
        c.title += f" (mean per slice of {len(tl) / MAX_SAMPLES:.0f} samples)"
        tl = slice_means(tl, MAX_SAMPLES)
    if tl:
        ts = [p.t for p in tl]
        if any(p.running is not None for p in tl):
            c.add(Series("running (server)", ts, [p.running for p in tl], "step"))
            c.add(Series("waiting (server)", ts, [p.waiting for p in tl], "step"))
        c.add(Series("in flight (client)", ts, [p.in_flight for p in tl], "step", dash=True))
        if any(p.kv_usage is not None for p in tl):
            kv = [None if p.kv_usage is None else 100 * p.kv_usage for p in tl]
            c.add(Series("KV usage", ts, kv, "line", right=True))
    return c
