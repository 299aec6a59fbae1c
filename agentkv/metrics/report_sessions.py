"""The report's per-session views: swim lanes (a lane per session tree, each request a bar, its
sub-agents on a second row), hit rate per session tree and context growth.

They stay readable at 119+ session trees: the largest are drawn one by one, the rest grouped
(one "other" row, grey unlabelled lines) and counted in a caption.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape

from agentkv.metrics.records import RequestRecord
from agentkv.metrics.svg import PALETTE, Area, Chart, Scale, Series, fmt

MAX_LANES = 40
MAX_HIT_ROWS = 30
MAX_GROWTH_LINES = 10
_PREFILL, _DECODE, _SUB_PREFILL, _SUB_DECODE, _FAILED = "#bfdbfe", "#2563eb", "#fed7aa", "#ea580c", "#dc2626"


def trees(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Records per live session tree (root session and its sub-agents)."""
    out: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        out[r.tree or r.session].append(r)
    return out


def _largest(groups: dict[str, list[RequestRecord]], n: int) -> list[str]:
    """The `n` trees with the most input tokens."""
    return sorted(groups, key=lambda k: -sum(r.input_tokens for r in groups[k]))[:n]


def _caption(shown: int, total: int, what: str) -> str:
    more = total - shown
    return f" ({shown} largest of {total} session trees; {more} {what})" if more > 0 else ""


def _bar(r: RequestRecord, sx: Scale, y: float, h: float, sub: bool) -> str:
    """A request as a bar from due to end: light until its first token, solid while decoding."""
    x0, x1 = sx(r.scheduled), sx(max(r.end, r.scheduled))
    tip = (
        f"<title>#{r.id} {escape(r.session)} turn {r.index}: {r.input_tokens:,} in, "
        f"{r.output_tokens:,} out, TTFT {'-' if r.ttft is None else f'{r.ttft * 1000:,.0f} ms'}, "
        f"E2E {r.e2e * 1000:,.0f} ms{'' if r.ok else ', failed: ' + escape(r.error)}</title>"
    )
    if not r.ok:
        return f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(1.0, x1 - x0):.1f}" height="{h}" fill="{_FAILED}">{tip}</rect>'
    ft = r.first_token if r.first_token is not None else r.end
    xm = sx(min(max(ft, r.scheduled), r.end))
    pre, dec = (_SUB_PREFILL, _SUB_DECODE) if sub else (_PREFILL, _DECODE)
    return (
        f'<g>{tip}<rect x="{x0:.1f}" y="{y:.1f}" width="{max(0.6, xm - x0):.1f}" height="{h}" fill="{pre}"/>'
        f'<rect x="{xm:.1f}" y="{y:.1f}" width="{max(0.8, x1 - xm):.1f}" height="{h}" fill="{dec}" '
        'fill-opacity="0.85"/></g>'
    )


def _lane_axis(sx: Scale, a: Area) -> str:
    out = [f'<rect x="{a.left}" y="{a.top}" width="{a.width}" height="{a.height}" class="plot"/>']
    for t in sx.ticks:
        out.append(
            f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{a.top}" y2="{a.top + a.height}" class="grid"/>'
            f'<text x="{sx(t):.1f}" y="{a.top + a.height + 16}" text-anchor="middle">{fmt(t)}</text>'
        )
    return "".join(out)


def _lane_legend(x: float) -> str:
    items = (
        (_PREFILL, "main: waiting + prefill"),
        (_DECODE, "main: decode"),
        (_SUB_PREFILL, "sub-agent: waiting + prefill"),
        (_SUB_DECODE, "sub-agent: decode"),
        (_FAILED, "failed"),
    )
    out = []
    for color, name in items:
        out.append(
            f'<rect x="{x:.0f}" y="28" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14:.0f}" y="37">{escape(name)}</text>'
        )
        x += 28 + 6.2 * len(name)
    return "".join(out)


def swimlanes_svg(records: list[RequestRecord], width: int = 1300) -> str:
    """A lane per session tree (the largest MAX_LANES, in start order): main-session requests on
    the lane's top row, sub-agent requests under them."""
    title = "Session swim lanes: each request from due to end"
    groups = trees(records)
    keys = sorted(_largest(groups, MAX_LANES), key=lambda k: min(r.scheduled for r in groups[k]))
    title += _caption(len(keys), len(groups), "not drawn")
    drawn = [r for k in keys for r in groups[k]]
    lane_h, left, top = 22, 150, 48
    height = top + lane_h * max(1, len(keys)) + 40
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}"'
    )
    caption = f'<text x="{width / 2}" y="18" class="title" text-anchor="middle">{escape(title)}</text>'
    if not drawn:
        return (
            head
            + f">{caption}"
            + f'<text x="{width / 2}" y="{height / 2}" class="empty">no data</text></svg>'
        )
    lo, hi = min(r.scheduled for r in drawn), max(r.end for r in drawn)
    a = Area(left, top, width - left - 20, lane_h * len(keys))
    sx = Scale(lo, hi if hi > lo else lo + 1, False, a.left, a.left + a.width)
    out = [
        head
        + f' data-xlim="{sx.lo:.6g},{sx.hi:.6g}" data-xdata="{lo:.6g},{hi:.6g}" data-lanes="{len(keys)}">',
        caption,
        _lane_legend(left),
        _lane_axis(sx, a),
    ]
    for i, k in enumerate(keys):
        y = top + i * lane_h
        rs = groups[k]
        subs = sum(1 for r in rs if r.depth > 0)
        label = k if len(k) <= 20 else k[:19] + "…"
        out.append(
            f'<text x="{left - 6}" y="{y + 14}" text-anchor="end"><title>{escape(k)}: {len(rs) - subs} main, '
            f"{subs} sub-agent requests</title>{escape(label)}</text>"
        )
        if i % 2:
            out.append(
                f'<rect x="{a.left}" y="{y}" width="{a.width}" height="{lane_h}" fill="#f3f4f6" fill-opacity="0.6"/>'
            )
        for r in sorted(rs, key=lambda r: r.scheduled):
            sub = r.depth > 0
            out.append(_bar(r, sx, y + (12 if sub else 3), 7 if sub else 9, sub))
    out.append(
        f'<text x="{a.left + a.width / 2}" y="{height - 6}" text-anchor="middle" class="label">time (s)</text></svg>'
    )
    return "".join(out)


def _hit_row(
    name: str, rs: list[RequestRecord], tip_extra: str = ""
) -> tuple[str, float | None, float | None, str]:
    ok = [r for r in rs if r.ok]
    rep = [r for r in ok if r.cached_tokens is not None]
    inp = sum(r.input_tokens for r in rep)
    hit = sum(r.cached_tokens for r in rep) / inp if inp else None  # type: ignore[misc]
    trace_in = sum(r.trace_input_tokens or r.input_tokens for r in ok)
    ceil = (
        sum(min(r.ceiling_tokens, r.trace_input_tokens or r.input_tokens) for r in ok) / trace_in
        if trace_in
        else None
    )
    tip = f"{name}{tip_extra}: {len(rs)} requests, {sum(r.input_tokens for r in rs):,} input tokens"
    return name, hit, ceil, tip


def hit_rate_svg(records: list[RequestRecord], width: int = 1300) -> str:
    """Hit rate per session tree as horizontal bars (the largest MAX_HIT_ROWS by input tokens, then
    one row for the rest), the tree's ceiling as a tick."""
    groups = trees(records)
    keys = _largest(groups, MAX_HIT_ROWS)
    rows = [_hit_row(k, groups[k]) for k in keys]
    rest = [r for k in groups if k not in set(keys) for r in groups[k]]
    if rest:
        rows.append(_hit_row(f"other {len(groups) - len(keys)} trees", rest, " (grouped)"))
    title = "Cache hit rate per session tree (bar: reported, tick: ceiling)" + _caption(
        len(keys), len(groups), "grouped in the last row"
    )
    row_h, left, top = 16, 170, 36
    height = top + row_h * max(1, len(rows)) + 40
    a = Area(left, top, width - left - 70, row_h * max(1, len(rows)))
    sx = Scale(0, 100, False, a.left, a.left + a.width)
    known = [v for _, h, c, _ in rows for v in (h, c) if v is not None]
    data = (
        f' data-xlim="0,100" data-xfixed="1" data-xdata="{100 * min(known):.6g},{100 * max(known):.6g}"'
        if known
        else ""
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(title)}"{data}>',
        f'<text x="{width / 2}" y="18" class="title" text-anchor="middle">{escape(title)}</text>',
    ]
    if not rows:
        out.append(f'<text x="{width / 2}" y="{height / 2}" class="empty">no data</text></svg>')
        return "".join(out)
    out.append(_lane_axis(sx, a))
    for i, (name, hit, ceil, tip) in enumerate(rows):
        y = top + i * row_h
        label = name if len(name) <= 24 else name[:23] + "…"
        grouped = rest and i == len(rows) - 1
        out.append(
            f'<text x="{left - 6}" y="{y + 12}" text-anchor="end"><title>{escape(tip)}</title>{escape(label)}</text>'
        )
        if hit is not None:
            color = "#9ca3af" if grouped else PALETTE[0]
            out.append(
                f'<rect x="{a.left}" y="{y + 3}" width="{max(0.5, sx(100 * hit) - a.left):.1f}" height="{row_h - 6}" '
                f'fill="{color}"><title>{escape(tip)}: hit rate {hit:.1%}</title></rect>'
            )
        if ceil is not None:
            cx = sx(100 * ceil)
            out.append(
                f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y + 1}" y2="{y + row_h - 1}" stroke="#111827" stroke-width="2"/>'
            )
        text = "unknown" if hit is None else f"{hit:.1%}"
        out.append(f'<text x="{a.left + a.width + 6}" y="{y + 12}">{text}</text>')
    out.append(
        f'<text x="{a.left + a.width / 2}" y="{height - 6}" text-anchor="middle" class="label">token hit rate (%)</text></svg>'
    )
    return "".join(out)


def context_chart(records: list[RequestRecord]) -> Chart:
    """Input tokens of each main-session request against time: the largest MAX_GROWTH_LINES trees
    in colour (their sub-agents as dots), every other tree as a thin grey line."""
    groups = trees(records)
    keys = _largest(groups, MAX_GROWTH_LINES)
    title = "Per-session context growth" + _caption(len(keys), len(groups), "in grey")
    c = Chart(title, "time the request was due (s)", "input tokens", width=1300, height=360, ylog=None)
    top = set(keys)
    for key in sorted(groups, key=lambda k: k in top):  # grey first, so coloured lines draw on top
        rs = sorted(groups[key], key=lambda r: r.scheduled)
        main = [r for r in rs if r.depth == 0]
        if key not in top:
            if main:
                c.add(
                    Series(
                        key,
                        [r.scheduled for r in main],
                        [r.input_tokens for r in main],
                        "line",
                        color="#d1d5db",
                        legend=False,
                        stroke=1.0,
                    )
                )
            continue
        color = PALETTE[keys.index(key) % len(PALETTE)]
        if main:
            c.add(
                Series(key, [r.scheduled for r in main], [r.input_tokens for r in main], "line", color=color)
            )
        subs = [r for r in rs if r.depth > 0]
        if subs:
            tips = [f"{r.session} #{r.index}: {r.input_tokens:,} tokens" for r in subs]
            c.add(
                Series(
                    f"{key} sub-agents",
                    [r.scheduled for r in subs],
                    [r.input_tokens for r in subs],
                    "dots",
                    color=color,
                    tips=tips,
                    legend=False,
                )
            )
    return c
