"""How `agentkv compare` shows a comparison: a terminal table, JSON, and a self-contained HTML page
(tables and inline SVG bar charts from agentkv.metrics.svg; no JavaScript, opens offline)."""

from __future__ import annotations

from html import escape
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentkv.bench.compare import Cell, Row, Run
from agentkv.metrics.report_prediction import SUMMARY_HEADERS, prediction_summary
from agentkv.metrics.svg import PALETTE, Chart, Series
from agentkv.terminal import show

LEGEND = (
    "better / worse: beyond the noise band, max(2% (1 point for hit rates), the 95% bootstrap "
    "interval of the difference over requests, paired when both runs replayed the same requests); "
    "~ within it. Lower is better for latencies, failures and preemptions; higher for throughput, "
    "hit rates and goodput; counts of the workload (requests, tokens, sessions, ceiling) have no side."
)
STYLE = {"better": "green", "worse": "red", "same": "dim", "changed": "yellow"}
CHARTS = ("TTFT p50", "TTFT p99", "TPOT p50", "E2E p50", "output tok/s", "cache hit: reported")


def label(run: Run) -> str:
    """A short name for a run: its folder (for a summary.json) or the file name."""
    p = Path(run.name)
    return p.parent.name if p.name == "summary.json" and p.parent.name else p.name or run.name


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v:.1%}"
    if unit in ("ms", "s"):
        return f"{v:,.1f}"
    if unit in ("tok/s", "req/s"):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,.0f}"


def change(c: Cell, unit: str) -> str:
    """`+25.0% worse`, `+10.0 pp better`, `-0.4% ~`; "-" when there is nothing to compare."""
    if c.diff is None:
        return "-"
    if unit == "%":
        text = f"{c.diff * 100:+.1f} pp"
    elif c.rel is not None:
        text = f"{c.rel:+.1%}"
    else:
        text = ("+" if c.diff > 0 else "") + fmt(c.diff, unit)
    return f"{text} {'~' if c.verdict == 'same' else c.verdict}".rstrip()


def table(runs: list[Run], rows: list[Row]) -> Table:
    names = [label(r) for r in runs]
    t = Table(
        title="compare: " + " | ".join(f"{n} ({r.summary.kind})" for n, r in zip(names, runs, strict=True))
    )
    t.add_column("figure")
    t.add_column(f"{names[0]} (baseline)", justify="right")
    for n in names[1:]:
        t.add_column(n, justify="right")
        t.add_column(f"vs {names[0]}", justify="right")
    for row in rows:
        name = f"{row.name} ({row.unit})" if row.unit in ("ms", "s") else row.name
        cells: list[str | Text] = [name, fmt(row.cells[0].value, row.unit)]
        for c in row.cells[1:]:
            cells += [fmt(c.value, row.unit), Text(change(c, row.unit), style=STYLE.get(c.verdict, ""))]
        t.add_row(*cells)
    t.add_row(
        "valid",
        *[x for r in runs for x in ([str(r.summary.valid)] if r is runs[0] else [str(r.summary.valid), ""])],
    )
    return t


def print_comparison(runs: list[Run], rows: list[Row], diff: dict, warn: list[str]) -> None:
    con = Console()
    show(con, table(runs, rows))
    con.print(Text(LEGEND, style="dim"))
    both = {k: v for k, v in diff.items() if len({repr(x) for x in v if x is not None}) > 1}
    if both:
        t = Table(title="settings that differ (bench's server info in simulate's names)")
        t.add_column("setting")
        for r in runs:
            t.add_column(label(r))
        for k, vals in both.items():
            t.add_row(k, *["-" if v is None else repr(v) for v in vals])
        show(con, t)
    for r, i in ((r, i) for i, r in enumerate(runs)):
        only = [k for k, v in diff.items() if k not in both and v[i] is not None]
        if only:
            con.print(
                Text(
                    f"settings only some runs record (same where recorded), {label(r)}: {', '.join(only)}",
                    style="dim",
                )
            )
    if any(r.prediction for r in runs):
        t = Table(title="prediction errors (agentkv predict: (predicted - measured) / measured)")
        for h in ("run", *SUMMARY_HEADERS):
            t.add_column(h, justify="left" if h in ("run", "profile") else "right")
        for r in runs:
            if r.prediction:
                t.add_row(label(r), *prediction_summary(r.prediction))
        show(con, t)
    for w in warn:
        con.print(Text("warning: " + w, style="yellow"))


def to_json(runs: list[Run], rows: list[Row], diff: dict, warn: list[str]) -> str:
    out = {
        "runs": [{"name": r.name, "kind": r.summary.kind, "target": r.summary.target} for r in runs],
        "baseline": runs[0].name,
        "figures": rows,
        "settings_diff": diff,
        "warnings": warn,
        "noise_band": LEGEND,
        "predictions": {r.name: r.prediction for r in runs if r.prediction},
    }
    return msgspec.json.format(msgspec.json.encode(out), indent=2).decode()


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:24px;color:#111827}table{border-collapse:collapse;"
    "margin:12px 0}td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:right}td:first-child,"
    "th:first-child{text-align:left}.better{color:#15803d;font-weight:600}.worse{color:#b91c1c;"
    "font-weight:600}.same{color:#6b7280}.changed{color:#a16207}.warn{color:#a16207}"
    ".charts{display:flex;flex-wrap:wrap;gap:12px}"
    "svg.chart text{font-size:11px;fill:#374151}svg.chart .title{font-size:13px;font-weight:600}"
    "svg.chart .plot{fill:#fff;stroke:#d1d5db}svg.chart .grid{stroke:#eef0f3}"
)


def _html_table(headers: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>" + "".join(f"<tr>{''.join(r)}</tr>" for r in body) + "</table>"


def _figures_html(runs: list[Run], rows: list[Row]) -> str:
    names = [label(r) for r in runs]
    headers = ["figure", f"{names[0]} (baseline)"] + [x for n in names[1:] for x in (n, f"vs {names[0]}")]
    body = []
    for row in rows:
        cells = [f"<td>{escape(row.name)}{' (' + row.unit + ')' if row.unit else ''}</td>"]
        cells.append(f"<td>{fmt(row.cells[0].value, row.unit)}</td>")
        for c in row.cells[1:]:
            band = (
                ""
                if c.band is None
                else f"noise band {c.band:.1%}"
                if row.unit != "%"
                else f"band {c.band * 100:.1f} pp"
            )
            cells += [
                f"<td>{fmt(c.value, row.unit)}</td>",
                f'<td class="{c.verdict}" title="{band}">{escape(change(c, row.unit))}</td>',
            ]
        body.append(cells)
    return _html_table(headers, body)


def _charts(runs: list[Run], rows: list[Row]) -> str:
    """One bar chart per headline figure, a bar per run (its colour in every chart)."""
    out = []
    by_name = {r.name: r for r in rows}
    for name in CHARTS:
        row = by_name[name]
        scale = 100.0 if row.unit == "%" else 1.0
        c = Chart(title=name, xlabel="run", ylabel=row.unit or "count", width=420, height=260, ymin=0.0)
        for i, (run, cell) in enumerate(zip(runs, row.cells, strict=True)):
            if cell.value is not None:
                tip = f"{label(run)}: {fmt(cell.value, row.unit)}"
                c.add(
                    Series(
                        label(run),
                        [i + 1.0],
                        [cell.value * scale],
                        "bars",
                        PALETTE[i % len(PALETTE)],
                        tips=[tip],
                        width=0.6,
                    )
                )
        out.append(c.svg())
    return '<div class="charts">' + "".join(out) + "</div>"


def _predictions_html(runs: list[Run]) -> str:
    """The runs' prediction errors (prediction.json beside them), or nothing when none has one."""
    body = [
        [f"<td>{escape(c)}</td>" for c in (label(r), *prediction_summary(r.prediction))]
        for r in runs
        if r.prediction
    ]
    if not body:
        return ""
    return "<h2>prediction errors (agentkv predict)</h2>" + _html_table(["run", *SUMMARY_HEADERS], body)


def write_html(runs: list[Run], rows: list[Row], diff: dict, warn: list[str], path: Path) -> None:
    """The comparison as one self-contained HTML page at `path`."""
    runs_rows = [
        [
            f"<td>{escape(label(r))}</td>",
            f"<td>{escape(r.summary.kind)}</td>",
            f"<td>{escape(r.summary.target)}</td>",
            f"<td>{r.summary.requests:,}</td>",
            f"<td>{'yes' if r.summary.valid else 'NO'}</td>",
        ]
        for r in runs
    ]
    settings = [
        [f"<td>{escape(k)}</td>"] + [f"<td>{escape('-' if v is None else repr(v))}</td>" for v in vals]
        for k, vals in diff.items()
    ]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>agentkv compare</title><style>{_CSS}</style></head><body>",
        f"<h1>agentkv compare: {len(runs)} runs against {escape(label(runs[0]))}</h1>",
        _html_table(["run", "kind", "target", "requests", "valid"], runs_rows),
        "".join(f'<p class="warn">warning: {escape(w)}</p>' for w in warn),
        _charts(runs, rows),
        "<h2>figures</h2>",
        _figures_html(runs, rows),
        f"<p class='same'>{escape(LEGEND)}</p>",
        _predictions_html(runs),
        "<h2>settings that differ</h2>",
        _html_table(["setting", *[label(r) for r in runs]], settings) if settings else "<p>none</p>",
        "</body></html>",
    ]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts), encoding="utf-8")
    except OSError as e:
        from agentkv.errors import UserError

        raise UserError(f"--out {path}: cannot write ({e.strerror or e})") from None
