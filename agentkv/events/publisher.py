"""KV events over ZMQ in vLLM's wire format: a non-blocking publisher with a replay buffer.

Live frames are `[topic, seq (8-byte big-endian), payload]`, payload = `encode_batch(EventBatch)`.
The PUB side binds when the endpoint contains `*` or `::` or is ipc/inproc, else connects (so
the subscriber binds), as vLLM does. The replay ROUTER always binds: a DEALER sends
`[b"", start_seq]` and gets `[b"", topic, seq, payload]` for every buffered batch from start_seq,
then `[b"", b"", 0xff*8, b""]` (observed on vLLM 0.32; ../shared/vllm/README.md).
agentkv's own options, none of which vLLM has: `host` binds a `tcp://*:PORT` endpoint on one
address (serve passes 127.0.0.1), `curve` authenticates and encrypts both sockets
(`agentkv.events.curve`), and `token_ids=False` leaves prompt token ids out of BlockStored.
The subscriber side lives in `agentkv.events.subscriber`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from agentkv.errors import UserError
from agentkv.events.curve import CurveServer, is_local, start_authenticator, with_host
from agentkv.kv.events import BlockStored, EventBatch, KVEvent, decode_batch

log = logging.getLogger("agentkv.events")

DEFAULT_TOPIC = "kv-events"
END_SEQ = b"\xff" * 8


class MalformedFrame(ValueError):
    """A message that is not `[topic, 8-byte seq, msgpack EventBatch]`; subscribers count and skip it."""


def should_bind(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard, IPv6 or ipc/inproc endpoint, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedFrame(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def parse_payload(payload: bytes, token_ids: bool = True) -> EventBatch:
    """Decode one payload (`token_ids=False`: BlockStored token ids left undecoded); MalformedFrame
    (never a msgspec error) when it is not an EventBatch."""
    try:
        return decode_batch(payload, token_ids)
    except (msgspec.MsgspecError, ValueError, TypeError) as e:
        raise MalformedFrame(f"undecodable payload: {e}") from None


def parse_message(frames: Sequence[bytes], token_ids: bool = True) -> tuple[bytes, int, EventBatch]:
    """(topic, seq, batch) of a live message, or MalformedFrame saying what is wrong."""
    if len(frames) != 3:
        raise MalformedFrame(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), parse_seq(seq), parse_payload(payload, token_ids)


def without_token_ids(batch: EventBatch) -> EventBatch:
    """`batch` with every BlockStored's token ids left out (hashes, parent, salt and tier kept)."""
    if not any(isinstance(e, BlockStored) and e.token_ids for e in batch.events):
        return batch
    events = [
        msgspec.structs.replace(e, token_ids=[]) if isinstance(e, BlockStored) and e.token_ids else e
        for e in batch.events
    ]
    return msgspec.structs.replace(batch, events=events)


class DropOldestQueue:
    """A bounded FIFO whose `put` never blocks: when full it drops the oldest item and counts it.

    `put` also says whether the consumer needs a wake-up (the first item since the last `take_all`).
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.dropped = 0
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._pending_wake = False

    def put(self, item: object) -> bool:
        with self._lock:
            if len(self._items) >= self.maxsize:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            wake, self._pending_wake = not self._pending_wake, True
            return wake

    def take_all(self) -> list:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._pending_wake = False
            return items

    def __len__(self) -> int:
        return len(self._items)


@dataclass(slots=True)
class PublisherStats:
    """Batches queued, sent, dropped on overflow or unencodable; replay requests; subscriptions seen."""

    queued: int = 0
    sent: int = 0
    dropped: int = 0
    errors: int = 0
    replay_requests: int = 0
    bad_replay_requests: int = 0
    subscriptions: int = 0
    auth_denied: int = 0  # CURVE handshakes refused: a key not on the allow-list


class ZmqEventPublisher:
    """Publishes EventBatches from a background thread so `publish` never blocks the engine.

    Sequence numbers are assigned in `publish` (0, 1, 2, ...), so a batch dropped by the bounded
    queue shows downstream as a gap that replay cannot fill, rather than going unnoticed. The PUB
    socket is an XPUB (same wire as PUB) so the publisher can see subscriptions arrive
    (`wait_for_subscribers`), which lets a caller avoid ZMQ's slow-joiner loss at start-up.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = DEFAULT_TOPIC,
        data_parallel_rank: int | None = None,
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        linger_ms: int = 200,
        bind: bool | None = None,
        host: str | None = None,
        curve: CurveServer | None = None,
        token_ids: bool = True,
    ) -> None:
        """`bind`: None follows vLLM's rule (`should_bind`); `host`: where `tcp://*:PORT` binds (None:
        every interface); `curve`: CURVE on both sockets; `token_ids`: keep BlockStored's token ids."""
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.token_ids = token_ids
        self.curve = curve
        self.stats = PublisherStats()
        self._queue = DropOldestQueue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._subs = threading.Condition()
        self._stopping = False
        self._closed = False
        self._linger_ms = linger_ms
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._auth = self._gate = None
        self._replay: zmq.Socket | None = None
        try:
            if curve is not None:  # the ZAP handler must be up before a peer can connect
                self._auth, self._gate = start_authenticator(self._ctx, curve.allowed)
            self._open(endpoint, replay_endpoint, bind, host, hwm)
        except zmq.ZMQError as e:
            self._destroy()
            raise UserError(f"KV event publisher: cannot use {endpoint} / {replay_endpoint}: {e}") from None
        self._warn_if_exposed()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _open(self, endpoint: str, replay: str | None, bind: bool | None, host: str | None, hwm: int) -> None:
        """Create, secure and bind (or connect) the XPUB and the replay ROUTER; set the endpoints."""
        self.endpoint, self.replay_endpoint = endpoint, replay
        if bind is None:
            bind = should_bind(endpoint)
        if bind:
            endpoint = with_host(endpoint, host)
        self._pub = self._socket(zmq.XPUB, endpoint)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        if bind:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
        if replay is not None:
            replay = with_host(replay, host)
            self._replay = self._socket(zmq.ROUTER, replay)
            self._replay.setsockopt(zmq.SNDHWM, self._buffer.maxlen + 16)
            self._replay.bind(replay)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if "[" in endpoint:  # an IPv6 address (vLLM's `tcp://[::]:PORT`, or a host given as one)
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    def _warn_if_exposed(self) -> None:
        """Say what leaves this host when an endpoint is reachable from elsewhere without CURVE."""
        if self.curve is not None:
            return
        exposed = [e for e in (self.endpoint, self.replay_endpoint) if e is not None and not is_local(e)]
        if exposed:
            what = "block hashes, prompt token ids" if self.token_ids else "block hashes (token ids off)"
            log.warning(
                "KV events on %s without CURVE: anyone who reaches %s reads every tenant's %s and "
                "event timings, and can subscribe or replay anonymously; bind 127.0.0.1 or a private "
                "interface, or turn CURVE on (docs/security.md, 'The event plane')",
                " and ".join(exposed),
                "it" if len(exposed) == 1 else "them",
                what,
            )

    def _destroy(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    # -- the engine's side -----------------------------------------------------------------------
    def publish(self, events: EventBatch | Sequence[KVEvent], ts: float | None = None) -> int:
        """Queue one batch (an EventBatch, or events stamped with `ts` or now); return its seq."""
        if self._stopping:
            raise RuntimeError("KV event publisher is closed")
        if isinstance(events, EventBatch):
            batch = events
            if batch.data_parallel_rank is None and self.data_parallel_rank is not None:
                batch = msgspec.structs.replace(batch, data_parallel_rank=self.data_parallel_rank)
        else:
            batch = EventBatch(time.time() if ts is None else ts, list(events), self.data_parallel_rank)
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            wake = self._queue.put((seq, batch))
            self.stats.queued += 1
            self.stats.dropped = self._queue.dropped
        if wake:
            self._wake()
        return seq

    def wait_for_subscribers(self, n: int = 1, timeout: float | None = None) -> bool:
        """Block until `n` subscriptions have reached the PUB socket (False on timeout)."""
        with self._subs:
            return self._subs.wait_for(lambda: self.stats.subscriptions >= n, timeout)

    @property
    def next_seq(self) -> int:
        return self._seq

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = self._stopping = True
        self._wake()
        self._thread.join(timeout)
        if self._auth is not None:
            self._auth.stop()
        if not self._thread.is_alive():
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher thread --------------------------------------------------------------------
    def _wake(self) -> None:
        # a full pipe means the thread will wake anyway; a closed one, that it has stopped
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(100))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._pub in ready:
                    self._read_subscriptions()
                if self._gate is not None:
                    self.stats.auth_denied = self._gate.denied
                for seq, batch in self._queue.take_all():
                    try:
                        self._send(seq, batch)
                    except (msgspec.EncodeError, TypeError, ValueError):
                        self.stats.errors += 1  # a bad event must not stop the stream
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._stopping and not len(self._queue):
                    break
        finally:
            self.stats.dropped = self._queue.dropped
            self._pub.close(linger=self._linger_ms)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, batch: EventBatch) -> None:
        if not self.token_ids:
            batch = without_token_ids(batch)
        payload = self._encoder.encode(batch)
        self._pub.send_multipart((self.topic, seq_bytes(seq), payload), copy=False)
        self._buffer.append((seq, payload))
        self.stats.sent += 1
        self.stats.dropped = self._queue.dropped

    def _read_subscriptions(self) -> None:
        """Drain XPUB's (un)subscribe messages; count the subscriptions and wake any waiter."""
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                with self._subs:
                    self.stats.subscriptions += 1
                    self._subs.notify_all()

    def _serve_replay(self) -> None:
        """Answer each waiting request `[id, b"", start_seq]` with the buffered batches from start_seq."""
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident = frames[0]
            if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
                start = int.from_bytes(frames[2], "big")
                self.stats.replay_requests += 1
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart((ident, b"", self.topic, seq_bytes(seq), payload))
            else:
                self.stats.bad_replay_requests += 1
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))
