"""The one `agentkv` entry point. Sub-commands stay thin: they parse flags and call the packages."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from agentkv import __version__
from agentkv.errors import UserError

Handler = Callable[[argparse.Namespace], int | None]


def _trace_commands(sub: argparse._SubParsersAction) -> None:
    """`agentkv trace ...`: read, convert, synthesise and summarise agentic traces."""
    trace = sub.add_parser("trace", help="read, convert, synthesise and summarise agentic traces")
    tsub = trace.add_subparsers(dest="trace_cmd", required=True, metavar="COMMAND")

    p = tsub.add_parser("stats", help="per-trace and total statistics, with the prefix-cache hit ceiling")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="trace files or directories (default: the bundled sample)")
    p.add_argument("--format", default="auto", choices=["auto", "agentx", "mooncake", "claude_code"],
                   help="input format (default: detect from file name and content)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--top", type=int, default=10, metavar="N",
                   help="show one row per trace up to N traces, else the N largest and a total (default 10)")
    p.set_defaults(func=_cmd_trace_stats)

    p = tsub.add_parser("synth", help="write seeded synthetic agentic sessions as AgentX JSON")
    p.add_argument("--sessions", type=int, default=10, metavar="N", help="sessions (traces) to write (default 10)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed; same seed, same bytes (default 0)")
    p.add_argument("-o", "--output", default="synth-traces", metavar="OUT",
                   help="directory to write <trace id>.json files into (default ./synth-traces)")
    p.add_argument("--gzip", action="store_true", help="write .json.gz files")
    p.set_defaults(func=_cmd_trace_synth)

    p = tsub.add_parser("convert", help="save traces (any format) as AgentX JSON, as kv-cache-tester and AIPerf read")
    p.add_argument("paths", nargs="+", metavar="INPUT", help="trace files or directories")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="a .json or .json.gz file for one trace, or a directory for many")
    p.add_argument("--format", default="auto", choices=["auto", "agentx", "mooncake", "claude_code"],
                   help="input format (default: detect from file name and content)")
    p.add_argument("--gzip", action="store_true", help="gzip the files written into a directory (.json.gz)")
    p.set_defaults(func=_cmd_trace_convert)


def _cmd_trace_stats(args: argparse.Namespace) -> int:
    from agentkv.trace.stats import stats_command

    return stats_command(args)


def _cmd_trace_synth(args: argparse.Namespace) -> int:
    from agentkv.trace.synth import synth_command

    return synth_command(args)


def _cmd_trace_convert(args: argparse.Namespace) -> int:
    from agentkv.trace.formats.convert import convert

    for t, path in convert(args.paths, args.output, args.format, gzip=args.gzip):
        print(f"{path}  ({t.num_requests} requests, {t.num_subagents} sub-agents, from {t.format})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description="Replay, simulate and route agentic LLM inference; the KV cache at the centre.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _trace_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"agentkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
