"""Routing quality, small and end to end: kv_aware keeps more cache hits than round_robin.

Three real `agentkv serve` workers (subprocesses, KV events over ZMQ), two real `agentkv route`
processes in front of them (kv_aware and round_robin), and `agentkv bench` replaying the same six
multi-turn sessions through each; the second replay is cache-busted so it reuses nothing of the
first. The full comparison on the Claude Code traces is benchmarks/routing_quality.py.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.trace.model import Request, Session, Trace

pytestmark = pytest.mark.slow
SCALE = 50.0
WORKERS = 3
TURNS = 6
BLOCKS = [64 + 8 * i for i in range(TURNS)]  # a session's prompt lengths in blocks, turn by turn
CEILING = sum(BLOCKS[:-1]) / sum(BLOCKS)  # each turn can reuse the whole previous turn


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def _session(k: int) -> Trace:
    """A session whose turn i extends turn i-1 by 8 blocks of 16 tokens (hash ids its own)."""
    reqs = [Request(t=0.001 * i, input_tokens=n * 16, output_tokens=4, hash_ids=list(range(k * 10_000, k * 10_000 + n)),
                    think_time=0.05 if i else 0.0) for i, n in enumerate(BLOCKS)]
    return Trace(id=f"rq{k}", block_size=16, session=Session(id=f"rq{k}", requests=reqs))


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    """{policy: router URL} over three shared workers; every process stopped at the end."""
    tmp: Path = tmp_path_factory.mktemp("routing-quality")
    ports = _free_ports(3 * WORKERS + 2)
    http, events, replay = ports[:WORKERS], ports[WORKERS:2 * WORKERS], ports[2 * WORKERS:3 * WORKERS]
    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(args: list[str], name: str) -> None:
        f = (tmp / name).open("w")
        logs.append(f)
        procs.append(subprocess.Popen([sys.executable, "-m", "agentkv.cli", *args], stdout=f,
                                      stderr=subprocess.STDOUT))

    try:
        for i in range(WORKERS):
            spawn(["serve", "--port", str(http[i]), "--time-scale", str(SCALE), "--log-level", "error",
                   "--kv-events-endpoint", f"tcp://*:{events[i]}",
                   "--kv-events-replay-endpoint", f"tcp://*:{replay[i]}"], f"worker{i}.log")
        urls = {}
        for policy, port in zip(("kv_aware", "round_robin"), ports[3 * WORKERS:], strict=True):
            args = ["route", "--port", str(port), "--policy", policy, "--health-interval", "30",
                    "--log-level", "warning"]
            for i in range(WORKERS):
                args += ["--worker", f"http://127.0.0.1:{http[i]}=tcp://127.0.0.1:{events[i]},"
                                     f"tcp://127.0.0.1:{replay[i]}"]
            spawn(args, f"route-{policy}.log")
            urls[policy] = f"http://127.0.0.1:{port}"
        for i in range(WORKERS):
            _wait_http(f"http://127.0.0.1:{http[i]}/health")
        for u in urls.values():
            _wait_http(u + "/health")
        yield urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()


def _hit_rate(url: str, cache_bust: bool) -> float:
    cfg = BenchConfig(target=url, lanes=6, duration=None, idle_gap_cap=None, time_scale=SCALE, sample_every=0.2,
                      cache_bust=cache_bust, monitor_gpu=False)
    res = asyncio.run(BenchRun(cfg, [_session(k) for k in range(6)]).run())
    assert all(r.ok for r in res.records), [r.error for r in res.records]
    assert res.summary.cache.ceiling == pytest.approx(CEILING, abs=0.01)
    return res.summary.cache.reported


def test_kv_aware_keeps_more_hits_than_round_robin(routers):
    time.sleep(1.0)  # the routers' event subscriptions settle
    kv = _hit_rate(routers["kv_aware"], cache_bust=False)
    rr = _hit_rate(routers["round_robin"], cache_bust=True)
    assert kv >= 0.9 * CEILING, (kv, rr, CEILING)  # nearly every turn lands where its prefix is
    assert kv > rr + 0.05, (kv, rr)  # round robin lands 51-68% here, depending on timing under load
