"""`agentkv route`: an OpenAI-compatible proxy that sends each request to the worker that caches it.

Per request: authenticate (401 before any worker is touched), inject the tenant's cache_salt
(overriding a client's), hash the prompt as the engine will, look the hashes up in the tenant's
index (event mode) or the router's own prediction (approximate mode), let the policy pick among
healthy workers, and forward over pooled keep-alive connections (TCP_NODELAY is set on both
sides by aiohttp). The response streams back chunk by chunk, untouched (usage included). A
request that fails before its first byte is retried on another worker. Prompt content is never
logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from agentkv.kv.digest import block_digest
from agentkv.kv.hashing import make_hasher
from agentkv.placement.policy import KV_WEIGHT, RouteRequest, make_policy
from agentkv.route.approx import ApproxIndex
from agentkv.route.index import Match, TenantIndex
from agentkv.route.metrics import RouterStats, render_metrics
from agentkv.route.prompt import RequestHasher, Tokenizer
from agentkv.route.tenants import Tenants, router_secret
from agentkv.route.workers import Load, Worker, WorkerPool, WorkerSpec

log = logging.getLogger("agentkv.route")

_NO_MATCH = Match(0)
_RETRY_STATUS = frozenset({502, 503, 504})
_CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, TimeoutError)
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class RouterConfig:
    """Everything `agentkv route` takes on its command line."""

    workers: list[WorkerSpec]
    block_size: int = 16
    hash_algo: str = "xxhash"
    hash_seed: str | int | None = None
    policy: str = "kv_aware"
    approximate: bool = False
    api_keys: str | None = None
    secret: str | None = None
    tokenizer: str | None = None
    kv_weight: float = KV_WEIGHT
    temperature: float = 0.0
    affinity: float = 8.0  # blocks a session's worker may cost above the best and still keep it
    approx_capacity: int = 65_536
    approx_ttl: float = 300.0
    health_interval: float = 1.0
    first_byte_timeout: float | None = None  # seconds a worker may take to its first byte (None: no limit)
    scrape_interval: float = 2.0
    max_body_bytes: int = 256 << 20  # largest request body (413 past it)
    max_streams_per_tenant: int = 1024  # concurrent requests per tenant (429 past it; 0: no limit)
    max_index_blocks: int = 1 << 22  # indexed blocks per worker (stores past it are dropped, counted)
    host: str = "127.0.0.1"
    port: int = 8000
    extra: dict = field(default_factory=dict)


def _error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": err_type, "code": status}}, status=status)


class Router:
    """The routing proxy: an aiohttp app plus the index, tenants, policy and worker pool behind it."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tenants = Tenants.from_file(cfg.api_keys, router_secret(cfg.secret) if cfg.api_keys else b"")
        self.index = TenantIndex(salts=self.tenants.salts(), max_blocks=cfg.max_index_blocks)
        self.approx = ApproxIndex(cfg.approx_capacity, cfg.approx_ttl)
        self.hasher = RequestHasher(
            make_hasher(cfg.hash_algo, cfg.hash_seed), cfg.block_size, Tokenizer(cfg.tokenizer)
        )
        self.pool = WorkerPool(
            cfg.workers,
            self.index,
            cfg.block_size,
            approximate=cfg.approximate,
            health_interval=cfg.health_interval,
            scrape_interval=cfg.scrape_interval,
            on_membership=self._new_policy,
            forget=self.approx.clear_worker,
        )
        self.stats = RouterStats()
        self.policy = self._make_policy()
        self.session: aiohttp.ClientSession | None = None
        self._streams: dict[str, int] = {}  # tenant -> requests in flight
        self.app = web.Application(client_max_size=cfg.max_body_bytes)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/debug/index", self.debug_index)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    def _make_policy(self, retry: bool = False):
        """The configured policy; for a retry (a partial worker list, no session state) kv_aware
        without affinity, or least_loaded in place of the stateful others."""
        if self.cfg.policy != "kv_aware":
            return make_policy("least_loaded" if retry else self.cfg.policy)
        return make_policy(
            "kv_aware",
            weight=self.cfg.kv_weight,
            temperature=self.cfg.temperature,
            affinity=0.0 if retry else self.cfg.affinity,
        )

    def _new_policy(self) -> None:
        """Workers came or went: policy state indexes the healthy list, so start it afresh."""
        self.policy = self._make_policy()

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=75, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        await self.pool.start(self.session)
        if self.tenants.open:
            log.info("no --api-keys: requests are not authenticated and client cache_salt passes through")
        else:
            log.info("%d tenants; each request gets its tenant's cache_salt", len(self.tenants))

    async def _cleanup(self, app: web.Application) -> None:
        await self.pool.close()
        if self.session is not None:
            await self.session.close()

    # -- endpoints -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._limited(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._limited(request, chat=True)

    async def _limited(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """At most `max_streams_per_tenant` requests of one tenant in flight; 429 past it."""
        limit = self.cfg.max_streams_per_tenant
        tenant = self.tenants.authenticate(request.headers) if limit else None
        if tenant is None:  # no limit, or unauthenticated (_generate answers 401)
            return await self._generate(request, chat)
        n = self._streams.get(tenant.id, 0)
        if n >= limit:
            self.stats.throttled += 1
            return _error(
                429,
                f"too many concurrent requests for this API key's tenant (limit {limit})",
                "RateLimitError",
            )
        self._streams[tenant.id] = n + 1
        try:
            return await self._generate(request, chat)
        finally:
            n = self._streams[tenant.id] - 1
            if n:
                self._streams[tenant.id] = n
            else:
                del self._streams[tenant.id]

    async def debug_index(self, request: web.Request) -> web.Response:
        """Per event-mode worker: the count and an order-free digest of its indexed GPU blocks (all
        tenants), to compare with the worker's own `/debug/kv_blocks`; no hash is revealed."""
        with self.pool.lock:
            held = {str(w.slot): self.index.held(w.slot) for w in self.pool.workers if w.mode == "event"}
        return web.json_response(
            {
                "workers": {k: block_digest(v) for k, v in held.items()},
                "index_overflow_blocks": self.index.overflow,
            }
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        if self.tenants.authenticate(request.headers) is None:
            self.stats.unauthorized += 1
            return _error(401, "missing or invalid API key", "AuthenticationError")
        for w in self.pool.healthy():
            try:
                async with self.session.get(w.spec.url + "/v1/models") as r:
                    return web.Response(body=await r.read(), status=r.status, content_type="application/json")
            except _CONNECT_ERRORS:
                continue
        return _error(503, "no healthy worker", "ServiceUnavailableError")

    async def health(self, request: web.Request) -> web.Response:
        up = [w.slot for w in self.pool.workers if w.healthy]
        return web.json_response(
            {"status": "ok" if up else "no healthy worker", "healthy_workers": up}, status=200 if up else 503
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self), content_type="text/plain", charset="utf-8")

    # -- routing ---------------------------------------------------------------------------------
    def choose(
        self, tenant: str, body: dict, chat: bool, session: str, exclude: set[int]
    ) -> tuple[Worker, int]:
        """The worker for this request (healthy, not in `exclude`) and its predicted cached blocks."""
        t0 = time.perf_counter()
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        h = self.hasher.hash(body, chat, salt)
        views = [w for w in self.pool.workers if w.healthy and w.slot not in exclude]
        with self.pool.lock:
            if h.exact:
                ev = (
                    self.index.find_matches(tenant, h.hashes) if any(w.mode == "event" for w in views) else {}
                )
                ap = (
                    self.approx.find_matches(tenant, h.hashes)
                    if any(w.mode != "event" for w in views)
                    else {}
                )
                for w in views:
                    w.match = (ev if w.mode == "event" else ap).get(w.slot, _NO_MATCH)
            else:
                ap = self.approx.find_matches(tenant, h.hashes)
                for w in views:
                    w.match = ap.get(w.slot, _NO_MATCH)
        policy = self.policy
        if len(views) != len(self.pool.healthy()):  # a retry: stateful policies index the full list
            policy = self._make_policy(retry=True)
        req = RouteRequest(h.hashes, h.prompt_tokens, session, self.cfg.block_size)
        w = views[policy.choose(req, views)]
        if h.exact:
            with self.pool.lock:
                self.index.expect(tenant, h.hashes)
        if w.mode != "event" or not h.exact:
            self.approx.record(w.slot, tenant, h.hashes)
        st = self.stats
        st.prompt_blocks += len(h.hashes)
        st.predicted_hit_blocks += w.match.gpu + w.match.lower
        st.exact += h.exact
        st.route_seconds += time.perf_counter() - t0
        return w, h.prompt_tokens

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        st = self.stats
        tenant = self.tenants.authenticate(request.headers)
        if tenant is None:
            st.unauthorized += 1
            return _error(401, "missing or invalid API key", "AuthenticationError")
        try:
            body = _json_decode(await request.read())
        except (msgspec.DecodeError, UnicodeDecodeError):
            return _error(400, "malformed JSON body", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if tenant.salt:
            body["cache_salt"] = tenant.salt  # the tenant's namespace, whatever the client sent
        payload = _json_encode(body)
        session = request.headers.get("x-session-id") or str(body.get("session_id") or "")
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or (256 if chat else 16)
        headers = {"Content-Type": "application/json"}
        if session:
            headers["x-session-id"] = session
        path = request.path
        tried: set[int] = set()
        st.requests += 1
        while True:
            if not any(w.healthy and w.slot not in tried for w in self.pool.workers):
                st.failed += 1
                return _error(503, "no healthy worker could take the request", "ServiceUnavailableError")
            w, prompt_tokens = self.choose(tenant.id, body, chat, session, tried)
            tokens = prompt_tokens + (max_out if type(max_out) is int and 0 < max_out < 1 << 32 else 0)
            tried.add(w.slot)
            load = w.start(tokens)
            try:
                resp = await self._forward(request, w, path, payload, headers, load)
            except _Retry as e:
                w.failures += 1
                w.retried_away += 1
                st.retries += 1
                log.warning("worker %d failed before the first byte (%s); retrying elsewhere", w.slot, e)
                if e.dead:
                    await self.pool.mark_dead(w, str(e))
                else:
                    asyncio.get_running_loop().create_task(self.pool.check(w))
                continue
            finally:
                load.finish()
            return resp

    async def _forward(
        self, request: web.Request, w: Worker, path: str, payload: bytes, headers: dict, load: Load
    ) -> web.StreamResponse:
        """POST to `w` and stream its answer back; raise _Retry if it failed before its first byte
        (from which on the request counts as `w`'s KV load): an error, a retryable status, no byte
        within --first-byte-timeout, or the worker taken out of rotation meanwhile."""
        limit = self.cfg.first_byte_timeout
        deadline = asyncio.timeout(limit)
        w.waiting.add(deadline)
        upstream = None
        try:
            async with deadline:
                upstream = await self.session.post(w.spec.url + path, data=payload, headers=headers)
                if upstream.status in _RETRY_STATUS:
                    raise _Retry(f"HTTP {upstream.status}")
                first = await upstream.content.readany()
        except _CONNECT_ERRORS + (_Retry,) as e:
            if upstream is not None:
                upstream.release()
            if isinstance(e, _Retry):
                raise
            if deadline.expired():
                if not w.healthy:
                    raise _Retry(
                        "taken out of rotation while the request waited for its first byte"
                    ) from None
                w.first_byte_timeouts += 1
                raise _Retry(f"no first byte within --first-byte-timeout {limit:g}s") from None
            raise _Retry(type(e).__name__, dead=isinstance(e, aiohttp.ClientConnectorError)) from None
        finally:
            w.waiting.discard(deadline)
        try:
            load.first_byte()
            resp = web.StreamResponse(status=upstream.status, headers={"x-agentkv-worker": str(w.slot)})
            resp.content_type = upstream.content_type
            if upstream.content_type == "text/event-stream":
                resp.headers["Cache-Control"] = "no-cache"
            elif upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            if first:
                await resp.write(first)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except _CONNECT_ERRORS:
                self.stats.broken_streams += 1
                log.warning("worker %d broke a response mid-stream; the client's stream ends early", w.slot)
                raise
            await resp.write_eof()
            return resp
        finally:
            upstream.release()


class _Retry(Exception):
    """The worker failed before sending a byte: the request may go to another worker."""

    def __init__(self, why: str, dead: bool = False) -> None:
        super().__init__(why)
        self.dead = dead


def run_router(cfg: RouterConfig) -> None:
    """Serve until interrupted."""
    router = Router(cfg)
    log.info(
        "agentkv route on http://%s:%d, policy %s, %d workers",
        cfg.host,
        cfg.port,
        cfg.policy,
        len(cfg.workers),
    )
    loop_factory = None
    try:  # uvloop when present: about a third less CPU per proxied request
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    # run_app closes the loop it is given (an asyncio.Runner around it would close it twice)
    web.run_app(
        router.app,
        host=cfg.host,
        port=cfg.port,
        print=None,
        access_log=None,
        loop=(loop_factory or asyncio.new_event_loop)(),
    )
