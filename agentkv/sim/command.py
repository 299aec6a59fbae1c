"""`agentkv simulate`: flags -> SimConfig, one run or a sweep grid, tables and JSON out.

Import-light at module level (the CLI builds every parser); the simulator loads when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentkv.engine.config import EngineConfig, add_engine_args
from agentkv.metrics.flags import add_output_flags
from agentkv.placement import POLICIES, add_kv_weight_arg
from agentkv.scaleout.raytasks import add_ray_arg
from agentkv.sim.deploy_args import add_deploy_args, deploy_settings
from agentkv.trace.command import add_trace_args
from agentkv.trace.warmup import add_warmup_args, parse_think_scale, parse_warmup


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv simulate`: trace, cluster, router and engine settings."""
    p = sub.add_parser(
        "simulate", help="replay traces on N simulated engines behind a router (virtual clock)"
    )
    add_trace_args(p)
    p.add_argument("--workers", type=int, default=1, help="simulated engines (default 1)")
    p.add_argument(
        "--lanes",
        type=int,
        default=None,
        help="concurrent session lanes (default 16); with --session-rate a cap on trees at once (default: none)",
    )
    add_arrival_args(p)
    add_warmup_args(p)
    p.add_argument(
        "--router", default="kv_aware", choices=POLICIES, help="placement policy (default kv_aware)"
    )
    add_kv_weight_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the replay plan (default 0)")
    p.add_argument(
        "--warm-start", action="store_true", help="start each lane's first trace at a random point"
    )
    p.add_argument(
        "--idle-gap-cap", default="10s", help="longest gap while nothing is in flight (default 10s)"
    )
    p.add_argument("--max-requests", type=int, default=None, help="stop after releasing this many requests")
    p.add_argument(
        "--duration", default=None, help="stop releasing requests after this simulated time, e.g. 10m"
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run a grid over a setting (repeatable), e.g. --sweep lanes=16,64 --sweep cpu_offload=0,512GB; "
        "lanes=LO..HI searches the tier's knee, disagg=1p3d,2p2d,3p1d the prefill:decode split",
    )
    add_ray_arg(p, "the sweep's points")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write requests.jsonl, summary.json, records.csv, vllm_result.json and report.html here "
        "(a --sweep: one summary per point)",
    )
    add_output_flags(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_engine_args(p)
    add_deploy_args(p)
    p.set_defaults(func=simulate_command)


def add_arrival_args(p: argparse.ArgumentParser) -> None:
    """Open-loop load as `agentkv bench` offers it, so a bench run's load can be simulated and compared."""
    from agentkv.trace.arrivals import ARRIVALS  # light: random and the error type

    p.add_argument(
        "--session-rate",
        type=float,
        default=None,
        metavar="R",
        help="open loop: R new session trees per simulated second, each replaying its turns as usual "
        "(as agentkv bench --session-rate)",
    )
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="poisson",
        help="--session-rate spacing: poisson (exponential gaps seeded by --seed) or constant (default poisson)",
    )


def arrival_settings(args: argparse.Namespace) -> dict:
    """SimConfig's load from the flags (lanes, session rate, arrivals, think scale, warm-up); one-line
    errors for a bad rate or warm-up."""
    rate = args.session_rate
    if rate is not None and not 0 < rate < float("inf"):
        from agentkv.errors import UserError

        raise UserError(f"--session-rate must be > 0 sessions/s, got {rate:g}")
    lanes = args.lanes if args.lanes is not None or rate is not None else 16
    warm_n, warm_s = parse_warmup(args.warmup)
    return {
        "lanes": lanes,
        "session_rate": rate,
        "arrivals": args.arrivals,
        "think_scale": parse_think_scale(args.think_scale),
        "warmup_requests": warm_n,
        "warmup_s": warm_s,
    }


def load_traces(args: argparse.Namespace):
    """The traces the trace flags select (default: the bundled sample), and notes on the selection."""
    from agentkv.trace.command import load_trace_args

    return load_trace_args(args)


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
        **arrival_settings(args),
        router=args.router,
        kv_weight=args.kv_weight,
        kv_queue_weight=args.kv_queue_weight,
        kv_queue_cap=args.kv_queue_cap,
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

    from agentkv.metrics.view import print_summary

    console = Console(stderr=True)
    cfg = sim_config_from_args(args)
    if args.ray is not None and not args.sweep:
        from agentkv.errors import UserError

        raise UserError("--ray runs a --sweep's points on Ray; add --sweep KEY=V1,V2")
    if args.sweep:
        from agentkv.sim.sweep import run_sweep

        return run_sweep(args, cfg, console)
    res, itl, interrupted = _run_one(args, cfg, console)
    if args.percentiles:
        from agentkv.metrics.summary import with_percentiles

        res.summary = with_percentiles(res.summary, res.records, itl, args.percentiles)
    if args.out:
        write_run(res, Path(args.out), report=not args.no_report, itl_values=itl)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(res.summary), indent=2).decode() + "\n")
    else:
        print_summary(res.summary, Console())
        Console().print(
            f"[dim]simulated {res.sim_s:,.0f} s in {res.wall_s:,.1f} s of wall time "
            f"({res.sim_s / max(res.wall_s, 1e-9):,.0f}x real time, "
            f"{len(res.records) / max(res.wall_s, 1e-9):,.0f} requests per wall second)[/dim]"
        )
    if interrupted:
        print("agentkv: interrupted: the summary covers the requests released before Ctrl-C", file=sys.stderr)
        from agentkv.terminal import EXIT_INTERRUPTED

        return EXIT_INTERRUPTED
    return exit_code(res.summary)


def _run_one(args: argparse.Namespace, cfg, console):
    """(result, token gaps, interrupted): one simulated run with a progress bar (and ETA) on a terminal. The
    first Ctrl-C stops releasing requests, lets those in flight finish and keeps the run; a second
    stops at once."""
    from agentkv.sim.cluster import make_cluster
    from agentkv.terminal import StopRequest, progress_bar
    from agentkv.trace.command import selection_of

    traces, notes = load_traces(args)
    cluster = make_cluster(traces, cfg)  # --disagg: the prefill and decode pools
    show = not args.quiet and sys.stderr.isatty()
    if not args.quiet and not show:  # no bar (piped): one line, so a long run is not silent
        print(
            f"simulating {cluster.total:,} requests (Ctrl-C stops and keeps what finished)", file=sys.stderr
        )
    note = "agentkv: stopping: finishing the requests in flight (Ctrl-C again to quit now)"
    with StopRequest(note) as stop, progress_bar(console, "simulating", show) as bar:
        task = bar.add_task("sim", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            if stop.requested:
                cluster.plan.stop()  # idempotent: nothing more is released

        cluster.progress = progress
        res = cluster.run()
    if stop.requested:
        res.summary.notes.append(
            f"interrupted (Ctrl-C) after {len(res.records):,} of {cluster.total:,} requests: "
            "no request was released after it, those in flight finished"
        )
    res.summary.notes[:0] = notes
    res.summary.config["selection"] = selection_of(args)
    if cluster.plan.arrivals is not None:  # --session-rate
        from agentkv.trace.arrivals import arrivals_note

        res.summary.notes.append(arrivals_note(cluster.plan.arrivals))
    return res, cluster.itl, stop.requested


def exit_code(summary) -> int:
    """EXIT_INVALID (as bench) when the simulated run is invalid, with why on stderr; else 0."""
    from agentkv.metrics.validity import EXIT_INVALID, invalid_line

    if summary.valid:
        return 0
    print(invalid_line(summary), file=sys.stderr)
    return EXIT_INVALID


def write_run(res, out: Path, report: bool = True, itl_values=None) -> None:
    """requests.jsonl, then what bench writes too (agentkv.metrics.export), of one run into `out`."""
    from agentkv.metrics.export import write_outputs
    from agentkv.metrics.records import encode_record

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "wb") as f:
        for r in res.records:
            f.write(encode_record(r) + b"\n")
    write_outputs(out, res.summary, res.records, report=report, itl_values=itl_values)
