"""One client shard of `agentkv bench --clients N`: a spawned process running the ordinary BenchRun on
its share of the session trees, streaming each finished record to the driver over a pipe.

Protocol (driver -> shard, shard -> driver), all over one multiprocessing Connection:
  "ping" -> ("clock", perf_counter, time)   repeated: the driver's clock-offset round trips
  "go"   -> ("start", t0)                    the shard's run start, on its own perf_counter
            ("rec", bytes)                   one finished request (encode_record), at once
            ("tick", in_flight, released, arrivals)  every sample period, for the live total
            ("done", itl bytes, interrupted, crash, arrivals)
            arrivals: (arrived, delayed, delay_total, waiting) with --session-rate, else None
            or ("error", message) for bad input
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from agentkv.bench.client import StreamResult
from agentkv.bench.prompts import PromptBuilder
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, encode_record
from agentkv.trace.model import Trace


class ShardRun(BenchRun):
    """A BenchRun whose records go to the driver as they finish (it writes no files itself)."""

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
            conn.send(("clock", time.perf_counter(), time.time()))
        result = run_loop(run.run(), loop)
        conn.send(("done", run.itl.tobytes(), result.interrupted, run.crash, arrived(run.plan.arrivals)))
    except UserError as e:
        conn.send(("error", str(e)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the driver went away: nothing to tell
        pass
    finally:
        conn.close()
