"""A small SVG chart writer for the self-contained report: dots, lines, steps and bars, two y axes.

No JavaScript and no external assets: the report opens offline and anywhere. Points carry
`<title>` tooltips; series longer than `MAX_POINTS` are thinned evenly so pages stay small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from typing import NamedTuple

MAX_POINTS = 4000
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
    kind: str = "dots"  # dots | line | step | bars
    color: str = ""
    right: bool = False  # plot against the right-hand y axis
    tips: list[str] | None = None
    width: float = 0.0  # bars: width in x units
    dash: bool = False  # lines: dashed, so a line drawn over an equal one still shows


class _Area(NamedTuple):
    """The plot rectangle inside a chart, in pixels: axes, grid and series are drawn against it."""

    left: int
    top: int
    width: int
    height: int


@dataclass(slots=True)
class Chart:
    """One chart: add series, then `svg()`."""

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

    def add(self, s: Series) -> Chart:
        if not s.color:
            s.color = PALETTE[len(self.series) % len(PALETTE)]
        self.series.append(s)
        return self

    def _range(self, right: bool) -> tuple[float, float] | None:
        ys = [y for s in self.series if s.right == right for y in s.ys if y is not None and math.isfinite(y)]
        if not ys:
            return None
        lo, hi = (self.y2min, self.y2max) if right else (self.ymin, self.ymax)
        lo = min(min(ys), 0.0) if lo is None else lo
        hi = max(ys) if hi is None else hi
        return lo, hi if hi > lo else lo + 1.0

    def svg(self) -> str:
        """The chart as one `<svg>` element; a "no data" note when nothing finite is plotted."""
        w, h = self.width, self.height
        left, right_pad, bottom = 64, (64 if self.y2label else 20), 44
        pw = w - left - right_pad
        legend, rows = self._legend(left, pw)
        top = 32 + 14 * rows
        area = _Area(left, top, pw, h - top - bottom)
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" '
            f'width="{w}" height="{h}" role="img" aria-label="{escape(self.title)}">',
            f'<text x="{w / 2}" y="18" class="title" text-anchor="middle">{escape(self.title)}</text>',
        ]
        xs = [x for s in self.series for x in s.xs if x is not None and math.isfinite(x)]
        yl, yr = self._range(False), self._range(True)
        if not xs or (yl is None and yr is None):
            out.append(
                f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle" class="empty">no data</text></svg>'
            )
            return "".join(out)
        bar_pad = max((s.width for s in self.series if s.kind == "bars"), default=0.0) / 2
        axis, sx = _x_axis(min(xs) - bar_pad, max(xs) + bar_pad, area)
        out.append(axis)
        scales = {}
        for side, rng in ((False, yl), (True, yr)):
            if rng is not None:
                axis, scales[side] = _y_axis(rng, side, area)
                out.append(axis)
        out.append(self._labels(area, True in scales))
        for s in self.series:
            sy = scales.get(s.right) or scales.get(not s.right)
            out.append(_draw(s, sx, sy, area.top + area.height))
        out.append(legend)
        out.append("</svg>")
        return "".join(out)

    def _labels(self, a: _Area, has_right: bool) -> str:
        """The x axis label under the plot, the y label on the left and, if plotted, the y2 label."""
        out = [
            f'<text x="{a.left + a.width / 2}" y="{self.height - 6}" text-anchor="middle" class="label">'
            f"{escape(self.xlabel)}</text>",
            f'<text transform="translate(14 {a.top + a.height / 2}) rotate(-90)" text-anchor="middle" '
            f'class="label">{escape(self.ylabel)}</text>',
        ]
        if self.y2label and has_right:
            out.append(
                f'<text transform="translate({self.width - 10} {a.top + a.height / 2}) rotate(90)" '
                f'text-anchor="middle" class="label">{escape(self.y2label)}</text>'
            )
        return "".join(out)

    def _legend(self, left: float, pw: float) -> tuple[str, int]:
        """Legend swatches in rows under the title; returns the markup and the number of rows."""
        if len(self.series) < 2:
            return "", 0
        parts, x, row = [], left + 4, 0
        for s in self.series:
            span = 20 + 6.2 * len(s.name)
            if x + span > left + pw and x > left + 4:
                x, row = left + 4, row + 1
            y = 26 + 14 * row
            parts.append(
                f'<g class="legend"><rect x="{x:.0f}" y="{y}" width="10" height="10" fill="{s.color}"/>'
                f'<text x="{x + 14:.0f}" y="{y + 9}">{escape(s.name)}</text></g>'
            )
            x += span + 10
        return "".join(parts), row + 1


def _x_axis(xlo: float, xhi: float, a: _Area) -> tuple[str, Callable[[float], float]]:
    """The plot frame and the x grid with its tick labels, and the x -> pixel scale."""
    xt = nice_ticks(xlo, xhi if xhi > xlo else xlo + 1)
    xlo, xhi = min(xt[0], xlo), max(xt[-1], xhi)

    def sx(x: float) -> float:
        return a.left + (x - xlo) / (xhi - xlo) * a.width

    out = [f'<rect x="{a.left}" y="{a.top}" width="{a.width}" height="{a.height}" class="plot"/>']
    bottom = a.top + a.height
    for x in xt:
        out.append(
            f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{a.top}" y2="{bottom}" class="grid"/>'
            f'<text x="{sx(x):.1f}" y="{bottom + 16}" text-anchor="middle">{fmt(x)}</text>'
        )
    return "".join(out), sx


def _y_axis(rng: tuple[float, float], right: bool, a: _Area) -> tuple[str, Callable[[float], float]]:
    """One y axis's tick labels (the left one with grid lines too), and its y -> pixel scale."""
    ticks = nice_ticks(*rng)
    lo, hi = min(ticks[0], rng[0]), max(ticks[-1], rng[1])

    def sy(y: float) -> float:
        return a.top + a.height - (y - lo) / (hi - lo) * a.height

    out = []
    for y in ticks:
        if right:
            out.append(f'<text x="{a.left + a.width + 6}" y="{sy(y) + 4:.1f}">{fmt(y)}</text>')
        else:
            out.append(
                f'<line x1="{a.left}" x2="{a.left + a.width}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                'class="grid"/>'
                f'<text x="{a.left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{fmt(y)}</text>'
            )
    return "".join(out), sy


def _thin(s: Series) -> list[int]:
    n = len(s.xs)
    if n <= MAX_POINTS:
        return list(range(n))
    step = n / MAX_POINTS
    return [int(i * step) for i in range(MAX_POINTS)]


def _draw(s: Series, sx, sy, base: float) -> str:
    idx = [
        i
        for i in _thin(s)
        if s.xs[i] is not None and s.ys[i] is not None and math.isfinite(s.xs[i]) and math.isfinite(s.ys[i])
    ]
    if not idx:
        return ""
    c = s.color
    if s.kind == "dots":
        dots = []
        for i in idx:
            tip = f"<title>{escape(s.tips[i])}</title>" if s.tips else ""
            dots.append(f'<circle cx="{sx(s.xs[i]):.1f}" cy="{sy(s.ys[i]):.1f}" r="2.6">{tip}</circle>')
        return f'<g fill="{c}" fill-opacity="0.6">{"".join(dots)}</g>'
    if s.kind == "bars":
        bars = []
        for i in idx:
            x0, x1 = sx(s.xs[i] - s.width / 2), sx(s.xs[i] + s.width / 2)
            y = sy(s.ys[i])
            tip = f"<title>{escape(s.tips[i])}</title>" if s.tips else ""
            bars.append(
                f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(0.5, x1 - x0 - 1):.1f}" '
                f'height="{max(0.0, base - y):.1f}">{tip}</rect>'
            )
        return f'<g fill="{c}" fill-opacity="0.8">{"".join(bars)}</g>'
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
        f'<polyline fill="none" stroke="{c}" stroke-width="1.8"{dash} points="{" ".join(pts)}">'
        f"<title>{escape(s.name)}</title></polyline>"
    )
