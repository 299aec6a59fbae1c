"""The router's worker pool: specs, health, KV-event subscriptions, load accounting, /metrics scrapes.

Each worker is an OpenAI-compatible engine (`--worker URL[=EVENTS[,REPLAY]]`). In `event` mode
one thread (`EventPoller`) consumes every worker's ZMQ KV events into the tenant index, one lock
per wake: each subscription first replays
the publisher's buffer (a router restart rebuilds the index), and the subscriber replays any
sequence gap; a publisher restart (sequence back to 0) clears the worker's entries first. In
`approximate` mode (no endpoint, or `--approximate`) the router predicts the cache from its own
routing. A worker failing its health check is taken out of rotation and its entries dropped;
when it answers again it is re-added and its subscription restarted from the replay buffer.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from agentkv.errors import UserError
from agentkv.events.curve import CurveClient, is_local
from agentkv.events.poller import Delivery, EventPoller
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.metrics.scrape import snapshot
from agentkv.route.index import Match, TenantIndex

log = logging.getLogger("agentkv.route")

# a worker's /metrics page past this is not read (vLLM's is ~50 KB per engine); it is parsed in a
# thread, so a page this size of hostile lines costs about a second of CPU, not a stalled event loop
MAX_METRICS_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker's HTTP base URL and, when it publishes KV events, its event and replay endpoints."""

    url: str
    events: str | None = None
    replay: str | None = None
    curve: CurveClient | None = None  # the worker's pinned public key and the router's key pair


def parse_worker(spec: str) -> WorkerSpec:
    """`http://host:port[=tcp://host:port[,tcp://host:port]]` -> WorkerSpec (UserError if malformed)."""
    url, _, ev = spec.partition("=")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")) or "://" not in url or len(url.split("://", 1)[1]) == 0:
        raise UserError(f"--worker {spec!r}: expected http://HOST:PORT[=tcp://HOST:PORT[,tcp://HOST:PORT]]")
    events, _, replay = ev.partition(",")
    for name, ep in (("events", events), ("replay", replay)):
        if ep and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise UserError(
                f"--worker {spec!r}: the {name} endpoint must be a ZMQ address like tcp://HOST:PORT"
            )
    return WorkerSpec(url, events or None, replay or None)


class Worker:
    """One engine as the policy sees it (`WorkerView`), with the router's own load accounting."""

    def __init__(self, slot: int, spec: WorkerSpec, block_size: int, approximate: bool) -> None:
        self.slot, self.spec, self.block_size = slot, spec, block_size
        self.mode = "event" if spec.events and not approximate else "approximate"
        self.healthy = True
        self.in_flight = 0  # requests sent and not finished
        self.in_flight_tokens = 0  # prompt + max output tokens of those already streaming (running)
        self.prefill_tokens = 0  # uncached prompt tokens of those not yet streaming (active prefill)
        self.scraped_active = 0  # running + waiting from the worker's /metrics
        self.requests = self.failures = self.retried_away = self.first_byte_timeouts = 0
        self.waiting: set[asyncio.Timeout] = set()  # deadlines of requests here awaiting their first byte
        self.slow_checks = 0  # health checks in a row that timed out
        self.last_byte = 0.0  # loop time of the last byte from it (a response or a /health answer)
        self.match = Match(0)  # this request's cached prefix here (set by the router before choosing)
        self.events_applied = self.resyncs = 0
        self.subscriber: ZmqEventSubscriber | None = None
        self.caught_up = -1  # the last seq applied from the replay buffer at subscription
        self.gaps_seen = 0  # the subscriber's gap count when last looked at

    # WorkerView ---------------------------------------------------------------------------------
    def active_requests(self) -> int:
        return max(self.in_flight, self.scraped_active)

    def active_blocks(self) -> int:
        return self.in_flight_tokens // self.block_size

    def active_prefill_blocks(self) -> float:
        return self.prefill_tokens / self.block_size

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        return self.match.gpu, self.match.lower

    def start(self, tokens: int, prefill: int = 0) -> Load:
        """A request of `tokens` (prompt + max output), `prefill` of them uncached here, was sent
        here: its load handle."""
        self.in_flight += 1
        self.requests += 1
        self.prefill_tokens += prefill
        return Load(self, tokens, prefill)


class Load:
    """One request's share of its worker's load: a request from `Worker.start`, active prefill
    (its uncached prompt) until its first byte, KV load from its first byte (`streaming`) to `finish`.

    A request still queued counts as a request and as prefill work, not as KV load: a queue of
    cache hits costs the worker little, and counting it moved sessions off the worker that caches
    them; its uncached rest is what Dynamo counts as the worker's active prefill tokens."""

    __slots__ = ("worker", "tokens", "prefill", "streaming")

    def __init__(self, worker: Worker, tokens: int, prefill: int = 0) -> None:
        self.worker, self.tokens, self.prefill, self.streaming = worker, tokens, prefill, False

    def first_byte(self) -> None:
        if not self.streaming:
            self.streaming = True
            self.worker.in_flight_tokens += self.tokens
            self.worker.prefill_tokens -= self.prefill

    def finish(self) -> None:
        self.worker.in_flight -= 1
        if self.streaming:
            self.worker.in_flight_tokens -= self.tokens
        else:
            self.worker.prefill_tokens -= self.prefill


SLOW_LIMIT = 3  # health-check timeouts in a row before a worker is taken out


class WorkerPool:
    """All workers, their event consumers, health checks and metric scrapes (one asyncio loop)."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        index: TenantIndex,
        block_size: int,
        *,
        approximate: bool = False,
        health_interval: float = 1.0,
        health_timeout: float = 5.0,
        scrape_interval: float = 2.0,
        on_membership: Callable[[], None] | None = None,
        forget: Callable[[int], None] | None = None,
    ):
        if not specs:
            raise UserError("agentkv route: give at least one --worker")
        self.workers = [Worker(i, s, block_size, approximate) for i, s in enumerate(specs)]
        self.index = index
        self.health_interval, self.scrape_interval = health_interval, scrape_interval
        self.health_timeout = health_timeout
        self.on_membership = on_membership or (lambda: None)
        self.forget = forget or (lambda slot: None)
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self.lock = threading.Lock()  # the index is written by the event thread, read by the loop
        self.poller = EventPoller(self._deliver, name="route-events")

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        for w in self.workers:
            log.info(
                "worker %d %s: %s mode%s",
                w.slot,
                w.spec.url,
                w.mode,
                f" (events {w.spec.events}, replay {w.spec.replay or 'none'}, "
                f"CURVE {'on' if w.spec.curve else 'off'})"
                if w.mode == "event"
                else "",
            )
            if w.mode == "event":
                _warn_if_exposed(w)
                self._subscribe(w)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="route-health"))
        if self.scrape_interval > 0:
            self._tasks.append(asyncio.create_task(self._scrape_loop(), name="route-scrape"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.poller.close)
        for w in self.workers:
            w.subscriber = None
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # -- events ----------------------------------------------------------------------------------
    def _subscribe(self, w: Worker) -> None:
        # token ids are left undecoded: the index reads hashes, parent, tier, group and salt only
        sub = ZmqEventSubscriber(
            w.spec.events, w.spec.replay, start_seq=0, curve=w.spec.curve, token_ids=False
        )
        w.caught_up, w.gaps_seen = -1, 0
        w.subscriber = sub
        self.poller.add(sub, w, f"worker {w.slot}", catch_up=sub.replay_endpoint is not None)

    def _unsubscribe(self, w: Worker) -> None:
        """Stop applying the worker's events now (a late batch is dropped); the poller closes it."""
        with self.lock:
            sub, w.subscriber = w.subscriber, None
        if sub is not None:
            self.poller.remove(sub)

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """One wake's batches, all workers, under one index lock (the poller thread): the replay
        buffer's at subscription (catch-up), then the live stream; a publisher restart clears the
        worker's entries first, and batches replayed again after catch-up are not applied twice."""
        apply = self.index.apply
        with self.lock:
            for d in deliveries:
                w = d.key
                assert isinstance(w, Worker)
                if w.subscriber is not d.sub:
                    continue  # unsubscribed meanwhile: its entries are gone
                if d.catch_up:
                    for r in d.batches:
                        for ev in r.batch.events:
                            apply(w.slot, ev)
                        w.events_applied += len(r.batch.events)
                        w.caught_up = max(w.caught_up, r.seq)
                    if d.batches:
                        log.info(
                            "worker %d: index rebuilt from %d replayed event batches", w.slot, len(d.batches)
                        )
                    continue
                gaps = d.sub.stats.gaps
                if gaps != w.gaps_seen:
                    w.gaps_seen = gaps
                    w.resyncs += 1
                for r in d.batches:
                    if r.restart:  # the publisher restarted: its engine's cache is new
                        self.index.clear_worker(w.slot)
                        w.resyncs += 1
                        w.caught_up = -1
                    if r.replayed and r.seq <= w.caught_up:
                        continue  # already applied during catch-up
                    for ev in r.batch.events:
                        apply(w.slot, ev)
                    w.events_applied += len(r.batch.events)

    # -- health and load -------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self.check(w) for w in self.workers))

    async def check(self, w: Worker) -> bool:
        """GET /health; take the worker out or bring it back accordingly. True if healthy."""
        assert self.session is not None
        slow = False
        t0 = asyncio.get_running_loop().time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout)
            async with self.session.get(w.spec.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
            w.last_byte = asyncio.get_running_loop().time()
        except TimeoutError:
            ok, slow = False, True
        except (aiohttp.ClientError, OSError):
            ok = False
        # a refused connection means the worker is gone; a slow answer only counts once it repeats
        # (a busy worker is not a dead one: SLOW_LIMIT timeouts in a row, as sglang-router does),
        # unless it is stalled: requests wait on it, nothing came from it during the probe, and
        # another worker answered meanwhile (so the router itself is not the one stalled)
        w.slow_checks = w.slow_checks + 1 if slow else 0
        stalled = slow and w.in_flight > 0 and w.last_byte < t0 and self._others_answered(w, t0)
        if ok and not w.healthy:
            self.revive(w)
        elif not ok and w.healthy and (not slow or stalled or w.slow_checks >= SLOW_LIMIT):
            why = "stalled: no byte and no /health answer" if stalled else "health check timed out"
            await self.mark_dead(w, why if slow else "health check failed")
        return ok

    def _others_answered(self, w: Worker, since: float) -> bool:
        return any(o is not w and o.healthy and o.last_byte >= since for o in self.workers)

    async def mark_dead(self, w: Worker, why: str) -> None:
        """Out of rotation, index entries dropped, subscription stopped until it answers again; its
        requests still waiting for a first byte give up now (the proxy retries them elsewhere)."""
        if not w.healthy:
            return
        w.healthy = False
        now = asyncio.get_running_loop().time()
        for deadline in w.waiting:
            deadline.reschedule(now)
        self._unsubscribe(w)
        with self.lock:
            dropped = self.index.clear_worker(w.slot)
        self.forget(w.slot)
        log.warning(
            "worker %d %s out of rotation (%s); %d indexed blocks dropped", w.slot, w.spec.url, why, dropped
        )
        self.on_membership()

    def revive(self, w: Worker) -> None:
        w.healthy = True
        with self.lock:
            self.index.clear_worker(w.slot)
        self.forget(w.slot)
        if w.mode == "event":
            self._subscribe(w)
        log.info(
            "worker %d %s back in rotation; index rebuilt from its replay buffer or from scratch",
            w.slot,
            w.spec.url,
        )
        self.on_membership()

    async def _scrape_loop(self) -> None:
        while True:
            up = [w for w in self.workers if w.healthy]
            results = await asyncio.gather(*(self.scrape(w) for w in up), return_exceptions=True)
            for w, res in zip(up, results, strict=True):
                if isinstance(res, Exception):  # never ends the loop, whatever a worker sends
                    log.warning("worker %d: /metrics scrape failed (%s)", w.slot, type(res).__name__)
            await asyncio.sleep(self.scrape_interval)

    async def scrape(self, w: Worker) -> None:
        """Running + waiting requests from the worker's Prometheus /metrics (vLLM's names, SGLang's
        as a fallback); a page that fails, is too large or undecodable leaves the last value."""
        assert self.session is not None
        try:
            async with self.session.get(w.spec.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200 or (r.content_length or 0) > MAX_METRICS_BYTES:
                    return
                body = await _read_capped(r.content, MAX_METRICS_BYTES)
                if body is None:
                    return
                charset = r.charset
        except (TimeoutError, aiohttp.ClientError, OSError):
            return
        text = _decode(body, charset)
        if text is not None:
            w.scraped_active = int(await asyncio.to_thread(parse_load, text))


def _warn_if_exposed(w: Worker) -> None:
    """A worker's events taken from a non-loopback endpoint without CURVE can be forged."""
    eps = [e for e in (w.spec.events, w.spec.replay) if e]
    if w.spec.curve is None and not all(is_local(e) for e in eps):
        log.warning(
            "worker %d: KV events from %s without CURVE: whoever reaches that address can forge this "
            "worker's cache in the index (give --kv-events-curve-server-key; docs/security.md)",
            w.slot,
            " and ".join(eps),
        )


async def _read_capped(stream: aiohttp.StreamReader, cap: int) -> bytes | None:
    """The whole body, or None once it passes `cap` bytes (the rest is not read)."""
    body = bytearray()
    async for chunk in stream.iter_any():
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)


def _decode(body: bytes, charset: str | None) -> str | None:
    """The page as text: its charset if Python knows it, else UTF-8 (as aiohttp's `text()`); None
    if it does not decode."""
    codec = "utf-8"
    if charset:
        with contextlib.suppress(LookupError, ValueError):
            codec = codecs.lookup(charset).name
    try:
        return body.decode(codec)
    except UnicodeDecodeError:
        return None


def parse_load(text: str) -> float:
    """Running + waiting requests in a Prometheus text page (vLLM's or SGLang's names; 0 if absent
    or not finite)."""
    total = snapshot(text).requests()
    return total if math.isfinite(total) else 0.0
