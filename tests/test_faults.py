"""Fault injection under load: the router in front of 3 `agentkv serve` workers at a steady request
rate while one worker is killed and restarted (by pid), another's KV event stream loses frames
(a ZMQ relay that drops every third message), and the third is stalled (SIGSTOP, then SIGCONT).

Afterwards: every request is accounted for (it succeeded, or failed with a reason the router
also counted); none is lost (no answer at all, or cut without the router noticing). The router's
index of each live worker equals that worker's own prefix cache (count and digest of the block
hashes, `/debug/index` vs `/debug/kv_blocks`), and resident memory stayed bounded. A bench run
whose target dies mid-way keeping every finished record is tests/test_bench_serve.py
(test_server_killed_mid_run_leaves_a_valid_summary).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest
import zmq
from cluster import Cluster, get_json, get_text, metric_sum, post, write_keys
from fuzzutil import rss_bytes

pytestmark = pytest.mark.slow

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
RATE = 8.0  # requests per second, open loop
DURATION = 40.0  # seconds of load
TIME_SCALE = 20.0
KILL_AT, RESTART_AT = 10.0, 16.0  # worker 0
STALL_AT, STALL_FOR = 24.0, 4.0  # worker 2
DROP_FROM, DROP_UNTIL = 4.0, 34.0  # worker 1's event frames


class DroppingRelay:
    """Relays a worker's KV events (SUB from the worker, PUB to the router), dropping every
    `every`-th message while `dropping` is set, as a lossy network would."""

    def __init__(self, upstream: str, port: int, every: int = 3) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.every, self.dropping = every, threading.Event()
        self.seen = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sub.poll(50):
                continue
            frames = self.sub.recv_multipart()
            self.seen += 1
            if self.dropping.is_set() and self.seen % self.every == 0:
                self.dropped += 1
                continue
            self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)


@dataclass
class Outcomes:
    """What the client saw for each request it sent."""

    sent: int = 0
    succeeded: int = 0
    failed: Counter = field(default_factory=Counter)  # reason -> count (an answer, not a success)
    lost: list = field(default_factory=list)  # (id, what happened): no answer the router accounts for
    workers: Counter = field(default_factory=Counter)


class Load:
    """The client: agentic sessions whose prompts grow turn by turn, sent open-loop at RATE per second."""

    def __init__(self, url: str, out: Outcomes) -> None:
        self.url, self.out = url, out
        self.rng = random.Random(5)
        self.sessions = [self._fresh() for _ in range(12)]
        self.home: dict[int, str] = {}  # session -> the worker that served its last turn
        self.tasks: list[asyncio.Task] = []
        self.s: aiohttp.ClientSession | None = None

    def _fresh(self, n: int = 512) -> list[int]:
        return [self.rng.randrange(1000, 30000) for _ in range(n)]

    def send(self, k: int, extra: int, max_tokens: int) -> None:
        """Session k's next turn: its prompt so far plus `extra` new tokens."""
        if len(self.sessions[k]) + extra > 40_000:  # the session ends; a new one starts
            self.sessions[k] = self._fresh()
        self.sessions[k] += self._fresh(extra)
        body = {
            "prompt": list(self.sessions[k]),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.tasks.append(asyncio.create_task(self._one(k, body, ("key-a", "key-b")[k % 2])))

    async def _one(self, k: int, body: dict, key: str) -> None:
        out = self.out
        out.sent += 1
        try:
            async with self.s.post(
                self.url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=60),
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                raw = await r.read()
                if r.status != 200:
                    err = json.loads(raw).get("error", {})  # an OpenAI error body: the reason
                    out.failed[f"http_{r.status}_{err.get('type', '?')}"] += 1
                    return
                worker = r.headers.get("x-agentkv-worker", "?")
                out.workers[worker] += 1
                if b"data: [DONE]" in raw:
                    out.succeeded += 1
                    self.home[k] = worker
                else:
                    out.failed["cut_mid_stream"] += 1  # must match the router's broken_streams count
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            out.failed["cut_mid_stream"] += 1
        except (TimeoutError, aiohttp.ClientError) as e:
            out.lost.append((k, type(e).__name__))

    async def run(self, t0: float) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as self.s:
            i = 0
            while (now := time.monotonic() - t0) < DURATION:
                self.send(i % len(self.sessions), self.rng.randrange(32, 256), self.rng.randrange(4, 24))
                i += 1
                await asyncio.sleep(max(0.0, i / RATE - now))
            while not all(t.done() for t in self.tasks):  # chaos may add a few late ones
                await asyncio.gather(*self.tasks)


class Chaos:
    """The faults, on a schedule, while the load runs; each live process's RSS is sampled meanwhile."""

    def __init__(self, cluster: Cluster, relay: DroppingRelay, url: str) -> None:
        self.cluster, self.procs, self.relay, self.url = cluster, cluster.procs, relay, url
        self.rss: dict[str, list[int]] = {}
        self.faults: list[str] = []

    def sample(self) -> None:
        for name, p in self.procs.procs.items():
            if p.poll() is None:
                self.rss.setdefault(name, []).append(rss_bytes(p.pid))

    async def kill_with_requests_in_flight(self, load: Load) -> None:
        """Send a burst of long turns of sessions living on worker 0, then SIGKILL it as soon as
        the router has requests in flight there (most still prefilling: no byte sent yet)."""
        for k in [k for k, w in load.home.items() if w == "0"][:4] or [0, 1, 2, 3]:
            load.send(k, 30_000, 8)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            text = await asyncio.to_thread(get_text, self.url + "/metrics")
            if metric_sum(text, 'agentkv_router_worker_in_flight{worker="0"') >= 1:
                break
            await asyncio.sleep(0.02)
        os.kill(self.procs.procs["worker0"].pid, signal.SIGKILL)
        await asyncio.to_thread(self.procs.procs["worker0"].wait, 10)

    async def apply(self, what: str, load: Load) -> None:
        w2 = self.procs.procs["worker2"]
        if what == "drop":
            self.relay.dropping.set()
        elif what == "undrop":
            self.relay.dropping.clear()
        elif what == "kill":
            await self.kill_with_requests_in_flight(load)
        elif what == "restart":
            self.cluster.start_worker(0, time_scale=TIME_SCALE)
        elif what == "stall":
            os.kill(w2.pid, signal.SIGSTOP)
        elif what == "resume":
            os.kill(w2.pid, signal.SIGCONT)

    async def run(self, t0: float, load: Load) -> None:
        steps = sorted(
            [
                (DROP_FROM, "drop"),
                (KILL_AT, "kill"),
                (RESTART_AT, "restart"),
                (STALL_AT, "stall"),
                (STALL_AT + STALL_FOR, "resume"),
                (DROP_UNTIL, "undrop"),
            ]
        )
        for at, what in steps:
            while time.monotonic() - t0 < at:
                self.sample()
                await asyncio.sleep(0.25)
            await self.apply(what, load)
            self.faults.append(f"{time.monotonic() - t0:5.1f}s {what}")
        while time.monotonic() - t0 < DURATION:
            self.sample()
            await asyncio.sleep(0.25)


def router_args(tmp_path) -> list[str]:
    return [
        "--api-keys",
        str(write_keys(tmp_path, KEYS)),
        "--router-secret",
        "s",
        "--health-interval",
        "0.5",
        "--scrape-interval",
        "1",
        "--log-level",
        "warning",
    ]


async def run_load(url: str, out: Outcomes, chaos: Chaos) -> None:
    t0 = time.monotonic()
    load = Load(url, out)
    await asyncio.gather(load.run(t0), chaos.run(t0, load))


def index_and_caches(url: str, http: list[int]) -> tuple[dict, dict]:
    """The router's index and each live worker's cache, once they agree (or after 20 s). One request
    per worker first reveals any trailing dropped frame (a gap shows only when the next message
    arrives)."""
    for i in range(3):
        assert (
            post(f"http://127.0.0.1:{http[i]}/v1/completions", {"prompt": [7] * 40, "max_tokens": 1})[0]
            == 200
        )
    deadline = time.monotonic() + 20
    while True:
        index = get_json(url + "/debug/index")["workers"]
        own = {str(i): get_json(f"http://127.0.0.1:{http[i]}/debug/kv_blocks")["GPU"] for i in range(3)}
        if index == own or time.monotonic() > deadline:
            return index, own
        time.sleep(0.5)


def print_report(out: Outcomes, chaos: Chaos, index: dict, own: dict, counts: dict[str, float]) -> None:
    relay, rss = chaos.relay, chaos.rss
    print(f"\nfaults: {'; '.join(chaos.faults)}")
    print(
        f"requests sent {out.sent}, succeeded {out.succeeded}, retried {int(counts['retried'])}, "
        f"failed {sum(out.failed.values())} ({dict(out.failed)}), lost {len(out.lost)}; "
        f"served by worker {dict(sorted(out.workers.items()))}"
    )
    print(
        f"event frames dropped by the relay {relay.dropped} of {relay.seen}; "
        f"router resyncs {int(counts['resyncs'])}, batches lost for good {int(counts['lost_events'])}"
    )
    print(
        "index vs workers: "
        + ", ".join(
            f"worker {k}: {v['blocks']} blocks {'==' if own[k] == v else '!='} {own[k]['blocks']}"
            for k, v in sorted(index.items())
        )
    )
    print(
        "peak RSS MiB: "
        + ", ".join(f"{k} {max(v) / 2**20:.0f} (start {v[0] / 2**20:.0f})" for k, v in sorted(rss.items()))
    )


def test_router_survives_kill_restart_dropped_events_and_a_stall(tmp_path):
    cluster = Cluster(tmp_path, 3, spare=1)
    http, events, (relay_port,) = cluster.http, cluster.events, cluster.spare
    relay = None
    try:
        cluster.start_workers(time_scale=TIME_SCALE)
        relay = DroppingRelay(f"tcp://127.0.0.1:{events[1]}", relay_port)
        ev = [f"tcp://127.0.0.1:{events[0]}", f"tcp://127.0.0.1:{relay_port}", f"tcp://127.0.0.1:{events[2]}"]
        cluster.start_router(router_args(tmp_path), events=ev)
        url = cluster.router_url()
        cluster.wait_ready()
        cluster.wait_taken_in(timeout=30)

        out, chaos = Outcomes(), Chaos(cluster, relay, url)
        asyncio.run(run_load(url, out, chaos))
        m = get_text(url + "/metrics")
        retried = metric_sum(m, "agentkv_router_retries_total")
        broken = metric_sum(m, "agentkv_router_broken_streams_total")
        router_failed = metric_sum(m, "agentkv_router_failed_total")

        # the index must equal each live worker's cache: compare digests once the workers answered
        index, own = index_and_caches(url, http)
        m = get_text(url + "/metrics")
        lost_events = metric_sum(m, "agentkv_router_worker_event_lost_total")
        resyncs = metric_sum(m, "agentkv_router_worker_event_resyncs_total")
        chaos.sample()

        failed = sum(out.failed.values())
        print_report(
            out, chaos, index, own, {"retried": retried, "resyncs": resyncs, "lost_events": lost_events}
        )

        assert out.sent >= RATE * DURATION * 0.9
        assert not out.lost, out.lost[:10]  # every request got an answer the router accounts for
        assert out.succeeded + failed == out.sent
        assert out.failed["cut_mid_stream"] <= broken  # cut streams are the router's counted ones
        assert sum(v for k, v in out.failed.items() if k != "cut_mid_stream") <= router_failed
        assert retried >= 1 and out.succeeded >= 0.9 * out.sent  # failures before the first byte were retried
        assert relay.dropped > 0 and resyncs >= 1 and lost_events == 0  # drops seen, all replayed
        assert index == own, (index, own)  # the router's index is exactly the workers' caches
        assert sum(v["blocks"] for v in own.values()) > 0
        for name, xs in chaos.rss.items():  # memory bounded: no process grew by more than 256 MiB
            assert max(xs) - xs[0] < 256 << 20, (name, xs[0], max(xs))
    finally:
        if relay is not None:
            relay.close()
        cluster.procs.stop_all()
