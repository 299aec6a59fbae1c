"""The engine in real time: an asyncio task that steps the engine, sleeps out each step, delivers tokens.

Engine time runs at `time_scale` engine seconds per wall second. The loop keeps an engine
timeline `t`: a step starts at `max(t, real_now - slack)`, where `t` is the previous step's end
while busy, so late wake-ups (timer granularity, a busy CPU) do not turn into simulated idle
GPU time unless the loop falls more than `slack` behind. Arrivals are stamped on the same
timeline (`event_time`): at real time when idle, and no later than the next step can start when
busy, so a request never starts before it arrived and never waits longer than it did. An idle
engine wakes at its first arrival, as vLLM's engine core does (it blocks on its input queue, takes
what is queued, schedules at once): that step starts at the arrival and holds the requests
stamped by then; one stamped later joins the next step, however late the event loop itself gets
to the wake (it is begun then, `_begin_step`). New requests join between steps; an idle loop awaits
an event (no polling). KV events emitted during a step are published as one EventBatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from agentkv.engine.clock import RealClock, VirtualClock
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine, StepResult
from agentkv.engine.request import EngineRequest
from agentkv.events.publisher import ZmqEventPublisher
from agentkv.kv.events import EventBatch, KVEvent
from agentkv.serve.protocol import GenRequest

log = logging.getLogger("agentkv.serve")
SLACK_WALL_S = 0.02  # how far (wall seconds) the engine timeline may lag real time before it jumps


class RequestStream:
    """One request's deliveries: the loop adds tokens, the HTTP handler awaits and takes them."""

    __slots__ = ("request_id", "gen", "engine_req", "pending", "sent", "finished", "aborted", "_waiter")

    def __init__(self, request_id: str, gen: GenRequest) -> None:
        self.request_id = request_id
        self.gen = gen
        self.engine_req: EngineRequest | None = None
        self.pending = 0  # tokens produced, not yet taken
        self.sent = 0  # tokens taken so far
        self.finished = False
        self.aborted = False
        self._waiter: asyncio.Future | None = None

    def push(self, n: int, finished: bool) -> None:
        self.pending += n
        if finished:
            self.finished = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> tuple[int, bool]:
        """Wait for new tokens; (count, finished). Tokens of one wake-up come out as one chunk."""
        while not self.pending and not self.finished:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        n, self.pending = self.pending, 0
        self.sent += n
        return n, self.finished and not self.pending

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (GPU plus lower tiers) or arrived from a prefill
        worker, as vLLM's usage reports them (its computed tokens at first scheduling)."""
        r = self.engine_req
        if r is None:
            return 0
        return max(r.num_cached_tokens + sum(r.lower_tier_tokens.values()), r.external_tokens)


class EngineRunner:
    """Owns one Engine on a real-time timeline; `submit` / `abort` from handlers, `start` / `stop` the loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        time_scale: float = 1.0,
        publisher: ZmqEventPublisher | None = None,
        on_step: Callable[[StepResult, list[float]], None] | None = None,
        on_finish: Callable[[EngineRequest, str], None] | None = None,
    ) -> None:
        self.real = RealClock(time_scale)
        self.clock = VirtualClock(self.real.now())
        self.publisher = publisher
        self._events: list[KVEvent] = []
        self._itl: list[float] = []
        self.engine = Engine(
            config,
            self.clock,
            on_event=self._events.append if publisher else None,
            itl_sink=self._itl,
            record_tokens=True,  # each token's engine time goes back in the response (`agentkv` object)
        )
        self.on_step = on_step
        self.on_finish = on_finish
        self.slack = SLACK_WALL_S * time_scale
        self.jumped_s = 0.0  # engine seconds skipped because the loop fell behind real time
        self.streams: dict[str, RequestStream] = {}
        self._t = self.clock.now()
        self._idle = True  # the loop waits for work: the timeline restarts at real time
        self._step_end: float | None = None  # the end of the step being slept out
        self.last_arrival = self._t  # the latest arrival stamped
        self._wake_at: float | None = None  # an idle engine's first arrival: its next step starts there
        self._begun: StepResult | None = None  # that step, begun before the loop woke (a later arrival)
        self.wakes, self.wake_s = 0, 0.0  # idle wakes; wall seconds from the first arrival to the loop's wake
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- handlers' side ---------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        gen: GenRequest,
        block_hashes: list[int] | None = None,
        external_tokens: int = 0,
    ) -> RequestStream:
        """Queue a validated request; it joins the batch at the next step. `external_tokens`: its
        prompt KV that arrived from a prefill worker (a disaggregated decode)."""
        stream = RequestStream(request_id, gen)
        arrival = self.event_time()
        self._begin_step(arrival)
        self.clock.advance_to(arrival)
        if gen.session_id is not None:  # a hint for session-aware eviction policies
            self.engine.session_resumed(gen.session_id, arrival)
        stream.engine_req = self.engine.add_request(
            request_id,
            max_tokens=gen.max_tokens,
            token_ids=gen.prompt_ids,
            block_hashes=block_hashes,
            external_tokens=external_tokens,
            cache_salt=gen.cache_salt,
            session_id=gen.session_id,
            user_data=stream,
            arrival=arrival,
        )
        self.last_arrival = max(self.last_arrival, arrival)
        if self._idle and self._wake_at is None:
            self._wake_at = arrival
        self.streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away) and free its blocks; False if it already finished."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        stream.aborted = True
        at = self.event_time()
        self._begin_step(at)
        self.clock.advance_to(at)
        ok = self.engine.abort(request_id)
        if ok and self.on_finish is not None and stream.engine_req is not None:
            self.on_finish(stream.engine_req, "abort")
        self._wake.set()
        return ok

    # -- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="agentkv-engine")

    async def stop(self) -> None:
        """Stop the loop, abort what is left and close the event publisher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._wake_at = None  # no step begins while stopping
        self._fail_all()
        self._publish()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)

    def event_time(self) -> float:
        """The engine time of an arrival (or abort) now: real time when idle; when busy, real time
        unless the timeline lags behind it, then where the next step can start (never later)."""
        real = self.real.now()
        if self._idle:
            return max(real, self._t)
        base = self._t if self._step_end is None else self._step_end
        return min(real, max(base, real - self.slack))

    async def _run(self) -> None:
        engine = self.engine
        while True:
            result, self._begun = self._begun, None
            if result is None:
                if not engine.has_work():
                    self._publish()
                    await self._idle_wait(None)
                    continue
                result = self._step(self._t)
            if result is None:  # nothing can run until something changes: idle GPU time
                await self._idle_wait(0.05)
                continue
            self._step_end = result.end
            try:
                delay = self.real.wall_delay(result.end - self.real.now())
                await asyncio.sleep(delay if delay > 0 else 0)
            finally:
                self._step_end = None
            self._t = max(self._t, result.end)
            self.clock.advance_to(result.end)
            self._deliver(result)

    def _step(self, t: float) -> StepResult | None:
        """One engine step from `t` (or real time less the slack, counted as catch-up); None when
        nothing could run or the step failed (every client is then failed, the server serves on)."""
        now = self.real.now()
        if now - self.slack > t:
            self.jumped_s += now - self.slack - t
        self.clock.advance_to(max(t, now - self.slack))
        try:
            result = self.engine.step()
        except Exception:  # a bug must not leave clients hanging: fail them all, keep serving
            log.exception("engine step failed; aborting %d requests", len(self.streams))
            self._fail_all()
            result = None
        self._publish()
        return result

    def _begin_step(self, t: float) -> None:
        """An event at `t` after an idle engine's first arrival that the loop has not yet woken to:
        the engine woke at that arrival, so its step begins there now, without what comes at `t`."""
        wake = self._wake_at
        if not self._idle or wake is None or t <= wake or self._begun is not None:
            return
        self._wake_at = None
        self._begun = self._step(wake)
        if self._begun is not None:
            self._idle = False  # arrivals are stamped as while a step runs
            self._step_end = self._begun.end

    async def _idle_wait(self, timeout: float | None) -> None:
        """Wait for a submit or abort (at most `timeout` wall seconds) as idle GPU time: the next
        step starts at the first arrival (a wake-up later than the slack is counted as catch-up)."""
        self._wake.clear()
        self._idle = True
        self._wake_at = None
        since = self.real.now()
        try:
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: never swallows a cancel
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
        finally:
            self._idle = False
        first = self._wake_at if self._begun is None else self._begun.start
        if first is not None and self._wake.is_set():  # host time: it never enters the timeline
            self.wakes += 1
            self.wake_s += self.real.wall_delay(max(0.0, self.real.now() - first))
        self._t = max(self._t, since, first) if first is not None else max(self._t, self.real.now())
        self._wake_at = None

    def _fail_all(self) -> None:
        """Abort every request and wake its handler (it sees `aborted` and ends the response)."""
        for rid, stream in list(self.streams.items()):
            self.abort(rid)
            stream.push(0, True)

    def _deliver(self, result: StepResult) -> None:
        if self.on_step is not None:
            self.on_step(result, self._itl)
        self._itl.clear()
        streams = self.streams
        for out in result.outputs:
            rid = out.request.request_id
            stream = streams.get(rid)
            if stream is None:
                continue  # aborted while the step ran
            if out.finished:
                del streams[rid]
                if stream.gen.session_id is not None:
                    self.engine.session_paused(stream.gen.session_id, result.end, "tool_use")
                if self.on_finish is not None:
                    self.on_finish(out.request, out.request.finish_reason or "length")
            stream.push(out.new_tokens, out.finished)

    def _publish(self) -> None:
        if self._events and self.publisher is not None:
            events = self._events[:]
            self._events.clear()
            self.publisher.publish(EventBatch(time.time(), events))
