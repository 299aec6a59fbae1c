"""The streaming HTTP/1.1 client: framing parsed right however the bytes are split, keep-alive reuse,
and one retry when a reused connection turns out to be closed."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agentkv.bench.http1 import Http1Pool, HttpError, _Exchange

EVENTS = [
    b'{"choices":[{"text":"a"}]}',
    b'{"choices":[{"text":"b\\nc"}]}',
    b'{"usage":{"prompt_tokens":3}}',
    b"[DONE]",
]


def _chunked(parts: list[bytes], *, ext: bool = False, trailer: bool = False) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for p in parts:
        out += b"%x%s\r\n%s\r\n" % (len(p), b";x=1" if ext else b"", p)
    return out + (b"0\r\nX-Trailer: 1\r\n\r\n" if trailer else b"0\r\n\r\n")


def _sse(crlf: bool = False) -> list[bytes]:
    nl = b"\r\n" if crlf else b"\n"
    return [b"data: " + e + nl + nl for e in EVENTS]


def _feed(raw: bytes, cuts: list[int]) -> tuple[list[bytes], bool]:
    loop = asyncio.new_event_loop()
    try:
        got: list[bytes] = []
        ex = _Exchange(
            lambda ps, now: got.extend(p.strip() for p in ps), time.perf_counter, loop.create_future()
        )
        prev = 0
        for c in [*cuts, len(raw)]:
            ex.feed(raw[prev:c])
            prev = c
        return got, ex.done.done()
    finally:
        loop.close()


@pytest.mark.parametrize(
    "ext, trailer, crlf", [(False, False, False), (True, True, False), (False, False, True)]
)
def test_chunked_sse_parsed_for_every_split(ext, trailer, crlf):
    raw = _chunked(_sse(crlf), ext=ext, trailer=trailer)
    assert _feed(raw, []) == (EVENTS, True)
    for i in range(1, len(raw)):  # every single cut point
        assert _feed(raw, [i]) == (EVENTS, True), i
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(2, 12)))
        assert _feed(raw, cuts) == (EVENTS, True), cuts


def test_events_split_across_chunks():
    body = b"".join(_sse())
    parts = [body[i : i + 7] for i in range(0, len(body), 7)]  # chunk boundaries inside lines
    raw = _chunked(parts)
    assert _feed(raw, []) == (EVENTS, True)
    assert _feed(raw, list(range(1, len(raw), 5))) == (EVENTS, True)


def test_content_length_and_error_bodies():
    body = b"".join(_sse())
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    assert _feed(raw, [30, 31, 100]) == (EVENTS, True)
    loop = asyncio.new_event_loop()
    ex = _Exchange(lambda ps, now: None, time.perf_counter, loop.create_future())
    ex.feed(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"x"}')
    assert ex.status == 400 and b"".join(ex.body) == b'{"error":"x"}' and ex.done.done()
    loop.close()


def test_close_delimited_body_and_reset():
    loop = asyncio.new_event_loop()
    got: list[bytes] = []
    ex = _Exchange(lambda ps, now: got.extend(p.strip() for p in ps), time.perf_counter, loop.create_future())
    ex.feed(b"HTTP/1.1 200 OK\r\n\r\n" + b"".join(_sse()))
    assert not ex.done.done()
    ex.lost(None)  # the server closing ends such a body
    assert ex.done.done() and ex.done.exception() is None and got == EVENTS
    ex2 = _Exchange(lambda ps, now: None, time.perf_counter, loop.create_future())
    ex2.feed(_chunked(_sse())[:80])
    ex2.lost(ConnectionResetError("boom"))
    assert isinstance(ex2.done.exception(), HttpError) and ex2.done.exception().kind == "reset"
    loop.close()


async def _server(answer_on_reuse: bool):
    """A raw server: answers each connection's first request; a second one is answered, or (stale
    keep-alive) the connection is closed without a word."""
    conns = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        conns.append(writer)
        n = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(
                int(ln.split(b":")[1])
                for ln in head.split(b"\r\n")
                if ln.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            n += 1
            if n > 1 and not answer_on_reuse:
                writer.close()
                break
            writer.write(_chunked(_sse()))
            await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, conns


@pytest.mark.parametrize("answer_on_reuse", [True, False])
def test_keep_alive_reuse_and_stale_connection_retry(answer_on_reuse):
    async def go():
        srv, conns = await _server(answer_on_reuse)
        port = srv.sockets[0].getsockname()[1]
        pool = Http1Pool(f"http://127.0.0.1:{port}")
        got: list[bytes] = []
        for _ in range(3):
            status, _ = await pool.post_stream(
                "/v1/completions", b"{}", lambda ps, now: got.extend(p.strip() for p in ps), time.perf_counter
            )
            assert status == 200
        pool.close()
        srv.close()
        await srv.wait_closed()
        return got, len(conns)

    got, n_conns = asyncio.run(go())
    assert got == EVENTS * 3
    assert n_conns == (1 if answer_on_reuse else 3)  # reused, or retried once on a fresh connection


def test_refused_connection():
    async def go():
        pool = Http1Pool("http://127.0.0.1:1")
        await pool.post_stream("/", b"", lambda ps, now: None, time.perf_counter)

    with pytest.raises(HttpError) as e:
        asyncio.run(go())
    assert e.value.kind == "connect_error"
