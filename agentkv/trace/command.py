"""`agentkv trace ...`: read, convert, synthesise and summarise agentic traces (flags and runs).

Also the trace flags other commands share (`add_trace_args`). Import-light: the readers load
when a command runs, so `agentkv --help` stays quick.
"""

from __future__ import annotations

import argparse
import sys

# "auto" + agentkv.trace.formats.FORMATS, written out (a test keeps them equal): importing the
# readers would slow `agentkv --help`
TRACE_FORMATS = ("auto", "agentx", "mooncake", "claude_code")


OVER_CONTEXT = ("drop", "trim", "keep")  # agentkv.trace.select.OVER_CONTEXT, written out (import-light)


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """Trace paths (default: the bundled sample), --format and the selection flags, as simulate,
    cache analyze, trace stats and bench take them; `load_trace_args` reads them."""
    p.add_argument(
        "paths", nargs="*", metavar="TRACE", help="trace files or directories (default: bundled sample)"
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=TRACE_FORMATS,
        help="input format (default: detect from file name and content)",
    )
    g = p.add_argument_group("trace selection")
    g.add_argument(
        "--trace-block-size",
        default=None,
        metavar="N",
        help="tokens per hash id in Mooncake traces (default 512, as the published ones; "
        "Dynamo's replay takes the same flag); other formats state their own",
    )
    g.add_argument(
        "--traces-limit", type=int, default=None, metavar="N", help="only the first N traces, in path order"
    )
    g.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="a random sample of N traces, seeded by --seed where the command has one (else 0)",
    )
    g.add_argument(
        "--max-context",
        default=None,
        metavar="TOKENS",
        help="a context window: sessions with a request whose prompt + max_tokens exceeds it are "
        "handled by --over-context (bench default: the target's max_model_len when /v1/models "
        "reports it; 'none' to turn off)",
    )
    g.add_argument(
        "--over-context",
        default="drop",
        choices=OVER_CONTEXT,
        help="drop a session tree with a request over --max-context, trim it before that request, "
        "or keep it and only count it (default drop); Mooncake requests are dropped one by one",
    )


def max_context_of(args: argparse.Namespace) -> int | None:
    """--max-context in tokens, or None (not given, or 'none'); a one-line error when it is not a count."""
    from agentkv.errors import UserError

    text = getattr(args, "max_context", None)
    if text is None or str(text).strip().lower() in ("none", "off", "auto"):
        return None
    t = str(text).strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        v = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise UserError(
            f"--max-context: expected a number of tokens such as 32768 or 32k, got {text!r}"
        ) from None
    if v < 2:
        raise UserError(f"--max-context: must be at least 2 tokens, got {text!r}")
    return v


def selection_of(args: argparse.Namespace) -> dict:
    """The trace selection flags as summary.json's config records them (`agentkv compare` warns
    when runs differ in them); None: the flag was not given."""
    return {
        "sample": getattr(args, "sample", None),
        "traces_limit": getattr(args, "traces_limit", None),
        "max_context": getattr(args, "max_context", None),
        "over_context": getattr(args, "over_context", None),
        "trace_block_size": getattr(args, "trace_block_size", None),
    }


def load_noted(args: argparse.Namespace):
    """`load_trace_args` for commands without a summary: its notes go to stderr, the traces back."""
    traces, notes = load_trace_args(args)
    for n in notes:
        print(n, file=sys.stderr)
    return traces


def load_trace_args(args: argparse.Namespace, window: int | None = None, window_from: str = ""):
    """The traces the trace flags select, and notes saying what was dropped, trimmed or sampled.

    `window` (from `window_from`, e.g. the target's max_model_len) applies when --max-context is
    not given; --max-context none turns both off.
    """
    from agentkv.trace.formats import bundled_sample, load_paths
    from agentkv.trace.select import fit_context, parse_trace_block_size, pick

    bs = parse_trace_block_size(getattr(args, "trace_block_size", None))
    pick_args = {"sample": getattr(args, "sample", None), "limit": getattr(args, "traces_limit", None)}
    if pick_args["sample"] is not None and pick_args["limit"] is not None:
        pick(traces=[], **pick_args)  # the one-line error, before reading anything
    traces = load_paths(args.paths or bundled_sample(), args.format, bs)
    notes: list[str] = []
    limit, source = max_context_of(args), "--max-context"
    raw = getattr(args, "max_context", None)
    off = raw is not None and str(raw).strip().lower() in ("none", "off")
    if limit is None and window and not off:
        limit, source = window, window_from or "context window"
    if limit is not None:
        traces, note = fit_context(traces, limit, getattr(args, "over_context", "drop"), source)
        notes += [note] if note else []
    traces, note = pick(traces, seed=getattr(args, "seed", 0) or 0, **pick_args)
    notes += [note] if note else []
    return traces, notes


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
    add_trace_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
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
    from agentkv.trace.formats import bundled_sample
    from agentkv.trace.stats import compute
    from agentkv.trace.stats_view import render

    top = getattr(args, "top", 10)
    if top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    if not args.paths and not bundled_sample():
        raise UserError("no PATH given and no bundled sample in agentkv/data/traces; pass trace files")
    report = compute(load_noted(args))
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
