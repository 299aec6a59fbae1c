"""How `agentkv trace stats` shows a `StatsReport` (rich tables), and where its default input lives."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from agentkv.errors import UserError
from agentkv.terminal import compact as num
from agentkv.terminal import show
from agentkv.trace.model import Trace
from agentkv.trace.stats import Dist, StatsReport, TraceStats


def bundled_traces() -> list[Trace]:
    """The sample of real traces shipped in `agentkv/data/traces/` (used when no PATH is given)."""
    from agentkv.trace.formats import bundled_sample, load_paths

    files = bundled_sample()
    if not files:
        raise UserError(
            "no PATH given and no bundled sample in agentkv/data/traces; pass trace files or directories"
        )
    return load_paths(files)


def secs(x: float) -> str:
    """A duration: 9.5s, 12m04s, 3h07m."""
    if x < 60:
        return f"{x:.1f}s"
    m, s = divmod(int(round(x)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


_COLS = (
    "trace",
    "reqs",
    "sub",
    "in p50",
    "in max",
    "out p50",
    "grow p50",
    "gap p50",
    "duration",
    "input",
    "ceiling",
)


def _p50(d: Dist, fmt=None) -> str:
    """The median, or "-" where the quantity does not apply (no samples)."""
    return (fmt or num)(d.p50) if d.count else "-"


def _row(r: TraceStats) -> list[str]:
    return [
        r.id,
        str(r.requests),
        str(r.subagents),
        _p50(r.input),
        num(r.input.max),
        _p50(r.output),
        _p50(r.growth),
        _p50(r.gap, secs),
        secs(r.duration),
        num(r.input_tokens),
        f"{r.ceiling:.4f}",
    ]


def trace_table(report: StatsReport, top: int = 10) -> Table:
    """One row per trace; when there are more than `top`, the `top` largest by input and a total."""
    t = Table(title="Traces", title_justify="left")
    for c in _COLS:
        t.add_column(c, justify="left" if c == "trace" else "right")
    rows = report.traces
    shown = rows if len(rows) <= top else sorted(rows, key=lambda r: -r.input_tokens)[:top]
    for r in shown:
        t.add_row(*_row(r))
    if len(shown) < len(rows):
        t.add_row(f"(+{len(rows) - len(shown)} more)", *[""] * (len(_COLS) - 1))
    tot = report.total
    t.add_section()
    t.add_row(
        f"total ({tot.traces})",
        str(tot.requests),
        str(tot.subagents),
        _p50(tot.input),
        num(tot.input.max),
        _p50(tot.output),
        _p50(tot.growth),
        _p50(tot.gap, secs),
        secs(tot.duration),
        num(tot.input_tokens),
        f"{tot.ceiling:.4f}",
        style="bold",
    )
    return t


def totals_table(report: StatsReport) -> Table:
    """Pooled percentiles (every request of every trace) and the summed counts."""
    tot = report.total
    t = Table(title="Totals", title_justify="left")
    for c in ("quantity", "count", "p50", "p90", "p99", "mean", "max"):
        t.add_column(c, justify="left" if c == "quantity" else "right")
    dists: list[tuple[str, Dist, bool]] = [
        ("input tokens / request", tot.input, False),
        ("output tokens / request", tot.output, False),
        ("context growth / turn", tot.growth, False),
        ("think/tool gap", tot.gap, True),
        ("first input / trace", tot.first_input, False),
        ("requests / trace", tot.requests_per_trace, False),
        ("duration / trace", tot.trace_duration, True),
    ]
    for name, d, is_time in dists:
        f = secs if is_time else num
        cells = [f(x) for x in (d.p50, d.p90, d.p99, d.mean, d.max)] if d.count else ["-"] * 5
        t.add_row(name, str(d.count), *cells)
    t.caption = (
        f"{tot.traces} traces, {tot.requests} requests, {tot.sessions} sessions "
        f"({tot.subagents} sub-agents), {tot.side_calls} side calls, {tot.compactions} compactions, "
        f"{num(tot.input_tokens)} input / {num(tot.output_tokens)} output tokens; "
        f"prefix-cache hit ceiling {tot.ceiling:.5f}"
    )
    t.caption_justify = "left"
    return t


def render(report: StatsReport, top: int = 10, console: Console | None = None) -> None:
    """Print the per-trace table and the totals table."""
    if console is None:
        console = Console()
    show(console, trace_table(report, top))
    show(console, totals_table(report))
