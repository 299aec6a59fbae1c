"""A minimal HTTP/1.1 client for streamed responses, on asyncio protocols, with keep-alive pooling.

aiohttp feeds every HTTP chunk of a stream (one per token) through its Python StreamReader; with
the same SSE reader behind both, it costs about twice the client CPU per token (docs/performance.md).
Here one `data_received` call de-chunks whatever arrived (the framing, shared with the router's
client, is agentkv/gate/http1.py) and hands each SSE `data:` line, with that read's arrival time,
to a callback. Supports chunked, Content-Length and close-delimited bodies, TLS,
and one retry on a fresh connection when a reused keep-alive connection turns out to be closed.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Callable
from urllib.parse import urlsplit

from agentkv.gate.http1 import ChunkDecoder, FramingError, Head, head_end, parse_head

# (payloads of the `data:` lines in one read, not stripped of the space/CR around them; arrival time)
OnLines = Callable[[list[bytes], float], None]

_HEAD, _BODY, _DONE = 0, 1, 2
KEEP_BYTES = 4096  # of a body that is not SSE (an error's JSON): enough for its message


class HttpError(Exception):
    """The connection failed (refused, reset, closed mid-response)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind  # connect_error | reset


class _Exchange:
    """One request's response: status, headers, then the body de-chunked into SSE lines."""

    __slots__ = (
        "on_lines",
        "clock",
        "done",
        "state",
        "head",
        "status",
        "chunks",
        "left",
        "close",
        "lbuf",
        "body",
        "got_bytes",
        "keep_body",
        "kept",
        "json",
    )

    def __init__(self, on_lines: OnLines, clock: Callable[[], float], done: asyncio.Future):
        self.on_lines, self.clock, self.done = on_lines, clock, done
        self.state, self.head, self.status = _HEAD, b"", 0
        self.chunks: ChunkDecoder | None = None  # a chunked body's decoder
        self.left, self.close = -1, False  # left: Content-Length bytes to go (-1: none)
        self.lbuf = b""  # a partial SSE line
        self.body: list[bytes] = []  # the first KEEP_BYTES of a body that is not SSE (its error message)
        self.got_bytes = False
        self.keep_body = False
        self.kept, self.json = 0, False

    def feed(self, data: bytes) -> None:
        self.got_bytes = True
        now = self.clock()
        if self.state == _HEAD:
            self.head += data
            try:
                end = head_end(self.head)
                if end < 0:
                    return
                self._parse_head(parse_head(self.head[:end]))
            except FramingError as e:
                self._fail(f"the server sent a bad response: {e}")
                return
            data = self.head[end + 4 :]
            self.state = _BODY
            if self.left == 0:
                self._finish()
                return
            if not data:
                return
        if self.state != _BODY:
            return
        dec = self.chunks
        if dec is not None:
            try:
                data = dec.feed(data)
            except FramingError as e:
                self._fail(f"the server sent a bad response: {e}")
                return
            if data:
                self._body(data, now)
            if dec.done:
                self.close = self.close or dec.extra  # bytes after the response: not reused
                self._finish()
            return
        if self.left >= 0:
            data = data[: self.left]
            self.left -= len(data)
        if data:
            self._body(data, now)
        if self.left == 0:
            self._finish()

    def _parse_head(self, head: Head) -> None:
        self.status, self.close = head.status, not head.keep
        if head.chunked:
            self.chunks = ChunkDecoder()
        elif head.length is not None:
            self.left = head.length
        self.json = head.content_type.startswith("application/json")
        self.keep_body = self.status != 200 or self.json  # a JSON 200: the server ignored `stream`

    def _body(self, data: bytes, now: float) -> None:
        if self.keep_body:
            if self.kept < KEEP_BYTES:
                self.body.append(data[: KEEP_BYTES - self.kept])
                self.kept += len(self.body[-1])
            return
        buf = self.lbuf + data if self.lbuf else data
        lines = buf.split(b"\n")
        self.lbuf = lines.pop()  # a partial line waits for the next read
        batch = [ln[5:] for ln in lines if ln[:5] == b"data:"]  # JSON ignores the blank/CR around it
        if batch:
            self.on_lines(batch, now)

    def _finish(self) -> None:
        if self.lbuf.startswith(b"data:"):
            self.on_lines([self.lbuf[5:]], self.clock())
            self.lbuf = b""
        self.state = _DONE
        if not self.done.done():
            self.done.set_result(None)

    def _fail(self, detail: str) -> None:
        self.state, self.close = _DONE, True
        if not self.done.done():
            self.done.set_exception(HttpError("reset", detail))

    def lost(self, exc: Exception | None) -> None:
        if self.state == _BODY and self.chunks is None and self.left < 0 and exc is None:
            self._finish()  # a close-delimited body ends here
        elif self.state != _DONE and not self.done.done():
            self.done.set_exception(HttpError("reset", f"connection closed mid-response ({exc or 'EOF'})"))


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "exchange", "closed", "reused")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed, self.reused = False, False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # nothing asked: a server talking out of turn; do not reuse this connection
            self.close()
            return
        ex.feed(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.lost(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Keep-alive connections to one origin; `post_stream` sends a request and streams its SSE lines."""

    def __init__(
        self, base: str, *, limit: int = 0, connect_timeout: float = 10.0, headers: dict | None = None
    ):
        u = urlsplit(base)
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []
        self._sem = asyncio.Semaphore(limit) if limit > 0 else None
        self._ssl = _ssl.create_default_context() if self.tls else None
        host = self.host if self.port in (80, 443) else f"{self.host}:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (
            f"Host: {host}\r\nUser-Agent: agentkv-bench\r\nAccept: text/event-stream\r\n"
            f"Content-Type: application/json\r\n{extra}"
        ).encode("latin-1")

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self._ssl)
        except (OSError, TimeoutError) as e:
            raise HttpError("connect_error", f"{type(e).__name__}: {e}") from None
        return conn

    def _get_idle(self) -> _Conn | None:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                c.reused = True
                return c
        return None

    async def post_stream(
        self, path: str, body: bytes, on_lines: OnLines, clock: Callable[[], float]
    ) -> tuple[int, bytes]:
        """POST `body`; the SSE `data:` lines of a 200 answer go to `on_lines`, a batch per read.

        Returns (status, the first KEEP_BYTES of a body that is not SSE: a non-200 answer, or a 200
        answered as one JSON document by a server that ignores `stream`).

        Raises HttpError on a refused or broken connection; cancel it (e.g. a timeout) to abandon it.
        """
        if self._sem is not None:
            await self._sem.acquire()
        try:
            for attempt in (0, 1):
                conn = self._get_idle() or await self._connect()
                ex = _Exchange(on_lines, clock, asyncio.get_running_loop().create_future())
                conn.exchange = ex
                conn.transport.write(
                    b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n"
                    % (path.encode(), self._head, len(body))
                    + body
                )
                try:
                    await ex.done
                except HttpError:
                    conn.close()
                    if attempt == 0 and conn.reused and not ex.got_bytes:
                        continue  # a stale keep-alive connection: the server had closed it; try a fresh one
                    raise
                except BaseException:  # cancelled (timeout, Ctrl-C): this connection is mid-answer
                    conn.close()
                    raise
                conn.exchange = None
                if ex.close or conn.closed:
                    conn.close()
                else:
                    self._idle.append(conn)
                return ex.status, b"".join(ex.body)
            raise AssertionError("unreachable")
        finally:
            if self._sem is not None:
                self._sem.release()

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
