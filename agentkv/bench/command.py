"""`agentkv bench`: flags -> BenchConfig, the embedded server when no --target, live progress, outputs.

Outputs in --out: requests.jsonl (appended as requests finish), summary.json (the schema
`agentkv simulate` writes) and report.html. The summary is written even after Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agentkv.bench.args import DEFAULT_EMBEDDED_TIME_SCALE
from agentkv.bench.runner import BenchConfig, BenchResult, BenchRun
from agentkv.errors import UserError
from agentkv.metrics.summary import parse_slo, write_summary
from agentkv.metrics.view import print_summary, sessions_table
from agentkv.units import parse_duration


def _duration(text: str | None, flag: str) -> float | None:
    if text is None or str(text).lower() in ("none", "off", "0"):
        return None
    v = parse_duration(text, flag)
    if v <= 0:
        raise UserError(f"{flag} must be > 0, got {text!r}")
    return v


def config_from_args(args: argparse.Namespace, target: str) -> BenchConfig:
    if args.lanes < 1:
        raise UserError(f"--lanes must be >= 1, got {args.lanes}")
    if args.max_requests is not None and args.max_requests < 1:
        raise UserError(f"--max-requests must be >= 1, got {args.max_requests}")
    prompt_mode = args.prompt_mode or ("text" if args.api == "chat" else "token-ids")
    scale = (
        args.time_scale
        if args.time_scale is not None
        else (1.0 if args.target else DEFAULT_EMBEDDED_TIME_SCALE)
    )
    return BenchConfig(
        target=target,
        lanes=args.lanes,
        duration=_duration(args.duration, "--duration"),
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
        timeout=parse_duration(args.timeout, "--timeout"),
        sample_every=parse_duration(args.sample_every, "--sample-every"),
        max_connections=args.max_connections,
        time_scale=scale,
    )


def _progress(run: BenchRun) -> Group:
    """The live panel: progress counters, throughput so far and the recent TTFT."""
    s, cfg = run.stats, run.cfg
    wall = time.time() - s.started if s.started else 0.0
    t = Table.grid(padding=(0, 2))
    for _ in range(4):
        t.add_column()
    ttft = np.median(s.recent_ttft) * 1000 if s.recent_ttft else None
    hit = s.cached_tokens / s.input_tokens if s.input_tokens else None
    left = f" / {cfg.duration:.0f}s" if cfg.duration else ""
    t.add_row("elapsed", f"{wall:,.0f}s{left}", "released", f"{s.released:,}")
    t.add_row("finished", f"{s.finished:,} ({s.failed:,} failed)", "in flight", f"{s.in_flight:,}")
    t.add_row(
        "output tok/s",
        f"{s.output_tokens / max(wall * run.scale, 1e-9):,.0f}",
        "TTFT p50 (recent)",
        "-" if ttft is None else f"{ttft:,.0f} ms",
    )
    t.add_row(
        "cache hit (reported)",
        "-" if hit is None else f"{hit:.1%}",
        "KV usage",
        "-" if s.kv_usage is None else f"{s.kv_usage:.1%}",
    )
    stopping = cfg.duration is not None and wall >= cfg.duration
    scale = f"  (time scale {run.scale:g}: rates and latencies in target seconds)" if run.scale != 1 else ""
    head = Text(
        f"agentkv bench -> {cfg.target}{scale}"
        + ("  (stopping: waiting for in-flight requests)" if stopping else ""),
        style="bold",
    )
    rows = [head, t]
    if s.errors:
        rows.append(
            Text("errors: " + ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())), style="red")
        )
    return Group(*rows)


def _run_loop(coro, loop: str):
    """Run `coro` on uvloop when asked (or when `auto` and it is installed), else asyncio's loop."""
    factory = None
    if loop in ("auto", "uvloop"):
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            if loop == "uvloop":
                raise UserError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_stoppable(coro))


async def _stoppable(coro):
    """Run `coro`; the first SIGINT or SIGTERM cancels it (the run keeps what finished and writes
    its summary), a second stops at once. Installed on the loop itself, so it works under uvloop
    and when the shell started us with SIGINT ignored (a background job: `agentkv bench ... &`)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    signals = (signal.SIGINT, signal.SIGTERM)
    hits = 0

    def on_signal() -> None:
        nonlocal hits
        hits += 1
        if hits > 1:
            raise KeyboardInterrupt
        task.cancel()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    try:
        return await coro
    except asyncio.CancelledError:
        if hits:  # stopped before the run could catch it (still connecting): a plain interrupt
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _load(args: argparse.Namespace):
    from agentkv.trace.formats import bundled_sample, load_paths

    return load_paths(args.paths or bundled_sample(), args.format)


def bench_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv bench`."""
    from agentkv.bench.embedded import EmbeddedServer, needed_model_len

    traces = _load(args)
    out = Path(args.out or f"out/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    console = Console(stderr=True)
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        if args.target:
            target = args.target
        else:
            need = needed_model_len(traces)
            srv = EmbeddedServer(
                time_scale=args.time_scale or DEFAULT_EMBEDDED_TIME_SCALE,
                max_model_len=max(need, 131072),
                extra_args=args.serve_args or (),
            )
            console.print(f"[dim]starting the embedded server: agentkv {' '.join(srv.argv[3:])}[/dim]")
            stack.enter_context(srv)
            target = srv.url
            notes.append(
                f"target: the embedded server ({srv.description.removeprefix('agentkv serve: ')}), "
                f"started as: agentkv {' '.join(srv.argv[3:])}"
            )
            if need > 131072:
                notes.append(
                    f"embedded server's max_model_len raised from the model's 131072 to {need} so that "
                    "every trace request fits (as agentkv simulate does)"
                )
        cfg = config_from_args(args, target)
        run = BenchRun(cfg, traces, out=out, notes=notes)
        live = None
        if not args.quiet and console.is_terminal:
            live = Live(_progress(run), console=console, auto_refresh=False, transient=True)
            run.on_tick = lambda r: live.update(_progress(r), refresh=True)
            stack.enter_context(live)
        result: BenchResult = _run_loop(run.run(), args.loop)
    write_summary(result.summary, out / "summary.json")
    if not args.no_report:
        from agentkv.bench.report import write_report

        write_report(result.summary, result.records, out / "report.html")
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result.summary), indent=2).decode() + "\n")
    else:
        con = Console()
        print_summary(result.summary, con)
        if result.summary.sessions:
            con.print(sessions_table(result.summary))
        files = "requests.jsonl, summary.json" + ("" if args.no_report else ", report.html")
        con.print(f"[dim]wrote {files} to {out}[/dim]")
    if run.crash:
        console.print(f"agentkv: error: the run stopped early: {run.crash} (outputs written)", markup=False)
        return 1
    return 130 if result.interrupted else 0
