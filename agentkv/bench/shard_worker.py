"""One client shard of `agentkv bench --clients N`: the ordinary BenchRun on its share of the session
trees, streaming each finished record to the driver; here as a spawned process over a pipe (both
ends: `shard_main` in the shard, `ProcessLink` in the driver). `agentkv.bench.ray_shards` runs the
same ShardRun in a Ray actor and speaks the same messages.

Protocol (driver -> shard, shard -> driver):
  "ping" -> ("clock", perf_counter, time)   repeated: the driver's clock-offset round trips
  "go"   -> ("start", t0)                    the shard's run start, on its own perf_counter
            ("rec", bytes)                   one finished request (encode_record), at once
            ("tick", in_flight, released, arrivals)  every sample period, for the live total
            ("done", itl bytes, interrupted, crash, arrivals)
            arrivals: (arrived, delayed, delay_total, waiting) with --session-rate, else None
            or ("error", message) for bad input
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence

from agentkv.bench.client import StreamResult
from agentkv.bench.prompts import PromptBuilder
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, encode_record
from agentkv.trace.model import Trace

STOP_GRACE_S = 10.0
ENDS = ("done", "error")  # the last message of a shard


class ShardRun(BenchRun):
    """A BenchRun whose records go to the driver as they finish (it writes no files itself).
    `conn` needs only `send(message)`: a pipe's end, or a Ray actor's outbox."""

    def __init__(self, cfg: BenchConfig, traces: Sequence[Trace], conn, marker: str | None):
        super().__init__(cfg, traces, out=None, on_tick=self._tick)
        c = cfg
        # the driver's cache-bust marker: one run, one marker, whichever shard sends the prompt
        self.prompts = PromptBuilder(
            c.prompt_mode,
            c.tokenizer,
            tenant_salts=c.tenant_salts,
            cache_bust=c.cache_bust,
            bust_marker=marker,
        )
        self.conn = conn
        self._started = False

    def _tick(self, run: BenchRun) -> None:
        if not self._started:  # the first sample follows the run's start: the driver needs t0 first
            self._started = True
            self.conn.send(("start", self._t0))
        self.conn.send(("tick", self.plan.in_flight, self.stats.released, arrived(self.plan.arrivals)))

    def _finish(self, rec: RequestRecord, res: StreamResult) -> None:
        super()._finish(rec, res)
        self.conn.send(("rec", encode_record(rec)))


def arrived(a) -> tuple | None:
    """An open-loop shard's arrivals for the driver: (arrived, delayed, delay_total, backlog)."""
    return None if a is None else (a.arrived, a.delayed, a.delay_total, a.backlog)


def clock_reply() -> tuple:
    """The answer to a clock ping: this shard's monotonic and wall clocks, now."""
    return ("clock", time.perf_counter(), time.time())


def play(run: ShardRun, runner: Callable) -> None:
    """Run the shard to its end (`runner(coroutine)` runs it on an event loop) and send how it ended:
    stopped before its run began counts as interrupted, an unexpected error as an error, named."""
    interrupted = True
    try:
        interrupted = runner(run.run()).interrupted
    except UserError as e:
        return run.conn.send(("error", str(e)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        pass
    except Exception as e:  # a bug: the driver names it (a Ray actor has no terminal of its own)
        return run.conn.send(("error", f"{type(e).__name__}: {e}"))
    run.conn.send(("done", run.itl.tobytes(), interrupted, run.crash, arrived(run.plan.arrivals)))


def shard_main(conn, cfg: BenchConfig, traces: list[Trace], marker: str | None, loop: str) -> None:
    """The shard process: answer clock pings, run on "go", report how it ended."""
    from agentkv.bench.live import run_loop

    if hasattr(os, "setpgrp"):  # a terminal's Ctrl-C reaches the driver alone; it stops the shards
        os.setpgrp()
    try:
        run = ShardRun(cfg, traces, conn, marker)
        while (msg := conn.recv()) != "go":
            if msg == "stop":
                return
            conn.send(clock_reply())
        play(run, lambda coro: run_loop(coro, loop))
    except UserError as e:
        conn.send(("error", str(e)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the driver went away: nothing to tell
        pass
    finally:
        conn.close()


class ProcessLink:
    """The driver's end of one shard process (spawned, not forked): its pipe and its pid.

    Every shard transport offers these: `pid`, `node`, `where`, `ping()`, `go()`, `messages()`,
    `gone()`, `stop()`, `close()` (see RayLink in agentkv.bench.ray_shards)."""

    def __init__(self, index: int, cfg: BenchConfig, traces: list[Trace], marker: str | None, loop: str):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=shard_main, args=(theirs, cfg, traces, marker, loop), name=f"agentkv-shard-{index}"
        )
        self.proc.daemon = True
        self.proc.start()
        theirs.close()
        self.index, self.pid, self.node = index, self.proc.pid, socket.gethostname()
        self.where = f"pid {self.pid}"

    def ping(self) -> tuple:
        """One clock round trip's answer: ("clock", perf_counter, time) or ("error", message)."""
        try:
            self.conn.send("ping")
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(STOP_GRACE_S)
            raise UserError(
                f"client shard {self.index} (pid {self.pid}) exited before its run started "
                f"(exit status {self.proc.exitcode}; its error is above)"
            ) from None

    def go(self) -> None:
        self.conn.send("go")

    def messages(self) -> Iterator[tuple]:
        """The shard's messages as they come, up to its last (or until its pipe closes)."""
        try:
            while True:
                msg = self.conn.recv()
                yield msg
                if msg[0] in ENDS:
                    return
        except (EOFError, OSError):
            return

    def gone(self) -> str:
        """Why a shard that sent no last message ended (after it exits)."""
        self.proc.join(STOP_GRACE_S)
        return f"exit status {self.proc.exitcode}"

    def stop(self) -> None:
        """SIGTERM by pid: the shard stops as a one-process run does and sends what finished."""
        if self.proc.is_alive() and self.pid:
            os.kill(self.pid, signal.SIGTERM)

    def close(self) -> None:
        """The process ends: SIGKILL by pid when it has not in STOP_GRACE_S after stop()."""
        self.proc.join(STOP_GRACE_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
