"""The router refuses a token-id prompt longer than the workers' context on its raw bytes: a 400 in
vLLM's words before the list is decoded (memory stays near the body's own size), while lists under
the bound and comma-heavy text pass to the worker. Real HTTP: the router's app on loopback in
front of a real streaming test server."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import aiohttp
from aiohttp import web

from agentkv.bench.testserver import StreamTestServer
from agentkv.gate.jsonbody import long_int_list
from agentkv.gate.options import HttpLimits
from agentkv.route.proxy import Router, RouterConfig
from agentkv.route.workers import WorkerSpec

LIMIT = 1000  # the workers' max_model_len


async def _post_all(bodies: list[bytes]) -> list[tuple[int, dict, float]]:
    """Each body through a router (parsing in a thread, so this process's allocations are all traced):
    (status, JSON answer, peak traced MiB during the request); and the worker's request count."""
    async with StreamTestServer() as worker:
        cfg = RouterConfig(
            workers=[WorkerSpec(worker.url)],
            max_model_len=LIMIT,
            health_interval=3600,
            scrape_interval=0,
            http=HttpLimits(parse_processes=0),
        )
        router = Router(cfg)
        runner = web.AppRunner(router.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for body in bodies:
                    tracemalloc.start()
                    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                        raw = await r.read()
                    answer = json.loads(raw) if r.status != 200 else raw
                    peak = tracemalloc.get_traced_memory()[1] / 2**20
                    tracemalloc.stop()
                    out.append((r.status, answer, peak))
        finally:
            await runner.cleanup()
        return out


def _ids(n: int) -> list[int]:
    return [1000 + (i * 7919) % 30000 for i in range(n)]


def test_an_oversized_token_id_list_is_refused_before_it_is_decoded():
    huge = json.dumps({"prompt": _ids(400_000), "max_tokens": 1}).encode()  # ~2.7 MiB of ids
    ok = json.dumps({"prompt": _ids(LIMIT - 10), "max_tokens": 1}).encode()
    prose = json.dumps({"prompt": "a, b, " * 3000, "max_tokens": 1}).encode()  # 6,000 commas, no ids
    nested = json.dumps({"prompt": [_ids(5 * LIMIT)], "max_tokens": 1}).encode()  # a batch of one
    (st, ans, peak), (st_ok, _, _), (st_prose, _, _), (st_nested, ans_nested, _) = asyncio.run(
        _post_all([huge, ok, prose, nested])
    )
    assert st == 400, ans
    # decoding 400,000 ids into Python ints takes ~14 MiB; refused on the bytes, the peak is the body
    body_mib = len(huge) / 2**20
    assert peak < 2.5 * body_mib + 1, (peak, body_mib)
    err = ans["error"]
    assert err["param"] == "prompt" and err["code"] == 400
    assert "maximum context length is 1000 tokens" in err["message"] and "400000 token ids" in err["message"]
    assert st_ok == 200 and st_prose == 200
    assert st_nested == 400 and "5000 token ids" in ans_nested["error"]["message"]


def test_long_int_list_counts_only_integer_arrays_past_the_floor():
    assert long_int_list(b'{"prompt": [1, 2, 3, 4, 5]}', 4) == 5
    assert long_int_list(b'{"prompt": [1, 2, 3, 4]}', 4) == 0
    assert long_int_list(b'{"prompt": [1,2,3], "stop": [4,5,6]}', 4) == 0  # two short lists
    assert long_int_list(b'{"prompt": "1 2 3 4 5 6", "x": [1.5, 2.5, 3.5, 4.5, 5.5]}', 2) == 0
    assert long_int_list(b'{"prompt": [[1,2,3,4,5,6]]}', 5) == 6
    assert long_int_list(bytearray(b"[-1, +2, 3,\n4, 5]"), 3) == 5  # bytearray: the body as read
