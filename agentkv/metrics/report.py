"""The self-contained report.html of a run: headline figures, latency over time and distributions,
cache and load, per-session swim lanes, hit rates and context growth, tables and the configuration.

Everything is inline (CSS, SVG, a few lines of JavaScript to sort tables): no network, no CDN.
Written by `bench` and `simulate` alike (layer 4, so both applications can import it), since both
write the same records and summary.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from agentkv.metrics.records import RequestRecord
from agentkv.metrics.report_charts import cache_chart, distribution_charts, load_chart, over_time_chart
from agentkv.metrics.report_prediction import prediction_panel
from agentkv.metrics.report_sessions import context_chart, hit_rate_svg, swimlanes_svg
from agentkv.metrics.summary import Summary
from agentkv.metrics.tier import agents_text, reached_text, tier_text
from agentkv.metrics.view import clocks_line

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
svg.chart .empty{fill:#9ca3af;font-size:14px}svg.chart .mark{stroke:#111827;stroke-dasharray:3 3}
svg.chart .marklabel{font-size:11px;fill:#111827}.config{display:flex;gap:14px;align-items:flex-start}.config table{flex:1}
.config td:last-child{text-align:left;word-break:break-all}
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
    """A latency in seconds as "12.3 ms", or "45.6 s" from 10 s on (long waits read as seconds)."""
    if v is None:
        return "-"
    return f"{v:,.1f} s" if abs(v) >= 10 else f"{v * 1000:,.1f} ms"


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


def _pct_keys(s: Summary) -> list[str]:
    """The percentiles the summary holds (--percentiles), in order; the fixed three for old summaries."""
    for d in (s.ttft, s.tpot, s.itl, s.e2e):
        if d.percentiles:
            return list(d.percentiles)
    return ["p50", "p90", "p99"]


def _dist_rows(s: Summary, keys: list[str]) -> list[list]:
    rows = []
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        ps = d.percentiles or {"p50": d.p50, "p90": d.p90, "p99": d.p99}
        cells = [_ms(ps.get(k)) for k in keys]
        rows.append([name, _ms(d.mean), _ms(d.std), *cells, _ms(d.max), f"{d.count:,}"])
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
    if (i := s.interactivity) is not None:
        got = reached_text(i) + (f"; {agents_text(i)}" if i.met else "")
        cards.append(_card(f"interactivity ({tier_text(i)})", got))
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


def _panels(charts) -> str:
    return "".join(f'<div class="panel">{c if isinstance(c, str) else c.svg()}</div>' for c in charts)


def _plots(s: Summary, records: list[RequestRecord], itl_values) -> str:
    """Latency over time and distributions, cache and load (half width), then the per-session
    views (full width)."""
    over_time = [
        over_time_chart(records, "ttft", "TTFT over time", "TTFT (ms)"),
        over_time_chart(records, "tpot", "TPOT over time", "TPOT (ms per output token)"),
    ]
    return (
        '<h2>Latency over time</h2><div class="grid">'
        + _panels(over_time)
        + '</div><h2>Latency distributions</h2><div class="grid">'
        + _panels(distribution_charts(s, records, itl_values))
        + '</div><h2>Cache and load</h2><div class="grid">'
        + _panels([cache_chart(records, s), load_chart(s)])
        + '</div><h2>Sessions over time</h2><div class="grid">'
        + _panels([swimlanes_svg(records), hit_rate_svg(records), context_chart(records)])
        + "</div>"
    )


def _latency(s: Summary) -> str:
    line = clocks_line(s)
    clock = f'<div class="sub">{escape(line)}</div>' if line else ""
    keys = _pct_keys(s)
    headers = ["metric", "mean", "std", *keys, "max", "count"]
    return "<h2>Latency</h2>" + clock + _table(headers, _dist_rows(s, keys), sortable=False)


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


def _flat(prefix: str, v, out: list[list[str]]) -> None:
    """Nested settings as (dotted key, value) rows; long lists shortened with their length."""
    if isinstance(v, dict):
        for k, x in v.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), x, out)
    elif isinstance(v, list) and v and not isinstance(v[0], (dict, list)):
        shown = ", ".join(str(x) for x in v[:12])
        out.append([prefix, shown + (f", … ({len(v)} in all)" if len(v) > 12 else "")])
    else:
        out.append([prefix, "-" if v is None else str(v).lower() if isinstance(v, bool) else str(v)])


def _config(s: Summary) -> str:
    """The run's settings as a two-column table (nested settings flattened to dotted keys)."""
    rows: list[list[str]] = []
    _flat("", s.config, rows)
    if not rows:
        return ""
    half = (len(rows) + 1) // 2
    tables = "".join(
        _table(["setting", "value"], part, sortable=False) for part in (rows[:half], rows[half:]) if part
    )
    return f'<h2>Configuration</h2><div class="config">{tables}</div>'


def title_of(s: Summary) -> str:
    """`agentkv bench: MODEL on TARGET`: the served model, and the embedded server described rather
    than its throwaway loopback URL."""
    cfg = s.config or {}
    model = cfg.get("model") or (cfg.get("engine") or {}).get("model") or ""
    target = s.target
    server = cfg.get("server") or {}
    if any(n.startswith("target: the embedded server") for n in s.notes):
        gpu = server.get("gpu") or "simulated GPU"
        target = f"the embedded agentkv serve (simulated {str(gpu).upper()}, time scale {cfg.get('time_scale', 1):g})"
    elif server.get("engine") == "agentkv":
        target = f"agentkv serve at {s.target}"
    if s.kind == "simulate":
        return f"agentkv simulate: {s.target}"
    return f"agentkv {s.kind}: {model} on {target}" if model else f"agentkv {s.kind}: {target}"


def render_report(s: Summary, records: list[RequestRecord], itl_values=None, prediction=None) -> str:
    """The report page as one HTML string; `itl_values` (every token gap, seconds) feeds the ITL
    histogram when the run kept them; `prediction` (prediction.json) adds its errors' panel."""
    title = title_of(s)
    body = "".join(
        (
            _heading(s, title),
            _latency(s),
            prediction_panel(prediction),
            _plots(s, records, itl_values),
            _errors(s),
            _gpu(s),
            _sessions(s),
            _config(s),
        )
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>'
        f"<body>{body}<script>{_JS}</script></body></html>"
    )


def write_report(
    s: Summary, records: list[RequestRecord], path: str | Path, itl_values=None, prediction=None
) -> Path:
    """Write report.html (UTF-8) and return its path."""
    p = Path(path)
    p.write_text(render_report(s, records, itl_values, prediction), encoding="utf-8")
    return p
