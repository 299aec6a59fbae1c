"""The KV event plane closed, over real ZMQ sockets on 127.0.0.1: with CURVE an anonymous or unlisted
subscriber reads nothing, a publisher without the pinned worker key injects nothing into the
router's index, the configured publisher's events arrive; token ids can be left out of BlockStored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
import zmq
from zmqutil import until

from agentkv.events.curve import CurveClient, CurveServer, is_local, with_host
from agentkv.events.publisher import ZmqEventPublisher, seq_bytes
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import AllBlocksCleared, BlockStored, EventBatch, encode_batch
from agentkv.route.index import Match, TenantIndex
from agentkv.route.workers import WorkerPool, WorkerSpec

T = 5.0
N = 200  # batches published in each exposure check


def keypair() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


def stored(i: int) -> list:
    """One block of 16 token ids drawn from a real vocabulary's range (3 msgpack bytes each)."""
    tokens = [1000 + (i * 7919 + j * 104729) % 30000 for j in range(16)]
    return [BlockStored(block_hashes=[1000 + i], token_ids=tokens, block_size=16)]


def drain(sock: zmq.Socket, wait: float) -> int:
    """Messages a socket receives within `wait` seconds."""
    n, end = 0, time.monotonic() + wait
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            sock.recv_multipart()
            n += 1
    return n


def test_curve_publisher_serves_only_admitted_subscribers():
    """Anonymous SUB and DEALER, and a CURVE client with an unlisted key (the worker's public key is
    public), get nothing from the PUB or the replay socket; the admitted router gets every batch."""
    server, router, stranger = keypair(), keypair(), keypair()
    curve = CurveServer(*server, allowed=frozenset({router[0]}))
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve) as pub:
        ctx = zmq.Context()
        try:
            anon_sub, anon_dealer, odd_sub = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
            CurveClient(*stranger, server=server[0]).apply(odd_sub)
            for s in (anon_sub, odd_sub):
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.connect(pub.endpoint)
            anon_dealer.connect(pub.replay_endpoint)
            with ZmqEventSubscriber(
                pub.endpoint, pub.replay_endpoint, curve=CurveClient(*router, server[0])
            ) as sub:
                assert pub.wait_for_subscribers(1, timeout=T)
                time.sleep(0.3)  # the others' handshakes have long been refused by now
                for i in range(N):
                    pub.publish(stored(i), ts=float(i))
                got = []
                while len(got) < N and (r := sub.recv(T)) is not None:
                    got.append(r)
                with contextlib.suppress(zmq.Again):  # no peer at all once the handshake failed
                    anon_dealer.send_multipart([b"", seq_bytes(0)], zmq.NOBLOCK)
                anon_n, odd_n, replay_n = drain(anon_sub, 1.0), drain(odd_sub, 0.1), drain(anon_dealer, 0.1)
                replayed = sub.replay(0)
        finally:
            ctx.destroy(linger=0)
        stats = pub.stats
    print(
        f"\nCURVE publisher, {N} batches: admitted router {len(got)}, anonymous SUB {anon_n}, "
        f"unlisted CURVE key {odd_n}, anonymous replay {replay_n} (router's replay {len(replayed)}); "
        f"subscriptions seen {stats.subscriptions}, handshakes refused {stats.auth_denied}"
    )
    assert [r.seq for r in got] == list(range(N)) and len(replayed) == N
    assert anon_n == odd_n == replay_n == 0
    assert stats.subscriptions == 1 and stats.auth_denied >= 1  # the unlisted key asked and was refused


def test_a_bound_subscriber_takes_events_only_from_the_pinned_publisher():
    """The router's SUB binds and publishers connect (vLLM's other direction): a publisher with its
    own key pair, and one without CURVE, reach nothing; the worker holding the pinned key does."""
    worker, forger, router = keypair(), keypair(), keypair()
    allowed = frozenset({router[0]})
    with ZmqEventSubscriber("tcp://127.0.0.1:*", curve=CurveClient(*router, server=worker[0])) as sub:
        ep = sub.endpoint
        with (
            ZmqEventPublisher(ep, curve=CurveServer(*forger, allowed)) as forged,
            ZmqEventPublisher(ep) as plain,
            ZmqEventPublisher(ep, curve=CurveServer(*worker, allowed)) as real,
        ):
            deadline = time.monotonic() + T
            while not real.stats.subscriptions and time.monotonic() < deadline:
                sub.recv(0.05)  # a bound SUB subscribes once polled (libzmq #2267)
            for i in range(50):
                forged.publish([AllBlocksCleared()], ts=float(i))
                plain.publish([AllBlocksCleared()], ts=float(i))
            real.publish(stored(7), ts=7.0)
            got = sub.recv(T)
            rest = sub.recv_batches(0.5)
        subs = (forged.stats.subscriptions, plain.stats.subscriptions, real.stats.subscriptions)
    print(f"\nbound SUB: forged 50 + plain 50 batches sent, received {1 + len(rest)}; subscriptions {subs}")
    assert got is not None and got.batch.events == stored(7) and rest == []
    assert subs == (0, 0, 1) and sub.stats.malformed == 0


def test_forged_publisher_never_reaches_the_router_index():
    """The worker's endpoints are taken by an impostor (its own key pair, then no CURVE at all):
    its stores and AllBlocksCleared never reach the router's index; then the real worker's do."""
    worker, forger, router = keypair(), keypair(), keypair()
    allowed = frozenset({router[0]})

    async def main() -> tuple[int, int, dict]:
        probe = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        ep, rep = probe.endpoint, probe.replay_endpoint
        probe.close()  # two free ports, released for the impostors and the worker
        index = TenantIndex()
        spec = WorkerSpec("http://127.0.0.1:9", ep, rep, curve=CurveClient(*router, server=worker[0]))
        pool = WorkerPool([spec], index, 16, health_interval=3600, scrape_interval=0)
        forged_sent = 0
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                for curve in (CurveServer(*forger, allowed), None):
                    with ZmqEventPublisher(ep, rep, bind=True, curve=curve) as fake:
                        for i in range(100):
                            fake.publish(stored(i) + [AllBlocksCleared()] * (i % 10 == 9), ts=float(i))
                            forged_sent += 1
                            await asyncio.sleep(0.005)
                        await asyncio.sleep(0.5)
                        assert fake.stats.subscriptions == 0
                assert index.blocks(0) == 0 and pool.workers[0].events_applied == 0
                sub = pool.workers[0].subscriber
                quiet = (sub.stats.received, sub.stats.malformed, sub.stats.lost)
                with ZmqEventPublisher(ep, rep, bind=True, curve=CurveServer(*worker, allowed)) as real:
                    real.publish(stored(1), ts=1.0)  # maybe before the router reconnects: replay brings it
                    assert await asyncio.to_thread(real.wait_for_subscribers, 1, T)
                    real.publish(stored(2), ts=2.0)
                    assert await until(lambda: index.find_matches("", [1002]) == {0: Match(1)})
                    assert index.find_matches("", [1001]) == {0: Match(1)}
                return (
                    forged_sent,
                    pool.workers[0].events_applied,
                    {
                        "received, malformed, lost before the real worker": quiet,
                        "handshakes refused": sub.stats.handshake_failures,
                    },
                )
            finally:
                await pool.close()

    forged, applied, quiet = asyncio.run(main())
    print(f"\nrouter index: {forged} forged batches -> 0 applied; real worker -> {applied} events; {quiet}")
    assert quiet["received, malformed, lost before the real worker"] == (0, 0, 0) and applied == 2
    assert quiet["handshakes refused"] >= 2  # one impostor each, at least


def test_token_ids_off_leaves_them_out_live_and_in_replay():
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token_ids=False) as off,
        ZmqEventSubscriber(off.endpoint, off.replay_endpoint) as sub,
    ):
        assert off.wait_for_subscribers(timeout=T)
        for i in range(1, 21):
            off.publish(stored(i) + [AllBlocksCleared()], ts=float(i))
        live = [sub.recv(T) for _ in range(20)]
        replayed = sub.replay(0)
    ev = [e for r in live + replayed for e in r.batch.events if isinstance(e, BlockStored)]
    assert len(ev) == 40 and all(e.token_ids == [] and e.block_hashes and e.block_size == 16 for e in ev)
    on = sum(len(encode_batch(EventBatch(float(i), stored(i) + [AllBlocksCleared()]))) for i in range(1, 21))
    print(f"\ntoken ids off: 20 batches, {sum(len(r.payload) for r in live)} bytes ({on} with token ids)")


@pytest.mark.parametrize(
    "endpoint, local",
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://[::1]:5557", True),
        ("tcp://localhost:5557", True),
        ("ipc:///tmp/kv", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False),
        ("tcp://[::]:5557", False),
        ("tcp://10.0.0.5:5557", False),
        ("tcp://eth0:5557", False),
    ],
)
def test_is_local(endpoint, local):
    assert is_local(endpoint) is local


def test_with_host_binds_a_wildcard_where_asked():
    assert with_host("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert with_host("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert with_host("tcp://*:5557", "*") == with_host("tcp://*:5557", None) == "tcp://*:5557"
    assert with_host("tcp://10.0.0.5:5557", "127.0.0.1") == "tcp://10.0.0.5:5557"


def test_ipc_endpoints_are_local_and_carry_events(tmp_path):
    """What the docs advise for vLLM on the router's host: ipc:// event and replay endpoints."""
    ep, rep = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    with ZmqEventPublisher(ep, rep) as pub, ZmqEventSubscriber(ep, rep, start_seq=0) as sub:
        assert is_local(pub.endpoint) and is_local(pub.replay_endpoint)
        pub.publish(stored(1), ts=1.0)  # maybe before the subscription: replay brings it
        assert pub.wait_for_subscribers(timeout=T)
        pub.publish(stored(2), ts=2.0)
        got = [sub.recv(T), sub.recv(T)]
    assert [r.batch.events for r in got] == [stored(1), stored(2)]
