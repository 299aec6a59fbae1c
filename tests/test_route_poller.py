"""The router's one KV-event thread for all workers, on real ZMQ sockets and a real /health server:
three workers' events reach the index through a single thread, a worker that dies and comes back
is subscribed again, and one worker's garbage or silent replay socket does not hold up the others."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import msgspec
import zmq
from aiohttp import web
from zmqutil import RawPublisher, until

from agentkv.events.poller import Delivery, EventPoller
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored
from agentkv.route.index import Match, TenantIndex
from agentkv.route.workers import WorkerPool, WorkerSpec


def event_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("route-events")]


def chain(k: int, n: int = 4) -> list[int]:
    return [1000 * k + i for i in range(n)]


def pool_for(specs: list[WorkerSpec], index: TenantIndex, **kw) -> WorkerPool:
    return WorkerPool(
        specs, index, 16, health_interval=kw.pop("health_interval", 3600), scrape_interval=0, **kw
    )


def test_three_workers_one_thread_and_garbage_from_one_is_skipped():
    async def main() -> None:
        pubs = [RawPublisher() for _ in range(3)]
        index = TenantIndex()
        specs = [WorkerSpec(f"http://127.0.0.1:{9 + i}", *p.endpoints) for i, p in enumerate(pubs)]
        for i, p in enumerate(pubs):  # published before the router started: caught up by replay
            p.batch(0, BlockStored(block_hashes=chain(i)))
        pool = pool_for(specs, index)
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                assert await until(
                    lambda: all(index.find_matches("", chain(i)) == {i: Match(4)} for i in range(3))
                )
                assert event_threads() == ["route-events"]
                live = [
                    p.batch(1, BlockStored(block_hashes=chain(10 + i), parent_block_hash=chain(i)[-1]))
                    for i, p in enumerate(pubs)
                ]

                def tick() -> None:  # worker 0 sends garbage between its real batches
                    for junk in (
                        [b"kv-events", b"\x00" * 8, b"\xc1 not msgpack"],
                        [b"short"],
                        [b"a", b"b", b"c", b"d"],
                    ):
                        pubs[0].pub.send_multipart(junk)
                    for p, payload in zip(pubs, live, strict=True):
                        p.send(1, payload)

                whole = [chain(i) + chain(10 + i) for i in range(3)]
                assert await until(
                    lambda: all(index.find_matches("", whole[i]) == {i: Match(8)} for i in range(3)),
                    tick=tick,
                )
                w0, w1 = pool.workers[0], pool.workers[1]
                assert w0.subscriber.stats.malformed >= 3 and w1.subscriber.stats.malformed == 0
                assert [w.events_applied for w in pool.workers] == [2, 2, 2]
                assert event_threads() == ["route-events"]
            finally:
                await pool.close()
                for p in pubs:
                    p.close()
        assert await until(lambda: not event_threads(), timeout=3)

    asyncio.run(main())


def test_a_silent_replay_socket_does_not_hold_up_other_workers():
    """Worker 0's replay socket takes requests and never answers (1 s timeout each): worker 1's live
    events are applied meanwhile, and worker 0's arrive once its replay gives up."""

    async def main() -> None:
        ctx = zmq.Context()
        mute = ctx.socket(zmq.ROUTER)  # accepts replay requests, answers none
        mport = mute.bind_to_random_port("tcp://127.0.0.1")
        quiet, other = RawPublisher(), RawPublisher()
        index = TenantIndex()
        specs = [
            WorkerSpec("http://127.0.0.1:9", quiet.endpoints[0], f"tcp://127.0.0.1:{mport}"),
            WorkerSpec("http://127.0.0.1:10", *other.endpoints),
        ]
        pool = pool_for(specs, index)
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                w0 = pool.workers[0]
                b = other.batch(0, BlockStored(block_hashes=chain(1)))
                assert await until(lambda: index.blocks(1) == 4, tick=lambda: other.send(0, b))
                assert w0.subscriber.stats.replay_requests == 1 and w0.subscriber.stats.replay_timeouts == 0
                a = quiet.batch(0, BlockStored(block_hashes=chain(0)))
                assert await until(lambda: index.blocks(0) == 4, tick=lambda: quiet.send(0, a))
                assert w0.subscriber.stats.replay_timeouts == 1
            finally:
                await pool.close()
                quiet.close()
                other.close()
                ctx.destroy(linger=0)

    asyncio.run(main())


async def health_server(port: int = 0) -> tuple[web.AppRunner, int]:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_a_worker_that_dies_and_restarts_is_subscribed_again():
    """The worker's /health stops answering (taken out, its blocks dropped, its subscription closed);
    a new engine comes up on the same ports with other blocks: back in rotation, its replay buffer
    read into the index, its live events applied, the other worker's untouched."""

    async def main() -> None:
        (runner, port), (steady_http, steady_port) = await health_server(), await health_server()
        pub, steady = RawPublisher(), RawPublisher()
        index = TenantIndex()
        specs = [
            WorkerSpec(f"http://127.0.0.1:{port}", *pub.endpoints),
            WorkerSpec(f"http://127.0.0.1:{steady_port}", *steady.endpoints),
        ]
        pub.batch(0, BlockStored(block_hashes=chain(0)))
        steady.batch(0, BlockStored(block_hashes=chain(1)))
        pool = pool_for(specs, index, health_interval=0.1)
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            w = pool.workers[0]
            try:
                assert await until(lambda: index.blocks(0) == 4 and index.blocks(1) == 4)
                await runner.cleanup()
                pub.close()  # the engine is gone
                assert await until(lambda: not w.healthy)
                assert w.subscriber is None and index.blocks(0) == 0 and index.blocks(1) == 4
                pub = RawPublisher(pub.port, pub.rport)  # the same ports, a new engine
                pub.batch(0, BlockStored(block_hashes=chain(5)))
                runner, _ = await health_server(port)
                assert await until(lambda: w.healthy and index.find_matches("", chain(5)) == {0: Match(4)})
                live = pub.batch(1, BlockStored(block_hashes=chain(6), parent_block_hash=chain(5)[-1]))
                assert await until(lambda: index.blocks(0) == 8, tick=lambda: pub.send(1, live))
                assert index.find_matches("", chain(0)) == {} and index.blocks(1) == 4
                assert event_threads() == ["route-events"]
            finally:
                await pool.close()
                await runner.cleanup()
                await steady_http.cleanup()
                pub.close()
                steady.close()

    asyncio.run(main())


def stored_raw(hashes: list[int], parent: int | None, token_ids: object) -> bytes:
    """A batch of one BlockStored whose token ids may be anything (hostile publishers)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids}
    return msgspec.msgpack.encode([0.0, [ev], None])


def test_the_index_is_the_same_with_or_without_100k_token_ids_and_odd_ones_are_harmless():
    """The router skips BlockStored token ids undecoded: worker 0 sends 100K of them (caught up by
    replay and live), then a string and a map (via gap replay), worker 1 none; both index the same
    blocks. A truncated payload is still counted malformed and skipped."""

    async def main() -> None:
        pubs = [RawPublisher() for _ in range(2)]
        index = TenantIndex()
        a, b, c, d = chain(1, 6250), chain(20), chain(30), chain(40)
        many = list(range(100_000))
        pubs[0].batch(0, BlockStored(block_hashes=a, token_ids=many, block_size=16))
        pubs[1].batch(0, BlockStored(block_hashes=a, block_size=16))
        pool = pool_for(
            [WorkerSpec(f"http://127.0.0.1:{9 + i}", *p.endpoints) for i, p in enumerate(pubs)], index
        )
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                assert await until(lambda: index.find_matches("", a) == {0: Match(6250), 1: Match(6250)})

                pubs[0].buffer[1] = stored_raw(b, a[-1], "not a list")  # after the catch-up
                pubs[0].buffer[2] = stored_raw(c, b[-1], {"a": [1]})
                pubs[1].buffer[1] = stored_raw(b, a[-1], [])
                pubs[1].buffer[2] = stored_raw(c, b[-1], [])
                d_of = [BlockStored(block_hashes=d, parent_block_hash=c[-1], token_ids=t) for t in (many, [])]
                last = [p.batch(3, ev) for p, ev in zip(pubs, d_of, strict=True)]
                truncated = last[0][:-1]

                def tick() -> None:  # seq 3 live: the gap 1-2 is replayed
                    pubs[0].send(3, truncated)
                    for p, payload in zip(pubs, last, strict=True):
                        p.send(3, payload)

                full = {0: Match(6262), 1: Match(6262)}
                assert await until(lambda: index.find_matches("", a + b + c + d) == full, tick=tick)
                s0, s1 = (w.subscriber.stats for w in pool.workers)
                assert s0.malformed >= 1 and s1.malformed == 0 and s0.lost == s1.lost == 0
                assert s0.recovered == s1.recovered >= 2 and index.blocks(0) == index.blocks(1) == 6262
            finally:
                await pool.close()
                for p in pubs:
                    p.close()

    asyncio.run(main())


def test_a_lone_batch_is_delivered_at_once_and_those_during_the_pause_in_one_wake():
    """The poller pauses after a wake that delivered (fewer wakes at high rates), never before one:
    the first batch comes on its own wake, the three sent during the pause together on the next."""
    pub = RawPublisher()
    sub = ZmqEventSubscriber(pub.endpoints[0])
    got: list[tuple[float, list[int]]] = []
    first = threading.Event()

    def deliver(deliveries: list[Delivery]) -> None:
        got.append((time.monotonic(), [r.seq for d in deliveries for r in d.batches]))
        first.set()

    poller = EventPoller(deliver, name="test-events", coalesce_s=0.3)
    poller.add(sub, "w0", "worker 0")
    payloads = [pub.batch(i, BlockStored(block_hashes=chain(i))) for i in range(4)]
    try:
        while not first.wait(0.05):  # until the subscription is up (a PUB drops what precedes it)
            pub.send(0, payloads[0])
        for i in (1, 2, 3):  # while the poller pauses
            pub.send(i, payloads[i])
        end = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert [seqs for _, seqs in got[:2]] == [[0], [1, 2, 3]]
        assert got[1][0] - got[0][0] >= 0.3 and poller.wakes == 2
    finally:
        poller.close()
        pub.close()


def test_a_burst_beyond_the_per_wake_cap_is_delivered_whole_and_in_order():
    """700 batches sent at once (more than MAX_READS a wake), then nothing more: every batch is
    delivered, in sequence order, over several wakes (a capped stream is read again without waiting
    for its descriptor, which need not fire again), none counted lost."""
    busy = RawPublisher()
    sub = ZmqEventSubscriber(busy.endpoints[0], start_seq=0)
    seqs: dict[str, list[int]] = {"busy": []}
    lock = threading.Lock()

    def deliver(deliveries: list[Delivery]) -> None:
        with lock:
            for d in deliveries:
                seqs[d.key].extend(r.seq for r in d.batches)

    poller = EventPoller(deliver, name="test-events", coalesce_s=0)
    poller.add(sub, "busy", "worker 0")
    payloads = [busy.batch(i, BlockStored(block_hashes=chain(i))) for i in range(700)]
    try:
        end = time.monotonic() + 5
        while not seqs["busy"] and time.monotonic() < end:  # until the subscription is up
            busy.send(0, payloads[0])
            time.sleep(0.05)
        with lock:
            seqs["busy"].clear()
        for i in range(1, 700):
            busy.send(i, payloads[i])
        while len(seqs["busy"]) < 699 and time.monotonic() < end + 5:
            time.sleep(0.02)
        with lock:
            assert seqs["busy"] == list(range(1, 700))
        assert poller.wakes >= 3 and sub.stats.lost == 0
    finally:
        poller.close()
        busy.close()
