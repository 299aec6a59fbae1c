"""A small SVG chart writer for the self-contained report: dots, lines, steps and bars, two y axes,
linear or log scales fitted to the data.

No JavaScript and no external assets: the report opens offline and anywhere. Points carry
`<title>` tooltips; series longer than `MAX_POINTS` are thinned evenly so pages stay small. Each
`<svg>` carries its axis limits and data extent (`data-xlim`, `data-ylim`, `data-xdata`,
`data-ydata`), so a test can check that the axes fit what is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import NamedTuple

MAX_POINTS = 4000
PAD = 0.04  # fitted y axes leave this share of the data's span free above and below
LOG_SPAN = 100.0  # auto log scale when positive data spans this factor or more
PALETTE = (
    "#2563eb",
    "#dc2626",
    "#16a34a",
    "#9333ea",
    "#ea580c",
    "#0891b2",
    "#ca8a04",
    "#db2777",
    "#4b5563",
    "#65a30d",
)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis covering [lo, hi] (lo > 0): decades, with 2 and 5 in between
    when the range spans three decades or fewer. The first and last ticks bound the range."""
    e0, e1 = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    e1 = max(e1, e0 + 1) if hi > lo else e1
    steps = (1, 2, 5) if e1 - e0 <= 3 else (1,)
    vals = [m * 10.0**e for e in range(e0, e1 + 1) for m in steps]
    below = [v for v in vals if v <= lo * (1 + 1e-9)]
    above = [v for v in vals if v >= hi * (1 - 1e-9)]
    first, last = (below[-1] if below else vals[0]), (above[0] if above else vals[-1])
    return [float(f"{v:.12g}") for v in vals if first <= v <= last]


def fmt(v: float) -> str:
    """A short tick label: 1.2M, 35k, 0.25, 12."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:.3g}"


@dataclass(slots=True)
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    kind: str = "dots"  # dots | rings (an open circle around a point) | line | step | bars
    color: str = ""
    right: bool = False  # plot against the right-hand y axis
    tips: list[str] | None = None
    width: float = 0.0  # bars: width in x units (bars centred on xs)
    dash: bool = False  # lines: dashed, so a line drawn over an equal one still shows
    x2s: list[float] | None = None  # bars: each bar spans xs[i]..x2s[i] (histograms, log axes)
    legend: bool = True  # False: drawn, not listed (e.g. the grey "rest" of many sessions)
    stroke: float = 1.8  # lines: width in pixels


class Area(NamedTuple):
    """The plot rectangle inside a chart, in pixels: axes, grid and series are drawn against it."""

    left: int
    top: int
    width: int
    height: int


class Scale:
    """Data -> pixels along one axis, linear or log, over [lo, hi] (the outer ticks)."""

    def __init__(self, lo: float, hi: float, log: bool, p0: float, p1: float):
        self.log = log
        self.ticks = log_ticks(lo, hi) if log else nice_ticks(lo, hi)
        self.lo, self.hi = min(self.ticks[0], lo), max(self.ticks[-1], hi)
        if self.hi <= self.lo:
            self.hi = self.lo + 1.0
        self.p0, self.p1 = p0, p1
        self._f = (lambda v: math.log10(max(v, 1e-300))) if log else (lambda v: v)
        self._a, self._b = self._f(self.lo), self._f(self.hi)

    def __call__(self, v: float) -> float:
        return self.p0 + (self._f(v) - self._a) / (self._b - self._a) * (self.p1 - self.p0)

    def ok(self, v) -> bool:
        """Whether `v` can be drawn on this scale (finite, and > 0 on a log scale)."""
        return v is not None and math.isfinite(v) and (v > 0 or not self.log)


def _extent(vals: list[float], log: bool) -> tuple[float, float] | None:
    vals = [v for v in vals if v is not None and math.isfinite(v) and (v > 0 or not log)]
    return (min(vals), max(vals)) if vals else None


def _auto_log(vals: list[float]) -> bool:
    pos = [v for v in vals if v is not None and math.isfinite(v)]
    return bool(pos) and min(pos) > 0 and max(pos) / min(pos) >= LOG_SPAN


@dataclass(slots=True)
class Chart:
    """One chart: add series, then `svg()`. y axes fit the data (0 included when it is near, or
    forced with ymin=0); `ylog`/`xlog` None picks a log scale when positive data spans 100x."""

    title: str
    xlabel: str
    ylabel: str
    y2label: str = ""
    width: int = 640
    height: int = 300
    ymin: float | None = None
    ymax: float | None = None
    y2min: float | None = None
    y2max: float | None = None
    series: list[Series] = field(default_factory=list)
    ylog: bool | None = False
    xlog: bool | None = False
    marks: list[tuple[float, str]] = field(default_factory=list)  # labelled vertical lines at x

    def add(self, s: Series) -> Chart:
        if not s.color:
            s.color = PALETTE[len(self.series) % len(PALETTE)]
        self.series.append(s)
        return self

    def _ys(self, right: bool) -> list[float]:
        return [y for s in self.series if s.right == right for y in s.ys]

    def _xs(self) -> list[float]:
        return [x for s in self.series for x in (*s.xs, *(s.x2s or ()))]

    def _y_scale(self, right: bool, a: Area) -> Scale | None:
        ys = self._ys(right)
        lo, hi = (self.y2min, self.y2max) if right else (self.ymin, self.ymax)
        log = (self.ylog if self.ylog is not None else lo is None and _auto_log(ys)) and not right
        ext = _extent(ys, log)
        if ext is None:
            return None
        span = ext[1] - ext[0]
        if lo is None:  # fitted: a little room, so a line at the data's edge is not drawn on the frame
            lo = ext[0] if log or ext[0] < 0 or ext[0] > 0.3 * ext[1] else 0.0
            lo = lo / 1.03 if log else lo - PAD * span if lo != 0 else 0.0
        if hi is None:
            hi = ext[1] * 1.03 if log else ext[1] + PAD * span
        return Scale(lo, hi if hi > lo else lo + (abs(lo) or 1.0), log, a.top + a.height, a.top)

    def _x_scale(self, a: Area) -> Scale | None:
        xs = self._xs()
        log = self.xlog if self.xlog is not None else _auto_log(xs)
        ext = _extent(xs + [m[0] for m in self.marks], log)
        if ext is None:
            return None
        pad = max((s.width for s in self.series if s.kind == "bars"), default=0.0) / 2
        lo, hi = ext[0] - pad, ext[1] + pad
        return Scale(lo, hi if hi > lo else lo + (abs(lo) or 1.0), log, a.left, a.left + a.width)

    def svg(self) -> str:
        """The chart as one `<svg>` element; a "no data" note when nothing finite is plotted."""
        w, h = self.width, self.height
        left, right_pad, bottom = 64, (64 if self.y2label else 20), 44
        pw = w - left - right_pad
        legend, rows = self._legend(left, pw)
        area = Area(left, 32 + 14 * rows, pw, h - 32 - 14 * rows - bottom)
        sx, syl, syr = self._x_scale(area), self._y_scale(False, area), self._y_scale(True, area)
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" width="{w}" '
            f'height="{h}" role="img" aria-label="{escape(self.title)}"{self._data_attrs(sx, syl)}>'
            f'<text x="{w / 2}" y="18" class="title" text-anchor="middle">{escape(self.title)}</text>'
        )
        if sx is None or (syl is None and syr is None):
            return (
                head
                + f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle" class="empty">no data</text></svg>'
            )
        out = [head, _x_axis(sx, area)]
        for side, sc in ((False, syl), (True, syr)):
            if sc is not None:
                out.append(_y_axis(sc, side, area))
        out.append(self._labels(area, syr is not None, sx, syl))
        base = area.top + area.height
        for s in self.series:
            sy = (syr if s.right else syl) or syl or syr
            out.append(_draw(s, sx, sy, base))
        for x, label in self.marks:
            if sx.ok(x):
                px = sx(x)
                out.append(
                    f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{area.top}" y2="{base}" class="mark"/>'
                    f'<text x="{px + 3:.1f}" y="{area.top + 11}" class="marklabel">{escape(label)}</text>'
                )
        out.append(legend)
        out.append("</svg>")
        return "".join(out)

    def _data_attrs(self, sx: Scale | None, sy: Scale | None) -> str:
        """Axis limits and the extent of the drawn data, for checks that the axes fit the data."""
        if sx is None or sy is None:
            return ""
        xe, ye = _extent(self._xs(), sx.log), _extent(self._ys(False), sy.log)
        parts = [f' data-xlim="{sx.lo:.6g},{sx.hi:.6g}" data-ylim="{sy.lo:.6g},{sy.hi:.6g}"']
        if xe and ye:
            parts.append(f' data-xdata="{xe[0]:.6g},{xe[1]:.6g}" data-ydata="{ye[0]:.6g},{ye[1]:.6g}"')
        parts.append(f' data-xlog="{int(sx.log)}" data-ylog="{int(sy.log)}"')
        if self.ymin is not None and self.ymax is not None:
            parts.append(' data-yfixed="1"')  # set by the chart (0-100%), not fitted
        elif self.ymin == 0 and any(s.kind == "bars" for s in self.series):
            parts.append(' data-ybars="1"')  # bars stand on zero: only the top is fitted
        return "".join(parts)

    def _labels(self, a: Area, has_right: bool, sx: Scale, sy: Scale | None) -> str:
        """The x axis label under the plot, the y label on the left and, if plotted, the y2 label;
        "(log)" marks a log axis."""
        xl = self.xlabel + (" (log scale)" if sx.log else "")
        yl = self.ylabel + (" (log scale)" if sy is not None and sy.log else "")
        out = [
            f'<text x="{a.left + a.width / 2}" y="{self.height - 6}" text-anchor="middle" class="label">'
            f"{escape(xl)}</text>",
            f'<text transform="translate(14 {a.top + a.height / 2}) rotate(-90)" text-anchor="middle" '
            f'class="label">{escape(yl)}</text>',
        ]
        if self.y2label and has_right:
            out.append(
                f'<text transform="translate({self.width - 10} {a.top + a.height / 2}) rotate(90)" '
                f'text-anchor="middle" class="label">{escape(self.y2label)}</text>'
            )
        return "".join(out)

    def _legend(self, left: float, pw: float) -> tuple[str, int]:
        """Legend swatches in rows under the title; returns the markup and the number of rows."""
        shown = [s for s in self.series if s.legend]
        if len(shown) < 2 and len(shown) == len(self.series):
            return "", 0
        parts, x, row = [], left + 4, 0
        for s in shown:
            span = 20 + 6.2 * len(s.name)
            if x + span > left + pw and x > left + 4:
                x, row = left + 4, row + 1
            y = 26 + 14 * row
            parts.append(
                f'<g class="legend"><rect x="{x:.0f}" y="{y}" width="10" height="10" fill="{s.color}"/>'
                f'<text x="{x + 14:.0f}" y="{y + 9}">{escape(s.name)}</text></g>'
            )
            x += span + 10
        return "".join(parts), (row + 1 if shown else 0)


def _x_axis(sx: Scale, a: Area) -> str:
    """The plot frame and the x grid with its tick labels."""
    out = [f'<rect x="{a.left}" y="{a.top}" width="{a.width}" height="{a.height}" class="plot"/>']
    bottom = a.top + a.height
    for x in sx.ticks:
        out.append(
            f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{a.top}" y2="{bottom}" class="grid"/>'
            f'<text x="{sx(x):.1f}" y="{bottom + 16}" text-anchor="middle">{fmt(x)}</text>'
        )
    return "".join(out)


def _y_axis(sy: Scale, right: bool, a: Area) -> str:
    """One y axis's tick labels (the left one with grid lines too)."""
    out = []
    for y in sy.ticks:
        if right:
            out.append(f'<text x="{a.left + a.width + 6}" y="{sy(y) + 4:.1f}">{fmt(y)}</text>')
        else:
            out.append(
                f'<line x1="{a.left}" x2="{a.left + a.width}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                'class="grid"/>'
                f'<text x="{a.left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{fmt(y)}</text>'
            )
    return "".join(out)


def _thin(s: Series) -> list[int]:
    n = len(s.xs)
    if n <= MAX_POINTS:
        return list(range(n))
    step = n / MAX_POINTS
    return [int(i * step) for i in range(MAX_POINTS)]


def _tip(s: Series, i: int) -> str:
    return f"<title>{escape(s.tips[i])}</title>" if s.tips else ""


def _bars(s: Series, idx: list[int], sx: Scale, sy: Scale, base: float) -> str:
    bars = []
    for i in idx:
        if s.x2s is not None:
            x0, x1 = sx(s.xs[i]), sx(s.x2s[i])
        else:
            x0, x1 = sx(s.xs[i] - s.width / 2), sx(s.xs[i] + s.width / 2)
        y = sy(s.ys[i]) if s.ys[i] > 0 or not sy.log else base
        bars.append(
            f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(0.5, x1 - x0 - 1):.1f}" '
            f'height="{max(0.0, base - y):.1f}">{_tip(s, i)}</rect>'
        )
    return f'<g fill="{s.color}" fill-opacity="0.8">{"".join(bars)}</g>'


def _draw(s: Series, sx: Scale, sy: Scale, base: float) -> str:
    ok_y = (lambda v: v is not None and math.isfinite(v)) if s.kind == "bars" else sy.ok
    idx = [i for i in _thin(s) if sx.ok(s.xs[i]) and ok_y(s.ys[i])]
    if not idx:
        return ""
    c = s.color
    if s.kind == "dots":
        dots = [
            f'<circle cx="{sx(s.xs[i]):.1f}" cy="{sy(s.ys[i]):.1f}" r="2.6">{_tip(s, i)}</circle>'
            for i in idx
        ]
        return f'<g fill="{c}" fill-opacity="0.6">{"".join(dots)}</g>'
    if s.kind == "rings":
        rings = [f'<circle cx="{sx(s.xs[i]):.1f}" cy="{sy(s.ys[i]):.1f}" r="5.5"/>' for i in idx]
        return f'<g fill="none" stroke="{c}" stroke-width="1.5">{"".join(rings)}</g>'
    if s.kind == "bars":
        return _bars(s, idx, sx, sy, base)
    pts = []
    prev_y = None
    for i in idx:
        x, y = sx(s.xs[i]), sy(s.ys[i])
        if s.kind == "step" and prev_y is not None:
            pts.append(f"{x:.1f},{prev_y:.1f}")
        pts.append(f"{x:.1f},{y:.1f}")
        prev_y = y
    dash = ' stroke-dasharray="5 4"' if s.dash else ""
    return (
        f'<polyline fill="none" stroke="{c}" stroke-width="{s.stroke:g}"{dash} points="{" ".join(pts)}">'
        f"<title>{escape(s.name)}</title></polyline>"
    )
