"""A small HTTP/1.1 client for the proxy's hot path: POST a body to an engine, stream the answer back.

aiohttp's client costs a proxied request about as much CPU as everything else the router does
(benchmarks/upstream_client.py measures both); this one does only what a proxy to vLLM-style
workers needs: one request per pooled keep-alive connection (TCP_NODELAY, as asyncio sets it),
a response head parsed once, the body de-framed (Content-Length, chunked, or to the close) and
handed over as it arrives, with reading paused while a slow client leaves BUFFER_BYTES unread.
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

BUFFER_BYTES = 1 << 18  # unread body bytes past which reading from the worker pauses
MAX_HEAD_BYTES = 1 << 16  # a response head (status line and headers) longer than this is refused


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
        self.buf = b""  # bytes not yet parsed (head, chunk framing)
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

    # asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done or self.error is not None:
            return  # bytes after a complete response (or a failure): the connection is not reused
        if self.head is None or self.mode == "chunked":
            self.buf = self.buf + data if self.buf else data
            self._parse()
        elif self.mode == "length":
            n = self.left
            if len(data) >= n:
                if len(data) > n:  # bytes past the body: the connection is not reused
                    self.keep = False
                    data = data[:n]
                self._take(data)
                self.left = 0
                self.done = True
            else:
                self._take(data)
                self.left = n - len(data)
        else:
            self._take(data)
        self._wake()

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
        self.body.append(data)
        self.body_bytes += len(data)
        if self.body_bytes > BUFFER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _parse(self) -> None:
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    self._fail(UpstreamBroken("the worker's response head is too long"))
                return
            try:
                self._head(self.buf[:end].decode("latin-1"))
            except (ValueError, IndexError):
                self._fail(UpstreamBroken("the worker's response is not HTTP/1.x"))
                return
            rest, self.buf = self.buf[end + 4 :], b""
            if self.mode != "chunked":
                if rest and not self.done:
                    self.data_received(rest)
                elif rest:
                    self.keep = False  # bytes after a body-less answer
                return
            self.buf = rest
        self._chunks()

    def _head(self, text: str) -> None:
        """Status line and the headers the proxy needs; the framing of the body."""
        first, _, rest = text.partition("\r\n")
        version, status = first.split(" ", 2)[:2]
        if not version.startswith("HTTP/1."):
            raise ValueError(version)
        ctype, length, chunked, close = "application/octet-stream", None, False, version == "HTTP/1.0"
        for line in rest.split("\r\n"):
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-type":
                ctype = value.split(";", 1)[0].strip().lower() or ctype
            elif name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = value.strip().lower().endswith("chunked")
            elif name == "connection":
                v = value.lower()
                close = "close" in v if version != "HTTP/1.0" else "keep-alive" not in v
        code = int(status)
        self.keep = not close
        if chunked:
            self.mode, length = "chunked", None
        elif length is not None:
            if length < 0:
                raise ValueError(length)
            self.mode, self.left = "length", length
            self.done = length == 0
        elif code in (204, 304) or code < 200:
            self.mode, self.done, length = "length", True, 0
        else:
            self.mode, self.keep = "close", False
        self.head = (code, ctype, length)

    def _chunks(self) -> None:
        """De-frame the chunked bytes in `buf`: `left` > 0 is data still owed of the current chunk,
        -1 the CRLF after a chunk, -2 the trailers after the last, 0 a chunk-size line."""
        buf, pos, n, left, out = self.buf, 0, len(self.buf), self.left, []
        while pos < n:
            if left > 0:
                end = min(pos + left, n)
                out.append(buf[pos:end])
                left -= end - pos
                pos = end
                if not left:
                    left = -1
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if n - pos > MAX_HEAD_BYTES:
                    return self._bad_chunk()
                break
            if left == -1:  # the CRLF closing a chunk
                if end != pos:
                    return self._bad_chunk()
                left = 0
            elif left == -2:  # trailers, up to an empty line
                if end == pos:
                    self.done = True
                    if end + 2 < n:
                        self.keep = False  # bytes after the response
                    pos = n
                    break
            else:
                try:
                    size = int(buf[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    return self._bad_chunk()
                if size < 0:
                    return self._bad_chunk()
                left = size if size else -2
            pos = end + 2
        self.left = left
        self.buf = buf[pos:] if pos < n else b""
        if out:
            self._take(out[0] if len(out) == 1 else b"".join(out))

    def _bad_chunk(self) -> None:
        self._fail(UpstreamBroken("bad chunk framing from the worker"))

    def _fail(self, e: Exception) -> None:
        if not self.done and self.error is None:
            self.error = e
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    # the response's side ------------------------------------------------------------------------
    async def response(self) -> Response:
        while self.head is None:
            if self.error is not None:
                raise self.error
            await self._wait()
        status, ctype, length = self.head
        return Response(self, status, ctype, length)

    async def readany(self) -> bytes:
        while not self.body:
            if self.done:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.body_bytes = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
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


class _Host:
    """Idle keep-alive connections to one host:port, most recently used first."""

    def __init__(self, url: URL, keepalive: float, connect_timeout: float) -> None:
        self.host, self.port = url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.keepalive, self.connect_timeout = keepalive, connect_timeout
        self.idle: deque[_Conn] = deque()
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

    async def post(self, url: str, body: bytes, headers: bytes = b"") -> Response:
        """POST `body` to `url` (`headers`: extra header lines, each ending in CRLF); the response once
        its head has arrived."""
        host, start = self._target(url)
        req = b"".join((start, host.head_tail, str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
        c = host.get()
        if c is not None:
            try:
                return await self._send(c, req)
            except UpstreamBroken:
                if c.head is not None:
                    raise
                # closed by the worker as it was reused: once more, on a fresh connection
        c = await host.connect()
        return await self._send(c, req)

    async def _send(self, c: _Conn, req: bytes) -> Response:
        try:
            c.transport.write(req)
            return await c.response()
        except BaseException:
            c.abort()
            raise

    def close(self) -> None:
        for host in self._hosts.values():
            host.close()
        self._hosts.clear()
        self._targets.clear()
