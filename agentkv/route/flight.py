"""The router's common request driven from read callbacks, with no asyncio task of its own.

A plain request (gate.fastpath) whose chosen worker has an idle pooled keep-alive connection is sent
there at once; the worker's response is stepped from that connection's read callback (`Flight` stands
in for its waiter) and written straight to the client. Anything unusual falls back to the task path
(route/forward.py) at the point reached: no idle connection, a connection broken before its head (the
same worker, on a fresh one), a retryable status or no first byte within --first-byte-timeout (Retry:
another worker), a client slower than the stream (its rest relayed by a task). The counters, the load,
error bodies and tenant slots are kept as the task path keeps them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from agentkv.gate.errors import RequestError
from agentkv.gate.upconn import Response
from agentkv.route.forward import RETRY_STATUS, Retry, _broken, _relay
from agentkv.route.prepare import prepare
from agentkv.route.proxy import request_headers

if TYPE_CHECKING:
    from agentkv.gate.fastpath import Exchange, FastProtocol, FastRequest
    from agentkv.route.proxy import Router

log = logging.getLogger("agentkv.route")


class FlightHandler:
    """gate.fastpath's handler for the proxied endpoints: `begin` without a task, else the task path."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def __call__(self, req: FastRequest, ex: Exchange) -> None:
        """The task path (a small plain body, all here): as Router._limited."""
        r = self.router
        tenant = r.tenants.authenticate(req.headers)
        if (refused := r._admit(tenant)) is not None:
            return ex.error(refused)
        try:
            chat = req.path == "/v1/chat/completions"
            try:
                prep = prepare(req.body, chat, tenant.salt, r.hasher, r.max_model_len, r.max_model_len_known)
            except RequestError as e:
                return ex.error(e)
            refused = await r._dispatch(prep, tenant, req.headers.get("x-session-id"), req.path, ex)
            if refused is not None:
                ex.error(refused)
        finally:
            r.in_flight.give(tenant.id)

    def begin(self, proto: FastProtocol, req: FastRequest, ex: Exchange) -> bool:
        """Answer `req` from callbacks when its worker has an idle connection (True: taken, whether
        answered, in flight, or handed to a task of its own); False: the caller runs the task path."""
        r = self.router
        tenant = r.tenants.authenticate(req.headers)
        if tenant is None or not r.in_flight.free(tenant.id):
            return False  # refusals: the task path answers them
        chat = req.path == "/v1/chat/completions"
        try:
            prep = prepare(req.body, chat, tenant.salt, r.hasher, r.max_model_len, r.max_model_len_known)
        except RequestError:
            return False  # the task path prepares it again and answers the error
        r.in_flight.take(tenant.id)
        session = req.headers.get("x-session-id") or prep.session
        r.stats.requests += 1
        w = r.choose(tenant.id, prep.hashed, session, set())
        c = (
            None
            if w is None
            else r.upstream.send(w.spec.url + req.path, prep.payload, request_headers(session))
        )
        f = Flight(r, proto, ex, prep, tenant, session, req.path, w)
        if c is None:  # no worker, or no idle connection to it: the task path from here
            f.fallback(set(), w)
            return True
        f.fly(c)
        return True


class Flight:
    """One request from its send on a pooled connection to its end, stepped by the connection's wake-ups."""

    __slots__ = ("r", "proto", "ex", "prep", "tenant", "session", "path", "w", "load", "c", "timer", "state")

    def __init__(self, r, proto, ex, prep, tenant, session, path, w) -> None:
        self.r, self.proto, self.ex, self.prep, self.tenant = r, proto, ex, prep, tenant
        self.session, self.path, self.w = session, path, w
        self.load = self.c = self.timer = None
        self.state = 0  # 0: waiting for the first byte, 1: streaming, 2: over

    def fly(self, c) -> None:
        r, w = self.r, self.w
        self.c, self.load = c, r.load(w, self.prep)
        c.first = True  # a 200's head alone wakes no one: its first bytes will
        c.waiter = self  # the connection's wake-ups step this flight (`set_result`)
        limit = r.cfg.first_byte_timeout
        if limit is not None:
            self.timer = r.loop.call_later(limit, self.expire)
        w.waiting.add(self)
        self.proto.task = self  # the client leaving cancels it

    # as the connection's waiter, and as a deadline in Worker.waiting ----------------------------
    def done(self) -> bool:
        return self.state == 2

    def set_result(self, _) -> None:
        try:
            if self.state == 0:
                self._first()
            elif self.state == 1:
                self._streamed()
        except Exception:
            log.exception("error answering %s", self.path)
            self.state = 2
            self.c.abort()
            self.ex.abort()
            self._end()

    def reschedule(self, when) -> None:
        """The worker was taken out of rotation: give up waiting for its first byte (after mark_dead's loop)."""
        if self.state == 0:
            self.r.loop.call_soon(self.expire)

    def cancel(self) -> None:
        """The client left."""
        if self.state != 2:
            self.state = 2
            self.r.stats.client_disconnects += 1
            self._unwait()
            self.c.abort()  # the worker sees the disconnect and aborts the request
            self._end()

    # steps --------------------------------------------------------------------------------------
    def _first(self) -> None:
        c, w = self.c, self.w
        if c.head is None:
            if c.error is not None:  # closed as it was reused: the same worker, on a fresh connection
                self._retry(None)
            return
        status = c.head[0]
        if status in RETRY_STATUS:
            return self._retry(Retry(f"HTTP {status}"))
        if status == 200 and not c.body and not c.done:
            if c.error is not None:
                self._retry(Retry(type(c.error).__name__))
            return
        self._unwait()
        self.load.first_byte()
        w.last_byte = self.r.loop.time()
        ex = self.ex
        ex.begin(status, c.head[1], c.head[2], f"x-agentkv-worker: {w.slot}\r\n")
        data = c.take_body() if c.body else b""
        c.resume()
        end = c.done
        behind = ex.write_now(data, end)
        if end:
            return self._over()
        self.state = 1
        c.pipe = self._piece
        if behind:
            c.pause()
            self._streamed()

    def _piece(self, data: bytes, end: bool) -> bool:
        self.w.last_byte = self.r.loop.time()
        return self.ex.write_now(data, end)

    def _streamed(self) -> None:
        c = self.c
        if c.done:
            if not self.ex.ended:
                self.ex.write_now(b"", True)
            return self._over()
        if c.error is not None:
            self.state = 2
            _broken(self.r, self.ex, self.w)
            c.abort()
            return self._end()
        if c.paused:  # the client is behind: a task waits for it and relays the rest
            self.state = 2
            c.pipe = c.waiter = None
            up = Response(c, *c.head)
            self.proto.spawn(self._tail(up), self.ex, self.path)

    async def _tail(self, up: Response) -> None:
        try:
            await _relay(self.r, self.ex, up, self.w, b"", self.r.loop)
        except asyncio.CancelledError:  # the client left
            self.r.stats.client_disconnects += 1
            up.close()
            raise
        finally:
            up.release()
            self.load.finish()
            self.r.in_flight.give(self.tenant.id)

    def expire(self) -> None:
        if self.state != 0:
            return
        w, limit = self.w, self.r.cfg.first_byte_timeout
        if not w.healthy:
            return self._retry(Retry("taken out of rotation while the request waited for its first byte"))
        w.first_byte_timeouts += 1
        self._retry(Retry(f"no first byte within --first-byte-timeout {limit:g}s"))

    # endings ------------------------------------------------------------------------------------
    def _retry(self, e: Retry | None) -> None:
        """Before the first byte: the task path from here (`e` None: the same worker again)."""
        self.state = 2
        self._unwait()
        self.c.waiter = None
        self.c.release() if e is not None and self.c.head is not None else self.c.abort()
        self.load.finish()
        self.fallback(set() if e is None else {self.w.slot}, self.w if e is None else None, e)

    def fallback(self, tried: set, w, e: Retry | None = None) -> None:
        self.proto.spawn(self._rest(tried, w, e), self.ex, self.path)

    async def _rest(self, tried: set, w, e: Retry | None) -> None:
        r = self.r
        try:
            if e is not None:
                await r.retried(self.w, e)
            elif w is None:  # choose found no worker
                r.stats.failed += 1
                return self.ex.error(RequestError("no healthy worker could take the request", None, 503))
            refused = await r._dispatch(self.prep, self.tenant, self.session, self.path, self.ex, tried, w)
            if refused is not None:
                self.ex.error(refused)
        finally:
            r.in_flight.give(self.tenant.id)

    def _over(self) -> None:
        self.state = 2
        self.c.waiter = self.c.pipe = None
        self.c.release()
        self._end()

    def _unwait(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.w.waiting.discard(self)

    def _end(self) -> None:
        self.load.finish()
        self.r.in_flight.give(self.tenant.id)
        self.proto.finish(self.ex)
