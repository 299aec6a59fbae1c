"""A worker that hangs: it accepts requests and never answers them (a stuck engine).

The router must not leave requests waiting on it forever: with `--first-byte-timeout` they are
retried on another worker after that long; without it, they are released as soon as a health
check takes the worker out of rotation. The hung worker is agentkv's stream test server told to
hang (a real engine cannot be made to hang on cue), on its own loop in a thread; the healthy one
and the router are real subprocesses (`agentkv serve`, `agentkv route`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster import HOST, Cluster, get_text, metric_sum, wait_http

from agentkv.bench.testserver import Behaviour, StreamTestServer

pytestmark = pytest.mark.slow


class HungWorker:
    """A StreamTestServer whose completions hang (counted in `received`), on a loop in a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server = StreamTestServer(behave=lambda body, n: Behaviour(hang=True))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(port, HOST), self._loop).result(10)

    @property
    def received(self) -> int:
        return len(self.server.seen)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(
            10
        )  # releases the hung requests
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def pair(tmp_path):
    """One real serve worker (slot 0), one hung worker (slot 1), and a router port."""
    c = Cluster(tmp_path, 1, events=False, replay=False, spare=1)
    hung = HungWorker(c.spare[0])
    try:
        c.start_workers(log_level="error")
        c.wait_workers()
        yield c, hung
    finally:
        c.close()
        hung.close()


def _router(c: Cluster, hung: HungWorker, *flags: str) -> str:
    proc = c.procs.start(
        "router",
        [
            "route",
            "--port",
            str(c.router_ports[0]),
            "--worker",
            c.worker_url(0),
            "--worker",
            f"http://{HOST}:{hung.port}",
            "--policy",
            "round_robin",
            "--scrape-interval",
            "0",
            "--log-level",
            "warning",
            *flags,
        ],
    )
    wait_http(c.router_url() + "/health", 30, proc)
    return c.router_url()


def _send(url: str, n: int) -> list[tuple[int, str, float]]:
    """n concurrent short completions: (status, serving worker, seconds) each."""

    def one(i: int) -> tuple[int, str, float]:
        body = json.dumps({"prompt": [1000 + i] * 40, "max_tokens": 2}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status, r.headers["x-agentkv-worker"], time.monotonic() - t0

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def test_first_byte_timeout_retries_on_another_worker(pair):
    c, hung = pair
    url = _router(c, hung, "--first-byte-timeout", "1", "--health-interval", "60")
    results = _send(url, 4)
    assert [s for s, _, _ in results] == [200] * 4
    assert {w for _, w, _ in results} == {"0"}
    assert hung.received >= 1  # round robin did send some there
    m = get_text(url + "/metrics")
    assert metric_sum(m, 'agentkv_router_worker_first_byte_timeouts_total{worker="1"') == hung.received
    assert metric_sum(m, "agentkv_router_retries_total") == hung.received
    assert max(t for _, _, t in results) < 20


def test_a_worker_taken_out_releases_its_waiting_requests(pair):
    """No --first-byte-timeout: the requests wait on the hung worker until its health check fails."""
    c, hung = pair
    url = _router(c, hung, "--health-interval", "0.2")
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_send, url, 4)
        deadline = time.monotonic() + 20
        while hung.received < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hung.received >= 1
        time.sleep(1.0)
        assert not fut.done()  # still waiting on the hung worker
        hung.server.health_status = 503
        results = fut.result(timeout=30)
    assert [s for s, _, _ in results] == [200] * 4
    assert {w for _, w, _ in results} == {"0"}
    m = get_text(url + "/metrics")
    assert metric_sum(m, 'agentkv_router_worker_up{worker="1"') == 0
    assert metric_sum(m, "agentkv_router_retries_total") == hung.received
    assert metric_sum(m, "agentkv_router_worker_first_byte_timeouts_total") == 0
