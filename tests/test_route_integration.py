"""The router in front of 3 real `agentkv serve` workers, each a subprocess, the router one too.

Checks, end to end over loopback HTTP and ZMQ: a session's turns land on the worker holding its
prefix; two tenants sending one prompt never share cached tokens while a tenant does; forged or
missing keys get 401 without reaching a worker; killing a worker mid-run loses no request that had
not started streaming, and the worker rejoins when it comes back.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster import Cluster, get_text, metric_sum, wait_http, write_keys
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


class Routed(Cluster):
    """Three serve workers (time-scale 1: a simulated H200) and the router, all subprocesses."""

    def post(
        self, body: dict, key: str | None = "key-a", session: str | None = None, path: str = "/v1/completions"
    ) -> tuple[int, dict, dict]:
        """(status, response headers, JSON body or the usage of a stream)."""
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if session:
            headers["x-session-id"] = session
        req = urllib.request.Request(
            self.router_url() + path, data=json.dumps(body).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw = r.read().decode()
                return r.status, dict(r.headers), _parse(raw)
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read() or b"{}")

    def metric(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples of `name` on the router's /metrics, keyed by their labels (sorted pairs)."""
        text = get_text(self.router_url() + "/metrics", timeout=5)
        return {
            tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name
        }


def _by_worker(samples: dict[tuple[tuple[str, str], ...], float]) -> list[float]:
    """Per-worker sample values in worker order."""
    return [v for k, v in sorted(samples.items(), key=lambda kv: int(dict(kv[0])["worker"]))]


def _queued_on(url: str, timeout: float = 30.0) -> None:
    """Return once the worker at `url` reports a request waiting (a busy host may take seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_sum(get_text(url + "/metrics", timeout=5), "vllm:num_requests_waiting") >= 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"no request waited on {url} within {timeout:.0f} s")


def _parse(raw: str) -> dict:
    if not raw.startswith("data:"):
        return json.loads(raw)
    usage = {}
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    return {"usage": usage, "stream": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("route")
    with Routed(tmp, 3) as c:
        c.start_workers(log_level="error")
        c.start_router(
            [
                "--api-keys",
                str(write_keys(tmp, KEYS)),
                "--router-secret",
                "test-secret",
                "--tokenizer",
                "builtin",
                "--health-interval",
                "0.2",
                "--scrape-interval",
                "0.5",
                "--log-level",
                "warning",
            ]
        )
        c.wait_ready(timeout=30)
        c.wait_taken_in(timeout=20)  # every worker in rotation
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(n)]


def _cached(resp: dict) -> int:
    return resp["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_session_turns_land_on_the_worker_holding_their_prefix(cluster):
    homes = {}
    for s in range(6):  # six sessions spread over the three idle workers
        status, h, r = cluster.post({"prompt": _prompt(s, 256), "max_tokens": 4}, session=f"s{s}")
        assert status == 200
        homes[s] = h["x-agentkv-worker"]
    assert len(set(homes.values())) == 3  # idle workers share the first turns
    time.sleep(0.3)  # let the KV events reach the router
    for turn in range(2):
        for s in range(6):
            prompt = _prompt(s, 256) + _prompt(100 + s, 64 * (turn + 1))
            # no session header on odd sessions: the KV index alone must find the prefix
            status, h, r = cluster.post(
                {
                    "prompt": prompt,
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                session=f"s{s}" if s % 2 == 0 else None,
            )
            assert status == 200 and h["x-agentkv-worker"] == homes[s]
            assert _cached(r) >= 256
        time.sleep(0.3)


def test_tenants_never_share_cached_tokens(cluster):
    prompt = {"prompt": _prompt(42, 320), "max_tokens": 2, "cache_salt": "client-chosen"}
    status, _, a1 = cluster.post(prompt, key="key-a")
    assert status == 200 and _cached(a1) == 0
    time.sleep(0.3)
    status, _, b1 = cluster.post(prompt, key="key-b")
    assert status == 200 and _cached(b1) == 0  # same prompt, other tenant: nothing shared
    time.sleep(0.3)
    _, _, a2 = cluster.post(prompt, key="key-a")
    _, _, b2 = cluster.post(prompt, key="key-b")
    assert _cached(a2) >= 304 and _cached(b2) >= 304  # each tenant hits its own cache


def test_forged_or_missing_keys_are_rejected_before_any_worker(cluster):
    before = sum(cluster.metric("agentkv_router_worker_requests_total").values())
    for key in (None, "key-c", "key-a2", "KEY-A", "key-"):
        status, _, body = cluster.post({"prompt": [1, 2, 3], "max_tokens": 1}, key=key)
        assert status == 401 and body["error"]["type"] == "AuthenticationError"
    req = urllib.request.Request(cluster.router_url() + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    assert sum(cluster.metric("agentkv_router_worker_requests_total").values()) == before
    assert sum(cluster.metric("agentkv_router_unauthorized_total").values()) >= 5
    modes = cluster.metric("agentkv_router_worker_mode")
    assert len(modes) == 3 and all(dict(k)["mode"] == "event" for k in modes)


def test_killing_a_worker_loses_no_request_that_had_not_started(cluster):
    """Long prompts keep requests queued before their first byte; one worker is SIGKILLed mid-run."""

    def one(i: int) -> tuple[int, int]:
        body = {"prompt": _prompt(1000 + i, 6000), "max_tokens": 8, "stream": True}
        try:
            status, _, r = cluster.post(body, session=f"k{i}")
        except (http.client.IncompleteRead, ConnectionError):
            return -1, i  # cut mid-stream: allowed only after its first byte (counted by the router)
        return status, i

    with ThreadPoolExecutor(18) as ex:
        futures = [ex.submit(one, i) for i in range(18)]
        _queued_on(cluster.worker_url(1))  # a request waits there, not started: the kill must not lose it
        victim = cluster.worker(1)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(5)
        results = [f.result() for f in futures]
    # streams cut after their first byte may fail; everything else must have succeeded
    broken = cluster.metric("agentkv_router_broken_streams_total")
    n_broken = int(sum(broken.values()))
    assert sum(1 for s, _ in results if s != 200) <= n_broken
    assert sum(1 for s, _ in results if s == 200) >= 18 - n_broken
    assert sum(cluster.metric("agentkv_router_retries_total").values()) >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        up = cluster.metric("agentkv_router_worker_up")
        if _by_worker(up) == [1.0, 0.0, 1.0]:
            break
        time.sleep(0.1)
    assert _by_worker(up) == [1.0, 0.0, 1.0]
    status, h, _ = cluster.post({"prompt": _prompt(7, 64), "max_tokens": 1})
    assert status == 200 and h["x-agentkv-worker"] != "1"
    # the worker comes back: it is re-added and serves again
    wait_http(cluster.worker_url(1) + "/health", 30, cluster.start_worker(1, log_level="error"))
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and cluster.metric("agentkv_router_worker_up").get(
            (("url", f"http://127.0.0.1:{cluster.http[1]}"), ("worker", "1"))
        )
        != 1.0
    ):
        time.sleep(0.1)
    seen = {
        cluster.post({"prompt": _prompt(500 + i, 32), "max_tokens": 1})[1]["x-agentkv-worker"]
        for i in range(9)
    }
    assert "1" in seen
