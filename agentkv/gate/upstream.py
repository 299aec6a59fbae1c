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

from agentkv.gate.upconn import BUFFER_BYTES, HEAD_CACHE, ConnectFailed, Response, UpstreamBroken, _Conn  # noqa: F401


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

    def send(self, url: str, body: bytes, headers: bytes = b"") -> _Conn | None:
        """POST on an idle pooled connection to `url`'s host, if one is there (else None, nothing sent):
        the connection, whose response its read callbacks parse (route/flight.py steps it)."""
        host, start = self._target(url)
        c = host.get()
        if c is not None:
            c.transport.write(
                b"".join((start, host.head_tail, str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
            )
        return c

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
