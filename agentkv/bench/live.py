"""The bench's live terminal panel, and the event loop it runs on (uvloop when there, stoppable
by the first SIGINT/SIGTERM so the summary is still written)."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from agentkv.bench.runner import BenchRun
from agentkv.errors import UserError


def progress_panel(run: BenchRun) -> Group:
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
    shards = getattr(run, "shards", ())
    if len(shards) > 1:
        rows.append(shard_table(shards, wall * run.scale))
    rows += [Text(x) for x in load_lines(cfg, s.released, run.plan.arrivals, wall)]
    if s.errors:
        rows.append(
            Text("errors: " + ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())), style="red")
        )
    return Group(*rows)


def shard_table(shards, span: float) -> Table:
    """A line per client shard under the totals (`span`: target seconds so far): where it runs,
    requests done and failed, output tok/s, in flight, and how it ended once it has."""
    t = Table(box=None, padding=(0, 2), pad_edge=False, header_style="dim")
    for name in ("shard", "runs as", "done", "failed", "output tok/s", "in flight", "state"):
        t.add_column(name, justify="left" if name in ("runs as", "state") else "right")
    for s in shards:
        t.add_row(
            str(s.index),
            getattr(s.link, "where", ""),
            f"{s.records:,}",
            Text(f"{s.failed:,}", style="red" if s.failed else ""),
            f"{s.output_tokens / max(span, 1e-9):,.0f}",
            f"{s.in_flight:,}",
            Text(s.ended or "running", style="red" if s.ended in ("died", "error") else ""),
        )
    return t


def load_lines(cfg, released: int, arrivals, wall: float) -> list[str]:
    """The panel's load lines: open-loop arrivals (trees arrived, waiting for a lane slot) with
    --session-rate, and the warm-up's state with --warmup."""
    out = []
    if arrivals is not None:
        cap = f"at most {arrivals.cap} at once" if arrivals.cap else "no cap"
        out.append(
            f"arrivals: {arrivals.arrived:,} session trees arrived ({arrivals.kind}, "
            f"--session-rate {cfg.session_rate:g}/s, {cap}), {arrivals.backlog:,} waiting for a lane"
        )
    if cfg.warmup_requests:
        n = cfg.warmup_requests
        if released < n:
            out.append(f"warming up: {released:,} of {n:,} requests sent (left out of every statistic)")
        else:
            out.append(f"warm-up done: the first {n:,} requests are left out of every statistic")
    elif cfg.warmup_s:
        if wall < cfg.warmup_s:
            out.append(f"warming up: {wall:,.0f}s of {cfg.warmup_s:g}s (left out of every statistic)")
        else:
            out.append(f"warm-up done: requests due in the first {cfg.warmup_s:g}s are left out")
    return out


def loop_factory(loop: str):
    """uvloop's loop factory when asked (or when `auto` and it is installed), else None: asyncio's."""
    if loop in ("auto", "uvloop"):
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            if loop == "uvloop":
                raise UserError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    return None


def run_loop(coro, loop: str):
    """Run `coro` on uvloop when asked (or when `auto` and it is installed), else asyncio's loop."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
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
