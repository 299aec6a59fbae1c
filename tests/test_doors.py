"""The HTTP door shared by serve and route (`agentkv.gate`) on a real loopback server: bodies read
under caps on the wire and inflated, every malformed body a 4xx in OpenAI's error shape, JSON
depth, heavy parsing in worker processes behind per-key slots, keep-alive and body timeouts,
and the connection cap (idle connections make room; busy ones get a 503)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import time
import zlib

import aiohttp
import pytest
from aiohttp import web

from agentkv.gate.body import BodyTimeout, read_body, refuse_and_close
from agentkv.gate.conn import make_runner, start_site
from agentkv.gate.errors import RequestError
from agentkv.gate.jsonbody import MAX_DEPTH, check_depth, decode_object, json_depth
from agentkv.gate.options import HttpLimits
from agentkv.gate.web import error_middleware, error_response
from agentkv.gate.work import Offload

CAP = 64 << 10


@contextlib.asynccontextmanager
async def door(limits: HttpLimits):
    """A server with the door's runner and site: POST /echo answers the body's length, GET /slow
    waits on `release` (a busy connection)."""
    release = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        try:
            body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
        except BodyTimeout as e:
            return await refuse_and_close(request, e)
        except RequestError as e:
            return error_response(e)
        return web.json_response({"n": len(body), "head": body[:20].decode("latin-1")})

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="done")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/echo", echo)
    app.router.add_get("/slow", slow)
    runner = make_runner(app, limits)
    await runner.setup()
    guard = await start_site(runner, "127.0.0.1", 0, limits)
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", port, guard, release
    finally:
        release.set()
        await runner.cleanup()


def run(coro):
    return asyncio.run(coro)


async def _post(s: aiohttp.ClientSession, url: str, data, headers=None) -> tuple[int, dict]:
    async with s.post(url, data=data, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None)


def _is_openai_error(body: dict, status: int) -> bool:
    e = body.get("error", {})
    return set(e) == {"message", "type", "param", "code"} and e["code"] == status


def test_bodies_are_capped_on_the_wire_and_inflated():
    payload = b'{"prompt": "' + b"a" * 1000 + b'"}'

    async def main():
        async with door(HttpLimits(max_body_bytes=CAP)) as (url, _, _, _), aiohttp.ClientSession() as s:
            gz = {"Content-Encoding": "gzip"}
            bomb = gzip.compress(b"\0" * (50 << 20))  # 50 MiB of zeros in ~50 KB
            assert len(bomb) < CAP
            cases = [
                (bomb, gz, 413),
                (b"x" * (CAP + 1), {}, 413),  # Content-Length over the cap
                (gzip.compress(payload), gz, 200),
                (gzip.compress(payload[:500]) + gzip.compress(payload[500:]), gz, 200),  # two members
                (zlib.compress(payload), {"Content-Encoding": "deflate"}, 200),
                (zlib.compress(payload)[2:-4], {"Content-Encoding": "deflate"}, 200),  # raw deflate
                (payload, {"Content-Encoding": "identity"}, 200),
                (payload, gz, 400),  # says gzip, is not
                (gzip.compress(payload)[:-9], gz, 400),  # truncated
                (gzip.compress(payload) + b"junk", gz, 400),  # trailing garbage
                (payload, {"Content-Encoding": "br"}, 415),
                (payload, {"Content-Encoding": "gzip, gzip"}, 415),
            ]
            for data, headers, status in cases:
                got, body = await _post(s, url + "/echo", data, headers)
                assert got == status, (headers, got, body)
                if status == 200:
                    assert body == {"n": len(payload), "head": payload[:20].decode()}
                else:
                    assert _is_openai_error(body, status)

            async def chunked():  # no Content-Length: the cap applies while reading
                for _ in range(100):
                    yield b"y" * 4096

            assert (await _post(s, url + "/echo", chunked()))[0] == 413

    run(main())


def test_aiohttp_refusals_get_the_json_error_shape():
    async def main():
        async with door(HttpLimits()) as (url, _, _, _), aiohttp.ClientSession() as s:
            for method, path, status in (("GET", "/nope", 404), ("GET", "/echo", 405)):
                async with s.request(method, url + path) as r:
                    assert r.status == status and _is_openai_error(await r.json(), status)

    run(main())


def _raw(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    if data:
        sock.sendall(data)
    return sock


def _wait_closed(sock: socket.socket, within: float) -> bytes:
    """Everything the server sends until it closes; fails if it has not closed within `within` s."""
    sock.settimeout(within)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        pytest.fail(f"connection still open after {within} s; got {out[:200]!r}")
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return out


def test_idle_half_sent_and_stalled_connections_are_closed():
    """No request, half a request line, headers without their end, a body that stops: each is closed
    after its timeout (keep-alive for the first three, the body timeout with a 408 for the last)."""

    async def main():
        limits = HttpLimits(keep_alive=0.5, body_timeout=0.5)
        async with door(limits) as (url, port, guard, _):
            socks = [
                _raw(port),
                _raw(port, b"POST /ec"),
                _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le"),
                _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"),
            ]
            outs = await asyncio.gather(*(asyncio.to_thread(_wait_closed, s, 10.0) for s in socks))
            assert outs[:3] == [b"", b"", b""]
            assert outs[3].startswith(b"HTTP/1.1 408") and b'"code":408' in outs[3]
            assert not guard.open  # nothing left behind

    run(main())


def test_connection_cap_makes_room_from_idle_and_refuses_when_busy():
    async def main():
        limits = HttpLimits(max_connections=4, keep_alive=30)
        async with door(limits) as (url, port, guard, release):
            idle = [_raw(port) for _ in range(4)]
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                # at the cap, a new client is served: the longest-idle connection is closed for it
                assert (await _post(s, url + "/echo", b"hi"))[0] == 200
                assert guard.evicted >= 1
                # fill the cap with busy requests: the next client gets a clear 503
                busy = [asyncio.create_task(s.get(url + "/slow")) for _ in range(4)]
                await asyncio.sleep(0.5)
                status, body = await _post(s, url + "/echo", b"hi")
                assert status == 503 and _is_openai_error(body, 503) and guard.refused >= 1
                release.set()
                for t in busy:
                    (await t).release()
                assert (await _post(s, url + "/echo", b"hi"))[0] == 200  # and served again after
            for sock in idle:
                sock.close()

    run(main())


def test_json_depth_and_decoder_errors():
    assert json_depth(b'{"a": [[{"b": "[[[[["}]], "c": "\\"]]]"}') == 4
    assert json_depth(b"[]") == 1 and json_depth(b'"x"') == 0
    check_depth(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    for body in (
        b'{"x":' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}",
        b'{"x":' + b"[" * 100_000,  # unbalanced: still refused before decoding
    ):
        with pytest.raises(RequestError, match="nests"):
            decode_object(body)
    for body, msg in ((b"[1]", "object"), (b"{", "malformed"), (b'{"a": "\xff"}', "malformed|UTF-8")):
        with pytest.raises(RequestError, match=msg) as e:
            decode_object(body)
        assert e.value.status == 400


def _parse_len(body: bytes, bad: bool) -> int:
    if bad:
        raise RequestError("refused in the worker", "prompt", 413)
    return len(body)


def test_offload_runs_in_a_process_and_bounds_each_key():
    async def main():
        off = Offload(1, per_key=1, total=2)
        try:
            assert await off.run(_parse_len, b"abc", False) == 3
            with pytest.raises(RequestError) as e:
                await off.run(_parse_len, b"abc", True)
            assert (e.value.status, e.value.param) == (413, "prompt")  # pickled whole

            order: list[str] = []

            async def hold(key: str, name: str, gate: asyncio.Event) -> None:
                async with off.slot(key):
                    order.append(name)
                    await gate.wait()

            g1, g2 = asyncio.Event(), asyncio.Event()
            a1 = asyncio.create_task(hold("a", "a1", g1))
            a2 = asyncio.create_task(hold("a", "a2", g2))
            b1 = asyncio.create_task(hold("b", "b1", g2))
            await asyncio.sleep(0.1)
            assert order == ["a1", "b1"] and off.waiting == 1  # a's second waits; b is not held up
            g1.set()
            await asyncio.sleep(0.1)
            assert order == ["a1", "b1", "a2"]
            g2.set()
            await asyncio.gather(a1, a2, b1)
            assert not off._keys and off.waiting == 0
        finally:
            off.close()

    t0 = time.monotonic()
    run(main())
    assert time.monotonic() - t0 < 120
