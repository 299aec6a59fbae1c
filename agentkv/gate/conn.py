"""Connection hygiene for an aiohttp server: idle and half-sent connections closed, a connection cap,
and recovery when file descriptors run out.

- keep-alive: a connection with no request in progress (idle, or a request's headers not yet
  complete) is closed `keep_alive` seconds after it was opened or last answered (aiohttp's own
  timer, which otherwise waits an hour);
- the cap: at `max_connections` a new connection closes the quietest idle one to make room (no
  request in progress, or a request body that has sent nothing for STALL_S); when every
  connection is busy it gets a 503 in the JSON error shape, and the connection is closed;
- descriptors: the soft RLIMIT_NOFILE is raised to the hard limit (as vLLM does) and the default
  cap leaves room below it; should accept() still fail for want of descriptors, idle connections
  are closed and one line is logged instead of a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import resource

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from agentkv.gate.errors import error_body
from agentkv.gate.fastpath import FastProtocol
from agentkv.gate.options import HttpLimits
from agentkv.gate.web import quiet_probes
from agentkv.gate.work import OFFLOAD_BYTES

log = logging.getLogger("agentkv.gate")
STALL_S = 1.0  # a request body silent this long makes its connection evictable at the cap
FAST_BODY_BYTES = OFFLOAD_BYTES - 1  # larger bodies go to aiohttp (the router parses them in processes)
RESERVED_FDS = 128  # descriptors kept back from the connection cap: logs, pipes, sockets to workers
_BUSY = error_body("the server is at its connection limit; retry shortly", "ServiceUnavailableError", 503)
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY
)


def return_freed_memory() -> None:
    """glibc: allocations of 128 KiB and more always from mmap (setting M_MMAP_THRESHOLD also stops
    glibc raising it after large frees), so the memory of a burst of large bodies goes back to the
    system when they are freed instead of staying in the heap."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(fds_per_connection: int = 1) -> int:
    """A cap that cannot run the process out of descriptors: (soft limit - reserve) / fds per connection."""
    soft = raise_nofile()
    return max(16, (soft - RESERVED_FDS) // fds_per_connection)


class ConnectionGuard:
    """Counts a server's connections and admits new ones under the cap (evicting the longest idle)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: dict[GuardedHandler, None] = {}  # insertion-ordered: oldest first
        self.refused = self.evicted = self.fd_shortages = 0
        self._logged_at = -1e9

    def admit(self, handler: GuardedHandler) -> bool:
        if len(self.open) >= self.cap and not self.evict_idle(1):
            self.refused += 1
            return False
        self.open[handler] = None
        return True

    def evict_idle(self, n: int) -> int:
        """Close up to `n` idle or stalled connections, quietest first."""
        now = asyncio.get_running_loop().time()
        idle = sorted((h for h in self.open if h.evictable(now)), key=lambda h: h.quiet_since)[:n]
        for h in idle:
            self.open.pop(h, None)
            h.force_close()
        self.evicted += len(idle)
        return len(idle)

    def on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """A loop exception handler: accept() out of descriptors frees idle ones, logged in one line."""
        if context.get("message") == "socket.accept() out of system resource":
            self.fd_shortages += 1
            freed = self.evict_idle(max(1, len(self.open) // 10))
            if loop.time() - self._logged_at > 10:  # one line per 10 s, not one per failed accept()
                self._logged_at = loop.time()
                log.warning(
                    "out of file descriptors on accept() (%d times so far); closed %d idle connections; "
                    "%d open (--limit-concurrency %d)",
                    self.fd_shortages,
                    freed,
                    len(self.open),
                    self.cap,
                )
            return
        loop.default_exception_handler(context)


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, admitted through a ConnectionGuard."""

    def __init__(self, guard: ConnectionGuard, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.refused = False
        self.idle_since = self.last_data = self._loop.time()

    @property
    def quiet_since(self) -> float:
        return max(self.idle_since, self.last_data)

    def evictable(self, now: float) -> bool:
        """Idle (no request in progress: keep-alive, or headers not complete), or uploading a body
        that has sent nothing for STALL_S (a request being answered never is)."""
        if self._force_close:
            return False
        if not self._request_in_progress and not self._messages:
            return True
        req = self._current_request
        return req is not None and not req.content.is_eof() and now - self.last_data >= STALL_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard.admit(self):
            super().connection_made(transport)
            return
        self.refused = True  # answered at once; the client's request, if any, is read and dropped
        transport.write(BUSY_RESPONSE)
        transport.write_eof()
        self._loop.call_later(2.0, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            self.last_data = self._loop.time()
            super().data_received(data)

    def eof_received(self) -> bool | None:
        return False if self.refused else super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self.guard.open.pop(self, None)
        super().connection_lost(exc)

    async def _handle_request(self, request, start_time, request_handler):
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self.idle_since = self._loop.time()


class GuardedSite(web.TCPSite):
    """A TCPSite whose connections go through `guard`."""

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard, fast=None, **kw
    ) -> None:
        super().__init__(runner, host, port, **kw)
        self.guard = guard
        self.fast = fast  # (routes, (max body, keep-alive s, body timeout s)) for gate.fastpath, or None

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        kwargs = server._kwargs  # the runner's handler settings (keep-alive, decompression, logging)

        def factory() -> GuardedHandler:
            return GuardedHandler(self.guard, server, loop=loop, **kwargs)

        def fast_factory() -> FastProtocol:
            return FastProtocol(self.guard, *self.fast, factory)

        self._server = await loop.create_server(
            factory if self.fast is None else fast_factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )

    async def stop(self) -> None:
        for h in list(self.guard.open):  # aiohttp closes its own handlers; the fast path's are here
            if isinstance(h, FastProtocol):
                h.force_close()
        await super().stop()


def base_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 host in brackets."""
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def make_runner(app: web.Application, limits: HttpLimits) -> web.AppRunner:
    """An AppRunner with the limits' keep-alive, client cancellation, and no automatic decompression
    (read_body inflates under its caps instead); unparsable requests are answered without a traceback."""
    quiet_probes()
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=limits.keep_alive,
        auto_decompress=False,
        lingering_time=min(10.0, limits.body_timeout),
    )


async def start_site(
    runner: web.AppRunner,
    host: str,
    port: int,
    limits: HttpLimits,
    fds_per_connection: int = 1,
    reuse_port: bool = False,
    fast: dict | None = None,
) -> ConnectionGuard:
    """Bind `runner` (set up) on host:port behind a ConnectionGuard; the guard. `reuse_port`: share the
    port with sibling processes (SO_REUSEPORT: the kernel spreads connections over them). `fast`:
    path -> handler answered by gate.fastpath ahead of aiohttp (plain POSTs with small bodies)."""
    return_freed_memory()
    cap = limits.max_connections or default_max_connections(fds_per_connection)
    guard = ConnectionGuard(cap)
    bounds = (min(limits.max_body_bytes, FAST_BODY_BYTES), limits.keep_alive, limits.body_timeout)
    routes = None if fast is None else ({k.encode(): v for k, v in fast.items()}, bounds)
    site = GuardedSite(runner, host, port, guard, routes, backlog=1024, reuse_port=reuse_port or None)
    await site.start()
    asyncio.get_running_loop().set_exception_handler(guard.on_loop_error)
    return guard
