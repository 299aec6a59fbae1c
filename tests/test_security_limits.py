"""Every resource a client or a worker can make agentkv hold is bounded, and each bound is a flag;
here each is pushed past its limit. Serve's own bounds (body size, prompt tokens vs max_model_len,
max_tokens) are exercised in tests/test_serve.py and tests/test_security_privacy.py; the router's
(body size, concurrent requests per tenant, index blocks per worker) here.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from cluster import ADMIN_KEY, write_keys

from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.cli import build_parser
from agentkv.errors import UserError
from agentkv.gate.conn import make_runner, start_site
from agentkv.gate.options import HttpLimits
from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.route.command import config_from_args
from agentkv.route.index import TenantIndex
from agentkv.route.listen import fast_paths
from agentkv.route.proxy import Router, RouterConfig
from agentkv.route.workers import WorkerSpec

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


async def _router(cfg: RouterConfig, fast: bool = False) -> tuple[web.AppRunner, str, Router]:
    """The router on a free port: aiohttp alone, or (`fast`) behind gate.fastpath as `agentkv route` runs."""
    router = Router(cfg)
    if fast:
        runner = make_runner(router.app, cfg.http)
        await runner.setup()
        await start_site(runner, "127.0.0.1", 0, cfg.http, fast=fast_paths(router))
    else:
        runner = web.AppRunner(router.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", router


@pytest.mark.parametrize("fast", [False, True], ids=["aiohttp", "fastpath"])
def test_concurrent_requests_per_tenant_are_capped(tmp_path, fast):
    async def main():
        async with StreamTestServer(behave=lambda body, n: Behaviour(ttft=1.0)) as worker:
            cfg = RouterConfig(
                workers=[WorkerSpec(worker.url)],
                api_keys=str(write_keys(tmp_path, KEYS)),
                secret="s",
                max_streams_per_tenant=2,
                health_interval=3600,
                scrape_interval=0,
            )
            runner, url, router = await _router(cfg, fast)
            try:
                async with aiohttp.ClientSession() as s:

                    async def send(key: str) -> int:
                        body = {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
                        async with s.post(
                            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                        ) as r:
                            await r.read()
                            return r.status

                    first = [asyncio.create_task(send("key-a")) for _ in range(2)]
                    await asyncio.sleep(0.3)  # both in flight (the worker waits 1 s before answering)
                    third_a, other_b = await asyncio.gather(send("key-a"), send("key-b"))
                    assert third_a == 429  # tenant a is at its limit ...
                    assert other_b == 200  # ... which does not touch tenant b
                    assert await asyncio.gather(*first) == [200, 200]
                    assert await send("key-a") == 200  # slots are given back when streams end
                    assert router.stats.throttled == 1 and not router.in_flight.n
                    async with s.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                        assert "agentkv_router_throttled_total 1" in await r.text()
            finally:
                await runner.cleanup()

    asyncio.run(main())


def test_router_body_size_limit(tmp_path):
    async def main():
        async with StreamTestServer() as worker:
            cfg = RouterConfig(
                workers=[WorkerSpec(worker.url)],
                http=HttpLimits(max_body_bytes=4096),
                health_interval=3600,
                scrape_interval=0,
            )
            runner, url, _ = await _router(cfg)
            try:
                async with aiohttp.ClientSession() as s:
                    ok = json.dumps({"prompt": [1] * 100, "max_tokens": 1}).encode()
                    big = json.dumps({"prompt": [1] * 2000, "max_tokens": 1}).encode()
                    async with s.post(url + "/v1/completions", data=ok) as r:
                        assert r.status == 200
                    async with s.post(url + "/v1/completions", data=big) as r:
                        assert r.status == 413
                    assert len(worker.seen) == 1  # the big one never reached the worker
            finally:
                await runner.cleanup()

    asyncio.run(main())


def test_index_blocks_per_worker_are_capped():
    idx = TenantIndex(max_blocks=10)
    idx.apply(0, BlockStored(block_hashes=list(range(8))))
    idx.apply(0, BlockStored(block_hashes=[100, 101, 102], parent_block_hash=7))  # would make 11
    assert idx.blocks(0) == 8 and idx.overflow == 3
    idx.apply(1, BlockStored(block_hashes=list(range(10))))  # the bound is per worker
    assert idx.blocks(1) == 10
    idx.apply(0, BlockRemoved(block_hashes=[0, 1, 2]))
    idx.apply(0, BlockStored(block_hashes=[100, 101, 102], parent_block_hash=7))
    assert idx.blocks(0) == 8 and idx.overflow == 3
    for _ in range(1000):  # a publisher flooding stores: memory stays at the cap
        idx.apply(0, BlockStored(block_hashes=list(range(10_000, 10_050))))
    assert idx.blocks(0) <= 10


def _route_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["route", "--worker", "http://127.0.0.1:1", *extra])


def test_router_limit_flags():
    cfg = config_from_args(
        _route_args("--max-body-size", "1MiB", "--max-streams-per-tenant", "8", "--max-index-blocks", "1000")
    )
    assert (cfg.http.max_body_bytes, cfg.max_streams_per_tenant, cfg.max_index_blocks) == (1 << 20, 8, 1000)
    default = config_from_args(_route_args())
    assert default.max_streams_per_tenant > 0 and default.max_index_blocks > 0  # bounded by default
    for bad in (
        ["--max-body-size", "10"],
        ["--max-streams-per-tenant", "-1"],
        ["--max-index-blocks", "0"],
        ["--max-body-size", "lots"],
    ):
        with pytest.raises(UserError):
            config_from_args(_route_args(*bad))


def test_router_timing_flags():
    """Intervals and the first-byte timeout: valid values reach the config, bad ones are one-line errors
    (a zero health interval would spin the health loop)."""
    cfg = config_from_args(
        _route_args("--health-interval", "0.5", "--scrape-interval", "0", "--first-byte-timeout", "30")
    )
    assert (cfg.health_interval, cfg.scrape_interval, cfg.first_byte_timeout) == (0.5, 0, 30)
    assert config_from_args(_route_args()).first_byte_timeout is None  # no limit by default
    for bad in (
        ["--health-interval", "0"],
        ["--health-interval", "nan"],
        ["--scrape-interval", "-1"],
        ["--first-byte-timeout", "-1"],
        ["--first-byte-timeout", "nan"],
        ["--temperature", "nan"],
        ["--affinity", "nan"],
        ["--approx-ttl", "nan"],
    ):
        with pytest.raises(UserError, match=bad[0]):
            config_from_args(_route_args(*bad))


def test_door_flags(tmp_path):
    """The door's flags (shared with serve) and the router's own: values reach the config, bad ones
    are one-line errors; the default body cap is the workers' 32MiB."""
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    cfg = config_from_args(
        _route_args(
            "--timeout-keep-alive",
            "3",
            "--body-timeout",
            "7",
            "--limit-concurrency",
            "100",
            "--parse-processes",
            "0",
            "--max-parses-per-tenant",
            "3",
            "--max-model-len",
            "4096",
            "--health-timeout",
            "1.5",
            "--router-secret-file",
            str(secret),
        )
    )
    assert cfg.http == HttpLimits(32 << 20, 3.0, 7.0, 100, 0)
    assert (cfg.max_parses_per_tenant, cfg.max_model_len, cfg.health_timeout) == (3, 4096, 1.5)
    assert cfg.secret == "from-a-file"
    assert config_from_args(_route_args()).http == HttpLimits(parse_processes=2)
    for bad in (
        ["--timeout-keep-alive", "0"],
        ["--body-timeout", "inf"],
        ["--limit-concurrency", "-1"],
        ["--max-parses-per-tenant", "0"],
        ["--health-timeout", "0"],
        ["--router-secret", "x", "--router-secret-file", str(secret)],
    ):
        with pytest.raises(UserError):
            config_from_args(_route_args(*bad))
