"""A small HTTP/1.1 client for the proxy's hot path: POST a body to an engine, stream the answer back.

aiohttp's client costs a proxied request about as much CPU as everything else the router does
(benchmarks/upstream_client.py measures both); this one does only what a proxy to vLLM-style
workers needs: one request per pooled keep-alive connection (TCP_NODELAY, as asyncio sets it),
a response head parsed once, the body de-framed (Content-Length, chunked, or to the close; the
framing is gate/http1.py, shared with the bench's client) and handed over as it arrives, with reading paused while a slow client leaves BUFFER_BYTES unread.
No redirects, cookies or compression (no Accept-Encoding is sent, so the body is as the engine
wrote it). Errors are ConnectionError subclasses: `ConnectFailed` when no connection could be
made (the worker is down), `UpstreamBroken` when it broke off or answered something that is not
HTTP/1.x. A pooled connection that fails before its first byte is retried once on a fresh one
(the worker may have closed it just as it was reused).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque

from yarl import URL

from agentkv.gate.http1 import ChunkDecoder, FramingError, head_end, parse_head

BUFFER_BYTES = 1 << 18  # unread body bytes past which reading from the worker pauses
HEAD_CACHE = 64  # response heads kept parsed per host (a worker's heads differ by their Date, per second)


class UpstreamBroken(ConnectionError):
    """The worker closed the connection early or answered something that is not HTTP/1.x."""


class ConnectFailed(ConnectionError):
    """No connection to the worker could be made (refused, unreachable, or timed out)."""


class Response:
    """A worker's answer: `status`, `content_type`, `content_length`, then the body by `readany()`."""

    __slots__ = ("status", "content_type", "content_length", "_conn")

    def __init__(self, conn: _Conn, status: int, content_type: str, length: int | None) -> None:
        self.status, self.content_type, self.content_length, self._conn = status, content_type, length, conn

    async def readany(self) -> bytes:
        """The body bytes received since the last call (waiting for some); b'' at the end of the body.
        UpstreamBroken when the worker broke off before the end."""
        return await self._conn.readany()

    async def pipe(self, write, drain) -> None:
        """From here to the end, hand the body to `write(data, end)` inside the read callback, with no
        task switch per read (`write` returns True when its reader is behind: reading pauses until
        `await drain()`). UpstreamBroken when the worker breaks off before the end."""
        c = self._conn
        if c.body and write(c.take_body(), c.done):
            c.pause()
        c.pipe = write
        try:
            while not c.done:
                if c.error is not None:
                    raise c.error
                if c.paused:
                    await drain()
                    c.resume()
                    continue
                await c._wait()
        finally:
            c.pipe = None
            c.resume()  # a connection goes back to the pool reading

    @property
    def at_end(self) -> bool:
        """The whole body has arrived and been read: the next `readany()` would return b''."""
        c = self._conn
        return c.done and not c.body

    def release(self) -> None:
        """Done with it: the connection goes back to the pool when the body was read to its end and
        the worker keeps it alive, else it is closed."""
        self._conn.release()

    def close(self) -> None:
        """Close the connection now (the worker sees the client go and can abort the request)."""
        self._conn.abort()


class _Conn(asyncio.Protocol):
    """One connection to a worker: the response parser and the body's buffer."""

    def __init__(self, pool: _Host) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set with the transport
        self.buf = b""  # bytes of the response head not yet parsed
        self.chunks: ChunkDecoder | None = None  # a chunked body's decoder
        self.body: list[bytes] = []  # de-framed body bytes not yet read
        self.body_bytes = 0
        self.head: tuple | None = None  # (status, content type, content length) once parsed
        self.mode = ""  # body framing: "length", "chunked", "close"
        self.left = 0  # bytes left of the body ("length") or of the current chunk ("chunked")
        self.done = False  # the body is complete
        self.error: Exception | None = None
        self.closed = False
        self.paused = False
        self.keep = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future | None = None
        self.pipe = None  # Response.pipe's write(data, end): body bytes go there as they arrive
        self.first = False  # the reader waits for a 200's first body bytes, not its head alone

    # asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # once: each call is a getpid() syscall on 3.11

    def data_received(self, data: bytes) -> None:
        if self.done or self.error is not None:
            return  # bytes after a complete response (or a failure): the connection is not reused
        if self.mode == "chunked":
            self._chunks(data)
        elif self.head is None:
            self.buf = self.buf + data if self.buf else data
            self._parse()
        elif self.mode == "length":
            n = self.left
            if len(data) >= n:
                if len(data) > n:  # bytes past the body: the connection is not reused
                    self.keep = False
                    data = data[:n]
                self.left = 0
                self.done = True
                self._take(data)
            else:
                self._take(data)
                self.left = n - len(data)
        else:
            self._take(data)
        if self.pipe is None:
            if not self.first or self.body or self.done or (self.head is not None and self.head[0] != 200):
                self._wake()  # with `first`, a 200's head alone wakes no one: its first bytes will
        elif self.done or self.paused:
            self._wake()  # piped bytes wake the reader only at the end or to pause

    def eof_received(self) -> bool:
        if self.head is not None and self.mode == "close":
            self.done = True
        self._fail(UpstreamBroken("the worker closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        if self.head is not None and self.mode == "close":
            self.done = True
        self._fail(UpstreamBroken(f"the worker closed the connection{f' ({exc})' if exc else ''}"))

    # parsing ------------------------------------------------------------------------------------
    def _take(self, data: bytes) -> None:
        if self.pipe is not None:
            if self.pipe(data, self.done) and not self.paused:
                self.pause()  # the client is behind: read on once it has drained
            return
        self.body.append(data)
        self.body_bytes += len(data)
        if self.body_bytes > BUFFER_BYTES and not self.paused:
            self.pause()

    def _parse(self) -> None:
        try:
            end = head_end(self.buf)
            if end < 0:
                return
            raw = self.buf[:end]
            heads = self.pool.heads
            head = heads.get(raw)
            if head is None:
                head = parse_head(raw)
                if len(heads) >= HEAD_CACHE:
                    heads.clear()
                heads[raw] = head
        except FramingError as e:
            self._fail(UpstreamBroken(f"the worker sent a bad response: {e}"))
            return
        rest, self.buf = self.buf[end + 4 :], b""
        self.keep = head.keep
        self.head = (head.status, head.content_type, head.length)
        if head.chunked:
            self.mode, self.chunks = "chunked", ChunkDecoder()
            if rest:
                self._chunks(rest)
        else:
            self.mode = "close" if head.to_close else "length"
            self.left = head.length or 0
            self.done = head.length == 0
            if rest and not self.done:
                self.data_received(rest)
            elif rest:
                self.keep = False  # bytes after a body-less answer

    def _chunks(self, data: bytes) -> None:
        """De-frame chunked bytes (gate/http1.ChunkDecoder) into the body."""
        dec = self.chunks
        try:
            out = dec.feed(data)
        except FramingError as e:
            self._fail(UpstreamBroken(f"the worker sent a bad response: {e}"))
            return
        if dec.done:
            self.done = True
            if dec.extra:
                self.keep = False  # bytes after the response
        if out:
            self._take(out)

    def pause(self) -> None:
        if self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _fail(self, e: Exception) -> None:
        if not self.done and self.error is None:
            self.error = e
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wait(self) -> asyncio.Future:
        """A future the next `_wake` resolves, to await: a plain future, not a coroutine around one
        (a frame less for each wake-up to pass through; a done or cancelled one is never woken)."""
        self.waiter = fut = self.loop.create_future()
        return fut

    # the response's side ------------------------------------------------------------------------
    async def response(self, first: bool = False) -> Response:
        """The response once its head is in; `first`: a 200's once its first body bytes are in too
        (or its end), so a head and the bytes the worker writes after it cost one wake-up, not two."""
        self.first = first
        while self.head is None or (first and self.head[0] == 200 and not self.body and not self.done):
            if self.error is not None:
                raise self.error
            await self._wait()
        self.first = False
        status, ctype, length = self.head
        return Response(self, status, ctype, length)

    async def readany(self) -> bytes:
        while not self.body:
            if self.done:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        data = self.take_body()
        self.resume()
        return data

    def take_body(self) -> bytes:
        """The de-framed body bytes not yet read, all of them; the buffer empty."""
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.body_bytes = 0
        return data

    def release(self) -> None:
        if self.done and self.keep and not self.body and not self.closed and self.error is None:
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        if self.transport is not None:
            self.transport.abort()
        self._fail(UpstreamBroken("closed"))

    def reset(self) -> None:
        """Ready for the next request on this keep-alive connection."""
        self.buf = b""
        self.body.clear()
        self.body_bytes, self.head, self.mode, self.left, self.done = 0, None, "", 0, False
        self.chunks = None
        self.first = False


class _Host:
    """Idle keep-alive connections to one host:port, most recently used first."""

    def __init__(self, url: URL, keepalive: float, connect_timeout: float) -> None:
        self.host, self.port = url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.keepalive, self.connect_timeout = keepalive, connect_timeout
        self.idle: deque[_Conn] = deque()
        self.heads: dict[bytes, object] = {}  # response head bytes -> their parsed Head
        self.busy: set[_Conn] = set()
        authority = url.raw_authority.encode("ascii")
        self.head_tail = b" HTTP/1.1\r\nHost: " + authority + b"\r\nAccept: */*\r\nContent-Length: "

    def get(self) -> _Conn | None:
        """A pooled connection idle for less than `keepalive` s, or None."""
        now = time.monotonic()
        while self.idle:
            c = self.idle.pop()
            if not c.closed and c.error is None and now - c.idle_since < self.keepalive:
                c.reset()
                self.busy.add(c)
                return c
            c.abort()
        return None

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, c = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e}") from None
        self.busy.add(c)
        return c

    def put(self, c: _Conn) -> None:
        self.busy.discard(c)
        c.idle_since = now = time.monotonic()
        idle = self.idle
        while idle and (idle[0].closed or now - idle[0].idle_since >= self.keepalive):
            idle.popleft().abort()  # left over from a burst: closed, or about to be by the worker
        idle.append(c)

    def close(self) -> None:
        for c in [*self.idle, *self.busy]:
            c.abort()
        self.idle.clear()
        self.busy.clear()


class Upstream:
    """Pooled keep-alive connections to the workers; `post` sends one request and returns its Response."""

    def __init__(self, keepalive: float = 4.0, connect_timeout: float = 5.0) -> None:
        self.keepalive, self.connect_timeout = keepalive, connect_timeout
        self._hosts: dict[str, _Host] = {}  # scheme://host:port -> its connections
        self._targets: dict[str, tuple[_Host, bytes]] = {}  # URL -> (its host, its request line's start)

    def _target(self, url: str) -> tuple[_Host, bytes]:
        t = self._targets.get(url)
        if t is None:
            u = URL(url)
            key = f"{u.scheme}://{u.raw_authority}"
            host = self._hosts.get(key)
            if host is None:
                host = self._hosts[key] = _Host(u, self.keepalive, self.connect_timeout)
            t = self._targets[url] = (host, b"POST " + (u.raw_path_qs or "/").encode("ascii"))
        return t

    async def post(self, url: str, body: bytes, headers: bytes = b"", first: bool = False) -> Response:
        """POST `body` to `url` (`headers`: extra header lines, each ending in CRLF); the response once
        its head has arrived (`first`: a 200's once its first body bytes have too)."""
        host, start = self._target(url)
        req = b"".join((start, host.head_tail, str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
        c = host.get()
        while True:  # sent here, not in a coroutine of its own: a frame less for each wake-up
            pooled = c is not None
            if not pooled:
                c = await host.connect()
            try:
                c.transport.write(req)
                return await c.response(first)
            except UpstreamBroken:
                c.abort()
                if not pooled or c.head is not None:
                    raise
                c = None  # closed by the worker as it was reused: once more, on a fresh connection
            except BaseException:
                c.abort()
                raise

    def close(self) -> None:
        for host in self._hosts.values():
            host.close()
        self._hosts.clear()
        self._targets.clear()
