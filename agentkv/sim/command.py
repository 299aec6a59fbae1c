"""`agentkv simulate`: flags -> SimConfig, one run or a sweep grid, tables and JSON out."""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentkv.errors import UserError
from agentkv.metrics.records import encode_record
from agentkv.metrics.summary import Summary, write_summary
from agentkv.metrics.view import ms, num, pct, print_summary
from agentkv.sim.cluster import SimConfig, SimResult, simulate
from agentkv.units import parse_duration


def load_traces(args: argparse.Namespace):
    from agentkv.trace.formats import bundled_sample, load_paths

    paths = args.paths or bundled_sample()
    return load_paths(paths, args.format)


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    from agentkv.cli import engine_config_from_args

    if args.workers < 1 or args.lanes < 1:
        raise UserError("--workers and --lanes must be >= 1")
    if not args.kv_weight >= 0:
        raise UserError(f"--kv-weight must be >= 0, got {args.kv_weight}")
    cap = (
        None
        if str(args.idle_gap_cap).lower() in ("none", "off")
        else parse_duration(args.idle_gap_cap, "--idle-gap-cap")
    )
    return SimConfig(
        engine=engine_config_from_args(args),
        workers=args.workers,
        lanes=args.lanes,
        router=args.router,
        kv_weight=args.kv_weight,
        seed=args.seed,
        warm_start=args.warm_start,
        idle_gap_cap=cap,
        max_requests=args.max_requests,
        duration=parse_duration(args.duration, "--duration") if args.duration else None,
    )


def parse_sweep(specs: list[str], args: argparse.Namespace) -> list[dict[str, str]]:
    """`key=v1,v2` specs -> the grid of overrides (product over keys), keys checked against the flags."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not vals:
            raise UserError(f"--sweep: expected KEY=V1,V2,..., got {spec!r}")
        if not hasattr(args, key) or key in ("sweep", "paths", "func", "out", "json", "format", "quiet"):
            raise UserError(
                f"--sweep: unknown setting '{key}' (use a simulate flag name, e.g. lanes, "
                "cpu_offload, gpu_memory_utilization, router, gpu)"
            )
        axes.append((key, [v.strip() for v in vals.split(",") if v.strip()]))
    return [
        dict(zip([k for k, _ in axes], combo, strict=True))
        for combo in itertools.product(*[v for _, v in axes])
    ]


def _apply(args: argparse.Namespace, overrides: dict[str, str]) -> argparse.Namespace:
    a = copy.copy(args)
    for key, raw in overrides.items():
        cur = getattr(args, key)
        if key == "cpu_offload" and raw in ("0", "none", "off"):
            val = None
        elif isinstance(cur, bool):
            val = raw.lower() in ("1", "true", "yes", "on")
        elif isinstance(cur, int) or key in ("num_gpu_blocks_override", "max_model_len", "max_requests"):
            try:
                val = int(raw)
            except ValueError:
                raise UserError(f"--sweep {key}: expected an integer, got {raw!r}") from None
        elif isinstance(cur, float):
            try:
                val = float(raw)
            except ValueError:
                raise UserError(f"--sweep {key}: expected a number, got {raw!r}") from None
        else:
            val = raw
        setattr(a, key, val)
    return a


def _run_one(payload) -> tuple[dict, bytes, float, float]:
    args, overrides = payload
    a = _apply(args, overrides)
    res = simulate(load_traces(a), sim_config_from_args(a))
    return overrides, msgspec.json.encode(res.summary), res.wall_s, res.sim_s


def simulate_command(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.sweep:
        return _sweep(args, console)
    cfg = sim_config_from_args(args)
    traces = load_traces(args)
    if args.quiet or not sys.stderr.isatty():
        res = simulate(traces, cfg)
    else:
        with Progress(
            TextColumn("simulating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("sim", total=None)
            res = simulate(traces, cfg, progress=lambda d, t: bar.update(task, completed=d, total=t))
    if args.out:
        _write(res, Path(args.out))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(res.summary), indent=2).decode() + "\n")
    else:
        print_summary(res.summary, Console())
        Console().print(
            f"[dim]simulated {res.sim_s:,.0f} s in {res.wall_s:,.1f} s of wall time "
            f"({res.sim_s / max(res.wall_s, 1e-9):,.0f}x real time, "
            f"{len(res.records) / max(res.wall_s, 1e-9):,.0f} requests per wall second)[/dim]"
        )
    return 0


def _write(res: SimResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "wb") as f:
        for r in res.records:
            f.write(encode_record(r) + b"\n")
    write_summary(res.summary, out / "summary.json")


def _sweep(args: argparse.Namespace, console: Console) -> int:
    grid = parse_sweep(args.sweep, args)
    for overrides in grid:  # fail fast on a bad value, before spawning processes
        sim_config_from_args(_apply(args, overrides))
    results = []
    with ProcessPoolExecutor(max_workers=min(len(grid), 2)) as pool:
        for overrides, blob, wall, sim_s in pool.map(_run_one, [(args, g) for g in grid]):
            results.append((overrides, msgspec.json.decode(blob, type=Summary), wall, sim_s))
            console.print(f"[dim]done: {overrides} ({wall:.1f} s)[/dim]")
    table = Table(title="simulate sweep")
    keys = list(grid[0])
    for k in keys:
        table.add_column(k)
    for col in (
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "hit rate",
        "CPU hits",
        "out tok/s",
        "out tok/s/GPU",
        "preempt",
        "failed",
    ):
        table.add_column(col, justify="right")
    for overrides, s, _, _ in results:
        tp = s.throughput
        table.add_row(
            *[overrides[k] for k in keys],
            ms(s.ttft.p50),
            ms(s.ttft.p99),
            ms(s.tpot.p50),
            pct(s.cache.reported),
            pct(s.cache.by_tier.get("CPU")),
            num(tp.output_tokens_per_s if tp else None),
            num(tp.output_tokens_per_s_per_gpu if tp else None),
            f"{s.preemptions:,}",
            f"{s.failed:,}",
        )
    if args.json:
        out = [{"overrides": o, "summary": msgspec.to_builtins(s)} for o, s, _, _ in results]
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(out), indent=2).decode() + "\n")
    else:
        Console().print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for i, (overrides, s, _, _) in enumerate(results):
            name = "-".join(f"{k}={v}" for k, v in overrides.items()).replace("/", "_") or str(i)
            write_summary(s, out / f"summary-{name}.json")
    return 0
