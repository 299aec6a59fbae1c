"""KV events over real ZMQ sockets on 127.0.0.1: round trips, binding directions, malformed frames, replay."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from agentkv.errors import UserError
from agentkv.events.publisher import END_SEQ, DropOldestQueue, ZmqEventPublisher, seq_bytes, should_bind
from agentkv.events.subscriber import AsyncZmqEventSubscriber, ZmqEventSubscriber
from agentkv.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

T = 5.0  # generous bound for any single wait; never reached when things work
ANY = "tcp://127.0.0.1:*"


def events(i: int) -> list:
    """Batch i: stored, removed or cleared, in turn."""
    kind = i % 3
    if kind == 0:
        return [
            BlockStored(
                block_hashes=[i, i + 1], parent_block_hash=7, token_ids=list(range(64)), block_size=32
            )
        ]
    if kind == 1:
        return [BlockRemoved(block_hashes=[i]), BlockStored(block_hashes=[i + 100], medium="CPU")]
    return [AllBlocksCleared()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connectable(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


@contextmanager
def raw(kind: int, endpoint: str = ANY, bind: bool = True) -> Iterator[zmq.Socket]:
    """A bare socket of `kind` for playing the other side by hand."""
    ctx = zmq.Context()
    s = ctx.socket(kind)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    (s.bind if bind else s.connect)(endpoint)
    try:
        yield s
    finally:
        ctx.destroy(linger=0)


def last_endpoint(s: zmq.Socket) -> str:
    return s.getsockopt_string(zmq.LAST_ENDPOINT)


def wait_subscription(xpub: zmq.Socket) -> None:
    assert xpub.poll(int(T * 1000)), "no subscriber arrived"
    assert xpub.recv()[:1] == b"\x01"


def wait_sent(pub: ZmqEventPublisher, n: int) -> None:
    """Wait until the publisher thread has sent (or rejected) `n` batches."""
    deadline = time.monotonic() + T
    while pub.stats.sent + pub.stats.errors < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pub.stats.sent + pub.stats.errors == n


def recv_n(sub: ZmqEventSubscriber, n: int) -> list:
    out = []
    while len(out) < n:
        r = sub.recv(T)
        assert r is not None, f"timed out after {len(out)} of {n} batches"
        out.append(r)
    return out


def test_should_bind_follows_vllm():
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557") and should_bind("ipc:///tmp/kv")
    assert should_bind("inproc://kv") and not should_bind("tcp://127.0.0.1:5557")


def test_round_trip_publisher_binds_wildcard():
    port = free_port()
    with (
        ZmqEventPublisher(f"tcp://*:{port}", data_parallel_rank=3) as pub,
        ZmqEventSubscriber(f"tcp://127.0.0.1:{port}") as sub,
    ):
        assert pub.wait_for_subscribers(timeout=T)
        for i in range(3):
            assert pub.publish(events(i), ts=100.0 + i) == i
        got = recv_n(sub, 3)
    assert [r.seq for r in got] == [0, 1, 2]
    assert [r.batch.events for r in got] == [events(i) for i in range(3)]
    assert all(r.topic == b"kv-events" and r.batch.data_parallel_rank == 3 and not r.replayed for r in got)
    assert [r.batch.ts for r in got] == [100.0, 101.0, 102.0]
    assert sub.stats.received == 3 and sub.stats.gaps == sub.stats.malformed == 0
    assert pub.stats.sent == 3 and pub.stats.dropped == 0


def test_publisher_connects_and_subscriber_binds_with_callback_api():
    sub = ZmqEventSubscriber(ANY)  # '*' in the endpoint: the subscriber binds
    assert sub.endpoint.startswith("tcp://127.0.0.1:") and "*" not in sub.endpoint
    seen: list = []
    stop = threading.Event()
    worker = threading.Thread(target=sub.run, args=(seen.append, stop))
    try:
        with ZmqEventPublisher(sub.endpoint, topic="kv@rank0") as pub:  # no '*': the publisher connects
            assert pub.endpoint == sub.endpoint
            worker.start()  # a bound SUB sends its subscription only once polled (libzmq #2267)
            assert pub.wait_for_subscribers(timeout=T)
            for i in range(4):
                pub.publish(EventBatch(float(i), events(i)))
            deadline = time.monotonic() + T
            while len(seen) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        stop.set()
        if worker.is_alive():
            worker.join(T)
        sub.close()
    assert [(r.seq, r.topic) for r in seen] == [(i, b"kv@rank0") for i in range(4)]
    assert seen[3].batch.events == events(3)


def test_malformed_frames_are_counted_and_skipped():
    good = encode_batch(EventBatch(1.0, events(0)))
    bad_messages = [
        [b"kv-events", seq_bytes(0)],  # two frames
        [b"kv-events", seq_bytes(0), good, b"extra"],  # four frames
        [b"kv-events", b"\x00" * 7, good],  # 7-byte sequence
        [b"kv-events", seq_bytes(0), b"\xc1 not msgpack"],
        [b"kv-events", seq_bytes(0), msgspec.msgpack.encode({"ts": 1.0})],  # not an array
        [
            b"kv-events",
            seq_bytes(0),
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]),
        ],
        [b"kv-events", seq_bytes(0), msgspec.msgpack.encode([1.0, [{"type": "NoSuchEvent"}], 0])],
    ]
    with raw(zmq.XPUB) as xpub, ZmqEventSubscriber(last_endpoint(xpub)) as sub:
        wait_subscription(xpub)
        for frames in bad_messages:
            xpub.send_multipart(frames)
        xpub.send_multipart([b"kv-events", seq_bytes(0), good])
        xpub.send_multipart([b"kv-events", seq_bytes(1), encode_batch(EventBatch(2.0, events(1)))])
        got = recv_n(sub, 2)
        assert sub.recv(0.05) is None
    assert [r.seq for r in got] == [0, 1] and got[1].batch.events == events(1)
    assert sub.stats.malformed == len(bad_messages) and sub.stats.received == 2


def test_duplicates_are_skipped_and_a_restart_is_accepted():
    payload = encode_batch(EventBatch(1.0, events(2)))
    with raw(zmq.XPUB) as xpub, ZmqEventSubscriber(last_endpoint(xpub)) as sub:
        wait_subscription(xpub)
        for seq in (5, 6, 6, 0, 1):
            xpub.send_multipart([b"t", seq_bytes(seq), payload])
        got = recv_n(sub, 4)
    assert [r.seq for r in got] == [5, 6, 0, 1]
    assert [r.restart for r in got] == [False, False, True, False]
    assert (sub.stats.duplicates, sub.stats.resets, sub.stats.gaps) == (1, 1, 0)


def test_restart_whose_first_batches_were_missed_is_replayed():
    """A publisher restarts on the same endpoints and its first batches go out before the subscriber
    reconnects (slow joiner). Its next batch numbers below the last one seen: a restart, and the
    missed batches come from the new publisher's replay buffer, the first marked `restart`."""
    port, rep = free_port(), f"tcp://127.0.0.1:{free_port()}"
    ep, bind = f"tcp://127.0.0.1:{port}", f"tcp://*:{port}"  # `*`: the publisher binds (vLLM's rule)
    with ZmqEventSubscriber(ep, rep, start_seq=0) as sub:
        with ZmqEventPublisher(bind, rep) as old:
            assert old.wait_for_subscribers(timeout=T)
            for i in range(5):
                old.publish(events(i), ts=float(i))
            assert [r.seq for r in recv_n(sub, 5)] == list(range(5))
        sub._sub.disconnect(ep)  # the subscriber is away while the new publisher starts
        with ZmqEventPublisher(bind, rep) as new:
            new.publish(events(10), ts=10.0)
            new.publish(events(11), ts=11.0)
            wait_sent(new, 2)
            sub._sub.connect(ep)
            assert new.wait_for_subscribers(timeout=T)
            new.publish(events(12), ts=12.0)
            got = recv_n(sub, 3)
    assert [(r.seq, r.replayed, r.restart) for r in got] == [
        (0, True, True),
        (1, True, False),
        (2, False, False),
    ]
    assert [r.batch.events for r in got] == [events(10), events(11), events(12)]
    assert (sub.stats.resets, sub.stats.duplicates, sub.stats.recovered, sub.stats.lost) == (1, 0, 2, 0)


def test_restart_that_got_past_the_old_numbering_is_not_taken_for_a_gap():
    """The new publisher sends more batches than the old one did before the subscriber is back, so
    the next seq seen is ahead, not behind. Replay shows another batch under the last seq delivered:
    a restart, and everything of the new publisher is delivered from seq 0, the first marked."""
    port, rep = free_port(), f"tcp://127.0.0.1:{free_port()}"
    ep, bind = f"tcp://127.0.0.1:{port}", f"tcp://*:{port}"
    with ZmqEventSubscriber(ep, rep, start_seq=0) as sub:
        with ZmqEventPublisher(bind, rep) as old:
            assert old.wait_for_subscribers(timeout=T)
            for i in range(3):
                old.publish(events(i), ts=float(i))
            assert [r.seq for r in recv_n(sub, 3)] == [0, 1, 2]
        sub._sub.disconnect(ep)
        with ZmqEventPublisher(bind, rep) as new:
            for i in range(6):
                new.publish(events(20 + i), ts=20.0 + i)
            wait_sent(new, 6)
            sub._sub.connect(ep)
            assert new.wait_for_subscribers(timeout=T)
            new.publish(events(26), ts=26.0)
            got = recv_n(sub, 7)
    assert [r.seq for r in got] == list(range(7))
    assert [r.restart for r in got] == [True] + [False] * 6
    assert [r.batch.events for r in got] == [events(20 + i) for i in range(7)]
    assert (sub.stats.resets, sub.stats.gaps, sub.stats.recovered, sub.stats.lost) == (1, 1, 6, 0)


def test_a_repeat_of_the_last_seq_with_other_content_is_a_restart():
    first, other = encode_batch(EventBatch(1.0, events(0))), encode_batch(EventBatch(2.0, events(1)))
    with raw(zmq.XPUB) as xpub, ZmqEventSubscriber(last_endpoint(xpub)) as sub:
        wait_subscription(xpub)
        for seq, payload in ((0, first), (1, first), (1, first), (1, other), (2, other)):
            xpub.send_multipart([b"t", seq_bytes(seq), payload])
        got = recv_n(sub, 3)
    assert [(r.seq, r.restart) for r in got] == [(0, False), (1, False), (1, True)]
    assert (sub.stats.duplicates, sub.stats.resets) == (1, 1)


def test_gap_triggers_replay_and_recovers_missing_batches():
    """A lossy relay between publisher and subscriber drops seqs 2 and 3; replay fills them in."""
    with (
        ZmqEventPublisher(ANY, ANY) as pub,
        raw(zmq.SUB, pub.endpoint, bind=False) as relay_in,
        raw(zmq.XPUB) as relay_out,
        ZmqEventSubscriber(last_endpoint(relay_out), pub.replay_endpoint) as sub,
    ):
        assert pub.wait_for_subscribers(timeout=T)
        wait_subscription(relay_out)
        for i in range(6):
            pub.publish(events(i), ts=float(i))
        for _ in range(6):
            assert relay_in.poll(int(T * 1000))
            frames = relay_in.recv_multipart()
            if int.from_bytes(frames[1], "big") not in (2, 3):
                relay_out.send_multipart(frames)
        got = recv_n(sub, 6)
    assert [r.seq for r in got] == list(range(6))
    assert [r.replayed for r in got] == [False, False, True, True, False, False]
    assert [r.batch.events for r in got] == [events(i) for i in range(6)]
    assert (sub.stats.gaps, sub.stats.recovered, sub.stats.lost, sub.stats.replay_requests) == (1, 2, 0, 1)
    assert pub.stats.replay_requests == 1


def test_gap_beyond_the_replay_buffer_is_counted_as_lost():
    with (
        ZmqEventPublisher(ANY, ANY, buffer_steps=1) as pub,
        raw(zmq.SUB, pub.endpoint, bind=False) as relay_in,
        raw(zmq.XPUB) as relay_out,
        ZmqEventSubscriber(last_endpoint(relay_out), pub.replay_endpoint) as sub,
    ):
        assert pub.wait_for_subscribers(timeout=T)
        wait_subscription(relay_out)
        for i in range(5):
            pub.publish(events(i))
        for _ in range(5):
            assert relay_in.poll(int(T * 1000))
            frames = relay_in.recv_multipart()
            if int.from_bytes(frames[1], "big") in (0, 4):
                relay_out.send_multipart(frames)
        got = recv_n(sub, 2)
    assert [r.seq for r in got] == [0, 4]
    assert (sub.stats.gaps, sub.stats.recovered, sub.stats.lost) == (1, 0, 3)


def test_replay_socket_wire_format_bounded_buffer_and_end_marker():
    with ZmqEventPublisher(ANY, ANY, buffer_steps=3, topic="kv") as pub:
        for i in range(5):
            pub.publish(events(i), ts=float(i))
        wait_sent(pub, 5)
        with raw(zmq.DEALER, pub.replay_endpoint, bind=False) as dealer:

            def ask(request: list[bytes]) -> list[list[bytes]]:
                dealer.send_multipart(request)
                replies = []
                while True:
                    assert dealer.poll(int(T * 1000)), "no end marker"
                    replies.append(dealer.recv_multipart())
                    if replies[-1][2:3] == [END_SEQ]:
                        return replies

            replies = ask([b"", seq_bytes(0)])
            assert [f[:3] for f in replies[:-1]] == [[b"", b"kv", seq_bytes(s)] for s in (2, 3, 4)]
            assert [decode_batch(f[3]).events for f in replies[:-1]] == [events(s) for s in (2, 3, 4)]
            assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
            assert [int.from_bytes(f[2], "big") for f in ask([b"", seq_bytes(4)])[:-1]] == [4]
            assert ask([b"", seq_bytes(99)]) == [[b"", b"", END_SEQ, b""]]
            assert ask([b"", b"short"]) == [[b"", b"", END_SEQ, b""]]
        with ZmqEventSubscriber("tcp://127.0.0.1:1", pub.replay_endpoint) as sub:
            assert [(r.seq, r.replayed) for r in sub.replay(3)] == [(3, True), (4, True)]
    assert (pub.stats.replay_requests, pub.stats.bad_replay_requests) == (4, 1)


def test_async_subscriber_replays_batches_sent_before_it_joined():
    async def main() -> tuple[list, object]:
        with ZmqEventPublisher(ANY, ANY) as pub:
            for i in range(3):  # nobody listens yet: only the replay buffer keeps these
                pub.publish(events(i))
            wait_sent(pub, 3)
            sub = AsyncZmqEventSubscriber(connectable(pub.endpoint), pub.replay_endpoint, start_seq=0)
            try:
                assert await asyncio.to_thread(pub.wait_for_subscribers, 1, T)
                pub.publish(events(3))
                got = []
                async for r in sub:
                    got.append(r)
                    if len(got) == 4:
                        break
                return got, sub.stats
            finally:
                sub.close()

    got, stats = asyncio.run(asyncio.wait_for(main(), 4 * T))
    assert [(r.seq, r.replayed) for r in got] == [(0, True), (1, True), (2, True), (3, False)]
    assert [r.batch.events for r in got] == [events(i) for i in range(4)]
    assert (stats.gaps, stats.recovered, stats.lost) == (1, 3, 0)


def test_drop_oldest_queue_never_blocks_and_counts_drops():
    q = DropOldestQueue(2)
    assert q.put(1) is True and q.put(2) is False and q.put(3) is False
    assert q.dropped == 1 and q.take_all() == [2, 3] and len(q) == 0
    assert q.put(4) is True  # the consumer needs waking again after it drained the queue


def test_publisher_errors_and_close():
    with ZmqEventPublisher(ANY) as pub:
        with pytest.raises(UserError, match="cannot use"):
            ZmqEventPublisher(ANY, replay_endpoint=pub.endpoint)  # that port is taken
        pub.publish([object()])  # unencodable: counted, the thread keeps going
        pub.publish(events(0))
        wait_sent(pub, 2)
        assert (pub.stats.errors, pub.stats.sent) == (1, 1)
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(events(1))
