"""`agentkv bench --clients N [--ray ADDRESS]`: N client shards (local processes, or Ray actors), each
replaying whole session trees.

The driver splits the traces (largest first, each to the shard with the fewest requests so far: a
session tree never spans two shards) and the load (lanes, session rate, request and warm-up
counts) over the shards, measures each shard's clock offset by round trips (the NTP midpoint of
the best of several, as AIPerf records one per worker), then moves every record a shard streams
back onto its own timeline, writes it to requests.jsonl at once, and builds the one summary
through BenchRun's own path. A shard that dies is reported; its finished records are kept. The
transport (a pipe to a process, or Ray actor calls) is a link: agentkv.bench.shard_worker.ProcessLink,
agentkv.bench.ray_shards.RayLink; everything else is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

from agentkv.bench.runner import BenchConfig, BenchResult, BenchRun
from agentkv.bench.shard_worker import STOP_GRACE_S, ProcessLink
from agentkv.errors import UserError
from agentkv.metrics.records import decode_record
from agentkv.trace.model import Trace

PINGS = 8  # clock round trips per shard; the one with the shortest RTT sets the offset


def _share(total: int, n: int, i: int) -> int:
    """Shard i's part of `total` split as evenly as integers allow."""
    return total // n + (1 if i < total % n else 0)


def clamp_clients(n: int, traces: Sequence[Trace], cfg: BenchConfig) -> tuple[int, list[str]]:
    """The shard count a run can use: at most one per session tree (and per lane); notes say why."""
    if n < 1:
        raise UserError(f"--clients must be >= 1, got {n}")
    notes, most = [], len(traces)
    if cfg.lanes is not None and cfg.session_rate is None:
        most = min(most, cfg.lanes)
    if cfg.max_requests is not None:
        most = min(most, cfg.max_requests)
    if n > most:
        notes.append(
            f"--clients {n} lowered to {most}: a shard needs a whole session tree and a lane of its own "
            f"({len(traces)} traces, --lanes {cfg.lanes}"
            + (f", --max-requests {cfg.max_requests})" if cfg.max_requests is not None else ")")
        )
        n = most
    return n, notes


def split(cfg: BenchConfig, traces: Sequence[Trace], n: int) -> list[tuple[BenchConfig, list[Trace]]]:
    """Each shard's config and traces: whole traces, balanced by request count, load divided."""
    parts: list[list[Trace]] = [[] for _ in range(n)]
    size = [0] * n
    for k, t in sorted(((t.num_requests, t) for t in traces), key=lambda x: (-x[0], x[1].id)):
        i = min(range(n), key=lambda j: (size[j], j))
        parts[i].append(t)
        size[i] += k
    out = []
    for i, part in enumerate(parts):
        c = dataclasses.replace(
            cfg,
            lanes=None if cfg.lanes is None else max(1, _share(cfg.lanes, n, i)),
            session_rate=None if cfg.session_rate is None else cfg.session_rate / n,
            max_requests=None if cfg.max_requests is None else _share(cfg.max_requests, n, i),
            warmup_requests=_share(cfg.warmup_requests, n, i),
            seed=cfg.seed + i,
            monitor_gpu=False,  # the driver watches the GPU, once
        )
        out.append((c, sorted(part, key=lambda t: t.id)))
    return out


@dataclasses.dataclass(slots=True)
class Shard:
    """The driver's view of one shard; `link` is its transport (a process's pipe, a Ray actor)."""

    index: int
    link: object
    lanes: int | None
    traces: int
    offset: float = 0.0  # shard perf_counter minus the driver's, at the same instant
    wall_offset: float = 0.0
    rtt: float = 0.0
    shift: float | None = None  # added to the shard's record times (target seconds)
    records: int = 0
    failed: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    released: int = 0
    ended: str = ""  # done | error | died
    detail: str = ""
    itl: bytes = b""
    arrived: tuple | None = None  # open loop: (trees arrived, delayed by the cap, total delay, waiting)


class _Flight:
    """Stands in for the driver's plan where BenchRun reads it: the shards' total in flight and,
    open loop, their session arrivals summed (a dead shard's are missing)."""

    def __init__(self, shards: list[Shard], plan):
        self.shards, self.traces, self._arrivals = shards, plan.traces, plan.arrivals

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.shards)

    @property
    def arrivals(self):
        a = self._arrivals
        if a is None:
            return None
        got = [s.arrived for s in self.shards if s.arrived is not None]
        a.arrived, a.delayed = sum(x[0] for x in got), sum(x[1] for x in got)
        a.delay_total = sum(x[2] for x in got)
        a.backlog = sum(x[3] for x in got)
        return a


class ShardedRun:
    """`await run()` replays `traces` with `n` client shards and returns one BenchResult: local
    processes, or with `ray` (an address, or "local") Ray actors on that cluster. `announce`: a
    line per shard on stderr as it starts (off in a sweep's points, which have their own progress)."""

    def __init__(
        self,
        cfg: BenchConfig,
        traces: Sequence[Trace],
        n: int,
        out: Path | None,
        notes=(),
        loop="auto",
        ray: str | None = None,
        announce: bool = True,
    ):
        n, clamp = clamp_clients(n, traces, cfg)
        self.base = BenchRun(cfg, traces, out=out, notes=[*notes, *clamp])
        self.cfg, self.n, self.loop, self.ray, self.on_tick = cfg, n, loop, ray, None
        self.announce = announce
        self.parts = split(cfg, traces, n)
        self.shards: list[Shard] = []
        self.transport = None  # RayShards with --ray
        self.crash = ""

    # the live panel reads these as it does a BenchRun's, and `shards` below the totals
    @property
    def itl(self) -> array:
        return self.base.itl

    @property
    def stats(self):
        return self.base.stats

    @property
    def scale(self) -> float:
        return self.base.scale

    @property
    def plan(self):
        return self.base.plan

    def _start(self) -> None:
        """Every shard started (each kept as it starts, so that _stop ends it whatever fails next)."""
        marker, parts, links = self.base.prompts.marker, self.parts, None
        if self.ray is not None:
            from agentkv.bench.ray_shards import RayShards

            self.transport = RayShards(self.ray)
            links = iter(self.transport.start(parts, marker, self.loop, self.cfg.target))
        for i, (c, part) in enumerate(parts):
            link = ProcessLink(i, c, part, marker, self.loop) if links is None else next(links)
            self.shards.append(Shard(i, link, c.lanes, len(part)))

    def _measure_clock(self, s: Shard) -> None:
        """Round trips: offset = shard time - midpoint of send and receive, from the fastest one."""
        best = None
        for k in range(PINGS + 1):
            t1 = time.perf_counter()
            msg = s.link.ping()
            t2 = time.perf_counter()
            w = time.time()
            if msg[0] != "clock":
                raise UserError(
                    f"client shard {s.index}: {msg[1]}" if msg[0] == "error" else f"shard {s.index}: {msg}"
                )
            if k and (best is None or t2 - t1 < best[0]):  # the first waited for the shard's start-up
                best = (t2 - t1, msg[1] - (t1 + t2) / 2, msg[2] - (w - (t2 - t1) / 2))
        s.rtt, s.offset, s.wall_offset = best

    def _reader(self, s: Shard, loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
        """Thread: each message from shard `s` onto the event loop; the end when its link closes."""
        for msg in s.link.messages():
            loop.call_soon_threadsafe(self._on_msg, s, msg)
        loop.call_soon_threadsafe(done.set)

    def _on_msg(self, s: Shard, msg: tuple) -> None:
        kind = msg[0]
        if kind == "rec":
            r = decode_record(msg[1])
            d = s.shift or 0.0
            r.scheduled += d
            r.sent += d
            r.end += d
            if r.first_token is not None:
                r.first_token += d
            r.id = r.id * self.n + s.index  # unique across shards
            r.lane = sum(x.lanes or 0 for x in self.shards[: s.index]) + r.lane if r.lane >= 0 else r.lane
            s.records += 1
            s.failed += not r.ok
            s.output_tokens += r.output_tokens
            self.base._finish(r, None)
        elif kind == "tick":
            s.in_flight, s.released, s.arrived = msg[1], msg[2], msg[3]
            self._totals()
        elif kind == "start":
            s.shift = (msg[1] - s.offset - self.base._t0) * self.base.scale
        elif kind == "done":
            s.ended, s.itl, interrupted, crash, s.arrived = "done", *msg[1:5]
            s.detail = crash or ("interrupted" if interrupted else "")
        elif kind == "error":
            s.ended, s.detail = "error", msg[1]
        if kind in ("done", "error"):
            s.in_flight = 0
            self._totals()

    def _totals(self) -> None:
        """The live totals: requests released and in flight, summed over the shards."""
        self.base.stats.released = sum(x.released for x in self.shards)
        self.base.stats.in_flight = sum(x.in_flight for x in self.shards)

    async def run(self) -> BenchResult:
        b = self.base
        if self.on_tick is not None:
            b.on_tick = lambda _: self.on_tick(self)
        try:
            self._start()
            for s in self.shards:
                await asyncio.to_thread(self._measure_clock, s)
                if not self.announce:
                    continue
                print(
                    f"client shard {s.index}: {s.link.where}, {s.traces} session trees, clock offset "
                    f"{s.offset * 1e6:+,.0f} us (RTT {s.rtt * 1e6:,.0f} us)",
                    file=sys.stderr,
                    flush=True,
                )
            async with b._client() as client:
                scraper, gpu, before = await b._open(client)
                result = await self._drive(client, scraper, gpu, before)
        finally:
            self._stop()
        return result

    async def _drive(self, client, scraper, gpu, before) -> BenchResult:
        b, loop = self.base, asyncio.get_running_loop()
        ends = [asyncio.Event() for _ in self.shards]
        b.plan = _Flight(self.shards, b.plan)
        interrupted, sampler = False, None
        try:
            b._t0, b.stats.started = b.clock(), time.time()
            for s, e in zip(self.shards, ends, strict=True):
                s.link.go()
                threading.Thread(target=self._reader, args=(s, loop, e), daemon=True).start()
            await b._sample(before, gpu)
            sampler = asyncio.create_task(b._sample_loop(scraper, gpu))
            await asyncio.gather(*(e.wait() for e in ends))
        except asyncio.CancelledError:  # Ctrl-C: the shards stop too and send what finished
            interrupted = True
            self._stop_shards()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ends)), STOP_GRACE_S)
        finally:
            await b._wind_down(sampler)
        return await self._result(client, scraper, gpu, before, interrupted)

    async def _result(self, client, scraper, gpu, before, interrupted: bool) -> BenchResult:
        b = self.base
        for s in self.shards:
            if not s.ended:
                s.ended, s.detail = "died", s.link.gone()
            b.itl.frombytes(s.itl)
        errors = [f"client shard {s.index}: {s.detail}" for s in self.shards if s.ended == "error"]
        if errors and not b.records:
            raise UserError(errors[0])
        after = None if interrupted else await scraper.scrape()
        if not interrupted:
            await b._sample(after, gpu)
        summary = b._summary(before, after or before if not interrupted else None, scraper, gpu, client.base)
        if gpu is not None:
            gpu.close()
        self._report(summary, interrupted)
        return BenchResult(b.records, summary, interrupted)

    def _report(self, summary, interrupted: bool) -> None:
        """Per-shard clock offsets and where each ran in the config; notes for the split and each
        shard that failed."""
        summary.config["clients"] = [
            {
                "shard": s.index,
                "transport": "ray" if self.ray is not None else "process",
                "node": s.link.node,
                "pid": s.link.pid,
                "traces": s.traces,
                "lanes": s.lanes,
                "records": s.records,
                "clock_offset_s": s.offset,
                "wall_clock_offset_s": s.wall_offset,
                "clock_rtt_s": s.rtt,
                "ended": s.ended,
            }
            for s in self.shards
        ]
        nodes = len({s.link.node for s in self.shards})
        how = f"{self.n} client processes" if self.ray is None else f"{self.n} Ray actors on {nodes} node(s)"
        summary.notes.append(
            f"load generation: {how}, whole session trees each "
            f"(traces {', '.join(str(s.traces) for s in self.shards)}); clock offsets "
            f"{', '.join(f'{s.offset * 1e6:+.0f}' for s in self.shards)} us, RTT up to "
            f"{max(s.rtt for s in self.shards) * 1e6:.0f} us, every timestamp corrected"
        )
        for s in self.shards:
            if s.ended in ("died", "error") or (s.detail and s.detail != "interrupted"):
                why = (
                    f"client shard {s.index} ({s.link.where}) {'died' if s.ended == 'died' else 'failed'} "
                    f"({s.detail}): its {s.records} finished requests are kept, the rest of its "
                    f"{s.traces} session trees was not replayed"
                    + (" (its inter-token gaps, sent at its end, are not in ITL)" if not s.itl else "")
                )
                summary.notes.append(why)
                summary.invalid_reasons.append(why)
                summary.valid, summary.invalid_reason = False, "; ".join(summary.invalid_reasons)
                if s.ended != "died" and not interrupted:
                    self.crash = self.crash or f"client shard {s.index}: {s.detail}"

    def _stop_shards(self) -> None:
        """Every shard still running stops as a one-process run does (and sends what finished)."""
        for s in self.shards:
            if not s.ended:
                s.link.stop()

    def _stop(self) -> None:
        """Every shard ends: stopped, then closed (killed when it does not end in STOP_GRACE_S);
        with Ray, the driver leaves the cluster."""
        self._stop_shards()
        try:
            for s in self.shards:
                s.link.close()
        finally:
            if self.transport is not None:
                self.transport.close()
