"""Drive the shared replay plan in real time against one target, on one asyncio event loop.

The loop sleeps until the plan's next due time (or until a request ends, which may arm the next
turn sooner), sends what `pop_due` releases, and reports each end with `complete`. Latencies count
from the plan's due time (no coordinated omission). Each end is flushed to requests.jsonl at once.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentkv.bench import load
from agentkv.bench.client import BenchClient, StreamResult
from agentkv.bench.clocks import Latency, catchup_note, clocks_of, engine_stamp
from agentkv.bench.gpu import GpuMonitor
from agentkv.bench.hints import add_hints
from agentkv.bench.prompts import PromptBuilder, send_item
from agentkv.bench.request_opts import RequestOptions
from agentkv.bench.scrape import MetricsSnapshot, Scraper, hit_rate
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, encode_record, record_for
from agentkv.metrics.summary import Sample, Summary, summarize
from agentkv.metrics.validity import DEFAULT_MAX_FAILURE_RATE
from agentkv.trace.ceiling import CeilingTracker
from agentkv.trace.model import Trace
from agentkv.trace.plan import Dispatch
from agentkv.trace.realtime import drive
from agentkv.trace.warmup import is_warmup, measured


@dataclass(slots=True)
class BenchConfig(load.LoadConfig):
    """One measured run: the target, the load (bench/load.py), replay settings and request options."""

    target: str
    duration: float | None = 60.0  # stop releasing after this many seconds (None: run the traces out)
    max_requests: int | None = None
    api: str = "completions"
    prompt_mode: str = "token-ids"
    tokenizer: str | None = None
    model: str | None = None  # None: the target's first served model
    slo: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    warm_start: bool = False
    idle_gap_cap: float | None = 10.0
    tenant_salts: bool = False
    cache_bust: bool = True  # a per-run marker in every prompt: nothing cached by an earlier run is reused
    max_failure_rate: float = DEFAULT_MAX_FAILURE_RATE  # above it the run is invalid
    timeout: float = 300.0  # per request, first byte to last
    sample_every: float = 1.0
    max_connections: int = 0  # 0: one per concurrent request (sub-agent bursts included)
    time_scale: float = 1.0  # target seconds per wall second (agentkv serve --time-scale); see below
    clock: str = "auto"  # latencies: "auto" (the target's engine clock when it sends one) or "client"
    monitor_gpu: bool = True
    requests: RequestOptions | None = None  # --header, --extra-body, the key (None: the environment's)
    cycle: str | None = None  # repeat the trace set: "fresh" (no hits across cycles) or "shared"
    transport: str = "http1"  # streaming client: http1 (agentkv's) or aiohttp (benchmarks/client_overhead.py)


class BenchSettings(load.LoadSettings, kw_only=True):
    """What summary.json's `config` records of a bench run (the settings that shaped it)."""

    seed: int
    warm_start: bool
    idle_gap_cap: float | None
    max_requests: int | None
    duration: float | None
    api: str
    prompt_mode: str
    prompts: str
    tokenizer: str | None
    model: str | None
    slo: dict[str, float]
    tenant_salts: bool
    cache_bust: str | None
    max_failure_rate: float
    timeout: float
    time_scale: float
    clock: str
    server: dict | None
    traces: list[str]
    requests: dict | None = None  # RequestOptions.settings(): credentials redacted
    cycle: str | None = None


@dataclass(slots=True)
class LiveStats:
    """Counters the progress display reads while the run goes on."""

    started: float = 0.0
    released: int = 0
    finished: int = 0
    failed: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    recent_ttft: deque = field(default_factory=lambda: deque(maxlen=200))
    kv_usage: float | None = None


class BenchResult:
    def __init__(self, records: list[RequestRecord], summary: Summary, interrupted: bool):
        self.records, self.summary, self.interrupted = records, summary, interrupted


class BenchRun:
    """One run: `await run()` replays `traces` against `cfg.target` and returns records and summary."""

    def __init__(
        self,
        cfg: BenchConfig,
        traces: Sequence[Trace],
        out: Path | None = None,
        on_tick: Callable[[BenchRun], None] | None = None,
        notes: Sequence[str] = (),
        clock: Callable[[], float] = time.perf_counter,
    ):
        if cfg.api == "chat" and cfg.prompt_mode == "token-ids":
            raise UserError(
                "--api chat sends text: use --prompt-mode text (token ids need --api completions)"
            )
        self.cfg, self.traces, self.out, self.on_tick, self.clock = cfg, list(traces), out, on_tick, clock
        if not cfg.time_scale > 0:
            raise UserError(f"--time-scale must be > 0, got {cfg.time_scale}")
        # a target running X times faster than real time gets gaps X times shorter; every time we
        # report is then multiplied by X, so results read in the target's own seconds
        self.scale = cfg.time_scale
        self.plan = load.build_plan(cfg, self.traces, cfg.time_scale)
        self.prompts = PromptBuilder(
            cfg.prompt_mode, cfg.tokenizer, tenant_salts=cfg.tenant_salts, cache_bust=cfg.cache_bust
        )
        self.ceiling = CeilingTracker()
        self.stats = LiveStats()
        self.records: list[RequestRecord] = []
        self.timeline: list[Sample] = []
        self.itl = array("d")
        self.notes = list(notes)
        self.model = cfg.model or ""
        self.server_info: dict | None = None
        self.crash = ""  # why the run stopped early, when a bug (not Ctrl-C) stopped it
        self._t0 = 0.0
        self._tasks: set[asyncio.Task] = set()
        self._file = None

    # ---- the run ------------------------------------------------------------------------------
    def _client(self) -> BenchClient:
        """The run's streaming client, with --header, --extra-body and the key (else the environment's)."""
        c, opts = self.cfg, self.cfg.requests.client_args() if self.cfg.requests else {}
        return BenchClient(
            c.target,
            api=c.api,
            timeout=c.timeout,
            max_connections=c.max_connections,
            clock=self.clock,
            transport=c.transport,
            **opts,
        )

    async def run(self) -> BenchResult:
        cfg, interrupted, dropped = self.cfg, False, 0
        async with self._client() as client:
            scraper, gpu, before = await self._open(client)
            last, sampler = before, None
            try:
                self._t0, self.stats.started = self.clock(), time.time()
                await self._sample(before, gpu)
                sampler = asyncio.create_task(self._sample_loop(scraper, gpu))
                await drive(self.plan, lambda d: self._one(client, d), clock=self._now, until=cfg.duration)
            except (asyncio.CancelledError, Exception) as e:  # Ctrl-C or a bug: keep what finished
                interrupted, dropped = True, len(self._tasks)
                if not isinstance(e, asyncio.CancelledError):
                    self.crash = f"{type(e).__name__}: {e}"
                self.plan.stop()
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                await self._wind_down(sampler)
            if not interrupted:
                after = await scraper.scrape()
                last = after or last
                await self._sample(after, gpu)
            summary = self._summary(before, last if not interrupted else None, scraper, gpu, client.base)
            if interrupted:
                why = f"stopped by an internal error ({self.crash})" if self.crash else "interrupted"
                summary.notes.append(
                    f"{why}: {dropped} in-flight requests dropped (everything that finished is recorded)"
                )
            if gpu is not None:
                gpu.close()
        return BenchResult(self.records, summary, interrupted)

    async def _open(self, client: BenchClient):
        """The model, the target's self-description, metrics before, requests.jsonl opened."""
        served = await client.models()
        if not self.model and not served:
            raise UserError(f"target {client.base} serves no model; pass --model")
        self.model = self.model or served[0]
        info = await client.get_json("/server_info")  # agentkv serve and SGLang describe themselves
        self.server_info = info if isinstance(info, dict) else None
        scraper = Scraper(client.session, client.base)
        gpu = GpuMonitor(client.base) if self.cfg.monitor_gpu else None
        before = await scraper.scrape()
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out / "requests.jsonl", "wb")  # noqa: SIM115 - closed by the run
        return scraper, gpu, before

    async def _wind_down(self, sampler: asyncio.Task | None) -> None:
        """Stop the sampler, close requests.jsonl: the end of a run, however it ended."""
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        if self._file is not None:
            self._file.close()

    def _now(self) -> float:
        """Wall seconds since the run started: the plan's clock."""
        return self.clock() - self._t0

    async def _one(self, client: BenchClient, d: Dispatch) -> tuple[bool, float | None]:
        """Send one released item and record it; its end for the plan: the due time plus the engine's
        E2E when the target stamps its times (as simulate: client time does not pile up), else now."""
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.released += 1
        self.stats.in_flight = len(self._tasks)
        try:
            item = d.item
            r = item.request
            out_tokens = max(1, r.output_tokens)
            ceil = self.ceiling.hit_tokens(
                self.prompts.ceiling_key(item), r.hash_ids, r.input_tokens, item.trace.block_size
            )
            res = await send_item(client, self.prompts, self.model, item, out_tokens)
            rec = self._record(d, res, ceil, out_tokens)
            self._finish(rec, res)
            return rec.ok, d.due + rec.e2e / self.scale if rec.clock == "engine" else None
        finally:
            self._tasks.discard(task)
            self.stats.in_flight = len(self._tasks)

    def _record(self, d: Dispatch, res: StreamResult, ceil: int, max_tokens: int) -> RequestRecord:
        item, t0, x = d.item, self._t0, self.scale
        r = item.request
        times = res.token_times
        first = (times[0] - t0) * x if times else None
        n = res.output_tokens if res.ok else len(times)
        end = (res.end - t0) * x
        due = d.due * x
        eng = res.engine if res.ok and self.cfg.clock == "auto" else None
        warm = is_warmup(self.cfg, d.item.id, d.due)
        if eng is not None:  # the target's own clock: no HTTP or client time in the latencies
            lat = Latency.of_engine(eng)
        else:
            lat = Latency.of_client(times, n, x, None if first is None else first - due, end - due)
        if res.ok and not warm:
            self.itl.frombytes(lat.gaps.tobytes())
        return record_for(
            item,
            due,
            worker=self.cfg.target,
            sent=(res.sent - t0) * x,
            first_token=first,
            end=end,
            ttft=lat.ttft,
            e2e=lat.e2e,
            tpot=lat.tpot,
            itl_max=lat.itl_max,
            itls=lat.itls,
            **engine_stamp(eng),
            input_tokens=res.prompt_tokens if res.prompt_tokens else r.input_tokens,
            output_tokens=n,
            expected_output_tokens=max_tokens,
            cached_tokens=res.cached_tokens,
            ceiling_tokens=ceil,
            ok=res.ok,
            error=res.error,
            http_status=0 if res.ok else res.status,
            error_detail="" if res.ok else res.detail,
            warmup=warm,
        )

    def _finish(self, rec: RequestRecord, res: StreamResult) -> None:
        self.records.append(rec)
        if self._file is not None:
            self._file.write(encode_record(rec) + b"\n")
            self._file.flush()
        s = self.stats
        s.finished += 1
        s.output_tokens += rec.output_tokens
        if rec.ok:
            s.input_tokens += rec.input_tokens
            s.cached_tokens += rec.cached_tokens or 0
            if rec.ttft is not None:
                s.recent_ttft.append(rec.ttft)
        else:
            s.failed += 1
            s.errors[rec.error] = s.errors.get(rec.error, 0) + 1

    async def _sample_loop(self, scraper: Scraper, gpu: GpuMonitor | None) -> None:
        every = self.cfg.sample_every
        nxt = self.clock()
        while True:
            nxt += every
            await asyncio.sleep(max(0.0, nxt - self.clock()))
            snap = await scraper.scrape() if scraper.absent_reason is None else None
            await self._sample(snap, gpu)

    async def _sample(self, snap: MetricsSnapshot | None, gpu: GpuMonitor | None) -> None:
        t = (self.clock() - self._t0) * self.scale
        s = snap or MetricsSnapshot()
        self.stats.kv_usage = s.kv_usage
        self.timeline.append(
            Sample(
                t,
                self.plan.in_flight,
                s.kv_usage,
                None if s.running is None else int(s.running),
                None if s.waiting is None else int(s.waiting),
                s.prefix_hits,
                s.prefix_queries,
            )
        )
        if gpu is not None:
            gpu.sample()
        if self.on_tick is not None:
            self.on_tick(self)

    # ---- summary --------------------------------------------------------------------------
    def _summary(self, before, after, scraper: Scraper, gpu: GpuMonitor | None, base: str) -> Summary:
        cfg = self.cfg
        records = measured(self.records)
        warm = len(self.records) - len(records)
        notes = [
            f"prompts: {self.prompts.description}",
            *self.notes,
            *load.load_notes(cfg, self.plan, warm, self.scale),
        ]
        clocks, clock_notes = clocks_of(records, self.scale)
        notes += clock_notes
        if (skipped := catchup_note(before, after)) is not None:
            notes.append(skipped)
        if before is None:
            notes.append(f"server metrics absent: {scraper.absent_reason}")
        gpu_summary = gpu.summary() if gpu is not None else None
        if gpu_summary is None:
            reason = gpu.absent_reason if gpu is not None else "disabled"
            notes.append(f"GPU monitoring absent: {reason}")
        config = BenchSettings(
            **load.settings_of(cfg),
            seed=cfg.seed,
            warm_start=cfg.warm_start,
            idle_gap_cap=cfg.idle_gap_cap,
            max_requests=cfg.max_requests,
            duration=cfg.duration,
            api=cfg.api,
            prompt_mode=cfg.prompt_mode,
            prompts=self.prompts.description,
            tokenizer=cfg.tokenizer,
            model=self.model,
            slo=cfg.slo,
            tenant_salts=cfg.tenant_salts,
            cache_bust=self.prompts.marker,
            max_failure_rate=cfg.max_failure_rate,
            timeout=cfg.timeout,
            time_scale=cfg.time_scale,
            clock=cfg.clock,
            server=self.server_info,
            traces=sorted({t.id for t in self.traces}),
            requests=cfg.requests.settings() if cfg.requests else None,
            cycle=cfg.cycle,
        )
        summary = summarize(
            records,
            kind="bench",
            target=base,
            config=config,
            itl_values=np.frombuffer(self.itl, dtype=float) if len(self.itl) else None,
            slo=cfg.slo or None,
            metrics_hit_rate=hit_rate(before, after),
            timeline=self.timeline,
            gpu=gpu_summary,
            notes=notes,
            max_failure_rate=cfg.max_failure_rate,
            clocks=clocks,
        )
        add_hints(summary.top_errors, cfg.api, cfg.prompt_mode)
        summary.warmup_requests = warm
        return summary
