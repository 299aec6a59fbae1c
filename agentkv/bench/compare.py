"""`agentkv compare A B`: two run summaries side by side (bench or simulate), with differences.

A and B are summary.json files or the run folders holding them. Each figure shows A, B, B - A
and (B - A) / A; settings that differ are listed under the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from agentkv.errors import UserError
from agentkv.metrics.summary import Summary, read_summary
from agentkv.metrics.view import latency_clock

ENGINE_TIME = {"engine", "virtual"}


class Row(msgspec.Struct):
    name: str
    unit: str  # ms | % | s | tok/s | req/s | "" (a count)
    a: float | None
    b: float | None
    diff: float | None
    rel: float | None  # (b - a) / a


def load(path: str) -> Summary:
    """A summary from a summary.json path or a run folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise UserError(f"{path}: no summary.json there (give a summary.json file or a run folder)")
    return read_summary(p)


_Get = Callable[[Summary], float | None]


def _dist(field: str) -> list[tuple[str, str, _Get]]:
    return [
        (
            f"{field.upper()} {stat}",
            "ms",
            lambda s, f=field, st=stat: (lambda v: None if v is None else v * 1000)(
                getattr(getattr(s, f), st)
            ),
        )
        for stat in ("mean", "p50", "p90", "p99")
    ]


def _tp(attr: str) -> _Get:
    return lambda s: getattr(s.throughput, attr) if s.throughput else None


FIGURES: list[tuple[str, str, _Get]] = [
    ("requests", "", lambda s: s.requests),
    ("succeeded", "", lambda s: s.succeeded),
    ("failed", "", lambda s: s.failed),
    ("duration", "s", lambda s: s.duration_s),
    ("input tokens", "", lambda s: s.input_tokens),
    ("output tokens", "", lambda s: s.output_tokens),
    ("input tok/s", "tok/s", _tp("input_tokens_per_s")),
    ("output tok/s", "tok/s", _tp("output_tokens_per_s")),
    ("requests/s", "req/s", _tp("requests_per_s")),
    *_dist("ttft"),
    *_dist("tpot"),
    *_dist("itl"),
    *_dist("e2e"),
    ("cache hit: reported", "%", lambda s: s.cache.reported),
    ("cache hit: server metrics", "%", lambda s: s.cache.metrics),
    ("cache hit: ceiling", "%", lambda s: s.cache.ceiling),
    ("goodput", "%", lambda s: s.goodput.fraction if s.goodput else None),
    ("preemptions", "", lambda s: s.preemptions),
    ("sessions", "", lambda s: len(s.sessions)),
]


def compare(a: Summary, b: Summary) -> list[Row]:
    rows = []
    for name, unit, get in FIGURES:
        va, vb = get(a), get(b)
        diff = vb - va if va is not None and vb is not None else None
        rel = diff / va if diff is not None and va else None
        rows.append(Row(name, unit, va, vb, diff, rel))
    return rows


def config_diff(a: Summary, b: Summary) -> dict[str, tuple[object, object]]:
    """Settings whose values differ (or that only one run has), flattened one level."""

    def flat(c: dict) -> dict:
        out = {}
        for k, v in c.items():
            if isinstance(v, dict) and k != "slo":
                out.update({f"{k}.{k2}": v2 for k2, v2 in v.items()})
            else:
                out[k] = v
        return out

    fa, fb = flat(a.config), flat(b.config)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v:.1%}"
    if unit in ("ms", "s"):
        return f"{v:,.1f}"
    if unit in ("tok/s", "req/s"):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,.0f}"


def _fmt_diff(r: Row) -> str:
    if r.diff is None:
        return "-"
    if r.unit == "%":
        return f"{r.diff * 100:+.1f} pp"
    return ("+" if r.diff > 0 else "") + _fmt(r.diff, r.unit)


def table(a: Summary, b: Summary, name_a: str, name_b: str) -> Table:
    t = Table(title=f"A: {a.kind} {a.target}\nB: {b.kind} {b.target}")
    t.add_column("figure")
    t.add_column(f"A ({name_a})", justify="right")
    t.add_column(f"B ({name_b})", justify="right")
    t.add_column("B - A", justify="right")
    t.add_column("(B - A) / A", justify="right")
    for r in compare(a, b):
        label = f"{r.name} ({r.unit})" if r.unit in ("ms", "s") else r.name
        rel = "-" if r.rel is None else f"{r.rel:+.1%}"
        style = "" if r.rel is None or abs(r.rel) < 0.1 else "yellow"
        t.add_row(label, _fmt(r.a, r.unit), _fmt(r.b, r.unit), _fmt_diff(r), rel, style=style)
    t.add_row("valid", str(a.valid), str(b.valid), "", "")
    return t


def compare_runs(args: argparse.Namespace) -> int:
    """Print (or write as JSON) the comparison of the two runs the flags name."""
    a, b = load(args.a), load(args.b)
    if args.json:
        out = {
            "a": args.a,
            "b": args.b,
            "figures": compare(a, b),
            "config_diff": {k: list(v) for k, v in config_diff(a, b).items()},
            "clocks": {"a": a.clocks, "b": b.clocks},
        }
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(out), indent=2).decode() + "\n")
        return 0
    con = Console()
    con.print(table(a, b, Path(args.a).name or args.a, Path(args.b).name or args.b))
    diff = config_diff(a, b)
    both = {k: v for k, v in diff.items() if None not in v}
    if both:
        con.print("[bold]settings that differ[/bold]")
        for k, (va, vb) in both.items():
            con.print(f"  {k}: A={va!r}  B={vb!r}", markup=False, highlight=False)
    for who, i in (("A", 0), ("B", 1)):
        only = [k for k, v in diff.items() if k not in both and v[i] is not None]
        if only:
            con.print(f"settings only {who} records: {', '.join(only)}", style="dim", highlight=False)
    ca, cb = latency_clock(a), latency_clock(b)
    if ca and cb and ca != cb and not {ca, cb} <= ENGINE_TIME:  # the engine clock is simulate's
        con.print(
            f"latencies on different clocks: A {ca}, B {cb} (the client's clock adds HTTP and client time)",
            style="yellow",
            highlight=False,
        )
    for who, s in (("A", a), ("B", b)):
        if not s.valid:
            con.print(f"{who} is INVALID: {s.invalid_reason}", style="red", markup=False)
        if s.cache.contaminated:
            con.print(f"{who}'s cache was contaminated: hits above its ceiling", style="yellow")
    return 0
