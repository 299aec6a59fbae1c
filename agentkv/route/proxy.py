"""`agentkv route`: an OpenAI-compatible proxy that sends each request to the worker that caches it.

Per request: authenticate (401 before any worker is touched), inject the tenant's cache_salt
(overriding a client's), hash the prompt as the engine will, look the hashes up in the tenant's
index (event mode) or the router's own prediction (approximate mode), let the policy pick among
healthy workers, and forward over pooled keep-alive connections (TCP_NODELAY is set on both
sides by aiohttp). The response streams back chunk by chunk, untouched (usage included). A
request that fails before its first byte is retried on another worker. Prompt content is never
logged. Bodies are read under the door's caps (`agentkv.gate`); large ones are decoded and
tokenized in parser processes, a few per tenant at once, so no tenant can stall the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from agentkv.gate.body import BodyTimeout, encoding_of, likely_large, read_body, refuse_and_close
from agentkv.gate.errors import RequestError
from agentkv.gate.fastpath import Exchange, FastRequest
from agentkv.gate.options import HttpLimits
from agentkv.gate.upstream import Upstream
from agentkv.gate.web import error_middleware, error_response
from agentkv.gate.work import OFFLOAD_BYTES, Offload
from agentkv.kv.digest import block_digest
from agentkv.kv.hashing import make_hasher
from agentkv.placement.policy import KV_QUEUE_CAP, KV_WEIGHT, RouteRequest, make_policy
from agentkv.route.approx import ApproxIndex
from agentkv.route.forward import Retry, StreamSink, forward
from agentkv.route.index import Match, TenantIndex
from agentkv.route.metrics import RouterStats, merge_processes, publish_page, render_metrics, sibling_pages
from agentkv.route.models import learn_max_model_len, models
from agentkv.route.prepare import Prepared, init_child, prepare, prepare_in_child
from agentkv.route.prompt import Hashed, RequestHasher, Tokenizer
from agentkv.route.replica import SessionTieKvAware, tie_key
from agentkv.route.tenants import InFlight, Tenant, Tenants, router_secret
from agentkv.route.workers import Load, Worker, WorkerPool, WorkerSpec

log = logging.getLogger("agentkv.route")

_NO_MATCH = Match(0)
_JSON = b"Content-Type: application/json\r\n"
FALLBACK_MAX_MODEL_LEN = 1 << 20  # the hashing bound until a worker reports its max_model_len


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
    kv_queue_weight: float = 0.0  # price of a worker's active prefill blocks (Dynamo: 1; docs/route.md)
    kv_queue_cap: float = KV_QUEUE_CAP  # ... counted up to this x the request's blocks (inf: uncapped)
    temperature: float = 0.0
    affinity: float = 8.0  # blocks a session's worker may cost above the best and still keep it
    tie_break: str = "rotate"  # kv_aware ties: "rotate", or "session" (keyed hash: replicas agree)
    approx_capacity: int = 65_536
    approx_ttl: float = 300.0
    health_interval: float = 1.0
    health_timeout: float = 2.0  # s a /health probe may take
    first_byte_timeout: float | None = None  # seconds a worker may take to its first byte (None: no limit)
    scrape_interval: float = 2.0
    http: HttpLimits = HttpLimits(parse_processes=2)  # body caps, timeouts, connection cap, parsers
    max_parses_per_tenant: int = 2  # large bodies of one tenant read and parsed at once
    max_model_len: int = 0  # the workers' context length (0: learned from their /v1/models)
    max_streams_per_tenant: int = 1024  # concurrent requests per tenant (429 past it; 0: no limit)
    max_index_blocks: int = 1 << 22  # indexed blocks per worker (stores past it are dropped, counted)
    windows: dict = field(default_factory=dict)  # hybrid models: rule -> tokens (--sliding-window)
    host: str = "127.0.0.1"
    port: int = 8000
    process: int | None = None  # this one's index under `--processes N` (the port is shared)
    metrics_dir: str | None = None  # where the N processes leave their /metrics pages for each other
    extra: dict = field(default_factory=dict)


def _error(status: int, message: str, err_type: str | None = None) -> web.Response:
    return error_response(RequestError(message, None, status, err_type))


class Router:
    """The routing proxy: an aiohttp app plus the index, tenants, policy and worker pool behind it."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tenants = Tenants.from_file(cfg.api_keys, router_secret(cfg.secret) if cfg.api_keys else b"")
        self.index = TenantIndex(self.tenants.salts(), cfg.max_index_blocks, cfg.windows, cfg.block_size)
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
            health_timeout=cfg.health_timeout,
            scrape_interval=cfg.scrape_interval,
            on_membership=self._new_policy,
            forget=self.approx.clear_worker,
        )
        self.stats = RouterStats()
        self.tie_key = tie_key(cfg.secret)  # replicas given one secret break ties alike
        self.policy = self._make_policy()
        self.session: aiohttp.ClientSession | None = None  # health checks, scrapes, /v1/models
        self.upstream = Upstream(keepalive=4.0, connect_timeout=5.0)  # the proxied requests
        self.guard = None  # the listening site's ConnectionGuard (set by listen.py)
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self.in_flight = InFlight(cfg.max_streams_per_tenant)  # tenant -> requests in flight
        self.max_model_len = cfg.max_model_len or FALLBACK_MAX_MODEL_LEN
        self.max_model_len_known = bool(cfg.max_model_len)  # else learned from the workers
        n = cfg.http.parse_processes
        self.offload = Offload(
            n,
            cfg.max_parses_per_tenant,
            max(4, 2 * n, cfg.max_parses_per_tenant),
            init=init_child,
            init_args=(cfg.hash_algo, cfg.hash_seed, cfg.block_size, cfg.tokenizer),
        )
        self.app = web.Application(client_max_size=cfg.http.max_body_bytes, middlewares=[error_middleware])
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
        kw = {
            "weight": self.cfg.kv_weight,
            "queue_weight": self.cfg.kv_queue_weight,
            "queue_cap": self.cfg.kv_queue_cap,
            "temperature": self.cfg.temperature,
            "affinity": 0.0 if retry else self.cfg.affinity,
        }
        if self.cfg.tie_break == "session":
            return SessionTieKvAware(self.tie_key, **kw)
        return make_policy("kv_aware", **kw)

    def _new_policy(self) -> None:
        """Workers came or went: policy state indexes the healthy list, so start it afresh."""
        self.policy = self._make_policy()

    async def _startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        # pooled connections are dropped after 4 s idle: before the workers' own keep-alive (uvicorn, vLLM
        # and agentkv serve: 5 s) closes them under a request sent at that moment
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        await self.pool.start(self.session)
        self.offload.start()
        if self.hasher.tokenizer.kind == "builtin":  # before listening: not on the first request's time
            from agentkv.trace.tokens import warm_up

            warm_up()
        if not self.cfg.max_model_len:
            self._learner = asyncio.create_task(learn_max_model_len(self), name="route-max-model-len")
        if self.cfg.metrics_dir is not None:
            self._publisher = asyncio.create_task(
                publish_page(self.cfg.metrics_dir, str(self.cfg.process), lambda: render_metrics(self)),
                name="route-metrics-page",
            )
        if self.tenants.open:
            log.info("no --api-keys: requests are not authenticated and client cache_salt passes through")
        else:
            log.info(
                "%d tenants; each request gets its tenant's cache_salt; %d admin keys for /metrics and "
                "/debug/index",
                len(self.tenants),
                self.tenants.admins,
            )

    async def _cleanup(self, app: web.Application) -> None:
        for task in (getattr(self, "_learner", None), getattr(self, "_publisher", None)):
            if task is not None:
                task.cancel()
        await self.pool.close()
        if self.session is not None:
            await self.session.close()
        self.upstream.close()
        self.offload.close()

    # -- endpoints -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._limited(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._limited(request, chat=True)

    async def _limited(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """aiohttp's path: authenticate, take a stream slot, read and prepare the body, dispatch."""
        tenant = self.tenants.authenticate(request.headers)
        if (refused := self._admit(tenant)) is not None:
            return error_response(refused)
        try:
            try:
                prep = await self._prepare(request, tenant.id, tenant.salt, chat)
            except BodyTimeout as e:
                return await refuse_and_close(request, e)
            except RequestError as e:
                return error_response(e)
            sink = StreamSink(request)
            refused = await self._dispatch(
                prep, tenant, request.headers.get("x-session-id"), request.path, sink
            )
            return sink.resp if refused is None else error_response(refused)
        finally:
            self.in_flight.give(tenant.id)

    async def fast(self, req: FastRequest, ex: Exchange) -> None:
        """gate.fastpath's handler (a small plain body, all here): the same steps as `_limited`."""
        tenant = self.tenants.authenticate(req.headers)
        if (refused := self._admit(tenant)) is not None:
            return ex.error(refused)
        try:
            limit, refuse = self.max_model_len, self.max_model_len_known
            chat = req.path == "/v1/chat/completions"
            try:
                prep = prepare(req.body, chat, tenant.salt, self.hasher, limit, refuse)
            except RequestError as e:
                return ex.error(e)
            refused = await self._dispatch(prep, tenant, req.headers.get("x-session-id"), req.path, ex)
            if refused is not None:
                ex.error(refused)
        finally:
            self.in_flight.give(tenant.id)

    def _admit(self, tenant: Tenant | None) -> RequestError | None:
        """401 without a tenant; 429 past `max_streams_per_tenant` in flight; else a slot taken."""
        if tenant is None:
            self.stats.unauthorized += 1
            return RequestError("missing or invalid API key", None, 401, "AuthenticationError")
        if self.in_flight.take(tenant.id):
            return None
        self.stats.throttled += 1
        msg = f"too many concurrent requests for this API key's tenant (limit {self.in_flight.limit})"
        return RequestError(msg, None, 429, "RateLimitError")

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        """None when the request may read every tenant's figures (an admin key, or no --api-keys)."""
        ok = self.tenants.admin(request.headers)
        if ok:
            return None
        self.stats.unauthorized += 1
        if ok is None:
            return _error(401, "an admin API key is required", "AuthenticationError")
        return _error(403, "this endpoint needs an admin API key, not a tenant's", "PermissionDeniedError")

    async def debug_index(self, request: web.Request) -> web.Response:
        """Per event-mode worker: the count and an order-free digest of its indexed GPU blocks (all
        tenants), to compare with the worker's own `/debug/kv_blocks`; no hash is revealed."""
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        with self.pool.lock:
            held = {str(w.slot): self.index.held(w.slot) for w in self.pool.workers if w.mode == "event"}
        return web.json_response(
            {
                "workers": {k: block_digest(v) for k, v in held.items()},
                "index_overflow_blocks": self.index.overflow,
                "skipped_group_blocks": self.index.groups.counts(),
            }
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await models(self, request)

    async def health(self, request: web.Request) -> web.Response:
        up = [w.slot for w in self.pool.workers if w.healthy]
        return web.json_response(
            {"status": "ok" if up else "no healthy worker", "healthy_workers": up}, status=200 if up else 503
        )

    async def metrics(self, request: web.Request) -> web.Response:
        """This router's metrics; under `--processes N` every process's, labelled `process`."""
        if (refused := self._admin_refusal(request)) is not None:
            return refused
        text = render_metrics(self)
        if self.cfg.metrics_dir is not None:
            pages = sibling_pages(self.cfg.metrics_dir)
            pages[str(self.cfg.process)] = text
            text = merge_processes(pages)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- routing ---------------------------------------------------------------------------------
    def choose(self, tenant: str, h: Hashed, session: str, exclude: set[int]) -> Worker | None:
        """The worker for this request (healthy, not in `exclude`), given its hashes; None when no
        worker is left to take it."""
        t0 = time.perf_counter()
        views = [w for w in self.pool.workers if w.healthy and w.slot not in exclude]
        if not views:
            return None
        events = sum(w.mode == "event" for w in views)
        with self.pool.lock:
            if h.exact:
                ev = self.index.find_matches(tenant, h.hashes, h.prompt_tokens) if events else {}
                ap = self.approx.find_matches(tenant, h.hashes) if events < len(views) else {}
                for w in views:
                    w.match = (ev if w.mode == "event" else ap).get(w.slot, _NO_MATCH)
                self.index.expect(tenant, h.hashes)
            else:
                ap = self.approx.find_matches(tenant, h.hashes)
                for w in views:
                    w.match = ap.get(w.slot, _NO_MATCH)
        policy = self.policy
        if exclude and len(views) != len(
            self.pool.healthy()
        ):  # a retry: stateful policies index the full list
            policy = self._make_policy(retry=True)
        req = RouteRequest(h.hashes, h.prompt_tokens, session, self.cfg.block_size)
        w = views[policy.choose(req, views)]
        if w.mode != "event" or not h.exact:
            self.approx.record(w.slot, tenant, h.hashes)
        st = self.stats
        st.prompt_blocks += len(h.hashes)
        st.predicted_hit_blocks += w.match.gpu + w.match.lower
        st.exact += h.exact
        st.route_seconds += time.perf_counter() - t0
        return w

    async def _dispatch(
        self, prep: Prepared, tenant: Tenant, session: str | None, path: str, sink
    ) -> RequestError | None:
        """Choose a worker, forward, retry elsewhere on a failure before the first byte; a 503 when no
        healthy worker is left (returned, for the caller to answer)."""
        st = self.stats
        session = session or prep.session
        headers = _JSON + (
            b"x-session-id: " + session.encode("utf-8", "surrogateescape") + b"\r\n" if session else b""
        )
        tried: set[int] = set()
        st.requests += 1
        while True:
            w = self.choose(tenant.id, prep.hashed, session, tried)
            if w is None:
                st.failed += 1
                return RequestError("no healthy worker could take the request", None, 503)
            tried.add(w.slot)
            n = prep.hashed.prompt_tokens
            load = w.start(n + prep.max_out, max(0, n - w.match.gpu * self.cfg.block_size))
            try:
                return await self._forward(sink, w, path, prep.payload, headers, load)
            except Retry as e:
                w.failures += 1
                w.retried_away += 1
                st.retries += 1
                log.warning("worker %d failed before the first byte (%s); retrying elsewhere", w.slot, e)
                if e.dead:
                    await self.pool.mark_dead(w, str(e))
                else:
                    asyncio.get_running_loop().create_task(self.pool.check(w))
            finally:
                load.finish()

    async def _prepare(self, request: web.Request, tenant: str, salt: str | None, chat: bool) -> Prepared:
        """The body read under the caps and prepared: here when small; else in a parser process, after
        taking one of the tenant's parse slots (before reading, so waiting holds no body)."""
        http = self.cfg.http
        limit, refuse = self.max_model_len, self.max_model_len_known
        if not likely_large(request, OFFLOAD_BYTES):
            body = await read_body(request, http.max_body_bytes, http.body_timeout)
            return prepare(body, chat, salt, self.hasher, limit, refuse)
        async with self.offload.slot(tenant):  # a compressed body is inflated in the parse process
            enc = encoding_of(request)
            body = await read_body(request, http.max_body_bytes, http.body_timeout, inflate=False)
            if enc is None and len(body) < OFFLOAD_BYTES:
                return prepare(body, chat, salt, self.hasher, limit, refuse)
            cap = http.max_body_bytes
            return await self.offload.run_raw(prepare_in_child, body, enc, cap, chat, salt, limit, refuse)

    async def _forward(self, sink, w: Worker, path: str, payload: bytes, headers: bytes, load: Load) -> None:
        await forward(self, sink, w, path, payload, headers, load)
