"""gate.upstream, the router's client to its workers: framing, keep-alive reuse and failures, against
real loopback servers that answer hand-written bytes (so each framing and fault is exactly as sent)."""

from __future__ import annotations

import asyncio

import pytest

from agentkv.gate.upstream import BUFFER_BYTES, ConnectFailed, Upstream, UpstreamBroken

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b"b;ext=1\r\ndata: one\n\n\r\n"
    b"b\r\ndata: two\n\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)
LENGTH = b'HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nContent-Length: 9\r\n\r\n{"a": 12}'


class RawServer:
    """A loopback server answering each request (head and Content-Length body read) with `answer(n)`,
    n counting requests on that connection; None closes the connection instead (as does `close`,
    after each answer)."""

    def __init__(self, answer, split: int = 0, close: bool = False) -> None:
        self.answer, self.split, self.close = answer, split, close
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/completions"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await r.readexactly(length))
                out = self.answer(n)
                n += 1
                if out is None:
                    break
                step = self.split or len(out)
                for i in range(0, len(out), step):  # byte by byte when split=1: every boundary
                    w.write(out[i : i + step])
                    await w.drain()
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()


async def _read_all(
    up: Upstream, url: str, body: bytes = b"{}", first: bool = False
) -> tuple[int, str, bytes]:
    r = await up.post(url, body, b"Content-Type: application/json\r\n", first=first)
    out = b""
    while chunk := await r.readany():
        out += chunk
    r.release()
    return r.status, r.content_type, out


@pytest.mark.parametrize("first", [False, True], ids=["head", "first-bytes"])
@pytest.mark.parametrize("split", [0, 1, 7])
def test_chunked_and_length_bodies_arrive_whole_however_the_bytes_are_cut(split, first):
    async def main():
        up = Upstream()
        async with RawServer(lambda n: CHUNKED if n % 2 == 0 else LENGTH, split) as url:
            want = (200, "text/event-stream", b"data: one\n\ndata: two\n\n")
            assert await _read_all(up, url, first=first) == want
            assert await _read_all(up, url, first=first) == (400, "application/json", b'{"a": 12}')
            assert await _read_all(up, url, first=first) == want
        up.close()

    asyncio.run(main())


def test_a_200_whose_worker_leaves_before_its_first_bytes_raises_from_post():
    """With `first` the response waits for a 200's first body bytes: a worker that closes after the
    head is UpstreamBroken there (the router retries it elsewhere), not a response with no body."""

    async def main():
        up = Upstream()
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        async with RawServer(lambda n: head, close=True) as url:
            with pytest.raises(UpstreamBroken):
                await up.post(url, b"{}", first=True)
        up.close()

    asyncio.run(main())


def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given():
    async def main():
        up = Upstream()
        srv = RawServer(lambda n: LENGTH)
        async with srv as url:
            for _ in range(5):
                await _read_all(up, url, b'{"prompt": "x"}')
        up.close()
        return srv

    srv = asyncio.run(main())
    assert srv.connections == 1 and len(srv.requests) == 5
    req = srv.requests[0]
    assert req.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Type: application/json\r\n" in req and req.endswith(b'\r\n\r\n{"prompt": "x"}')
    assert b"accept-encoding" not in req.lower()  # the body comes back as the worker wrote it


def test_connections_idle_past_keepalive_are_closed_not_reused():
    async def main():
        up = Upstream(keepalive=0.3)
        srv = RawServer(lambda n: LENGTH)
        async with srv as url:
            await asyncio.gather(*(_read_all(up, url) for _ in range(4)))  # a burst: 4 connections
            host = next(iter(up._hosts.values()))
            assert len(host.idle) == 4
            for _ in range(5):  # then one at a time: one connection kept warm, the others go stale
                await asyncio.sleep(0.1)
                await _read_all(up, url)
            assert srv.connections == 4 and len(host.idle) == 1
            await asyncio.sleep(0.4)
            await _read_all(up, url)  # past keepalive: not reused (the worker may close it as we send)
            assert srv.connections == 5
        up.close()

    asyncio.run(main())


def test_a_pooled_connection_the_worker_closed_is_replaced_without_an_error():
    async def main():
        up = Upstream()
        # every connection answers one request and then closes on the next: a stale keep-alive socket
        srv = RawServer(lambda n: LENGTH if n == 0 else None)
        async with srv as url:
            for _ in range(3):
                assert (await _read_all(up, url))[0] == 400
        up.close()
        return srv

    assert asyncio.run(main()).connections == 3


def test_close_delimited_body_and_connection_close_are_not_reused():
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/plain\r\n\r\nuntil the end"

    async def main():
        up = Upstream()
        srv = RawServer(lambda n: close, close=True)  # no Content-Length: the body ends with the connection
        async with srv as url:
            for _ in range(2):
                assert await _read_all(up, url) == (200, "text/plain", b"until the end")
        up.close()
        return srv

    assert asyncio.run(main()).connections == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # cut before the last chunk
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",  # fewer bytes than promised
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",  # not a chunk size
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",  # no CRLF after data
    ],
)
@pytest.mark.parametrize("piped", [False, True], ids=["readany", "pipe"])
def test_a_body_broken_off_or_malformed_raises_upstream_broken(answer, piped):
    async def main():
        up = Upstream()
        async with RawServer(lambda n: answer, close=True) as url:
            r = await up.post(url, b"{}")
            with pytest.raises(UpstreamBroken):
                if piped:
                    await _piped(r)
                while await r.readany():
                    pass
            r.release()
        up.close()

    asyncio.run(main())


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n", b"x" * 70_000, None])
def test_no_http_answer_raises_before_a_response(answer):
    async def main():
        up = Upstream()
        async with RawServer(lambda n: answer) as url:
            with pytest.raises(UpstreamBroken):
                await up.post(url, b"{}")
        up.close()

    asyncio.run(main())


def test_a_refused_connection_is_connect_failed():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        up = Upstream()
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await up.post(f"http://127.0.0.1:{port}/v1/completions", b"{}")
        up.close()

    asyncio.run(main())


def test_a_large_body_pauses_reading_until_it_is_read():
    big = b"x" * (4 * BUFFER_BYTES)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(big)).encode() + b"\r\n\r\n" + big

    async def main():
        up = Upstream()
        async with RawServer(lambda n: answer) as url:
            r = await up.post(url, b"{}")
            await asyncio.sleep(0.2)  # the worker has sent it all; the router has not read
            conn = r._conn
            assert conn.paused and conn.body_bytes <= 2 * BUFFER_BYTES
            got = 0
            while chunk := await r.readany():
                got += len(chunk)
            r.release()
        up.close()
        return got

    assert asyncio.run(main()) == len(big)


async def _piped(r, behind=lambda got: False, drain=None) -> tuple[bytes, list[bool]]:
    """The body through Response.pipe: the bytes written and each write's end flag."""
    got: list[bytes] = []
    ends: list[bool] = []

    def write(data: bytes, end: bool) -> bool:
        got.append(data)
        ends.append(end)
        return behind(got)

    async def no_wait() -> None:
        pass

    await r.pipe(write, drain or no_wait)
    return b"".join(got), ends


@pytest.mark.parametrize("split", [0, 1, 7])
def test_piped_bodies_arrive_whole_and_the_connection_is_reused(split):
    async def main():
        up = Upstream()
        srv = RawServer(lambda n: CHUNKED if n % 2 == 0 else LENGTH, split)
        async with srv as url:
            for want in (b"data: one\n\ndata: two\n\n", b'{"a": 12}') * 2:
                r = await up.post(url, b"{}")
                body, ends = await _piped(r)
                assert body == want and not any(ends[:-1])
                r.release()
        up.close()
        return srv

    assert asyncio.run(main()).connections == 1


def test_a_piped_body_pauses_reading_while_the_writer_is_behind():
    big = b"x" * (4 * BUFFER_BYTES)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(big)).encode() + b"\r\n\r\n" + big
    drains: list[bool] = []

    async def main():
        up = Upstream()
        async with RawServer(lambda n: answer) as url:
            r = await up.post(url, b"{}")
            conn = r._conn

            async def drain() -> None:
                drains.append(conn.paused)  # reading stopped while the writer was behind
                await asyncio.sleep(0.01)

            body, _ = await _piped(r, lambda got: len(got) % 2 == 1, drain)
            assert not conn.paused
            r.release()
        up.close()
        return body

    assert asyncio.run(main()) == big and drains and all(drains)
