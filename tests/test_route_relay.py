"""The router's relay of a worker's stream, on both of its server paths: the fast path (a plain small
body: gate.fastpath's Exchange pipes the rest from the worker's read callback) and aiohttp's (a gzip
body: route.forward's StreamSink reads it piece by piece). Whole streams pass through both unchanged;
a worker that breaks a stream mid-way leaves each client an incomplete response, never a clean end,
counted as a broken stream and not as a client disconnect. The worker is agentkv's stream test server
(told to cut on cue), on its own loop in a thread; the router is a real subprocess.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
import urllib.request

from cluster import HOST, Cluster, get_text, metric_sum, wait_http

from agentkv.bench.testserver import Behaviour, StreamTestServer


def _behave(body: dict, n: int) -> Behaviour:
    if body.get("user") == "cut":
        return Behaviour(itl=0.01, reset_after=2)  # two tokens, then the connection drops
    return Behaviour(itl=0.005)


def _post(url: str, user: str, gz: bool) -> tuple[str, bytes] | str:
    """(serving worker, whole body), or 'incomplete' when the response ended early."""
    data = json.dumps({"prompt": [7] * 40, "max_tokens": 6, "stream": True, "user": user}).encode()
    headers = {"Content-Type": "application/json"}
    if gz:  # a compressed body is not the fast path's: aiohttp's path answers it
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.headers["x-agentkv-worker"], r.read()
    except http.client.IncompleteRead:
        return "incomplete"


def test_both_server_paths_relay_whole_streams_and_cut_broken_ones(tmp_path):
    c = Cluster(tmp_path, 0, events=False, replay=False, spare=1)
    server = StreamTestServer(behave=_behave)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(c.spare[0], HOST), loop).result(10)
        worker = f"http://{HOST}:{c.spare[0]}"
        args = ["route", "--port", str(c.router_ports[0]), "--worker", worker, "--scrape-interval", "0"]
        proc = c.procs.start("router", [*args, "--log-level", "warning"])
        wait_http(c.router_url() + "/health", 30, proc)
        url = c.router_url()
        whole = [_post(url, "whole", gz) for gz in (False, True)]
        for slot, body in whole:
            events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
            assert slot == "0" and events[-1] == b"data: [DONE]" and len(events) >= 7, body
        assert [_post(url, "cut", gz) for gz in (False, True)] == ["incomplete", "incomplete"]
        m = get_text(url + "/metrics")
        assert metric_sum(m, "agentkv_router_broken_streams_total") == 2
        assert metric_sum(m, "agentkv_router_client_disconnects_total") == 0
        assert len(server.seen) == 4  # each request went to the worker once: no retry after its first byte
    finally:
        c.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
