"""Why `agentkv route` forwards with its own HTTP/1.1 client: CPU per proxied request, aiohttp vs gate.upstream.

Starts the streaming test server (`python -m agentkv.bench.testserver`, 4-token SSE answers with
usage) in a subprocess and, from this process, sends the same streamed completions over pooled
keep-alive connections with `--concurrency` in flight: once with aiohttp's ClientSession (as the
router did), once with `agentkv.gate.upstream.Upstream` (as it does now), interleaved `--rounds`
times, on uvloop as the router runs. Prints this process's CPU time per request for each (the server's CPU is not counted).

Run: .venv/bin/python benchmarks/upstream_client.py [--requests 3000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cluster.py: ports, readiness
from cluster import free_ports, stop_process, wait_http

from agentkv.gate.upstream import Upstream

BODY = msgspec.json.encode(
    {"model": "test-model", "prompt": [1, 2, 3, 4] * 16, "max_tokens": 4, "stream": True}
)


async def _drive(n: int, concurrency: int, one) -> float:
    """CPU seconds of this process per request for n calls of `one`, `concurrency` at a time."""
    todo = iter(range(n))

    async def lane() -> None:
        for _ in todo:
            await one()

    await asyncio.gather(*(lane() for _ in range(concurrency)))  # warm: connections, code paths
    todo = iter(range(n))
    t0 = time.process_time()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return (time.process_time() - t0) / n


async def with_aiohttp(url: str, n: int, concurrency: int) -> float:
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=4, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=conn, auto_decompress=False) as s:
        headers = {"Content-Type": "application/json", "x-session-id": "s1"}

        async def one() -> None:
            async with s.post(url, data=BODY, headers=headers) as r:
                assert r.status == 200, r.status
                while await r.content.readany():
                    pass

        return await _drive(n, concurrency, one)


async def with_upstream(url: str, n: int, concurrency: int) -> float:
    up = Upstream()
    headers = b"Content-Type: application/json\r\nx-session-id: s1\r\n"

    async def one() -> None:
        r = await up.post(url, BODY, headers)
        assert r.status == 200, r.status
        while await r.readany():
            pass
        r.release()

    try:
        return await _drive(n, concurrency, one)
    finally:
        up.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "agentkv.bench.testserver", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, server)
        url = f"http://127.0.0.1:{port}/v1/completions"
        runs: dict[str, list[float]] = {"aiohttp ClientSession": [], "gate.upstream": []}
        for _ in range(a.rounds):
            for name, fn in (("aiohttp ClientSession", with_aiohttp), ("gate.upstream", with_upstream)):
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as agentkv route runs
                    runs[name].append(runner.run(fn(url, a.requests, a.concurrency)))
        print(
            f"{a.requests} streamed completions (4 tokens + usage) x {a.rounds} rounds, "
            f"{a.concurrency} in flight, keep-alive; client CPU per request (median of rounds):"
        )
        for name, xs in runs.items():
            print(
                f"  {name:>22}: {statistics.median(xs) * 1e6:6.0f} us  (rounds: "
                + ", ".join(f"{x * 1e6:.0f}" for x in xs)
                + ")"
            )
    finally:
        stop_process(server)


if __name__ == "__main__":
    main()
