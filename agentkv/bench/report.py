"""The self-contained report.html of a run: headline figures, five plots, per-session and error tables.

Everything is inline (CSS, SVG, a few lines of JavaScript to sort tables): no network, no CDN.
Works for `bench` and `simulate` runs alike, since both write the same records and summary.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from pathlib import Path

import msgspec
import numpy as np

from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import Dist, Summary
from agentkv.metrics.svg import PALETTE, Chart, Series
from agentkv.metrics.view import clocks_line

MAX_SESSIONS_PLOTTED = 24

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1340px;
color:#111827;background:#f9fafb;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}.sub{color:#6b7280;font-size:13px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-top:14px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;min-width:150px}
.card .v{font-size:20px;font-weight:600}.card .k{font-size:12px;color:#6b7280}
.bad,.warn{background:#fee2e2;border:1px solid #fca5a5;padding:10px 14px;border-radius:8px;margin-top:12px}
.warn{background:#fef3c7;border-color:#fcd34d}
.grid{display:flex;flex-wrap:wrap;gap:14px}.panel{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:6px}
svg.chart{max-width:100%;height:auto}svg.chart text{font-size:11px;fill:#374151}svg.chart .title{font-size:13px;font-weight:600}
svg.chart .label{font-size:12px}svg.chart .plot{fill:#fff;stroke:#d1d5db}svg.chart .grid{stroke:#eef0f3}
svg.chart .empty{fill:#9ca3af;font-size:14px}
table{border-collapse:collapse;background:#fff;font-size:13px}th,td{border:1px solid #e5e7eb;padding:4px 8px;
text-align:right}th{background:#f3f4f6;cursor:pointer;user-select:none}td:first-child,th:first-child{text-align:left}
.notes li{font-size:13px;color:#374151}code{font-size:12px;white-space:pre-wrap;word-break:break-all}
"""

# sort a table by the clicked header: numbers numerically, the rest as text; click again to reverse
_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th, col) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var dir = th.dataset.dir === 'asc' ? -1 : 1;
    th.dataset.dir = dir === 1 ? 'asc' : 'desc';
    function key(r) { var t = r.cells[col].dataset.v || r.cells[col].textContent; var n = parseFloat(t);
      return isNaN(n) ? t : n; }
    rows.sort(function (a, b) { var x = key(a), y = key(b); return (x > y ? 1 : x < y ? -1 : 0) * dir; });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.1f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _card(key: str, value: str) -> str:
    return f'<div class="card"><div class="v">{escape(value)}</div><div class="k">{escape(key)}</div></div>'


def _table(headers: list[str], rows: list[list], sortable: bool = True) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, tuple):  # (shown text, sort value)
                cells.append(f'<td data-v="{escape(str(v[1]))}">{escape(str(v[0]))}</td>')
            else:
                cells.append(f"<td>{escape(str(v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    cls = ' class="sortable"' if sortable else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def ttft_chart(records: list[RequestRecord]) -> Chart:
    ok = [r for r in records if r.ok and r.ttft is not None]
    c = Chart("TTFT vs input length", "input tokens", "TTFT (ms)")
    for depth, name in ((0, "main session"), (1, "sub-agent")):
        rs = [r for r in ok if (r.depth > 0) == bool(depth)]
        if rs:
            c.add(
                Series(
                    name,
                    [r.input_tokens for r in rs],
                    [r.ttft * 1000 for r in rs],
                    "dots",
                    tips=[
                        f"#{r.id} {r.session}: {r.input_tokens:,} in, cached {r.cached_tokens}, "
                        f"TTFT {r.ttft * 1000:,.1f} ms"
                        for r in rs
                    ],
                )
            )
    return c


def tpot_chart(records: list[RequestRecord]) -> Chart:
    v = np.asarray([r.tpot * 1000 for r in records if r.ok and r.tpot is not None], dtype=float)
    c = Chart("TPOT distribution", "TPOT (ms per output token)", "requests")
    if v.size:
        counts, edges = np.histogram(v, bins=min(40, max(5, int(np.sqrt(v.size)) + 1)))
        mids = ((edges[:-1] + edges[1:]) / 2).tolist()
        c.add(
            Series(
                "requests",
                mids,
                counts.astype(float).tolist(),
                "bars",
                width=float(edges[1] - edges[0]),
                tips=[
                    f"{a:,.2f}-{b:,.2f} ms: {n}"
                    for a, b, n in zip(edges[:-1], edges[1:], counts, strict=True)
                ],
            )
        )
    return c


def cache_chart(records: list[RequestRecord], s: Summary) -> Chart:
    c = Chart("Cache hit over time", "time (s)", "hit rate (%)", ymin=0, ymax=100)
    done = sorted((r for r in records if r.ok), key=lambda r: r.end)
    rep = [r for r in done if r.cached_tokens is not None and r.input_tokens]
    if rep:
        c.add(
            Series(
                "per request (reported)",
                [r.end for r in rep],
                [100 * r.cached_tokens / r.input_tokens for r in rep],
                "dots",
                tips=[f"#{r.id}: {r.cached_tokens:,} of {r.input_tokens:,} cached" for r in rep],
            )
        )
        cum_c = np.cumsum([r.cached_tokens for r in rep])
        cum_i = np.cumsum([r.input_tokens for r in rep])
        c.add(Series("cumulative (reported)", [r.end for r in rep], (100 * cum_c / cum_i).tolist(), "line"))
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
    xs, ys = [], []
    for a, b in zip(s.timeline, s.timeline[1:], strict=False):
        if None in (a.prefix_hits, a.prefix_queries, b.prefix_hits, b.prefix_queries):
            continue
        dq = b.prefix_queries - a.prefix_queries
        if dq > 0:
            xs.append(b.t)
            ys.append(100 * (b.prefix_hits - a.prefix_hits) / dq)
    if xs:
        c.add(Series("server metrics (per interval)", xs, ys, "step"))
    return c


def load_chart(s: Summary) -> Chart:
    tl = s.timeline
    c = Chart(
        "In-flight requests and KV usage over time",
        "time (s)",
        "requests",
        "KV cache usage (%)",
        y2min=0,
        y2max=100,
    )
    if tl:
        ts = [p.t for p in tl]
        if any(p.running is not None for p in tl):
            c.add(Series("running (server)", ts, [p.running for p in tl], "step"))
            c.add(Series("waiting (server)", ts, [p.waiting for p in tl], "step"))
        c.add(Series("in flight (client)", ts, [p.in_flight for p in tl], "step", dash=True))
        if any(p.kv_usage is not None for p in tl):
            c.add(
                Series(
                    "KV usage",
                    ts,
                    [None if p.kv_usage is None else 100 * p.kv_usage for p in tl],
                    "line",
                    right=True,
                )
            )
    return c


def context_chart(records: list[RequestRecord]) -> Chart:
    c = Chart("Per-session context growth", "time (s)", "input tokens", width=1300, height=340)
    trees: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        trees[r.tree or r.session].append(r)
    largest = sorted(trees, key=lambda k: -max(r.input_tokens for r in trees[k]))[:MAX_SESSIONS_PLOTTED]
    for n, key in enumerate(sorted(largest)):
        rs = sorted(trees[key], key=lambda r: r.scheduled)
        color = PALETTE[n % len(PALETTE)]
        main = [r for r in rs if r.depth == 0]
        subs = [r for r in rs if r.depth > 0]
        if main:
            c.add(
                Series(key, [r.scheduled for r in main], [r.input_tokens for r in main], "line", color=color)
            )
        if subs:
            c.add(
                Series(
                    f"{key} sub-agents",
                    [r.scheduled for r in subs],
                    [r.input_tokens for r in subs],
                    "dots",
                    color=color,
                    tips=[f"{r.session} #{r.index}: {r.input_tokens:,} tokens" for r in subs],
                )
            )
    return c


def _dist_rows(s: Summary) -> list[list]:
    rows = []
    d: Dist
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        rows.append([name, _ms(d.mean), _ms(d.p50), _ms(d.p90), _ms(d.p99), _ms(d.max), f"{d.count:,}"])
    return rows


def _cards(s: Summary) -> str:
    """The headline figures as a row of cards (goodput only when SLOs were given)."""
    tp = s.throughput
    cards = [
        _card("requests ok / failed", f"{s.succeeded:,} / {s.failed:,}"),
        _card("duration", f"{s.duration_s:,.1f} s"),
        _card("TTFT p50 / p99", f"{_ms(s.ttft.p50)} / {_ms(s.ttft.p99)}"),
        _card("TPOT p50 / p99", f"{_ms(s.tpot.p50)} / {_ms(s.tpot.p99)}"),
        _card("output tok/s", f"{tp.output_tokens_per_s:,.0f}" if tp else "-"),
        _card("input tok/s", f"{tp.input_tokens_per_s:,.0f}" if tp else "-"),
        _card("requests/s", f"{tp.requests_per_s:,.2f}" if tp else "-"),
        _card("cache hit: reported", _pct(s.cache.reported)),
        _card("cache hit: server metrics", _pct(s.cache.metrics)),
        _card("cache hit: ceiling", _pct(s.cache.ceiling)),
    ]
    if s.goodput:
        slo = ", ".join(f"{k} ≤ {v * 1000:g} ms" for k, v in s.goodput.slo.items())
        cards.append(
            _card(f"goodput ({slo})", f"{_pct(s.goodput.fraction)} ({s.goodput.requests_per_s:.2f} req/s)")
        )
    return f'<div class="cards">{"".join(cards)}</div>'


def _heading(s: Summary, title: str) -> str:
    """Title, provenance line, the invalid-run banner, the cards and the run's notes."""
    parts = [
        f"<h1>{escape(title)}</h1>",
        f'<div class="sub">{escape(s.created)} · agentkv {escape(s.agentkv_version)} · schema '
        f"{escape(s.schema)}</div>",
    ]
    if not s.valid:
        why = "".join(f"<li>{escape(r)}</li>" for r in s.invalid_reasons or [s.invalid_reason])
        parts.append(f'<div class="bad"><b>INVALID RUN</b><ul>{why}</ul></div>')
    if s.cache.contaminated:
        note = next((n for n in s.notes if n.startswith("cache contaminated")), "hits above the ceiling")
        parts.append(f'<div class="warn"><b>CACHE CONTAMINATED:</b> {escape(note)}</div>')
    parts.append(_cards(s))
    if s.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{escape(n)}</li>" for n in s.notes) + "</ul>")
    return "".join(parts)


def _plots(s: Summary, records: list[RequestRecord]) -> str:
    """The four half-width charts, then the full-width context growth chart."""
    charts = [ttft_chart(records), tpot_chart(records), cache_chart(records, s), load_chart(s)]
    return (
        '<h2>Plots</h2><div class="grid">'
        + "".join(f'<div class="panel">{c.svg()}</div>' for c in charts)
        + f'<div class="panel">{context_chart(records).svg()}</div></div>'
    )


def _latency(s: Summary) -> str:
    line = clocks_line(s)
    clock = f'<div class="sub">{escape(line)}</div>' if line else ""
    return (
        "<h2>Latency</h2>"
        + clock
        + _table(["metric", "mean", "p50", "p90", "p99", "max", "count"], _dist_rows(s), sortable=False)
    )


def _errors(s: Summary) -> str:
    """The most frequent errors (reason, status, the server's message, a hint), then the count per
    reason; nothing when every request succeeded."""
    if not s.errors:
        return ""
    top = [[g.count, g.error, g.status or "-", g.message, g.hint] for g in s.top_errors]
    return (
        "<h2>Errors</h2>"
        + (_table(["requests", "reason", "status", "message", "hint"], top) if top else "")
        + _table(["reason", "requests"], [[k, v] for k, v in sorted(s.errors.items())])
    )


def _gpu(s: Summary) -> str:
    """The NVML table per device, or nothing when no GPU was monitored."""
    if not s.gpu:
        return ""
    rows = [
        [
            d.get("name", ""),
            f"{d.get('mem_used_gib_max', 0):.1f}",
            f"{d.get('util_pct_mean', 0):.0f}",
            f"{d.get('mem_bw_util_pct_mean', 0):.0f}",
        ]
        for d in s.gpu.get("devices", [])
    ]
    return "<h2>GPU (NVML)</h2>" + _table(
        ["device", "max memory used (GiB)", "mean util (%)", "mean memory-bandwidth util (%)"], rows
    )


_SESSION_HEADERS = [
    "session tree",
    "trace",
    "turns",
    "sub-agent requests",
    "time (s)",
    "input",
    "output",
    "cached",
    "hit rate",
    "TTFT p50",
    "failed",
]


def _sessions(s: Summary) -> str:
    """One sortable row per session tree; numeric cells carry their raw value to sort by."""
    rows = [
        [
            x.session,
            x.trace,
            x.turns,
            x.sub_requests,
            (f"{x.duration_s:,.1f}", x.duration_s),
            (f"{x.input_tokens:,}", x.input_tokens),
            (f"{x.output_tokens:,}", x.output_tokens),
            (f"{x.cached_tokens:,}", x.cached_tokens),
            (_pct(x.hit_rate), x.hit_rate or 0),
            (_ms(x.ttft_p50), x.ttft_p50 or 0),
            x.failed,
        ]
        for x in s.sessions
    ]
    return "<h2>Sessions</h2>" + _table(_SESSION_HEADERS, rows)


def _config(s: Summary) -> str:
    cfg = msgspec.json.encode(s.config).decode()
    return f"<h2>Configuration</h2><code>{escape(cfg)}</code>"


def render_report(s: Summary, records: list[RequestRecord]) -> str:
    """The report page as one HTML string."""
    title = f"agentkv {s.kind}: {s.target}"
    body = "".join(
        (_heading(s, title), _plots(s, records), _latency(s), _errors(s), _gpu(s), _sessions(s), _config(s))
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>'
        f"<body>{body}<script>{_JS}</script></body></html>"
    )


def write_report(s: Summary, records: list[RequestRecord], path: str | Path) -> Path:
    """Write report.html (UTF-8) and return its path."""
    p = Path(path)
    p.write_text(render_report(s, records), encoding="utf-8")
    return p
