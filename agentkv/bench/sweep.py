"""`agentkv bench --sweep lanes=1,2,4,8`: one full run per load point (OUT/point-<k>/), then
OUT/sweep.json and OUT/sweep.html (output throughput per GPU against interactivity, SLO compliance
per point, and the knee: the highest load meeting the --slo goodput target).

Its flags are in bench/load_flags.py.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from agentkv.errors import UserError

SWEEP_KEYS = {"lanes": int, "session_rate": float, "think_scale": float}
SCHEMA = "agentkv.bench-sweep/1"


def parse_sweep(spec: str) -> tuple[str, list]:
    """`lanes=1,2,4` -> ("lanes", [1, 2, 4]); one key, values typed and checked."""
    key, sep, vals = spec.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or key not in SWEEP_KEYS:
        raise UserError(f"--sweep: expected KEY=V1,V2,... with KEY in {', '.join(SWEEP_KEYS)}, got {spec!r}")
    out = []
    for v in (v.strip() for v in vals.split(",")):
        if not v:
            continue
        try:
            x = SWEEP_KEYS[key](v)
        except ValueError:
            what = "a whole number" if SWEEP_KEYS[key] is int else "a number"
            raise UserError(f"--sweep {key}: {v!r} is not {what}") from None
        if not (math.isfinite(x) and (x > 0 or (key == "think_scale" and x == 0))):
            raise UserError(f"--sweep {key}: values must be > 0, got {v!r}")
        out.append(x)
    if not out:
        raise UserError(f"--sweep {key}: no values given")
    if len(set(out)) != len(out):
        raise UserError(f"--sweep {key}: a value is repeated in {vals!r}")
    # lowest load first: more lanes or sessions per second is more load, a larger think scale less
    return key, sorted(out, reverse=key == "think_scale")


def sweep_settings(args: argparse.Namespace) -> tuple[str, list, dict[str, float], float]:
    """The key, values, SLO and attainment of a --sweep, checked (before any server starts)."""
    from agentkv.bench.load import parse_rate
    from agentkv.metrics.summary import parse_slo

    if args.slo_search and not (args.sweep and args.slo):
        raise UserError("--slo-search needs --sweep and --slo")
    if args.slo_search < 0:
        raise UserError(f"--slo-search must be >= 0, got {args.slo_search}")
    key, values = parse_sweep(args.sweep)
    return key, values, parse_slo(args.slo), parse_rate(args.slo_attainment, "--slo-attainment")


RunPoint = Callable[[argparse.Namespace, Path], tuple[int, object]]


def run_sweep(args: argparse.Namespace, run_point: RunPoint, out: Path, console) -> int:
    """Run every point (`run_point(args, folder) -> (exit status, BenchResult)`), then up to
    --slo-search more between the knee and the first point past it; write the sweep's JSON and
    HTML and print its table. Stops at the first interrupted or crashed point."""
    from agentkv.bench.sweep_view import point_row, print_table, write_sweep
    from agentkv.metrics.validity import EXIT_INVALID

    key, values, slo, attain = sweep_settings(args)
    rows: list[dict] = []
    search = args.slo_search if slo else 0
    status, todo = 0, list(values)
    while todo and not status:
        v, k = todo.pop(0), len(rows)
        a = argparse.Namespace(**vars(args))
        setattr(a, key, v)
        what = (
            f"search point {k + 1 - len(values)}/{search}"
            if k >= len(values)
            else f"point {k + 1}/{len(values)}"
        )
        console.print(f"[bold]sweep {what}: {key}={v:g}[/bold]")
        code, result = run_point(a, out / f"point-{k}")
        rows.append(point_row(k, key, v, result, slo, attain))
        rows.sort(key=lambda r: -r[key] if key == "think_scale" else r[key])
        if code not in (0, EXIT_INVALID):  # interrupted or crashed: keep what is done
            status = code
        elif not todo and len(rows) < len(values) + search and (mid := between(key, rows)) is not None:
            todo.append(mid)
    doc = write_sweep(out, key, rows, slo, attain)
    print_table(doc, args.json)
    if status:
        return status
    return EXIT_INVALID if any(not r["valid"] for r in rows) else 0


def between(key: str, rows: list[dict]) -> float | int | None:
    """The load halfway between the knee and the next point (which misses the SLO), or None when
    there is no such pair or no value left between them (lanes are whole)."""
    from agentkv.bench.sweep_view import knee

    best, _ = knee(rows)
    if best is None or best is rows[-1]:
        return None
    lo, hi = best[key], rows[rows.index(best) + 1][key]
    if key == "lanes":
        mid = (lo + hi) // 2
        return None if mid in (lo, hi) else mid
    return float(f"{(lo + hi) / 2:.4g}")
