"""One attempt to forward a prepared request to one worker and stream its answer back.

Failures before the worker's first byte raise `Retry` (the proxy tries another worker). After
it, the two ends are told apart: a worker that breaks the stream is counted in
`broken_streams` and the client's connection is cut (so it sees an incomplete response, not a
clean end); a client that leaves, or whose handler is cancelled because it left, is counted in
`client_disconnects` and the worker's request is closed, which aborts it there (a non-streamed
request's generation stops as a streamed one does).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from agentkv.gate.upstream import ConnectFailed, Response, UpstreamBroken

if TYPE_CHECKING:
    from agentkv.route.proxy import Router
    from agentkv.route.workers import Load, Worker

log = logging.getLogger("agentkv.route")
RETRY_STATUS = frozenset({502, 503, 504})
CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, TimeoutError)


class Retry(Exception):
    """The worker failed before sending a byte: the request may go to another worker."""

    def __init__(self, why: str, dead: bool = False) -> None:
        super().__init__(why)
        self.dead = dead


class StreamSink:
    """aiohttp's side of a forwarded response (gate.fastpath's Exchange is the fast path's, with the
    same begin, send, relay and abort): the worker's status and body streamed back through a
    StreamResponse."""

    __slots__ = ("request", "resp")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    def begin(self, status: int, content_type: str, length: int | None, extra: str = "") -> None:
        resp = web.StreamResponse(status=status)
        for line in extra.splitlines():
            name, _, value = line.partition(": ")
            resp.headers[name] = value
        resp.content_type = content_type
        if content_type == "text/event-stream":
            resp.headers["Cache-Control"] = "no-cache"
        elif length is not None:
            resp.content_length = length
        self.resp = resp

    async def send(self, data: bytes, end: bool = False) -> None:
        """Write `data`; `end`: with the end of the response (and the head, when it all came at once)."""
        resp = self.resp
        if not resp.prepared:
            await resp.prepare(self.request)
        if end:
            await resp.write_eof(data)
        elif data:
            await resp.write(data)

    async def relay(self, upstream: Response, touch) -> None:
        """The rest of `upstream`'s body, read by read, then the end of the response (`touch()` on
        each piece). UpstreamBroken when the worker breaks off, ConnectionError when the client leaves."""
        while True:
            chunk = await upstream.readany()
            if chunk:
                touch()
            end = upstream.at_end
            await self.send(chunk, end)
            if end:
                return

    def abort(self) -> None:
        if self.request.protocol is not None:
            self.request.protocol.force_close()  # an incomplete response, not a clean end


async def forward(
    router: Router, sink, w: Worker, path: str, payload: bytes, headers: bytes, load: Load
) -> None:
    """POST to `w` and stream its answer back through `sink` (a StreamSink or a fastpath Exchange);
    Retry if it failed before its first byte (from which on the request counts as `w`'s KV load):
    an error, a retryable status, no byte within --first-byte-timeout, or the worker taken out of
    rotation meanwhile."""
    loop = router.loop or asyncio.get_running_loop()  # each lookup is a getpid() syscall on 3.11
    upstream, first = await _first_byte(router, w, path, payload, headers, loop)
    try:
        load.first_byte()
        w.last_byte = loop.time()
        sink.begin(
            upstream.status, upstream.content_type, upstream.content_length, f"x-agentkv-worker: {w.slot}\r\n"
        )
        await _relay(router, sink, upstream, w, first, loop)
    except asyncio.CancelledError:  # the client left while we waited on the worker
        router.stats.client_disconnects += 1
        upstream.close()  # the worker sees the disconnect and aborts the request
        raise
    finally:
        upstream.release()


async def _first_byte(
    router: Router, w: Worker, path: str, payload: bytes, headers: bytes, loop
) -> tuple[Response, bytes]:
    """The worker's response and its first bytes, or Retry."""
    limit = router.cfg.first_byte_timeout
    deadline = asyncio.Timeout(
        None if limit is None else loop.time() + limit
    )  # asyncio.timeout, less a loop lookup
    w.waiting.add(deadline)
    upstream = None
    try:
        async with deadline:
            upstream = await router.upstream.post(w.spec.url + path, payload, headers, first=True)
            if upstream.status in RETRY_STATUS:
                raise Retry(f"HTTP {upstream.status}")
            return upstream, await upstream.readany()
    except CONNECT_ERRORS + (Retry,) as e:
        if upstream is not None:
            upstream.release()
        if isinstance(e, Retry):
            raise
        if deadline.expired():
            if not w.healthy:
                raise Retry("taken out of rotation while the request waited for its first byte") from None
            w.first_byte_timeouts += 1
            raise Retry(f"no first byte within --first-byte-timeout {limit:g}s") from None
        raise Retry(type(e).__name__, dead=isinstance(e, ConnectFailed)) from None
    except asyncio.CancelledError:
        router.stats.client_disconnects += 1
        if upstream is not None:
            upstream.close()
        raise
    finally:
        w.waiting.discard(deadline)


async def _relay(router: Router, sink, upstream: Response, w: Worker, first: bytes, loop) -> None:
    """Copy the worker's bytes to the client until either end stops, and say which one did. The
    first bytes go out with the head (and with the end of the response, when it all came at once:
    one write); the rest as the sink relays it (the fast path's Exchange pipes it from the worker's
    read callback, aiohttp's StreamSink reads it piece by piece)."""

    def touch() -> None:
        w.last_byte = loop.time()

    try:
        end = upstream.at_end
        await sink.send(first, end)
        if not end:
            await sink.relay(upstream, touch)
    except UpstreamBroken:
        _broken(router, sink, w)
    except ConnectionError:  # the client left
        router.stats.client_disconnects += 1
        upstream.close()


def _broken(router: Router, sink, w: Worker) -> None:
    router.stats.broken_streams += 1
    log.warning("worker %d broke a response mid-stream; the client's stream ends early", w.slot)
    sink.abort()
