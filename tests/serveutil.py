"""Helpers shared by the agentkv serve HTTP tests (tests/test_serve*.py): a server in-process on the
test's event loop, SSE and /metrics readers; the bench's streaming test server in its own process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from agentkv.engine.config import EngineConfig
from agentkv.serve.app import ServeOptions, Server

FAST = 1000.0  # --time-scale: engine steps of ~6 ms take ~6 us of wall time


@contextlib.asynccontextmanager
async def serving(config: EngineConfig | None = None, **opts):
    server = Server(
        config or EngineConfig(max_model_len=4096), ServeOptions(port=0, **{"time_scale": FAST, **opts})
    )
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield server, url, session
    finally:
        await server.stop()


def run(coro):
    return asyncio.run(coro)


async def sse(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    """POST and read an SSE stream: the decoded chunks (checks it ends with [DONE])."""
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        data = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    return [json.loads(d) for d in data[:-1]]


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


async def settle(server: Server, timeout: float = 5.0) -> None:
    """Wait until the engine holds no request (finished or aborted)."""
    for _ in range(int(timeout / 0.01)):
        if not server.runner.engine.requests and not server.runner.streams:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still holds {list(server.runner.engine.requests)}")


@contextlib.contextmanager
def stream_server_process(*flags: str):
    """`python -m agentkv.bench.testserver` on a free loopback port with `flags`; yields its URL,
    stopped by pid (a bench killed or interrupted on its own leaves it serving)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "agentkv.bench.testserver", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        p.terminate()
        p.wait(10)
