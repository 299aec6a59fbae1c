"""KV-event subscribers (blocking and asyncio): decode, track sequence numbers, replay gaps.

Tolerant by design: a malformed message (wrong frame count, bad sequence frame, undecodable or
ill-typed payload) is counted in `stats.malformed` and skipped. When a sequence number jumps, the
missing batches are fetched from the publisher's replay socket (if given) and delivered, in order
and marked `replayed`, before the batch that revealed the gap; what replay cannot supply is
counted in `stats.lost`. A publisher restart (`stats.resets`) is a jump back below the last
batch, or a repeat of the last seq with other content, or a jump ahead where replay shows a
different batch under the last seq delivered (the new publisher got further than the old one
while the subscriber was away): numbering starts again from 0, the batches of the new publisher
missed before it are replayed, and the first batch delivered after it is marked `restart`, so a
consumer knows to drop what it built from the old publisher before applying it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio

from agentkv.events.publisher import (
    END_SEQ,
    MalformedFrame,
    parse_message,
    parse_payload,
    parse_seq,
    seq_bytes,
)
from agentkv.kv.events import EventBatch


@dataclass(frozen=True, slots=True)
class Received:
    """One delivered batch with its sequence number and topic; `replayed` if it came via replay."""

    seq: int
    batch: EventBatch
    topic: bytes
    replayed: bool = False
    restart: bool = False  # the first batch of a restarted publisher: state from before it is stale
    payload: bytes = field(default=b"", repr=False, compare=False)  # as sent: tells two publishers apart


@dataclass(slots=True)
class SubscriberStats:
    """Delivered batches, skipped messages, gaps seen and what replay recovered or could not."""

    received: int = 0
    malformed: int = 0
    duplicates: int = 0
    resets: int = 0
    gaps: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    recovered: int = 0
    lost: int = 0


_END = object()


class _Tracker:
    """Decoding and sequence bookkeeping shared by the blocking and asyncio subscribers."""

    def __init__(self, start_seq: int | None) -> None:
        self.expected = start_seq
        self.stats = SubscriberStats()
        self._restart = False  # a restart was seen and its first batch is not delivered yet
        self.last_payload: bytes | None = None  # of the last batch delivered

    def decode(self, frames: Sequence[bytes]) -> Received | None:
        """The live message as Received, or None (counted) if malformed or a duplicate."""
        try:
            topic, seq, batch = parse_message(frames)
        except MalformedFrame:
            self.stats.malformed += 1
            return None
        payload = bytes(frames[2])
        if self.expected is not None and seq < self.expected:
            if seq == self.expected - 1 and seq != 0 and payload == self.last_payload:
                self.stats.duplicates += 1  # the batch just delivered, once more
                return None
            # Numbering went back: one publisher's sequence only grows, so it restarted. Its first
            # batches may have been lost (slow joiner): expect 0, so replay fetches them.
            self._restarted()
        return Received(seq, batch, topic, payload=payload)

    def _restarted(self) -> None:
        self.stats.resets += 1
        self.expected = 0
        self._restart = True

    def probe_from(self, gap: int) -> int:
        """Where a gap's replay starts: one batch early when the last one delivered can be compared."""
        return gap - 1 if gap > 0 and self.last_payload is not None else gap

    def renumbered(self, gap: int, replies: Sequence[Received]) -> bool:
        """True (a restart, counted) if replay holds another batch under the last seq delivered: a
        new publisher that got past the old one's numbering while the subscriber was away."""
        if gap == 0 or self.last_payload is None:
            return False
        prev = next((x for x in replies if x.seq == gap - 1), None)
        if prev is None or prev.payload == self.last_payload:
            return False  # same publisher (or too old to tell: the gap is filled as it can be)
        self._restarted()
        return True

    def gap_start(self, r: Received) -> int | None:
        """First missing seq if `r` skips ahead of the expected one."""
        if self.expected is not None and r.seq > self.expected:
            self.stats.gaps += 1
            return self.expected
        return None

    def parse_reply(self, frames: Sequence[bytes]) -> Received | object | None:
        """A replay reply: Received, `_END` for the end marker, None (counted) if malformed.

        Accepts `[b"", topic, seq, payload]` (vLLM 0.32) and `[b"", seq, payload]` (older vLLM).
        """
        try:
            if len(frames) == 4 and frames[0] == b"":
                topic, seq_frame, payload = frames[1], frames[2], frames[3]
            elif len(frames) == 3 and frames[0] == b"":
                topic, seq_frame, payload = b"", frames[1], frames[2]
            else:
                raise MalformedFrame(f"replay reply of {len(frames)} frames")
            if seq_frame == END_SEQ:
                return _END
            return Received(
                parse_seq(seq_frame),
                parse_payload(payload),
                bytes(topic),
                replayed=True,
                payload=bytes(payload),
            )
        except MalformedFrame:
            self.stats.malformed += 1
            return None

    def take_reply(self, frames: Sequence[bytes], out: list[Received]) -> bool:
        """Add a replay reply's batch to `out`; True at the end marker (malformed replies are counted)."""
        item = self.parse_reply(frames)
        if isinstance(item, Received):
            out.append(item)
        return item is _END

    def handle(
        self, frames: Sequence[bytes], can_replay: bool
    ) -> Generator[int, list[Received], list[Received]]:
        """One live message, sans I/O: yields each replay start seq it needs (the caller sends back
        the replies) and returns the batches to deliver, in order."""
        r = self.decode(frames)
        if r is None:
            return []
        gap = self.gap_start(r)
        replies: list[Received] = []
        if gap is not None and can_replay:
            replies = yield self.probe_from(gap)
            if self.renumbered(gap, replies):
                gap = 0
                replies = yield 0
        return self.accept(r, gap, replies)

    def accept(self, r: Received, gap: int | None, replies: list[Received]) -> list[Received]:
        """Deliver `r`, preceded by the replies that fill [gap, r.seq); advance the expected seq."""
        out: list[Received] = []
        if gap is not None:
            by_seq = {x.seq: x for x in replies if gap <= x.seq < r.seq}
            out = [by_seq[s] for s in sorted(by_seq)]
            self.stats.recovered += len(out)
            self.stats.lost += (r.seq - gap) - len(out)
        out.append(r)
        if self._restart:
            self._restart = False
            out[0] = replace(out[0], restart=True)
        self.stats.received += len(out)
        self.expected = r.seq + 1
        self.last_payload = r.payload
        return out


class _Base:
    """Socket setup shared by both subscribers: SUB bound or connected, topic filter, HWM."""

    def _setup(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        bind: bool | None,
        start_seq: int | None,
        replay_timeout: float,
        rcvhwm: int,
    ) -> None:
        self._ctx = ctx
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self._tracker = _Tracker(start_seq)
        self._pending: deque[Received] = deque()
        self._closed = False
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind if bind is not None else "*" in endpoint:
            self._sub.bind(endpoint)
            endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
        self.endpoint = endpoint

    @property
    def stats(self) -> SubscriberStats:
        return self._tracker.stats

    def _replay_socket(self) -> zmq.Socket:
        if self.replay_endpoint is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.replay_endpoint)
        self._tracker.stats.replay_requests += 1
        return sock

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sub.close(linger=0)
            self._ctx.term()


class ZmqEventSubscriber(_Base):
    """Blocking subscriber: `recv`, `recv_batches`, iteration, or `run(callback)` in a thread.

    The SUB socket binds when `bind` is True, or by default when the endpoint has a `*` (e.g.
    `tcp://127.0.0.1:*`; the chosen port is in `.endpoint`); otherwise it connects. A bound SUB
    sends its subscription to a connecting publisher only once it is polled (libzmq #2267), so
    start receiving before waiting on the publisher. `start_seq` (e.g. 0) makes the first batch's
    seq checked too, so batches missed before it are replayed.
    """

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
    ) -> None:
        self._setup(zmq.Context(), endpoint, replay_endpoint, topic, bind, start_seq, replay_timeout, rcvhwm)

    def recv(self, timeout: float | None = None) -> Received | None:
        """The next batch in sequence order, or None after `timeout` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(wait):
                return None
            self._handle(self._sub.recv_multipart())
            if deadline is not None and time.monotonic() >= deadline and not self._pending:
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
        sock = self._replay_socket()
        out: list[Received] = []
        try:
            sock.send_multipart((b"", seq_bytes(start_seq)))
            deadline = time.monotonic() + (self.replay_timeout if timeout is None else timeout)
            while True:
                if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    self._tracker.stats.replay_timeouts += 1
                    return out
                if self._tracker.take_reply(sock.recv_multipart(), out):
                    return out
        finally:
            sock.close()

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
    ) -> None:
        self._setup(
            zmq.asyncio.Context(), endpoint, replay_endpoint, topic, bind, start_seq, replay_timeout, rcvhwm
        )

    async def recv(self, timeout: float | None = None) -> Received | None:
        """The next batch in sequence order, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not await self._sub.poll(wait):
                return None
            await self._handle(await self._sub.recv_multipart())
            if deadline is not None and time.monotonic() >= deadline and not self._pending:
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
