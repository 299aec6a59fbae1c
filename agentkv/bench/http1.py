"""A minimal HTTP/1.1 client for streamed responses, on asyncio protocols, with keep-alive pooling.

aiohttp feeds every HTTP chunk of a stream (one per token) through its Python StreamReader; with
the same SSE reader behind both, it costs about twice the client CPU per token (docs/performance.md).
Here one `data_received` call de-chunks whatever arrived and hands each SSE `data:` line, with that
read's arrival time, to a callback. Supports chunked, Content-Length and close-delimited bodies, TLS,
and one retry on a fresh connection when a reused keep-alive connection turns out to be closed.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Callable
from itertools import repeat
from urllib.parse import urlsplit

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
        "chunked",
        "left",
        "close",
        "cbuf",
        "need",
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
        self.chunked, self.left, self.close = False, -1, False  # left: Content-Length bytes to go (-1: none)
        self.cbuf, self.need, self.lbuf = b"", 0, b""  # need > 0: chunk bytes to go; 0: size line; -1: CRLF
        self.body: list[bytes] = []  # the first KEEP_BYTES of a body that is not SSE (its error message)
        self.got_bytes = False
        self.keep_body = False
        self.kept, self.json = 0, False

    def feed(self, data: bytes) -> None:
        self.got_bytes = True
        data_in = data
        now = self.clock()
        if self.state == _HEAD:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            data = data_in = self.head[end + 4 :]
            self._parse_head(self.head[:end])
            self.state = _BODY
            if not self.chunked and self.left == 0:
                self._finish()
                return
            if not data:
                return
        if self.state != _BODY:
            return
        if self.chunked:
            data = self._whole_chunks(data) if not self.cbuf and not self.need else None
            if data is None:
                data = self._dechunk(data_in)
        elif self.left >= 0:
            data = data[: self.left]
            self.left -= len(data)
        if data:
            self._body(data, now)
        if self.state == _BODY and self.left == 0 and not self.chunked:
            self._finish()

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        try:
            self.status = int(parts[1])
        except (IndexError, ValueError):
            self.status = 0
        for ln in lines[1:]:
            name, _, value = ln.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value:
                self.chunked = True
            elif name == b"content-length":
                self.left = int(value)
            elif name == b"connection" and value == b"close":
                self.close = True
            elif name == b"content-type" and value.startswith(b"application/json"):
                self.json = True
        if self.chunked:
            self.left = -1
        self.keep_body = self.status != 200 or self.json  # a JSON 200: the server ignored `stream`
        if self.left < 0 and not self.chunked:
            self.close = True  # delimited by the connection closing

    @staticmethod
    def _whole_chunks(data: bytes) -> bytes | None:
        """Fast path: `data` is whole non-final chunks without CRLF inside (one SSE event each, as
        servers send them): their joined payloads, checked against the sizes; else None."""
        parts = data.split(b"\r\n")
        if not len(parts) & 1 or parts[-1]:
            return None
        sizes, datas = parts[0:-1:2], parts[1::2]
        try:  # compared in C (map), not in a Python loop: this runs once per read
            if b"0" in sizes or list(map(len, datas)) != list(map(int, sizes, repeat(16))):
                return None
        except ValueError:  # chunk extensions: the slow path reads them
            return None
        return b"".join(datas)

    def _dechunk(self, data: bytes) -> bytes:
        """The body bytes inside the chunk framing of `data` (plus what was left over from before)."""
        buf = self.cbuf + data if self.cbuf else data
        n, i, need, out = len(buf), 0, self.need, []
        if need > 0:  # finish a chunk begun in an earlier read
            take = min(need, n)
            out.append(buf[:take])
            i, need = take, need - take
            if need:
                self.cbuf, self.need = b"", need
                return out[0]
            need = -1
        if need == -1:  # the CRLF after a chunk's data
            if n - i < 2:
                self.cbuf, self.need = buf[i:], -1
                return b"".join(out)
            i += 2
        find, append = buf.find, out.append
        while True:  # whole chunks: size line, data, CRLF
            j = find(b"\r\n", i)
            if j < 0:
                need = 0
                break
            try:
                size = int(buf[i:j], 16)
            except ValueError:  # a chunk extension (";name=value")
                size = int(buf[i:j].split(b";", 1)[0], 16)
            if size == 0:  # last chunk; trailers (if any) end with an empty line
                end = j if buf[j + 2 : j + 4] == b"\r\n" else buf.find(b"\r\n\r\n", j)
                if end < 0:
                    need = 0
                    break
                self.cbuf, self.need = b"", 0
                body = b"".join(out)
                if body:
                    self._body(body, self.clock())
                self._finish()
                return b""
            start = j + 2
            stop = start + size
            if stop + 2 > n:  # this chunk (or its closing CRLF) continues in a later read
                if stop <= n:
                    append(buf[start:stop])
                    i, need = stop, -1
                else:
                    append(buf[start:])
                    i, need = n, stop - n
                break
            append(buf[start:stop])
            i = stop + 2
        self.cbuf, self.need = (buf[i:] if i < n else b""), need
        return out[0] if len(out) == 1 else b"".join(out)

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

    def lost(self, exc: Exception | None) -> None:
        if self.state == _BODY and self.close and not self.chunked and self.left < 0 and exc is None:
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
