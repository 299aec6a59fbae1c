"""Sequence numbers from a hostile or corrupt stream, over real ZMQ sockets on 127.0.0.1: a forged
huge seq is counted malformed, never as 1.8e19 lost batches, and the stream goes on; a genuine far
jump (a subscriber joining a long-running publisher) is believed once the publisher vouches for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
from zmqutil import serve_replay

from agentkv.events.publisher import seq_bytes
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.events.tracker import MAX_SEQ_JUMP, SEQ_LIMIT
from agentkv.kv.events import BlockStored, EventBatch, encode_batch

T = 5.0


def payload(i: int) -> bytes:
    return encode_batch(EventBatch(float(i), [BlockStored(block_hashes=[i])]))


class Wire:
    """A hand-driven publisher: live frames we choose on an XPUB, and a replay ROUTER serving `buffer`."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{self.rep.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int, data: bytes, keep: bool = True) -> None:
        if keep:
            self.buffer[seq] = data
        self.pub.send_multipart([b"kv-events", seq_bytes(seq), data])

    def _serve(self) -> None:
        serve_replay(self.rep, lambda: self.buffer, self._stop)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(T)
        self.ctx.destroy(linger=0)


@contextmanager
def wired(replay: bool) -> Iterator[tuple[Wire, ZmqEventSubscriber]]:
    wire = Wire()
    sub = ZmqEventSubscriber(wire.endpoint, wire.replay_endpoint if replay else None, start_seq=0)
    try:
        assert wire.pub.poll(int(T * 1000)) and wire.pub.recv()[:1] == b"\x01"  # subscribed
        yield wire, sub
    finally:
        sub.close()
        wire.close()


def take(sub: ZmqEventSubscriber, n: int) -> list:
    out = [sub.recv(T) for _ in range(n)]
    assert None not in out
    return out


def counters(sub: ZmqEventSubscriber) -> dict[str, int]:
    s = sub.stats
    return {
        "received": s.received,
        "malformed": s.malformed,
        "lost": s.lost,
        "gaps": s.gaps,
        "resets": s.resets,
    }


def test_forged_huge_seqs_are_malformed_and_the_stream_goes_on():
    """Seqs at 2**64 - 1, 2**63 and 2**53 are malformed outright; a lone jump to 2**40 is refused
    (malformed): replay does not hold it, or without replay no next message continues it. The real
    stream goes on unharmed. (Before, 2**64 - 1 counted 1.8e19 lost batches.)"""
    for replay in (False, True):
        with wired(replay) as (wire, sub):
            for i in range(3):
                wire.send(i, payload(i))
            for forged in (2**64 - 1, 2**63, SEQ_LIMIT, 2**40):
                wire.send(forged, payload(99), keep=False)
            wire.send(3, payload(3))
            wire.send(4, payload(4))
            got = take(sub, 5)
            c = counters(sub)
        print(f"\nforged seqs 2**64-1, 2**63, 2**53, 2**40 ({'with' if replay else 'no'} replay): {c}")
        assert [r.seq for r in got] == [0, 1, 2, 3, 4] and not any(r.restart for r in got)
        assert c == {"received": 5, "malformed": 4, "lost": 0, "gaps": 0, "resets": 0}


def test_a_genuine_far_jump_is_believed_when_the_publisher_vouches():
    """A subscriber joins a publisher already at seq 5,000,000: replay holds that batch, so it is
    taken, the buffered batches before it replayed, and what the buffer lost counted honestly."""
    start = 5_000_000
    with wired(True) as (wire, sub):
        wire.buffer = {start - 2: payload(1), start - 1: payload(2)}
        wire.send(start, payload(3))
        got = take(sub, 3)
        c = counters(sub)
    print(f"\ngenuine jump 0 -> {start:,} vouched by replay: {c}")
    assert [(r.seq, r.replayed) for r in got] == [(start - 2, True), (start - 1, True), (start, False)]
    assert c == {"received": 3, "malformed": 0, "lost": start - 2, "gaps": 1, "resets": 0}


def test_without_replay_a_far_jump_continued_is_a_restart_not_a_loss():
    """Without replay nothing can vouch: a far jump is held back until the next message continues
    it, then taken as a restart (the consumer rebuilds); never counted as lost batches."""
    with wired(False) as (wire, sub):
        wire.send(0, payload(0))
        far = MAX_SEQ_JUMP + 10
        for seq in (far, far + 1, far + 2):
            wire.send(seq, payload(seq))
        got = take(sub, 3)
        c = counters(sub)
    print(f"\nno replay, 0 -> {far:,} -> {far + 1:,}: {c}")
    assert [(r.seq, r.restart) for r in got] == [(0, False), (far + 1, True), (far + 2, False)]
    assert c == {"received": 3, "malformed": 1, "lost": 0, "gaps": 0, "resets": 1}
