"""`agentkv trace ...`: read, convert, synthesise and summarise agentic traces (flags and runs).

Also the trace flags other commands share (`add_trace_args`). Import-light: the readers load
when a command runs, so `agentkv --help` stays quick.
"""

from __future__ import annotations

import argparse

# "auto" + agentkv.trace.formats.FORMATS, written out (a test keeps them equal): importing the
# readers would slow `agentkv --help`
TRACE_FORMATS = ("auto", "agentx", "mooncake", "claude_code")


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """Trace paths (default: the bundled sample) and --format, as simulate, cache and bench take them."""
    p.add_argument(
        "paths", nargs="*", metavar="TRACE", help="trace files or directories (default: bundled sample)"
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="trace format (default: detect from file name and content)",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`agentkv trace ...`: read, convert, synthesise and summarise agentic traces."""
    trace = sub.add_parser("trace", help="read, convert, synthesise and summarise agentic traces")
    tsub = trace.add_subparsers(dest="trace_cmd", required=True, metavar="COMMAND")

    _stats_parser(tsub)
    _synth_parser(tsub)
    _convert_parser(tsub)


def _stats_parser(tsub) -> None:
    """`agentkv trace stats`."""
    p = tsub.add_parser("stats", help="per-trace and total statistics, with the prefix-cache hit ceiling")
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="trace files or directories (default: the bundled sample)"
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="input format (default: detect from file name and content)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="N",
        help="show one row per trace up to N traces, else the N largest and a total (default 10)",
    )
    p.set_defaults(func=stats_command)


def _synth_parser(tsub) -> None:
    """`agentkv trace synth`."""
    p = tsub.add_parser("synth", help="write seeded synthetic agentic sessions as AgentX JSON")
    p.add_argument(
        "--sessions", type=int, default=10, metavar="N", help="sessions (traces) to write (default 10)"
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="random seed; same seed, same bytes (default 0)"
    )
    p.add_argument(
        "-o",
        "--output",
        default="synth-traces",
        metavar="OUT",
        help="directory to write <trace id>.json files into (default ./synth-traces)",
    )
    p.add_argument("--gzip", action="store_true", help="write .json.gz files")
    p.set_defaults(func=synth_command)


def _convert_parser(tsub) -> None:
    """`agentkv trace convert`."""
    p = tsub.add_parser(
        "convert", help="save traces (any format) as AgentX JSON, as kv-cache-tester and AIPerf read"
    )
    p.add_argument("paths", nargs="+", metavar="INPUT", help="trace files or directories")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="a .json or .json.gz file for one trace, or a directory for many",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="input format (default: detect from file name and content)",
    )
    p.add_argument("--gzip", action="store_true", help="gzip the files written into a directory (.json.gz)")
    p.set_defaults(func=convert_command)


def stats_command(args) -> int:
    """`agentkv trace stats`: load the paths (or the bundled sample), print tables or JSON."""
    from agentkv.errors import UserError
    from agentkv.trace.formats import load_paths
    from agentkv.trace.stats import compute
    from agentkv.trace.stats_view import bundled_traces, render

    top = getattr(args, "top", 10)
    if top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    traces = load_paths(args.paths, args.format) if args.paths else bundled_traces()
    report = compute(traces)
    if args.json:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(report).decode(), indent=2))
    else:
        render(report, top=top)
    return 0


def synth_command(args) -> int:
    """`agentkv trace synth`: write the sessions and print one line about them."""
    from agentkv.errors import UserError
    from agentkv.trace.stats import compute
    from agentkv.trace.synth import synthesize, write_traces

    if args.sessions < 1:
        raise UserError(f"--sessions must be at least 1, got {args.sessions}")
    traces = synthesize(args.sessions, args.seed)
    paths = write_traces(traces, args.output, gz=args.gzip)
    tot = compute(traces).total
    print(
        f"wrote {len(paths)} traces to {args.output}: {tot.requests} requests, {tot.subagents} sub-agents, "
        f"{tot.input_tokens:,} input tokens, prefix-cache hit ceiling {tot.ceiling:.4f}"
    )
    return 0


def convert_command(args: argparse.Namespace) -> int:
    """`agentkv trace convert`: write the traces as AgentX JSON, one line per file written."""
    from agentkv.trace.formats.convert import convert

    for t, path in convert(args.paths, args.output, args.format, gzip=args.gzip):
        print(f"{path}  ({t.num_requests} requests, {t.num_subagents} sub-agents, from {t.format})")
    return 0
