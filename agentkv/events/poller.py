"""One thread for many KV-event subscribers: a `zmq.Poller` over every SUB socket, each wake's
batches handed over together (a router with N workers wakes one thread, not N).

The subscribers' own bookkeeping applies unchanged (`SeqTracker`: malformed frames counted and
skipped, gaps replayed, restarts marked); a replay is waited on without blocking: while one is in
flight its stream's SUB socket is left unread (order is kept) and the other streams go on. The
handshake monitors are read at most every `WATCH_S`. Streams are added and removed at any time
from any thread; the poller thread closes what it removes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import zmq

from agentkv.events.subscriber import WATCH_S, PendingReplay, Received, ZmqEventSubscriber

log = logging.getLogger("agentkv.events")

# after a wake that delivered, the thread waits this long before polling again, so the batches of
# busy publishers come in fewer wakes (a wake costs ~150 us of CPU on loopback whatever it brings);
# an event is applied at most this much later. 20 ms halved the thread's CPU per batch at 500
# batches/s (benchmarks/event_thread.py) but a turn sent within it after its previous turn's events
# was routed without them: tests/test_routing_quality.py failed 6 of 7 runs at 20 ms, 1 of 5 at
# 10 ms, 0 of 7 at 5 ms (docs/scale-out.md). A quiet stream's lone batch comes at once.
COALESCE_S = 0.005
MAX_READS = 256
RESTART_S = 0.1  # the pause before a failed thread loop starts over (a bug that repeats logs 10 a second)
# plain ints: pyzmq's enum members cost an enum call per use (recv_multipart asks RCVMORE with one)
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


@dataclass(eq=False)
class Delivery:
    """One stream's batches from one wake; `catch_up` for the replay-buffer read at subscription."""

    key: object
    sub: ZmqEventSubscriber
    batches: list[Received] = field(default_factory=list)
    catch_up: bool = False


@dataclass(eq=False)
class _Stream:
    key: object
    sub: ZmqEventSubscriber
    label: str
    replay: PendingReplay | None = None
    steps: Generator[int, list[Received], list[Received]] | None = None  # the message awaiting replay
    refused: int = 0  # handshake failures already reported


class EventPoller:
    """`deliver(deliveries)` is called on the poller thread once per wake that brought batches."""

    def __init__(
        self,
        deliver: Callable[[list[Delivery]], None],
        name: str = "agentkv-events",
        coalesce_s: float = COALESCE_S,
    ) -> None:
        self.deliver, self.name, self.coalesce_s = deliver, name, coalesce_s
        self.wakes = 0  # wakes that delivered something (a benchmark's figure)
        self.restarts = 0  # times the thread's loop failed and started over
        self._poller = zmq.Poller()
        self._streams: dict[zmq.Socket, _Stream] = {}  # by the socket it now waits on
        self._replaying: set[_Stream] = set()  # those waiting on a replay
        self._commands: deque[tuple[str, ZmqEventSubscriber, object, str, bool]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._lock = threading.Lock()  # guards the thread's start and stop

    def add(self, sub: ZmqEventSubscriber, key: object, label: str, catch_up: bool = False) -> None:
        """Start polling `sub` (its batches delivered under `key`); `catch_up` reads its publisher's
        replay buffer from 0 first. `label` names it in log lines ("worker 3")."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("event poller is closed")
            self._commands.append(("add", sub, key, label, catch_up))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._wake()

    def remove(self, sub: ZmqEventSubscriber) -> None:
        """Stop polling `sub` and close it (on the poller thread; at once if none ever ran)."""
        with self._lock:
            if self._thread is None:
                sub.close()
                return
            self._commands.append(("remove", sub, None, "", False))
        self._wake()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every subscriber still polled."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._close_all()
            self._wake_r.close()
            self._wake_w.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe wakes it already; a closed one has no thread
            self._wake_w.send(b"x")

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        """The thread: `_loop`, started over (logged, counted in `restarts`) if a bug ends it, so the
        router does not go on routing without events while nothing says so."""
        while not self._stopping:
            try:
                self._loop()
            except Exception:
                self.restarts += 1
                log.exception("%s: the KV-event thread failed; it starts over in %g s", self.name, RESTART_S)
                time.sleep(RESTART_S)

    def _loop(self) -> None:
        watch_at = 0.0
        poll, wake = self._poller.poll, self._wake_r.fileno()
        while not self._stopping:
            if self._commands:
                self._apply_commands()
            out: dict[int, Delivery] = {}
            for sock, _ in poll(self._timeout_ms(watch_at)):
                st = self._streams.get(sock)
                if st is None:
                    if sock == wake:
                        self._drain_wake()
                    continue
                try:
                    if st.replay is None:
                        self._read(st, out)
                    elif st.replay.take():
                        self._replayed(st, out)
                except Exception:  # a bug or a socket error: that stream ends, the others go on
                    log.exception("%s: KV events no longer read from %s", st.label, st.sub.endpoint)
                    out.pop(id(st), None)
                    self._drop(st.sub)
            now = time.monotonic()
            for st in [st for st in self._replaying if now >= st.replay.deadline]:
                st.replay.expire()
                self._replayed(st, out)
            if now >= watch_at:
                watch_at = now + WATCH_S
                self._watch()
            if out:
                self.wakes += 1
                self._hand_over(list(out.values()))
                if self.coalesce_s > 0:
                    time.sleep(self.coalesce_s)

    def _timeout_ms(self, watch_at: float) -> int:
        due = min(watch_at, *(st.replay.deadline for st in self._replaying)) if self._replaying else watch_at
        return max(0, min(int((due - time.monotonic()) * 1000) + 1, int(WATCH_S * 1000)))

    def _hand_over(self, deliveries: list[Delivery]) -> None:
        try:
            self.deliver(deliveries)
        except Exception:  # one bad batch must not end every stream's events
            log.exception("%s: applying KV events failed; those batches are skipped", self.name)

    def _read(self, st: _Stream, out: dict[int, Delivery]) -> None:
        """Take the stream's ready messages through its tracker, up to a replay one needs (at most
        MAX_READS a wake, so one busy stream cannot starve the others)."""
        sock, tracker = st.sub.socket, st.sub.tracker
        recv, get = sock.recv, sock.getsockopt
        got: list[Received] = []
        try:
            for _ in range(MAX_READS):
                try:
                    f = recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    return
                frames = [f.bytes]
                while f.more:  # the rest of a multipart message is there with its first frame
                    f = recv(_NOBLOCK, copy=False)
                    frames.append(f.bytes)
                r = tracker.decode(frames)
                if r is not None:
                    if tracker.in_order(r):
                        got += tracker.accept(r, None, [])
                    elif self._follow(st, tracker.follow(r, st.sub.replay_endpoint is not None), got):
                        return
                if not get(_EVENTS) & _POLLIN:  # cheaper than a read raising zmq.Again
                    return
        finally:
            if got:
                self._out(st, out).batches.extend(got)

    def _follow(self, st: _Stream, steps, got: list[Received]) -> bool:
        """Run a message that jumps or skips ahead to its first replay (True: reading stops there)."""
        try:
            start = next(steps)
        except StopIteration as done:
            got += done.value
            return False
        st.steps = steps
        self._begin_replay(st, start)
        return True

    def _begin_replay(self, st: _Stream, start: int) -> None:
        self._unwatch(st)
        st.replay = PendingReplay(st.sub, start)
        self._poller.register(st.replay.sock, zmq.POLLIN)
        self._streams[st.replay.sock] = st
        self._replaying.add(st)

    def _replayed(self, st: _Stream, out: dict[int, Delivery]) -> None:
        """A replay ended (answered or timed out): hand the replies on, then read live again."""
        assert st.replay is not None
        replies = st.replay.out
        self._unwatch(st)
        st.replay.close()
        st.replay = None
        self._replaying.discard(st)
        if st.steps is None:  # the catch-up read at subscription
            out[id(st)] = Delivery(st.key, st.sub, replies, catch_up=True)
        else:
            try:
                start = st.steps.send(replies)
            except StopIteration as done:
                st.steps = None
                self._out(st, out).batches.extend(done.value)
            else:
                self._begin_replay(st, start)
                return
        self._poller.register(st.sub.socket, zmq.POLLIN)
        self._streams[st.sub.socket] = st

    def _out(self, st: _Stream, out: dict[int, Delivery]) -> Delivery:
        """This wake's delivery for `st` (a catch-up ends a wake's reading of its stream, so a
        stream's live batches never share a wake with its catch-up)."""
        d = out.get(id(st))
        if d is None:
            d = out[id(st)] = Delivery(st.key, st.sub)
        return d

    def _unwatch(self, st: _Stream) -> None:
        sock = st.replay.sock if st.replay is not None else st.sub.socket
        self._poller.unregister(sock)
        del self._streams[sock]

    def _watch(self) -> None:
        """Read every handshake monitor (reconnecting after failures); report a refused one once."""
        for st in self._streams.values():
            st.sub.watch()
            failures = st.sub.stats.handshake_failures
            if failures > st.refused:
                if not st.refused:  # once per subscription: the counter on /metrics keeps the rest
                    log.warning(
                        "%s: KV event handshake refused at %s: the publisher there lacks the pinned "
                        "CURVE key, or CURVE is on at one end only; nothing from it is applied",
                        st.label,
                        st.sub.endpoint,
                    )
                st.refused = failures

    def _apply_commands(self) -> None:
        while self._commands:
            op, sub, key, label, catch_up = self._commands.popleft()
            if op == "add":
                st = _Stream(key, sub, label)
                if catch_up and sub.replay_endpoint is not None:
                    self._streams[sub.socket] = st
                    self._poller.register(sub.socket, zmq.POLLIN)
                    self._begin_replay(st, 0)
                else:
                    self._poller.register(sub.socket, zmq.POLLIN)
                    self._streams[sub.socket] = st
            else:
                self._drop(sub)

    def _drop(self, sub: ZmqEventSubscriber) -> None:
        for st in list(self._streams.values()):
            if st.sub is sub:
                self._unwatch(st)
                if st.replay is not None:
                    st.replay.close()
                    self._replaying.discard(st)
        sub.close()

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _close_all(self) -> None:
        while self._commands:
            op, sub, *_ = self._commands.popleft()
            sub.close()
        for st in {id(st): st for st in self._streams.values()}.values():
            self._drop(st.sub)
