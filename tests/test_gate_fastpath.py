"""gate/fastpath.py over real loopback sockets: the lean path answers plain POSTs, hands anything else
to aiohttp on the same connection, and holds the door's rules against hostile clients (cut and
oversized heads, smuggling framings, pipelining, slowloris heads and bodies, clients that leave)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from aiohttp import web

from agentkv.gate.conn import make_runner, start_site
from agentkv.gate.fastpath import MAX_HEAD
from agentkv.gate.options import HttpLimits
from agentkv.gate.web import error_middleware

LIMITS = HttpLimits(max_body_bytes=4096, keep_alive=0.5, body_timeout=0.5, max_connections=4)


class Served:
    def __init__(self) -> None:
        self.cancelled = 0
        self.guard = None
        self.port = 0


async def _fast(req, ex) -> None:
    if req.path == "/slow":  # streams, then waits: a client that leaves cancels this
        ex.begin(200, "text/event-stream", None)
        await ex.send(b"data: 1\n\n")
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            SERVED.cancelled += 1
            raise
    body = json.dumps({"by": "fast", "len": len(req.body), "key": req.headers.get("x-api-key")}).encode()
    ex.begin(200, "application/json", len(body), "x-test: 1\r\n")
    await ex.send(body, end=True)


async def _aio(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"by": "aiohttp", "len": len(body)})


SERVED = Served()


async def _serve():
    app = web.Application(client_max_size=LIMITS.max_body_bytes, middlewares=[error_middleware])
    app.router.add_post("/v1/completions", _aio)
    app.router.add_get("/other", _aio)
    runner = make_runner(app, LIMITS)
    await runner.setup()
    fast = {"/v1/completions": _fast, "/slow": _fast}
    SERVED.guard = await start_site(runner, "127.0.0.1", 0, LIMITS, fast=fast)
    SERVED.port = runner.addresses[0][1]
    return runner


def _post(body: bytes = b'{"a": 1}', path: str = "/v1/completions", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


async def _read_response(r: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One response off the stream: status, headers, de-framed body."""
    status = int((await r.readline()).split()[1])
    headers = {}
    while (line := await r.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, headers, await r.readexactly(int(headers["content-length"]))
    body = b""
    while (n := int((await r.readline()).strip(), 16)) > 0:
        body += await r.readexactly(n)
        await r.readline()
    await r.readline()
    return status, headers, body


def _run(test):
    async def main():
        runner = await _serve()
        try:
            await asyncio.wait_for(test(), 10)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_plain_posts_take_the_fast_path_and_keep_the_connection():
    async def t():
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        for n in (8, 0, 100):
            w.write(_post(b"x" * n, extra="X-Api-Key: k1\r\n"))
            status, h, body = await _read_response(r)
            assert status == 200 and h["x-test"] == "1" and "date" in h
            assert json.loads(body) == {"by": "fast", "len": n, "key": "k1"}
        # a request in pieces (head cut, body cut, the next request's head in the last piece)
        raw = _post(b"y" * 3000) + _post(b"z")
        for i in range(0, len(raw), 700):
            w.write(raw[i : i + 700])
            await asyncio.sleep(0.01)
        got = [json.loads((await _read_response(r))[2])["len"] for _ in range(2)]
        assert got == [3000, 1]
        w.close()

    _run(t)


def test_pipelined_requests_are_answered_in_order_across_both_paths():
    async def t():
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        w.write(_post(b"a") + _post(b"bbb") + b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n" + _post(b"cc"))
        got = [json.loads((await _read_response(r))[2]) for _ in range(4)]
        # the third goes to aiohttp, and the connection with it: the fourth is aiohttp's too
        assert got == [
            {"by": "fast", "len": 1, "key": None},
            {"by": "fast", "len": 3, "key": None},
            {"by": "aiohttp", "len": 0},
            {"by": "aiohttp", "len": 2},
        ]
        w.close()

    _run(t)


def test_unusual_heads_go_to_aiohttp_which_answers_or_refuses_them():
    cases = [
        (_post(b"hello", extra="Transfer-Encoding: chunked\r\n"), 400),  # smuggling: both framings
        (_post(b"hi", extra="Content-Length: 2\r\n"), 400),  # a repeated Content-Length
        (_post(b"x" * 5000), 413),  # over the body cap
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nBad Header: v\r\n\r\nhi", 400),
        (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 404),
        (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nX: "
            + b"a" * (MAX_HEAD + 10000)
            + b"\r\n\r\nhi",
            400,
        ),
    ]

    async def t():
        for raw, want in cases:
            r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
            w.write(raw)
            status, h, body = await _read_response(r)
            assert status == want, (raw[:80], status, body[:200])
            if want != 400:  # aiohttp's own parser refusals are plain text; the app's are JSON
                assert "error" in json.loads(body)
            w.close()

    _run(t)


def test_slow_and_cut_clients_are_bounded():
    async def t():
        # a head trickled in: closed by the keep-alive timer (0.5 s), not held open
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        t0 = time.monotonic()
        for b in _post()[:30]:
            w.write(bytes([b]))
            await asyncio.sleep(0.05)
            if r.at_eof():
                break
        assert await r.read() == b"" and time.monotonic() - t0 < 2.0
        # a body that stops arriving: 408 in the JSON shape, then closed
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        w.write(_post(b"x" * 50)[:-20])
        status, h, body = await _read_response(r)
        assert status == 408 and json.loads(body)["error"]["code"] == 408 and h["connection"] == "close"
        assert await r.read() == b""
        # a cut head, then gone: nothing left behind in the guard
        for raw in (b"POST /v1/comp", _post()[:-3]):
            r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
            w.write(raw)
            await asyncio.sleep(0.05)
            w.close()
        await asyncio.sleep(0.2)
        assert len(SERVED.guard.open) == 0

    _run(t)


def test_keep_alive_counts_from_the_last_answer():
    async def t():
        # requests 0.2 s apart for twice the keep-alive (0.5 s): one connection throughout
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        for _ in range(5):
            w.write(_post(b"k"))
            assert (await _read_response(r))[0] == 200
            await asyncio.sleep(0.2)
        last = time.monotonic() - 0.2
        # then idle: closed about keep-alive after the last answer, not after the first
        assert await asyncio.wait_for(r.read(), 3.0) == b""
        assert 0.4 <= time.monotonic() - last < 1.5
        w.close()

    _run(t)


def test_a_client_that_leaves_cancels_its_handler_and_the_cap_holds():
    async def t():
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        w.write(_post(path="/slow"))
        assert (await r.readline()).startswith(b"HTTP/1.1 200")
        w.close()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if SERVED.cancelled:
                break
        assert SERVED.cancelled == 1
        # four busy connections (the cap): a fifth gets the JSON 503
        busy = []
        for _ in range(4):
            r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
            w.write(_post(path="/slow"))
            await r.readline()
            busy.append(w)
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        status, _, body = await _read_response(r)
        assert status == 503 and json.loads(body)["error"]["type"] == "ServiceUnavailableError"
        for b in busy:
            b.close()

    _run(t)


def test_a_request_byte_by_byte_and_a_body_past_its_content_length():
    """One byte a TCP segment is still one request; bytes past the declared Content-Length are not
    the body but the start of the next request: garbage there gets aiohttp's 400, not a 200."""

    async def t():
        r, w = await asyncio.open_connection("127.0.0.1", SERVED.port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for b in _post(b"q" * 40, extra="X-Api-Key: k2\r\n"):
            w.write(bytes([b]))
            await w.drain()
            await asyncio.sleep(0.001)
        status, _, body = await _read_response(r)
        assert status == 200 and json.loads(body) == {"by": "fast", "len": 40, "key": "k2"}
        w.write(_post(b'{"a": 1}').replace(b"Length: 8", b"Length: 4") + b"\r\n\r\n")  # 4 declared, 8 sent
        status, _, body = await _read_response(r)
        assert status == 200 and json.loads(body)["len"] == 4
        status, _, body = await _read_response(r)
        assert status == 400
        assert await r.read() == b""  # and the connection is closed
        w.close()

    _run(t)
