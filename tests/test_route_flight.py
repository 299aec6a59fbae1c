"""route/flight.py over real loopback HTTP: a request whose worker has an idle pooled connection is
answered from read callbacks (no task), byte-identical to the task path (the first request, with no
pooled connection yet, and aiohttp's path for a gzip body); broken streams, first-byte timeouts and
client disconnects end as on the task path; the worker connection is reused, never when left dirty."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import socket
import threading
import time

import pytest
from cluster import HOST, Cluster, get_text, metric_sum, wait_http

from agentkv.bench.testserver import Behaviour, StreamTestServer


def _behave(body: dict, n: int) -> Behaviour:
    user = body.get("user")
    if user == "cut":
        return Behaviour(itl=0.01, reset_after=2)
    if user == "hang":
        return Behaviour(hang=True)
    if user == "slow":
        return Behaviour(itl=0.2)
    return Behaviour(itl=0.002)


class Peers(StreamTestServer):
    """The stream test server, noting each request's client port (one per router connection)."""

    async def _complete(self, request):
        self.ports.append(request.transport.get_extra_info("peername")[1])
        return await super()._complete(request)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("flight"), 0, events=False, replay=False, spare=1)
    server = Peers(behave=_behave)
    server.ports = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(c.spare[0], HOST), loop).result(10)
        args = ["route", "--port", str(c.router_ports[0]), "--worker", f"http://{HOST}:{c.spare[0]}"]
        args += ["--scrape-interval", "0", "--first-byte-timeout", "1", "--log-level", "error"]
        proc = c.procs.start("router", args)
        wait_http(c.router_url() + "/health", 30, proc)
        yield c.router_url(), server
    finally:
        c.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _body(user: str, stream: bool) -> bytes:
    return json.dumps({"prompt": [7] * 40, "max_tokens": 6, "stream": stream, "user": user}).encode()


def _post(conn: http.client.HTTPConnection, user: str, stream: bool, gz: bool = False):
    """(status, headers without Date, body) over `conn` (keep-alive); 'incomplete' when cut short."""
    data, headers = _body(user, stream), {"Content-Type": "application/json"}
    if gz:
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
    conn.request("POST", "/v1/completions", data, headers)
    r = conn.getresponse()
    try:
        body = r.read()
    except http.client.IncompleteRead:
        return "incomplete"
    body = re.sub(rb'"cached_tokens":\d+', b"", body)  # the worker's cache grows between requests
    return r.status, r.getheader("x-agentkv-worker"), r.getheader("Content-Type"), body


def test_identical_to_the_task_path_on_a_reused_worker_connection(router):
    url, server = router
    port = int(url.rsplit(":", 1)[1])
    for stream in (True, False):
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        n0 = len(server.ports)
        answers = [_post(conn, "whole", stream) for _ in range(4)]
        gz = _post(http.client.HTTPConnection(HOST, port, timeout=30), "whole", stream, gz=True)
        assert answers[0][0] == 200 and all(a == answers[0] for a in answers) and gz == answers[0], answers
        assert len(set(server.ports[n0 : n0 + 4])) == 1  # one worker connection, reused
        conn.close()


def test_broken_stream_timeout_and_disconnect_end_as_on_the_task_path(router):
    url, server = router
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    assert _post(conn, "whole", True)[0] == 200  # a pooled worker connection now idle
    assert _post(http.client.HTTPConnection(HOST, port, timeout=30), "cut", True) == "incomplete"
    assert _post(conn, "whole", True)[0] == 200
    t0 = time.monotonic()
    status, *_ = _post(http.client.HTTPConnection(HOST, port, timeout=30), "hang", True)
    assert status == 503 and time.monotonic() - t0 < 10  # no first byte in 1 s: no worker left to retry on
    _post(conn, "whole", True)
    s = socket.create_connection((HOST, port))  # a client that leaves mid-stream
    body = _body("slow", True)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    s.sendall(b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    time.sleep(0.5)
    n0 = len(server.ports)
    after = [_post(conn, "whole", True) for _ in range(3)]
    assert all(a[0] == 200 for a in after)
    assert len(set(server.ports[n0:])) == 1  # a clean connection, reused; the abandoned one was not
    m = get_text(url + "/metrics")
    assert metric_sum(m, "agentkv_router_broken_streams_total") == 1
    assert metric_sum(m, "agentkv_router_client_disconnects_total") == 1
