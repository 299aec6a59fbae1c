"""How `agentkv cache analyze` shows an `Analysis`: rich tables, JSON, and a hit-rate-vs-capacity chart.

The chart is a self-contained HTML page or SVG file (agentkv.metrics.svg, no JavaScript, no new
dependency): it opens offline, and a plotting library would add tens of MB to every install
for one picture.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentkv.cache.results import Analysis, CellResult, GroupFigure
from agentkv.errors import UserError
from agentkv.terminal import show

PLOT_SUFFIXES = (".html", ".svg")
_STYLE = (
    "svg.chart text{font-size:11px;fill:#374151;font-family:system-ui,sans-serif}"
    "svg.chart .title{font-size:13px;font-weight:600}svg.chart .label{font-size:12px}"
    "svg.chart .plot{fill:#fff;stroke:#d1d5db}svg.chart .grid{stroke:#eef0f3}"
)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _cell_text(r: CellResult | None, tiers: bool) -> str:
    if r is None:  # not replayed: the run was interrupted
        return "-"
    text = _pct(r.hit_rate)
    if tiers and r.query_tokens:
        gpu, cpu = (r.tier_hit_tokens.get(k, 0) / r.query_tokens for k in ("GPU", "CPU"))
        text += f" [dim]({100 * gpu:.1f} + {100 * cpu:.1f} CPU)[/dim]"
    return text


def _apart(
    rows: list[list[GroupFigure] | None], model: list[float | None]
) -> list[tuple[str, list[float | None]]]:
    """Each KV group's own hit rates (one per capacity, None where not replayed), for the groups
    whose figure differs from the model-level one at some capacity (the others add nothing)."""
    first = next((r for r in rows if r), None)
    out = []
    for g, fig in enumerate(first or []):
        rates = [r[g].hit_rate if r else None for r in rows]
        if any(
            x is not None and m is not None and abs(x - m) >= 5e-4 for x, m in zip(rates, model, strict=True)
        ):
            out.append((fig.group, rates))
    return out


def _group_rows(t: Table, rows: list[list[GroupFigure] | None], model: list[float | None]) -> None:
    """Under a row of model-level hits (one per capacity), each KV group's own figure, when some
    capacity shows it apart from the model's: what that group alone could serve."""
    for name, rates in _apart(rows, model):
        cells = [f"[dim]{_pct(x)}[/dim]" if x is not None else "-" for x in rates]
        t.add_row(f"[dim]  {name} alone[/dim]", *cells)


def tables(a: Analysis) -> list[Table]:
    """One table per block size: a row per policy, a column per capacity, then the reference rows."""
    cells = {(r.block_size, r.capacity, r.policy): r for r in a.results}
    ceilings = {c.block_size: c for c in a.ceilings}
    tiers = a.cpu is not None
    out = []
    for bs in a.block_sizes:
        t = Table(
            title=f"Token hit rate, block size {bs}" + (f", with a {a.cpu} CPU tier" if tiers else ""),
            title_justify="left",
        )
        t.add_column("policy")
        for cap in a.capacities:
            r = cells.get((bs, cap, a.policies[0]))
            head = f"{cap}\n{r.num_blocks:,} {'pages' if a.kv_groups else 'blocks'}" if r else cap
            if r and r.too_big:
                head += f"\n[yellow]{r.too_big} too big[/yellow]"
            t.add_column(head, justify="right")
        online = [p for p in a.policies if p != "belady"]
        best = {
            cap: max((cells[k].hit_rate for p in online if (k := (bs, cap, p)) in cells), default=None)
            for cap in a.capacities
        }
        for p in online:
            row = []
            for cap in a.capacities:
                r = cells.get((bs, cap, p))
                text = _cell_text(r, tiers)
                bold = r is not None and len(online) > 1 and r.hit_rate == best[cap]
                row.append(f"[bold]{text}[/bold]" if bold else text)
            t.add_row(p, *row)
            got = [cells.get((bs, cap, p)) for cap in a.capacities]
            _group_rows(t, [r.groups if r else None for r in got], [r.hit_rate if r else None for r in got])
        if "belady" in a.policies:
            t.add_section()
            t.add_row(
                "belady (offline optimum)",
                *(_cell_text(cells.get((bs, cap, "belady")), tiers) for cap in a.capacities),
            )
        c, n = ceilings[bs], len(a.capacities)
        t.add_row("unbounded cache (ceiling)", *([_pct(c.hit_rate)] * n))
        _group_rows(t, [c.groups] * n, [c.hit_rate] * n)
        out.append(t)
    return out


def render(a: Analysis, console: Console) -> None:
    order = (
        "every session from t=0, by its own timestamps"
        if a.order == "timestamps"
        else f"{a.concurrency} sessions at a time"
    )
    kv = f"{a.model} {a.kv_cache_dtype} KV, {a.kv_bytes_per_token:,} bytes a token"
    if a.kv_groups:
        each = ", ".join(f"{g.name} {g.block_bytes[0]:,}" for g in a.kv_groups)
        kv = f"{a.model} {a.kv_cache_dtype} KV in {len(a.kv_groups)} groups sharing the pool ({each} bytes a {a.block_sizes[0]}-token block)"
    console.print(
        f"{a.traces} traces, {a.requests:,} requests, {a.input_tokens:,} input tokens; {kv}; {order}"
    )
    for t in tables(a):
        show(console, t)
    if any(r.too_big for r in a.results):
        console.print(
            "[yellow]too big: requests larger than the whole pool; not replayed, their input tokens "
            "count as misses[/yellow]"
        )
    if a.kv_groups:
        console.print(
            "[dim]hybrid KV groups: a hit is what every group serves; 'alone' is what that group's "
            "own rule would serve from its own cached blocks (and the CPU tier's; docs/kv-cache.md)[/dim]"
        )
    console.print(f"[dim]{len(a.results)} replays in {a.seconds:.1f} s[/dim]")
    if a.interrupted:
        console.print("[yellow]interrupted: '-' marks replays that did not run[/yellow]")


def chart_series(a: Analysis, bs: int) -> list:
    """The lines of block size `bs`'s chart (agentkv.metrics.svg Series): one per policy and the
    ceiling, then for a hybrid model a dashed one per KV group whose own hit rate ('alone') differs."""
    from agentkv.metrics.svg import Series

    rows = sorted((r for r in a.results if r.block_size == bs), key=lambda r: r.capacity_bytes)
    kind = "line" if len(a.capacities) > 1 else "dots"
    xs_all = sorted({r.capacity_bytes / 1e9 for r in rows})
    out, alone = [], []
    for p in a.policies:
        pts = [r for r in rows if r.policy == p]
        xs, ys = [r.capacity_bytes / 1e9 for r in pts], [r.hit_rate for r in pts]
        tips = [f"{p} at {r.capacity}: {_pct(r.hit_rate)}" for r in pts]
        out.append(Series(p, xs, [100 * y for y in ys], kind, tips=tips))
        for g, rates in _apart([r.groups for r in pts], ys):
            got = [(r, x) for r, x in zip(pts, rates, strict=True) if x is not None]
            gx, gy = [r.capacity_bytes / 1e9 for r, _ in got], [100 * x for _, x in got]
            tips = [f"{g} alone, {p} at {r.capacity}: {_pct(x)}" for r, x in got]
            alone.append(Series(f"{p}: {g} alone", gx, gy, kind, tips=tips, dash=True))
    c = next(c for c in a.ceilings if c.block_size == bs)
    n = len(xs_all)
    out.append(
        Series(
            "unbounded",
            xs_all,
            [100 * c.hit_rate] * n,
            kind,
            color="#111827",
            tips=[f"unbounded cache: {_pct(c.hit_rate)}"] * n,
        )
    )
    for g, (x,) in _apart([c.groups], [c.hit_rate]):
        tip = f"unbounded cache, {g} alone: {_pct(x)}"
        alone.append(Series(f"unbounded: {g} alone", xs_all, [100 * x] * n, kind, tips=[tip] * n, dash=True))
    return out + alone


def charts(a: Analysis) -> list[str]:
    """One SVG chart per block size: hit rate (%) vs capacity (GB), a line per policy and the ceiling
    (and per KV group of a hybrid model, dashed)."""
    from agentkv.metrics.svg import Chart

    out = []
    for bs in a.block_sizes:
        ch = Chart(
            f"Token hit rate vs KV capacity, block size {bs} ({a.model} {a.kv_cache_dtype})",
            "KV capacity (GB)",
            "token hit rate (%)",
            width=720,
            height=360,
            ymin=0.0,
            ymax=100.0,
        )
        for s in chart_series(a, bs):
            ch.add(s)
        out.append(ch.svg())
    return out


def write_plot(a: Analysis, path: Path) -> None:
    """Write the charts as a self-contained .html page or one .svg file."""
    svgs = charts(a)
    if path.suffix.lower() == ".svg":
        h = 360
        body = "".join(f'<g transform="translate(0 {i * h})">{s}</g>' for i, s in enumerate(svgs))
        text = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="720" height="{h * len(svgs)}" '
            f'viewBox="0 0 720 {h * len(svgs)}"><style>{_STYLE}</style>{body}</svg>\n'
        )
    else:
        title = f"agentkv cache analyze: {a.traces} traces, {a.model}"
        text = (
            f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>body{{font-family:system-ui,sans-serif;margin:24px}}{_STYLE}</style></head><body>"
            f"<h1 style='font-size:20px'>{escape(title)}</h1>"
            + "".join(f"<div>{s}</div>" for s in svgs)
            + "</body></html>\n"
        )
    try:
        path.write_text(text)
    except OSError as e:
        raise UserError(f"--plot: cannot write {path}: {e.strerror or e}") from None
