"""`agentkv bench` (and `agentkv compare`): flags -> BenchConfig, the embedded server when no
--target, live progress, outputs.

Outputs in --out: requests.jsonl (appended as requests finish), summary.json (the schema
`agentkv simulate` writes), records.csv, vllm_result.json and report.html (agentkv.metrics.export).
They are written even after Ctrl-C. Import-light at module level: the CLI builds every parser.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv.bench.load_flags import add_load_args, check_clients
from agentkv.bench.request_flags import add_request_flags
from agentkv.errors import UserError
from agentkv.metrics.flags import add_output_flags
from agentkv.trace.command import add_trace_args, selection_of
from agentkv.units import parse_duration

if TYPE_CHECKING:
    from agentkv.bench.runner import BenchConfig

DEFAULT_EMBEDDED_TIME_SCALE = 10.0
# exit statuses of `agentkv bench` (docs/bench.md); 2 is a usage error (agentkv.cli)
EXIT_CRASH, EXIT_INTERRUPTED = 1, 130  # EXIT_INVALID (3): agentkv.metrics.validity


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`agentkv bench` and `agentkv compare`."""
    p = sub.add_parser(
        "bench",
        help="replay agentic sessions against an OpenAI-compatible server; "
        "requests.jsonl, summary.json and report.html (default: the embedded agentkv serve)",
    )
    add_bench_args(p)
    p.set_defaults(func=bench_command)
    p = sub.add_parser(
        "compare",
        help="N runs (bench or simulate) against the first: better/worse beyond a noise band, "
        "warnings when they replayed different requests or settings",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="summary.json files or run folders (with requests.jsonl: the noise band and request "
        "set come from it); the first is the baseline",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE.html",
        help="also write the comparison as a self-contained HTML page",
    )
    p.set_defaults(func=compare_command)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The flags of `agentkv bench`."""
    add_trace_args(p)
    add_load_args(p.add_argument_group("target and load"))
    _request_args(p.add_argument_group("requests"))
    _replay_args(p.add_argument_group("replay"))
    _output_args(p.add_argument_group("output and measurement"))


def _request_args(p) -> None:
    """Requests."""
    p.add_argument(
        "--api",
        default="completions",
        choices=["completions", "chat"],
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    p.add_argument(
        "--prompt-mode",
        default=None,
        choices=["token-ids", "text"],
        help="token ids (exact lengths; completions only) or text (default: token-ids, text for chat)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="text mode: tokenizer.json or a HF folder to render blocks with (default: built-in)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME", help="model name in requests (default: the target's first)"
    )
    add_request_flags(p)


def _replay_args(p) -> None:
    """Replay."""
    p.add_argument("--seed", type=int, default=0, help="seed of the replay plan (default 0)")
    p.add_argument(
        "--warm-start", action="store_true", help="start each lane's first trace at a random point"
    )
    p.add_argument(
        "--idle-gap-cap", default="10s", help="longest gap while nothing is in flight (default 10s)"
    )
    p.add_argument(
        "--tenant-salts",
        action="store_true",
        help="send each session tree's own cache_salt (tenants never share cache)",
    )
    p.add_argument(
        "--cache-bust",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mark this run's prompts so nothing cached by an earlier run is reused (default on; "
        "--no-cache-bust reuses what the server already cached)",
    )
    p.add_argument("--timeout", default="300s", help="per-request time limit (default 300s)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="X",
        help="target seconds per wall second: the embedded server runs X times faster, gaps shrink "
        f"X times and results are reported in target seconds (default {DEFAULT_EMBEDDED_TIME_SCALE:g} "
        "for the embedded server, 1 with --target)",
    )
    p.add_argument(
        "--serve-args",
        default=None,
        metavar="ARGS",
        help="extra flags for the embedded agentkv serve, e.g. '--gpu h100 --cpu-offload 256GB'",
    )


def _output_args(p) -> None:
    """Output and measurement."""
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default out/bench-<time>)")
    p.add_argument("--slo", default=None, metavar="SPEC", help="goodput SLOs, e.g. ttft=2s,tpot=50ms")
    p.add_argument("--sample-every", default="1s", help="time-series sampling period (default 1s)")
    p.add_argument(
        "--clock",
        choices=["auto", "client"],
        default="auto",
        help="latencies from the target's engine clock when it stamps its responses (agentkv serve), "
        "else the client's (default auto); client: always the client's, HTTP and client time included",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=0,
        metavar="N",
        help="cap on open connections (default 0: one per concurrent request)",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop (default auto: uvloop when installed)",
    )
    p.add_argument(
        "--max-failure-rate",
        default="1%",
        metavar="RATE",
        help="share of failed requests above which the run is invalid (exit 3), e.g. 1%% or 0.05 "
        "(default 1%%)",
    )
    add_output_flags(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no live progress display")


def _duration(text: str | None, flag: str) -> float | None:
    """A duration flag in seconds; None for none/off/0."""
    if text is None or str(text).lower() in ("none", "off", "0"):
        return None
    v = parse_duration(text, flag)
    if v <= 0:
        raise UserError(f"{flag} must be > 0, got {text!r}")
    return v


def config_from_args(args: argparse.Namespace, target: str) -> BenchConfig:
    """The BenchConfig of the flags, against `target` (durations and SLOs parsed)."""
    from agentkv.bench.agents import check_agents_args
    from agentkv.bench.load import DEFAULT_LANES, check, parse_rate
    from agentkv.bench.runner import BenchConfig
    from agentkv.metrics.summary import parse_slo
    from agentkv.trace.warmup import parse_think_scale, parse_warmup

    check_clients(args)
    if args.max_requests is not None and args.max_requests < 1:
        raise UserError(f"--max-requests must be >= 1, got {args.max_requests}")
    duration = _duration(args.duration, "--duration")
    if args.cycle and duration is None and args.max_requests is None:
        raise UserError("--cycle repeats the traces without end: give --duration or --max-requests")
    prompt_mode = args.prompt_mode or ("text" if args.api == "chat" else "token-ids")
    scale = (
        args.time_scale
        if args.time_scale is not None
        else (1.0 if args.target else DEFAULT_EMBEDDED_TIME_SCALE)
    )
    warm_n, warm_s = parse_warmup(args.warmup)
    cfg = BenchConfig(
        target=target,
        lanes=args.lanes if args.lanes is not None or args.session_rate else DEFAULT_LANES,
        session_rate=args.session_rate,
        arrivals=args.arrivals,
        warmup_requests=warm_n,
        warmup_s=warm_s,
        think_scale=parse_think_scale(args.think_scale),
        duration=duration,
        max_requests=args.max_requests,
        api=args.api,
        prompt_mode=prompt_mode,
        tokenizer=args.tokenizer,
        model=args.model,
        slo=parse_slo(args.slo),
        seed=args.seed,
        warm_start=args.warm_start,
        idle_gap_cap=_duration(args.idle_gap_cap, "--idle-gap-cap"),
        tenant_salts=args.tenant_salts,
        cache_bust=args.cache_bust,
        max_failure_rate=parse_rate(args.max_failure_rate, "--max-failure-rate"),
        timeout=parse_duration(args.timeout, "--timeout"),
        sample_every=parse_duration(args.sample_every, "--sample-every"),
        max_connections=args.max_connections,
        time_scale=scale,
        clock=args.clock,
        requests=request_options(args),
        cycle=args.cycle_cache if args.cycle else None,
    )
    check(cfg)
    check_agents_args(args)
    return cfg


def request_options(args: argparse.Namespace):
    """--header, --extra-body and the API key, parsed (one-line errors naming the flag)."""
    from agentkv.bench.request_opts import RequestOptions

    return RequestOptions.from_flags(args.header, args.extra_body, args.api_key, args.api_key_file)


def default_out() -> str:
    """The output folder when --out is not given: out/bench-<local time>."""
    return f"out/bench-{time.strftime('%Y%m%d-%H%M%S')}"


def load_traces(args: argparse.Namespace, notes: list[str], requests):
    """The selected traces; against a --target, sessions over its max_model_len (/v1/models, asked
    with `requests`' headers) are dropped or trimmed as --over-context says, unless --max-context."""
    from agentkv.bench.target_info import max_model_len
    from agentkv.trace.command import load_trace_args, max_context_of

    headers = requests.client_args()["headers"]
    window, model = None, ""
    if args.target and max_context_of(args) is None:
        window, model = max_model_len(args.target, headers, args.model)
    traces, picked = load_trace_args(args, window, f"the target's max_model_len ({model})")
    notes += picked
    return traces


def bench_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv bench` (one run, or with --sweep one run per load point)."""
    from rich.console import Console

    checked = config_from_args(args, "")  # bad flags fail here, before traces load or a server starts
    if args.sweep or args.slo_search:
        from agentkv.bench.sweep import sweep_settings

        sweep_settings(args)
    notes: list[str] = []
    traces = load_traces(args, notes, checked.requests)
    out = Path(args.out or default_out())
    console = Console(stderr=True)
    for n in notes:
        console.print(n, markup=False, highlight=False)
    with contextlib.ExitStack() as stack:
        target = args.target or _start_embedded(args, traces, stack, console, notes)
        if not args.sweep:
            return _run_one(args, traces, target, out, console, notes)[0]
        from agentkv.bench.sweep import run_sweep

        return run_sweep(
            args, lambda a, o: _run_one(a, traces, target, o, console, notes, show=False), out, console
        )


def _run_one(args, traces, target: str, out: Path, console, notes, show: bool = True):
    """One measured run against `target` into `out`: (exit status, BenchResult)."""
    from rich.live import Live

    from agentkv.bench.live import progress_panel, run_loop
    from agentkv.bench.runner import BenchRun

    cfg = config_from_args(args, target)
    if args.clients > 1 or args.ray is not None:
        from agentkv.bench.shards import ShardedRun

        run = ShardedRun(
            cfg, traces, args.clients, out=out, notes=notes, loop=args.loop, ray=args.ray, announce=show
        )
    else:
        run = BenchRun(cfg, traces, out=out, notes=notes)
    with contextlib.ExitStack() as stack:
        if not args.quiet and console.is_terminal:
            live = Live(progress_panel(run), console=console, auto_refresh=False, transient=True)
            run.on_tick = lambda r: live.update(progress_panel(r), refresh=True)
            stack.enter_context(live)
        result = run_loop(run.run(), args.loop)
    _write_outputs(args, result, out, run.itl, show)
    return _exit_status(run, result, console), result


def _exit_status(run, result, console) -> int:
    """1: a bug stopped the run; 130: interrupted; 3: the run is invalid (why, on stderr); else 0."""
    if run.crash:
        console.print(f"agentkv: error: the run stopped early: {run.crash} (outputs written)", markup=False)
        return EXIT_CRASH
    if result.interrupted:
        return EXIT_INTERRUPTED
    if not result.summary.valid:
        from agentkv.metrics.validity import EXIT_INVALID, invalid_line

        console.print(invalid_line(result.summary), markup=False, highlight=False)
        return EXIT_INVALID
    return 0


def _start_embedded(
    args: argparse.Namespace, traces, stack: contextlib.ExitStack, console, notes: list[str]
) -> str:
    """Start the embedded agentkv serve (stopped when `stack` closes) and return its URL."""
    from agentkv.bench.embedded import EmbeddedServer, needed_model_len

    need = needed_model_len(traces)
    srv = EmbeddedServer(
        time_scale=args.time_scale or DEFAULT_EMBEDDED_TIME_SCALE,
        max_model_len=max(need, 131072),
        extra_args=args.serve_args or (),
    )
    console.print(f"[dim]starting the embedded server: agentkv {' '.join(srv.argv[3:])}[/dim]")
    stack.enter_context(srv)
    notes.append(
        f"target: the embedded server ({srv.description.removeprefix('agentkv serve: ')}), "
        f"started as: agentkv {' '.join(srv.argv[3:])}"
    )
    if need > 131072:
        notes.append(
            f"embedded server's max_model_len raised from the model's 131072 to {need} so that "
            "every trace request fits (as agentkv simulate does)"
        )
    return srv.url


def _write_outputs(args: argparse.Namespace, result, out: Path, itl_values=None, show: bool = True) -> None:
    """summary.json, records.csv, vllm_result.json and report.html into `out` (the latency
    percentiles recomputed when --percentiles asks for others), then the summary on the terminal
    (or as JSON) unless `show` is False (a sweep point)."""
    import msgspec
    from rich.console import Console

    from agentkv.bench.agents import bench_interactivity
    from agentkv.metrics.dist import DEFAULT_PERCENTILES
    from agentkv.metrics.export import write_outputs
    from agentkv.metrics.summary import with_percentiles
    from agentkv.metrics.view import print_summary, sessions_table
    from agentkv.terminal import show as show_table

    result.summary.config["selection"] = selection_of(args)
    pcts = getattr(args, "percentiles", None) or DEFAULT_PERCENTILES
    if tuple(pcts) != DEFAULT_PERCENTILES:
        result.summary = with_percentiles(result.summary, result.records, itl_values, pcts)
    result.summary.interactivity = bench_interactivity(result.summary, result.records, args)
    written = write_outputs(
        out, result.summary, result.records, report=not args.no_report, itl_values=itl_values
    )
    if not show:
        return
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result.summary), indent=2).decode() + "\n")
    else:
        con = Console()
        print_summary(result.summary, con)
        if result.summary.sessions:
            show_table(con, sessions_table(result.summary))
        con.print(f"[dim]wrote {', '.join(['requests.jsonl', *written])} to {out}[/dim]")


def compare_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv compare`."""
    from agentkv.bench.compare import compare_runs

    return compare_runs(args)
