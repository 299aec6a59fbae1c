"""The red team's attacks on the HTTP doors of `agentkv serve` and `agentkv route`, as functions that
run them against real processes and return their figures: the one home for tests/test_redteam_http.py
(which asserts on them) and benchmarks/redteam_http.py (which prints them, for any checkout).

Only the standard library, aiohttp and /proc: the same drivers run against an older tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MIB = 1 << 20


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the parse processes), in MiB."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total / MIB


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def gzip_text_body(text_mb: float, word: bytes = b"hello world ") -> bytes:
    """A gzip'd completion body whose prompt is `text_mb` MB of text (the red team's shape: a few
    hundred KB that inflate a thousandfold)."""
    n = int(text_mb * 1e6) // len(word)
    return gzip.compress(b'{"prompt": "' + word * n + b'", "max_tokens": 4}', 6)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass
class Phase:
    """Latencies (s) and statuses seen by the victim and the /health prober during one phase."""

    victim: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    victim_status: Counter = field(default_factory=Counter)
    attack_status: Counter = field(default_factory=Counter)
    attack_sent: int = 0

    def line(self) -> str:
        v, h = self.victim, self.health
        return (
            f"victim n={len(v)} p50 {1e3 * pct(v, 0.5):.0f} ms p99 {1e3 * pct(v, 0.99):.0f} ms "
            f"max {1e3 * max(v, default=float('nan')):.0f} ms; /health n={len(h)} p99 "
            f"{1e3 * pct(h, 0.99):.0f} ms max {1e3 * max(h, default=float('nan')):.0f} ms"
        )


@dataclass
class BombRun:
    """The gzip-bomb attack's figures: each phase, and memory per process (start, peak, end)."""

    idle: Phase
    attack: Phase
    rss: dict[str, tuple[float, float, float]]


async def bomb_under_load(
    target: str,
    victim_body: dict,
    bombs: list[bytes],
    pids: dict[str, int],
    *,
    seconds: float = 8.0,
    parallel: int = 4,
    attacker_key: str | None = None,
    victim_key: str | None = None,
) -> BombRun:
    """An idle phase (the victim's small requests and /health alone), then an attack phase in which
    `parallel` attacker connections send `bombs` round and round: the victim's latencies in each,
    the attack's statuses, and each process's resident memory."""
    samples: dict[str, list[float]] = {k: [rss_mib(p)] for k, p in pids.items()}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        idle = await _phase(
            s, target, victim_body, victim_key, [], attacker_key, seconds, parallel, pids, samples
        )
        attack = await _phase(
            s, target, victim_body, victim_key, bombs, attacker_key, seconds, parallel, pids, samples
        )
    rss = {k: (v[0], max(v), v[-1]) for k, v in samples.items()}
    return BombRun(idle, attack, rss)


async def _phase(s, target, victim_body, victim_key, bombs, attacker_key, seconds, parallel, pids, samples):
    ph = Phase()
    end = time.monotonic() + seconds
    vh = {"Authorization": f"Bearer {victim_key}"} if victim_key else {}
    ah = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    if attacker_key:
        ah["Authorization"] = f"Bearer {attacker_key}"

    async def victim() -> None:
        while time.monotonic() < end:
            t0 = time.monotonic()
            async with s.post(target + "/v1/completions", json=victim_body, headers=vh) as r:
                await r.read()
                ph.victim_status[r.status] += 1
            ph.victim.append(time.monotonic() - t0)
            await asyncio.sleep(0.02)

    async def health() -> None:
        while time.monotonic() < end:
            t0 = time.monotonic()
            async with s.get(target + "/health") as r:
                await r.read()
            ph.health.append(time.monotonic() - t0)
            await asyncio.sleep(0.1)

    async def attacker(i: int) -> None:
        k = i
        while time.monotonic() < end:
            ph.attack_sent += 1
            try:
                async with s.post(target + "/v1/completions", data=bombs[k % len(bombs)], headers=ah) as r:
                    await r.read()
                    ph.attack_status[r.status] += 1
            except aiohttp.ClientError as e:
                ph.attack_status[type(e).__name__] += 1
            k += 1

    async def sampler() -> None:
        while time.monotonic() < end:
            for k, p in pids.items():
                samples[k].append(rss_mib(p))
            await asyncio.sleep(0.1)

    tasks = [victim(), health(), sampler()] + [attacker(i) for i in range(parallel if bombs else 0)]
    await asyncio.gather(*tasks)
    for k, p in pids.items():
        samples[k].append(rss_mib(p))
    return ph


# -- connections ---------------------------------------------------------------------------------
def open_flood(port: int, n: int, kind: str) -> list[socket.socket]:
    """`n` connections that hold the server without finishing a request: `idle` (nothing sent),
    `headers` (half a request's headers), `body` (headers, then a body that stops)."""
    data = {
        "idle": b"",
        "headers": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
        "body": b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": ',
    }[kind]
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if data:
            sock.sendall(data)
        socks.append(sock)
    return socks


def closed_after(
    socks: list[socket.socket], limit: float, since: float | None = None
) -> tuple[list[float], int]:
    """Seconds (from `since`, default now) until the server closed each socket, waiting at most `limit`
    s from now, and how many were still open then. What a socket received before the close is
    ignored (a 408, say)."""
    t0 = time.monotonic() if since is None else since
    start = time.monotonic()
    done: list[float] = []
    left = list(socks)
    for sock in left:
        sock.setblocking(False)
    while left and time.monotonic() - start < limit:
        still = []
        for sock in left:
            try:
                data = sock.recv(65536)
                if data:
                    still.append(sock)
                    continue
            except BlockingIOError:
                still.append(sock)
                continue
            except OSError:
                pass
            done.append(time.monotonic() - t0)
            sock.close()
        left = still
        time.sleep(0.05)
    for sock in left:
        sock.close()
    return done, len(left)


def summary(xs: list[float]) -> str:
    if not xs:
        return "none"
    return f"n={len(xs)} median {statistics.median(xs):.2f} s max {max(xs):.2f} s"


def post_json(url: str, body: dict, key: str | None = None, timeout: float = 30) -> tuple[int, float]:
    """(status, seconds) of one POST with a fresh connection; status -1 on a connection error."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.monotonic() - t0
    except OSError:
        return -1, time.monotonic() - t0


BAD_LOG = ("Traceback", "Error handling request", " ERROR ")
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


@contextlib.contextmanager
def red_cluster(tmp: Path):
    """Two workers and a router with tenants (KEYS), an admin key and a secret from a file, health
    probed every 0.5 s with a 1 s timeout."""
    from cluster import Cluster, tenant_flags

    secret = tmp / "secret"
    secret.write_text("not-in-ps-0123\n")
    with Cluster(tmp, 2, replay=False) as c:
        c.start_workers(time_scale=100, log_level="info", extra=("--max-model-len", "8192"))
        c.start_router(
            tenant_flags(
                tmp,
                KEYS,
                "--health-interval",
                "0.5",
                "--health-timeout",
                "1",
                secret=("--router-secret-file", str(secret)),
                log_level="info",
            )
        )
        c.wait_ready()
        c.wait_taken_in()
        yield c
