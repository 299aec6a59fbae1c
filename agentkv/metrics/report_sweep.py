"""sweep.html of `agentkv simulate --sweep ... --out DIR`, from the points' summaries alone: the
throughput-per-GPU against interactivity curve (as bench's sweep.html) and one table row per point."""

from __future__ import annotations

from html import escape
from pathlib import Path

from agentkv.metrics.summary import Summary
from agentkv.metrics.svg import PALETTE, Chart, Series
from agentkv.metrics.view import ms, num, pct

_CSS = (
    "body{font:14px system-ui,sans-serif;margin:24px;color:#111827}table{border-collapse:collapse}"
    "td,th{padding:3px 10px;border-bottom:1px solid #e5e7eb;text-align:right}th{background:#f3f4f6}"
    "td:first-child,th:first-child{text-align:left}svg.chart{max-width:100%;height:auto}"
    "svg.chart text{font-size:11px;fill:#374151}svg.chart .title{font-size:13px;font-weight:600}"
    "svg.chart .label{font-size:12px}svg.chart .plot{fill:#fff;stroke:#d1d5db}svg.chart .grid{stroke:#eef0f3}"
    ".no{color:#b91c1c}"
)
HEADERS = ("TTFT p50", "TTFT p99", "TPOT p50", "hit rate", "out tok/s", "out tok/s/GPU", "preempt", "failed")

Point = tuple[dict, Summary, str]  # overrides, summary, its summary file's name


def _xy(s: Summary) -> tuple[float | None, float | None]:
    """(1 / median TPOT: a user's decode tok/s, output tok/s per GPU)."""
    tp = s.throughput
    return (1.0 / s.tpot.p50 if s.tpot.p50 else None, tp.output_tokens_per_s_per_gpu if tp else None)


TIER_COLOR = "#7c3aed"


def tier_marks(tier_tps: float, xs: list, ys: list, met: list) -> list[Series]:
    """The interactivity tier on a throughput-against-interactivity chart (bench's and simulate's
    sweep.html): a dashed vertical line at its tok/s per user, and a ring round each point meeting
    it (`met[i]`); nothing when no point has both figures."""
    pts = [(x, y, m) for x, y, m in zip(xs, ys, met, strict=True) if x is not None and y is not None]
    if not pts:
        return []
    lo, hi = min(y for _, y, _ in pts), max(y for _, y, _ in pts)
    name = f"tier: {tier_tps:g} tok/s per user"
    out = [Series(name, [tier_tps, tier_tps], [lo, hi], kind="line", color=TIER_COLOR, dash=True)]
    ring = [(x, y) for x, y, m in pts if m]
    if ring:
        xs, ys = [x for x, _ in ring], [y for _, y in ring]
        out.append(Series("meets the tier", xs, ys, kind="rings", color=TIER_COLOR))
    return out


def curve(keys: list[str], points: list[Point]) -> Chart:
    """One line per setting of the keys after the first, its dots the first key's values."""
    ch = Chart(
        f"throughput vs interactivity ({keys[0]} sweep)" if keys else "throughput vs interactivity",
        "interactivity: output tok/s per user (1 / median TPOT)",
        "output tok/s per GPU",
    )
    groups: dict[str, list[Point]] = {}
    for p in points:
        rest = ", ".join(f"{k}={p[0][k]}" for k in keys[1:]) or "points"
        groups.setdefault(rest, []).append(p)
    for n, (name, pts) in enumerate(groups.items()):
        xy = [(*_xy(s), o) for o, s, _ in pts]
        xy = [(x, y, o) for x, y, o in xy if x is not None and y is not None]
        if not xy:
            continue
        tips = [
            f"{', '.join(f'{k}={v}' for k, v in o.items())}: {y:,.0f} tok/s/GPU, {x:,.1f} tok/s/user"
            for x, y, o in xy
        ]
        color = PALETTE[n % len(PALETTE)]
        ch.add(
            Series(name, [x for x, _, _ in xy], [y for _, y, _ in xy], kind="line", color=color, legend=False)
        )
        ch.add(
            Series(name, [x for x, _, _ in xy], [y for _, y, _ in xy], kind="dots", color=color, tips=tips)
        )
    tiers = [s.interactivity for _, s, _ in points if s.interactivity is not None]
    if tiers:
        xy = [_xy(s) for _, s, _ in points]
        met = [bool(s.interactivity and s.interactivity.met) for _, s, _ in points]
        for s in tier_marks(tiers[0].tier_tps, [x for x, _ in xy], [y for _, y in xy], met):
            ch.add(s)
    return ch


def _row(keys: list[str], p: Point) -> str:
    o, s, name = p
    tp = s.throughput
    cells = [escape(str(o[k])) for k in keys] + [
        ms(s.ttft.p50),
        ms(s.ttft.p99),
        ms(s.tpot.p50),
        pct(s.cache.reported),
        num(tp.output_tokens_per_s if tp else None),
        num(tp.output_tokens_per_s_per_gpu if tp else None),
        f"{s.preemptions:,}",
        f"{s.failed:,}",
    ]
    valid = "yes" if s.valid else f'<span class="no">NO: {escape(s.invalid_reason or "")}</span>'
    link = f'<a href="{escape(name)}">{escape(name)}</a>'
    return "<tr>" + "".join(f"<td>{c}</td>" for c in [*cells, valid, link]) + "</tr>"


def write_sweep_html(path: Path, keys: list[str], points: list[Point], total: int) -> Path:
    """sweep.html: the curve and the table of the finished points (`total`: points in the grid)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in (*keys, *HEADERS, "valid", "summary"))
    body = "".join(_row(keys, p) for p in points)
    done = f"{len(points)} of {total} points" if len(points) < total else f"{total} points"
    target = escape(points[0][1].target) if points else ""
    html = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>agentkv simulate sweep</title>"
        f"<style>{_CSS}</style></head><body><h1>agentkv simulate sweep: {done}</h1><p>{target}</p>"
        f"{curve(keys, points).svg() if points else ''}<table><tr>{head}</tr>{body}</table></body></html>"
    )
    path.write_text(html, encoding="utf-8")
    return path
