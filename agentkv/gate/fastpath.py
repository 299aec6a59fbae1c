"""A lean HTTP/1.1 server path for a proxy's hot requests, in front of aiohttp on the same port.

Per connection, `FastProtocol` reads request heads itself (gate/http1.parse_request_head). A plain
request to one of its routes (POST, HTTP/1.1, ASCII head, Host, a Content-Length under `max_body`,
no Transfer-Encoding, encoding, Expect or Upgrade) is answered by the route's handler, which writes straight to the transport
(`Exchange`): no request object, router, middleware or response object per request. Anything
else (another path or method, an unusual or malformed head, a larger or compressed body) hands
the connection, bytes unread included, to aiohttp's handler for good, so every other behaviour
(its errors, body caps, inflation, slow bodies) is aiohttp's as before. The door's rules hold on
the fast path too: the connection guard (cap, eviction of the quietest), keep-alive and head
timeouts (slowloris; one timer per connection), a body timeout (408), pipelined requests answered in order with reading
paused past PIPELINE_BYTES, a client that leaves cancels its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus

from agentkv.gate.errors import JSON, RequestError, error_body
from agentkv.gate.http1 import parse_request_head

log = logging.getLogger("agentkv.gate")
MAX_HEAD = 8 << 10  # a head not complete within this many bytes goes to aiohttp (its limits, its 4xx)
PIPELINE_BYTES = 1 << 16  # bytes buffered past the request being answered before reading pauses


class FastRequest:
    """A whole request: its path, lower-cased header names (str values) and body."""

    __slots__ = ("path", "headers", "body")

    def __init__(self, path: str, headers: dict[str, str], body: bytes) -> None:
        self.path, self.headers, self.body = path, headers, body


Handler = Callable[[FastRequest, "Exchange"], Awaitable[None]]


_date = [0, ""]


def http_date() -> str:
    """The Date header's value, formatted once a second."""
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, formatdate(now, usegmt=True)
    return _date[1]


_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _reason(status: int) -> str:
    return _REASONS.get(status, "Unknown")


class Exchange:
    """One response written straight to the connection: `begin` sets the head, `send` writes (the
    head goes out with the first bytes; chunked framing when no length is known), `abort` cuts the
    connection so the client sees an incomplete response. A gone client: ConnectionError."""

    __slots__ = ("proto", "head", "chunked", "started", "ended")

    def __init__(self, proto: FastProtocol) -> None:
        self.proto = proto
        self.head = b""
        self.chunked = self.started = self.ended = False

    def begin(self, status: int, content_type: str, length: int | None, extra: str = "") -> None:
        """The response's status and headers (`extra`: more header lines, each ending in CRLF)."""
        framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
        if content_type == "text/event-stream":
            extra += "Cache-Control: no-cache\r\n"
        close = "" if self.proto.keep else "Connection: close\r\n"
        self.chunked = length is None
        self.head = (
            f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Type: {content_type}\r\n{extra}"
            f"Date: {http_date()}\r\n{close}{framing}\r\n\r\n"
        ).encode("latin-1")

    async def send(self, data: bytes, end: bool = False) -> None:
        """Write `data` (after the head, the first time); `end`: the response is complete."""
        if self.write_now(data, end):
            await self.drain()

    def write_now(self, data: bytes, end: bool = False) -> bool:
        """`send` without waiting (for gate.upstream's Response.pipe, inside a read callback): True
        when the client is behind (or gone) and the caller should `drain` before writing more."""
        p = self.proto
        t = p.transport
        if t is None or t.is_closing():
            return True
        out = data
        if self.chunked:
            out = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
            if end:
                out += b"0\r\n\r\n"
        if not self.started:
            self.started = True
            out = self.head + out
        if out:
            t.write(out)
        if end:
            self.ended = True
            return False
        return p.write_paused

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written; ConnectionError if it left."""
        p = self.proto
        await p.drain()
        if p.transport is None or p.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")

    async def relay(self, upstream, touch: Callable[[], None]) -> None:
        """The rest of `upstream`'s body (a gate.upstream Response), then the end of the response:
        passed from the worker's read callback straight to the client's socket, no task switch per
        read; `touch()` on each piece. UpstreamBroken when the worker breaks off, ConnectionError
        when the client leaves."""
        write = self.write_now

        def piece(data: bytes, end: bool) -> bool:
            touch()
            return write(data, end)

        await upstream.pipe(piece, self.drain)
        if not self.ended:
            await self.send(b"", True)

    def error(self, e: RequestError) -> None:
        """The OpenAI error JSON for `e` as the whole response (nothing sent yet)."""
        body = error_body(e.message, e.err_type, e.status, e.param)
        self.begin(e.status, JSON, len(body))
        t = self.proto.transport
        if t is not None and not t.is_closing():
            self.started = self.ended = True
            t.write(self.head + body)

    def abort(self) -> None:
        self.proto.keep = False
        if self.proto.transport is not None:
            self.proto.transport.abort()


class FastProtocol(asyncio.Protocol):
    """One client connection: fast routes answered here, the rest handed to aiohttp (`fallback()`
    makes its protocol). Admitted through the same ConnectionGuard as aiohttp's handlers."""

    def __init__(self, guard, routes: dict[bytes, Handler], limits, fallback: Callable[[], asyncio.Protocol]):
        self.guard, self.routes, self.fallback = guard, routes, fallback
        self.max_body, self.keep_alive, self.body_timeout = limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.pending: tuple | None = None  # a parsed head whose body is still arriving
        self.task: asyncio.Task | None = None  # the request being answered
        self.keep = True
        self.write_paused = self.read_paused = self.refused = False
        self.waiter: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0  # when `timer` closes the connection, unless it is answering a request
        self.idle_since = self.last_data = self.loop.time()

    # the guard's view (as GuardedHandler) --------------------------------------------------------
    @property
    def quiet_since(self) -> float:
        return max(self.idle_since, self.last_data)

    def evictable(self, now: float) -> bool:
        """Idle or mid-head; or a body silent for STALL_S; never while a request is answered."""
        from agentkv.gate.conn import STALL_S

        if self.task is not None or self.transport is None or self.transport.is_closing():
            return False
        return self.pending is None or now - self.last_data >= STALL_S

    def force_close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        from agentkv.gate.conn import BUSY_RESPONSE

        self.transport = transport
        if not self.guard.admit(self):
            self.refused = True  # as GuardedHandler: a 503, then closed
            transport.write(BUSY_RESPONSE)
            transport.write_eof()
            self.loop.call_later(2.0, transport.close)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:  # as aiohttp's server: each streamed event leaves at once
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm(self.keep_alive)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.last_data = self.loop.time()
        if not self.buf:
            self.buf = data  # the usual case: a whole request in one read, never copied
        else:  # a request in pieces: appended in place, not copied whole per piece
            if type(self.buf) is bytes:
                self.buf = bytearray(self.buf)
            self.buf += data
        if self.task is None:
            self._next()
        elif len(self.buf) > PIPELINE_BYTES and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # as aiohttp: a client's EOF closes the connection (and cancels its request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.pop(self, None)
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the client left: its handler is cancelled (aiohttp's handler_cancellation)
        self.drained()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.drained()

    def drained(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written (or left)."""
        while self.write_paused and self.transport is not None:
            self.waiter = self.loop.create_future()
            await self.waiter

    # requests ------------------------------------------------------------------------------------
    def _next(self) -> None:
        """Start answering the next whole request in the buffer, hand over, or wait for more bytes."""
        if self.pending is None:
            end = self.buf.find(b"\r\n\r\n", 0, MAX_HEAD)
            if end < 0:
                if len(self.buf) > MAX_HEAD or b"\n\n" in self.buf:
                    self._hand_over()
                return
            head = parse_request_head(bytes(self.buf[: end + 2]), self.routes, self.max_body)
            if head is None:
                return self._hand_over()
            self.pending = head + (end + 4,)
            if len(self.buf) < end + 4 + head[4]:
                self._arm(self.body_timeout)  # once per request: the whole body within body_timeout
        handler, path, headers, keep, n, start = self.pending
        if len(self.buf) < start + n:
            return  # the body is still arriving
        body, self.buf, self.pending = bytes(self.buf[start : start + n]), self.buf[start + n :], None
        self.keep = keep
        self.task = self.loop.create_task(self._answer(handler, FastRequest(path, headers, body)))

    async def _answer(self, handler: Handler, req: FastRequest) -> None:
        ex = Exchange(self)
        try:
            await handler(req, ex)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("error answering %s", req.path)
            self.keep = False
            if not ex.started:
                ex.error(RequestError("internal server error", None, 500, "InternalServerError"))
        finally:
            self.task = None
        if not ex.ended:
            self.keep = False
        self._done()

    def _done(self) -> None:
        """The response is complete: close, or go on with the next request (pipelined or to come)."""
        t = self.transport
        if t is None:
            return
        if not self.keep:
            t.close()
            return
        self.idle_since = self.loop.time()
        self._arm(self.keep_alive)
        if self.read_paused:
            self.read_paused = False
            t.resume_reading()
        if self.buf:
            self._next()

    def _arm(self, seconds: float) -> None:
        """Close the connection when it is not answering a request `seconds` from now. One timer per
        connection, not one per request: a later deadline is only noted (`_expire` waits on to it),
        an earlier one moves the timer."""
        self.deadline = at = self.loop.time() + seconds
        t = self.timer
        if t is None or t.when() > at:
            if t is not None:
                t.cancel()
            self.timer = self.loop.call_at(at, self._expire)

    def _expire(self) -> None:
        self.timer = None
        t = self.transport
        if self.task is not None or t is None:
            return  # answering: the response's end arms the keep-alive deadline
        if self.deadline - self.loop.time() > 0.001:  # moved later since the timer was set
            self.timer = self.loop.call_at(self.deadline, self._expire)
            return
        if self.pending is not None:  # the body did not arrive in time: 408, as aiohttp's path answers
            self.keep = False
            Exchange(self).error(
                RequestError(f"the request body did not arrive within {self.body_timeout:g} s", None, 408)
            )
        t.close()

    def _hand_over(self) -> None:
        """aiohttp's handler takes the connection from here, the bytes not yet read included."""
        t, data = self.transport, self.buf
        if self.timer is not None:
            self.timer.cancel()
        self.guard.open.pop(self, None)
        self.transport, self.buf = None, b""
        if self.read_paused:
            t.resume_reading()
        proto = self.fallback()
        t.set_protocol(proto)
        proto.connection_made(t)
        if data:
            proto.data_received(bytes(data))
