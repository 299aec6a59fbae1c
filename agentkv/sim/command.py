"""`agentkv simulate`: flags -> SimConfig, one run or a sweep grid, tables and JSON out.

Import-light at module level (the CLI builds every parser); the simulator loads when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentkv.engine.config import EngineConfig, add_engine_args
from agentkv.placement import POLICIES, add_kv_weight_arg
from agentkv.sim.deploy_args import add_deploy_args, deploy_settings
from agentkv.trace.command import add_trace_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv simulate`: trace, cluster, router and engine settings."""
    p = sub.add_parser(
        "simulate", help="replay traces on N simulated engines behind a router (virtual clock)"
    )
    add_trace_args(p)
    p.add_argument("--workers", type=int, default=1, help="simulated engines (default 1)")
    p.add_argument("--lanes", type=int, default=16, help="concurrent session lanes (default 16)")
    p.add_argument("--router", default="kv_aware", choices=POLICIES)
    add_kv_weight_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warm-start", action="store_true", help="start each lane's first trace at a random point"
    )
    p.add_argument(
        "--idle-gap-cap", default="10s", help="longest gap while nothing is in flight (default 10s)"
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument(
        "--duration", default=None, help="stop releasing requests after this simulated time, e.g. 10m"
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run a grid over a setting (repeatable), e.g. --sweep lanes=16,64 --sweep cpu_offload=0,512GB",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the sweep's points as Ray tasks: on the cluster at ADDRESS (auto, ray://host:port, "
        "host:port) or, with no address, a new local cluster (needs pip install 'agentkv[ray]')",
    )
    p.add_argument("--out", default=None, help="write summary.json and requests.jsonl here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_engine_args(p)
    add_deploy_args(p)
    p.set_defaults(func=simulate_command)


def load_traces(paths: list[str], fmt: str):
    """The traces at `paths` (default: the bundled sample)."""
    from agentkv.trace.formats import bundled_sample, load_paths

    return load_paths(paths or bundled_sample(), fmt)


def sim_config_from_args(args: argparse.Namespace):
    """The SimConfig of the flags (durations parsed; SimConfig and EngineConfig validate)."""
    from agentkv.sim.cluster import SimConfig
    from agentkv.units import parse_duration

    cap = None
    if str(args.idle_gap_cap).lower() not in ("none", "off"):
        cap = parse_duration(args.idle_gap_cap, "--idle-gap-cap")
    return SimConfig(
        engine=EngineConfig.from_args(args),
        workers=args.workers,
        lanes=args.lanes,
        router=args.router,
        kv_weight=args.kv_weight,
        seed=args.seed,
        warm_start=args.warm_start,
        idle_gap_cap=cap,
        max_requests=args.max_requests,
        duration=parse_duration(args.duration, "--duration") if args.duration else None,
        **deploy_settings(args),
    )


def simulate_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv simulate`: one run with a progress bar, or a sweep grid."""
    import msgspec
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentkv.metrics.view import print_summary
    from agentkv.sim.cluster import simulate

    console = Console(stderr=True)
    cfg = sim_config_from_args(args)
    if args.ray is not None and not args.sweep:
        from agentkv.errors import UserError

        raise UserError("--ray runs a --sweep's points on Ray; add --sweep KEY=V1,V2")
    if args.sweep:
        from agentkv.sim.sweep import run_sweep

        return run_sweep(args, cfg, console)
    traces = load_traces(args.paths, args.format)
    if args.quiet or not sys.stderr.isatty():
        res = simulate(traces, cfg)
    else:
        columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("sim", total=None)
            res = simulate(traces, cfg, progress=lambda d, t: bar.update(task, completed=d, total=t))
    if args.out:
        write_run(res, Path(args.out))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(res.summary), indent=2).decode() + "\n")
    else:
        print_summary(res.summary, Console())
        Console().print(
            f"[dim]simulated {res.sim_s:,.0f} s in {res.wall_s:,.1f} s of wall time "
            f"({res.sim_s / max(res.wall_s, 1e-9):,.0f}x real time, "
            f"{len(res.records) / max(res.wall_s, 1e-9):,.0f} requests per wall second)[/dim]"
        )
    return exit_code(res.summary)


def exit_code(summary) -> int:
    """EXIT_INVALID (as bench) when the simulated run is invalid, with why on stderr; else 0."""
    from agentkv.metrics.validity import EXIT_INVALID, invalid_line

    if summary.valid:
        return 0
    print(invalid_line(summary), file=sys.stderr)
    return EXIT_INVALID


def write_run(res, out: Path) -> None:
    """requests.jsonl and summary.json of one run into `out`."""
    from agentkv.metrics.records import encode_record
    from agentkv.metrics.summary import write_summary

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "wb") as f:
        for r in res.records:
            f.write(encode_record(r) + b"\n")
    write_summary(res.summary, out / "summary.json")
