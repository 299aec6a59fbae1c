"""KV-event subscribers (blocking and asyncio): a SUB socket, a DEALER for replay, and the
sequence bookkeeping of `agentkv.events.tracker` (malformed frames counted and skipped, gaps
replayed, restarts marked, implausible sequence jumps refused).

With `curve` (`agentkv.events.curve.CurveClient`) both sockets talk only to the publisher holding
the pinned key's secret. `token_ids=False` leaves BlockStored token ids undecoded (a router's
choice: it never reads them, and a long prompt's events carry one per token).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import zmq
import zmq.asyncio

from agentkv.events.curve import CurveClient
from agentkv.events.publisher import seq_bytes
from agentkv.events.tracker import Received, SeqTracker, SubscriberStats

__all__ = ["AsyncZmqEventSubscriber", "PendingReplay", "Received", "SubscriberStats", "ZmqEventSubscriber"]

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
WATCH_S = 0.5  # a receive looks at the handshake monitor at least this often
RECONNECT_S = 1.0  # at most one reconnect per this many seconds after failed handshakes


class _Base:
    """Socket setup shared by both subscribers: SUB bound or connected, topic filter, HWM; the
    subclass names its context type (blocking or asyncio)."""

    _context: type[zmq.Context] = zmq.Context

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        bind: bool | None = None,
        start_seq: int | None = None,
        replay_timeout: float = 1.0,
        rcvhwm: int = 100_000,
        curve: CurveClient | None = None,
        token_ids: bool = True,
    ) -> None:
        self._ctx = ctx = self._context()
        self.curve = curve
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self._tracker = SeqTracker(start_seq, token_ids)
        self._pending: deque[Received] = deque()
        self._closed = False
        self._sub = ctx.socket(zmq.SUB)
        if curve is not None:
            curve.apply(self._sub)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._bound = bind if bind is not None else "*" in endpoint
        if self._bound:
            self._sub.bind(endpoint)
            endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
        self.endpoint = endpoint
        addr = f"inproc://agentkv-sub-monitor-{id(self):x}"
        self._sub.monitor(addr, _HANDSHAKE_FAILED)
        self._monitor = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)  # blocking, even under asyncio
        self._monitor.connect(addr)
        self._reconnect_due: float | None = None  # when to reconnect after a failed handshake
        self._reconnected = 0.0  # when it last did
        self._watch_at = 0.0  # when `watch` next reads the monitor

    def watch(self) -> None:
        """Count failed handshakes (a publisher without the pinned key, or a CURVE / plain mismatch)
        and reconnect: libzmq stops retrying a connection after a protocol error. At most every
        WATCH_S, not per batch: an empty monitor read costs ~9 us (pyzmq raises zmq.Again)."""
        now = time.monotonic()
        if now < self._watch_at:
            return
        self._watch_at = now + WATCH_S
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._tracker.stats.handshake_failures += 1
            if self._reconnect_due is None and not self._bound:
                self._reconnect_due = self._reconnected + RECONNECT_S
        if self._reconnect_due is not None and time.monotonic() >= self._reconnect_due:
            self._reconnect_due = None
            self._reconnected = time.monotonic()
            self._sub.disconnect(self.endpoint)
            self._sub.connect(self.endpoint)

    @property
    def stats(self) -> SubscriberStats:
        return self._tracker.stats

    @property
    def socket(self) -> zmq.Socket:
        """The SUB socket, for an outside poller (`agentkv.events.poller`)."""
        return self._sub

    @property
    def tracker(self) -> SeqTracker:
        return self._tracker

    def _replay_socket(self) -> zmq.Socket:
        if self.replay_endpoint is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.replay_endpoint)
        self._tracker.stats.replay_requests += 1
        return sock

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sub.close(linger=0)
            self._monitor.close(linger=0)
            self._ctx.term()


class PendingReplay:
    """A replay request in flight on its own DEALER socket: replies gathered by `take` (whenever the
    socket is readable, so one thread can wait on many) until the end marker or `deadline`."""

    def __init__(self, sub: _Base, start_seq: int, timeout: float | None = None) -> None:
        self.sock = sub._replay_socket()
        self._tracker = sub._tracker
        self.out: list[Received] = []
        self.deadline = time.monotonic() + (sub.replay_timeout if timeout is None else timeout)
        self.sock.send_multipart((b"", seq_bytes(start_seq)))

    def take(self) -> bool:
        """Read the replies ready now, without waiting; True once the end marker came."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if self._tracker.take_reply(frames, self.out):
                return True

    def expire(self) -> None:
        """The deadline passed: what came so far is the answer (counted as a replay timeout)."""
        self._tracker.stats.replay_timeouts += 1

    def close(self) -> None:
        self.sock.close()


class ZmqEventSubscriber(_Base):
    """Blocking subscriber: `recv`, `recv_batches`, iteration, or `run(callback)` in a thread.

    The SUB socket binds when `bind` is True, or by default when the endpoint has a `*` (e.g.
    `tcp://127.0.0.1:*`; the chosen port is in `.endpoint`); otherwise it connects. A bound SUB
    sends its subscription to a connecting publisher only once it is polled (libzmq #2267), so
    start receiving before waiting on the publisher. `start_seq` (e.g. 0) makes the first batch's
    seq checked too, so batches missed before it are replayed.
    """

    def recv(self, timeout: float | None = None) -> Received | None:
        """The next batch in sequence order, or None after `timeout` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            self.watch()
            left = WATCH_S if deadline is None else min(WATCH_S, deadline - time.monotonic())
            if self._sub.poll(max(0, int(left * 1000))):
                self._handle(self._sub.recv_multipart())
            elif deadline is not None and time.monotonic() >= deadline:
                return None
        return self._pending.popleft()

    def recv_batches(self, timeout: float = 0.0, max_batches: int | None = None) -> list[Received]:
        """Wait up to `timeout` for a first batch, then take whatever else is ready without waiting."""
        out: list[Received] = []
        first = self.recv(timeout)
        while first is not None:
            out.append(first)
            if max_batches is not None and len(out) >= max_batches:
                break
            first = self.recv(0)
        return out

    def __iter__(self) -> Iterator[Received]:
        while not self._closed:
            r = self.recv(0.1)
            if r is not None:
                yield r

    def run(self, callback: Callable[[Received], None], stop: threading.Event) -> None:
        """Call `callback` for each batch until `stop` is set (checked every 100 ms)."""
        while not stop.is_set():
            for r in self.recv_batches(0.1):
                callback(r)

    def replay(self, start_seq: int, timeout: float | None = None) -> list[Received]:
        """Ask the replay socket for every buffered batch from `start_seq` (without delivering them)."""
        pending = PendingReplay(self, start_seq, timeout)
        try:
            while not pending.take():
                if not pending.sock.poll(max(0, int((pending.deadline - time.monotonic()) * 1000))):
                    pending.expire()
                    break
            return pending.out
        finally:
            pending.close()

    def _handle(self, frames: list[bytes]) -> None:
        steps = self._tracker.handle(frames, self.replay_endpoint is not None)
        try:
            start = next(steps)
            while True:
                start = steps.send(self.replay(start))
        except StopIteration as done:
            self._pending.extend(done.value)

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncZmqEventSubscriber(_Base):
    """The same subscriber for an asyncio router (zmq.asyncio): `await recv()`, `async for`."""

    _context = zmq.asyncio.Context

    async def recv(self, timeout: float | None = None) -> Received | None:
        """The next batch in sequence order, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            self.watch()
            left = WATCH_S if deadline is None else min(WATCH_S, deadline - time.monotonic())
            if await self._sub.poll(max(0, int(left * 1000))):
                await self._handle(await self._sub.recv_multipart())
            elif deadline is not None and time.monotonic() >= deadline:
                return None
        return self._pending.popleft()

    async def __aiter__(self) -> AsyncIterator[Received]:
        while not self._closed:
            r = await self.recv(0.1)
            if r is not None:
                yield r

    async def replay(self, start_seq: int, timeout: float | None = None) -> list[Received]:
        """Ask the replay socket for every buffered batch from `start_seq` (without delivering them)."""
        sock = self._replay_socket()
        out: list[Received] = []
        try:
            await sock.send_multipart((b"", seq_bytes(start_seq)))
            deadline = time.monotonic() + (self.replay_timeout if timeout is None else timeout)
            while True:
                if not await sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    self._tracker.stats.replay_timeouts += 1
                    return out
                if self._tracker.take_reply(await sock.recv_multipart(), out):
                    return out
        finally:
            sock.close()

    async def _handle(self, frames: list[bytes]) -> None:
        steps = self._tracker.handle(frames, self.replay_endpoint is not None)
        try:
            start = next(steps)
            while True:
                start = steps.send(await self.replay(start))
        except StopIteration as done:
            self._pending.extend(done.value)
