"""Rich tables of a run summary, shared by `agentkv bench`, `simulate` and `compare`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentkv.metrics.summary import LATENCY_FIGURES, Dist, Summary
from agentkv.metrics.tier import agents_text, reached_text, tier_text
from agentkv.terminal import show

CLOCKS = {
    "engine": "the target's engine clock (its own timestamps)",
    "client": "the client's clock (wall x time scale)",
    "virtual": "the simulated clock",
    "mixed": "the engine's clock for some requests, the client's for the rest",
}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.1f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def latency_clock(s: Summary) -> str | None:
    """The clock the latency figures were read on (`Summary.clocks`), None when not recorded."""
    found = {s.clocks[k] for k in LATENCY_FIGURES if k in s.clocks}
    return found.pop() if len(found) == 1 else "mixed" if found else None


def clocks_line(s: Summary) -> str | None:
    """Which clock the latencies, and the duration and throughput, were read on (None: not recorded)."""
    lat, dur = latency_clock(s), s.clocks.get("duration")
    if lat is None:
        return None
    line = f"TTFT, TPOT, ITL and E2E on {CLOCKS.get(lat, lat)}"
    if dur is not None and dur != lat:
        line += f"; duration and throughput on {CLOCKS.get(dur, dur)}"
    return line


def latency_table(s: Summary, title: str | None = None) -> Table:
    clock = latency_clock(s)
    t = Table(title=title or ("latency (ms)" if clock is None else f"latency (ms, {clock} clock)"))
    for col in ("metric", "mean", "p50", "p90", "p99", "max", "count"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    rows: list[tuple[str, Dist]] = [("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)]
    for name, d in rows:
        t.add_row(name, ms(d.mean), ms(d.p50), ms(d.p90), ms(d.p99), ms(d.max), f"{d.count:,}")
    return t


def overview_table(s: Summary) -> Table:
    t = Table(title=f"{s.kind}: {s.target}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    tp = s.throughput
    t.add_row("requests (ok / failed)", f"{s.succeeded:,} / {s.failed:,}")
    if s.errors:
        t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())))
    t.add_row("duration (s)", num(s.duration_s, 1))
    t.add_row("input / output tokens", f"{s.input_tokens:,} / {s.output_tokens:,}")
    if tp:
        t.add_row("input tok/s", num(tp.input_tokens_per_s))
        t.add_row("output tok/s", num(tp.output_tokens_per_s))
        t.add_row("requests/s", num(tp.requests_per_s, 2))
        if tp.output_tokens_per_s_per_gpu is not None:
            t.add_row("output tok/s per GPU", num(tp.output_tokens_per_s_per_gpu))
        if tp.million_total_tokens_per_s_per_mw is not None:
            t.add_row("M total tok/s per MW", num(tp.million_total_tokens_per_s_per_mw, 2))
    c = s.cache
    t.add_row("cache hit: reported", pct(c.reported))
    t.add_row("cache hit: server metrics", pct(c.metrics))
    t.add_row("cache hit: ceiling (unbounded)", pct(c.ceiling))
    for tier, v in sorted(c.by_tier.items()):
        t.add_row(f"  hit from {tier}", pct(v))
    if c.clipped:
        t.add_row("  cached > prompt (clipped)", f"{c.clipped:,} requests")
    if c.contaminated:
        gap = max(x for x in (c.reported_over_ceiling, c.metrics_over_ceiling) if x is not None)
        t.add_row("[yellow]CACHE CONTAMINATED[/yellow]", f"hits above the ceiling by {gap * 100:.1f} points")
    if s.goodput:
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in s.goodput.slo.items())
        t.add_row(f"goodput ({slo})", f"{pct(s.goodput.fraction)} ({s.goodput.requests_per_s:.2f} req/s)")
    _deployment_rows(t, s)
    t.add_row("preemptions", f"{s.preemptions:,}")
    t.add_row("sessions", f"{len(s.sessions):,}")
    if not s.valid:
        for why in s.invalid_reasons or [s.invalid_reason]:
            t.add_row("[red]INVALID[/red]", Text(why))
    return t


def _deployment_rows(t: Table, s: Summary) -> None:
    """A disaggregated run's two pools, and the run against its interactivity tier (agents per MW)."""
    if (d := s.disagg) is not None:
        t.add_row("prefill / decode pool hit rate", f"{pct(d.prefill_hit_rate)} / {pct(d.decode_hit_rate)}")
        t.add_row(
            "KV transfer p50 / p99 (ms)",
            f"{ms(d.kv_transfer_s.p50)} / {ms(d.kv_transfer_s.p99)} "
            f"({d.kv_transferred_gb:,.1f} GB; {d.transfers_nvlink:,} NVLink, {d.transfers_rdma:,} RDMA)",
        )
    if (i := s.interactivity) is not None:
        t.add_row(f"interactivity ({tier_text(i)})", reached_text(i))
        if i.met:
            t.add_row("agents at the tier", agents_text(i))
            t.add_row("power per GPU", i.power_basis or "unknown")


def errors_table(s: Summary) -> Table:
    """The most frequent errors: count, reason, HTTP status, the server's message and a hint."""
    t = Table(title="top errors")
    t.add_column("requests", justify="right")
    for col in ("reason", "status", "message", "hint"):
        t.add_column(col, overflow="fold")
    for g in s.top_errors:
        msg = g.message if len(g.message) <= 200 else g.message[:200] + "..."
        t.add_row(f"{g.count:,}", Text(g.error), str(g.status or "-"), Text(msg), Text(g.hint))
    return t


def short(v: float) -> str:
    """A compact count: 9,999, 12.3k, 1.31M."""
    return f"{v / 1e6:.3g}M" if v >= 1e6 else f"{v / 1e3:.3g}k" if v >= 1e4 else f"{v:,.0f}"


def sessions_table(s: Summary, top: int = 20) -> Table:
    """Per-session roll-ups (turns, time, tokens, hit rate), the `top` largest by input tokens."""
    rows = sorted(s.sessions, key=lambda x: -x.input_tokens)[:top]
    more = len(s.sessions) - len(rows)
    t = Table(title="sessions" + (f" (largest {len(rows)} of {len(s.sessions)})" if more > 0 else ""))
    t.add_column("session tree", no_wrap=True)
    for col in ("turns", "sub", "time s", "input", "output", "hit", "TTFT p50 ms", "fail"):
        t.add_column(col, justify="right")
    for x in rows:
        t.add_row(
            x.session,
            f"{x.turns:,}",
            f"{x.sub_requests:,}",
            num(x.duration_s, 1),
            short(x.input_tokens),
            short(x.output_tokens),
            pct(x.hit_rate),
            ms(x.ttft_p50),
            f"{x.failed:,}",
        )
    return t


def print_summary(s: Summary, console: Console | None = None) -> None:
    console = console or Console()
    show(console, overview_table(s))
    if s.top_errors:
        show(console, errors_table(s))
    show(console, latency_table(s))
    for note in s.notes:
        console.print(f"[dim]note: {note}[/dim]")
