"""The HTTP server: vLLM's OpenAI endpoints over aiohttp, in front of one real-time engine.

`Server(config, options)`: `await start()` binds and starts the engine loop, `await stop()`
shuts down. A client that disconnects cancels its handler (aiohttp `handler_cancellation`),
which aborts its request in the engine and frees its blocks. Bodies are read under the door's
caps (`agentkv.gate`); large ones are parsed and tokenized in a worker process, never on the
loop that runs the engine. Logs never carry prompt or completion text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from agentkv.engine.config import EngineConfig
from agentkv.events.curve import CurveServer
from agentkv.events.publisher import DEFAULT_TOPIC, ZmqEventPublisher
from agentkv.gate.body import BodyTimeout, encoding_of, likely_large, read_body, refuse_and_close
from agentkv.gate.conn import ConnectionGuard, base_url, make_runner, start_site
from agentkv.gate.errors import JSON
from agentkv.gate.options import HttpLimits
from agentkv.gate.web import error_middleware, error_response, quiet_probes
from agentkv.gate.work import OFFLOAD_BYTES, Offload
from agentkv.kv.transfer import LinkModel, nvlink
from agentkv.serve.info import add_info_routes
from agentkv.serve.metrics import ServerMetrics
from agentkv.serve.pd import KVLink
from agentkv.serve.protocol import GenRequest, Limits, RequestError, parse_chat, parse_completion
from agentkv.serve.responses import DONE, ChunkWriter, engine_times, full_response
from agentkv.serve.runner import EngineRunner, RequestStream
from agentkv.serve.tokenize import detokenize_body, tokenize_body
from agentkv.trace.tokens import warm_up

log = logging.getLogger("agentkv.serve")


@dataclass(slots=True)
class ServeOptions:
    """Everything about one server that is not the engine: address, names, events, limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 1.0
    served_model_name: str | None = None  # default: the --model value
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = DEFAULT_TOPIC
    kv_events_host: str | None = "127.0.0.1"  # where a tcp://*:PORT endpoint binds (None: everywhere)
    kv_events_curve: CurveServer | None = None  # CURVE on the event and replay sockets
    kv_events_token_ids: bool = True  # BlockStored carries the prompt's token ids (as vLLM)
    http: HttpLimits = HttpLimits()  # body caps, timeouts, connection cap, parser processes
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as vLLM)
    kv_link: LinkModel | None = None  # a disaggregated decode's inbound KV link (None: the GPU's NVLink)


class Server:
    """One agentkv engine behind vLLM's OpenAI HTTP API."""

    def __init__(self, config: EngineConfig, options: ServeOptions | None = None) -> None:
        self.config = config
        self.options = opts = options or ServeOptions()
        self.model_name = opts.served_model_name or config.model
        self.publisher: ZmqEventPublisher | None = None
        if opts.kv_events_endpoint:
            self.publisher = ZmqEventPublisher(
                opts.kv_events_endpoint,
                opts.kv_events_replay_endpoint,
                topic=opts.kv_events_topic,
                data_parallel_rank=0,
                host=opts.kv_events_host,
                curve=opts.kv_events_curve,
                token_ids=opts.kv_events_token_ids,
            )
        try:
            self.runner = EngineRunner(config, time_scale=opts.time_scale, publisher=self.publisher)
        except BaseException:
            if self.publisher is not None:
                self.publisher.close()
            raise
        link = opts.kv_link if opts.kv_link is not None else nvlink(self.runner.engine.cost.gpu.gpu_link_gbps)
        self.kv_link = KVLink(self.runner, link, opts.host, opts.port)
        self.metrics = ServerMetrics(self.runner, self.model_name)
        self.runner.on_step = self.metrics.on_step
        self.runner.on_finish = self.metrics.on_finish
        eng = self.runner.engine
        self.limits = Limits(
            (self.model_name, config.model),
            eng.max_model_len,
            eng.model_shape.vocab,
            default_chat_tokens=opts.default_max_tokens,
        )
        warm_up()  # build the tokenizer's tables now, not during the first request
        quiet_probes()
        n = opts.http.parse_processes
        self.offload = Offload(n, max(4, 2 * n), max(4, 2 * n), init=warm_up)
        self.app = self._make_app()
        self._site_runner: web.AppRunner | None = None
        self.guard: ConnectionGuard | None = None
        self.port: int | None = None
        self.created = int(time.time())

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind, start the engine loop; the base URL (the real port when `port` was 0)."""
        runner = make_runner(self.app, self.options.http)
        await runner.setup()
        try:
            self.guard = await start_site(runner, self.options.host, self.options.port, self.options.http)
        except OSError as e:
            await runner.cleanup()
            await self.runner.stop()
            from agentkv.errors import UserError

            raise UserError(
                f"cannot listen on {self.options.host}:{self.options.port}: {e.strerror}"
            ) from None
        self._site_runner = runner
        self.port = runner.addresses[0][1]
        self.kv_link.port = self.port
        self.runner.start()
        self.offload.start()
        return self.url

    @property
    def url(self) -> str:
        return base_url(self.options.host, self.port)

    async def stop(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.shutdown()
        await self.runner.stop()
        if self._site_runner is not None:
            await self._site_runner.cleanup()
            self._site_runner = None
        self.offload.close()

    # -- routes -----------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.options.http.max_body_bytes, middlewares=[error_middleware]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        add_info_routes(app, self)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl")

    async def _generate(
        self, request: web.Request, parse: Callable[[bytes, Limits], GenRequest], prefix: str
    ) -> web.StreamResponse:
        try:
            gen = await self._parsed(request, parse, self.limits)
        except BodyTimeout as e:
            return await refuse_and_close(request, e)
        except RequestError as e:
            return self._error(request, e)
        if gen.session_id is None:
            gen.session_id = request.headers.get("x-session-id")  # what agentkv route forwards
        rid = f"{prefix}-{uuid.uuid4().hex}"
        kt = gen.kv_transfer
        try:
            if kt is not None and kt.do_remote_prefill:  # a decode: wait for the prompt's KV to arrive
                hashes, arrived, wait_s = self.kv_link.receive(gen)
                await asyncio.sleep(wait_s)
                stream = self.runner.submit(rid, gen, hashes, arrived)
            else:
                stream = self.runner.submit(rid, gen)
        except ValueError as e:  # the engine's own checks (lengths): a bad request all the same
            return self._error(request, RequestError(str(e)))
        if kt is not None and kt.do_remote_decode and stream.engine_req is not None:
            stream.engine_req.block_ids = []  # a prefill: keep its block ids for the decode
        try:
            if gen.stream:
                return await self._stream(request, rid, gen, stream)
            done = False
            while not done:
                _, done = await stream.take()
            n = stream.sent
            if stream.aborted:
                return self._error(
                    request, RequestError("the server is shutting down", None, 503, "ServiceUnavailableError")
                )
            times = self._times(gen, stream)
            handoff = self.kv_link.producer_params(stream) if kt is not None and kt.do_remote_decode else None
            body = full_response(rid, gen, n, stream.cached_tokens, engine=times, kv_transfer_params=handoff)
            return web.Response(body=body, content_type=JSON)
        finally:
            if not stream.finished:
                self.runner.abort(rid)  # the client went away (cancelled) or a write failed

    async def _stream(
        self, request: web.Request, rid: str, gen: GenRequest, stream: RequestStream
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        writer = ChunkWriter(rid, gen)
        try:
            done = False
            while not done:
                start = stream.sent
                n, done = await stream.take()
                if stream.aborted:
                    return resp
                if n:
                    await resp.write(writer.chunk(start, n, done))
            tail = DONE
            if gen.include_usage:
                times = self._times(gen, stream)
                tail = writer.usage_chunk(stream.sent, stream.cached_tokens, times) + DONE
            await resp.write(tail)
            await resp.write_eof()
        except (ConnectionError, RuntimeError) as e:  # peer gone: the finally in _generate aborts
            log.info("%s: client disconnected mid-stream (%s)", rid, type(e).__name__)
        return resp

    def _times(self, gen: GenRequest, stream: RequestStream) -> dict | None:
        """The engine's times of a request, but not of a disaggregated decode: they would start when
        its KV arrived, not when the client sent it (clients then time it with their own clock)."""
        if gen.kv_transfer is not None and gen.kv_transfer.do_remote_prefill:
            return None
        return engine_times(stream.engine_req, self.options.time_scale, self.kv_link.engine_id)

    async def _parsed(self, request: web.Request, parse: Callable, *args):
        """`parse(body, *args)` of the body read under the caps: here when small, else in a worker
        process (which also inflates a compressed body), taking one of the parse slots before the
        body is read (so waiting costs no memory)."""
        http = self.options.http
        if not likely_large(request, OFFLOAD_BYTES):
            return parse(await read_body(request, http.max_body_bytes, http.body_timeout), *args)
        async with self.offload.slot():  # a compressed body is inflated in the parse process
            enc = encoding_of(request)
            body = await read_body(request, http.max_body_bytes, http.body_timeout, inflate=False)
            if enc is None and len(body) < OFFLOAD_BYTES:
                return parse(body, *args)
            return await self.offload.run_raw(parse, body, enc, http.max_body_bytes, *args)

    def _error(self, request: web.Request, e: RequestError) -> web.Response:
        log.info(
            "%s %s -> %d %s (param %s): %s",
            request.method,
            request.path,
            e.status,
            e.err_type,
            e.param,
            e.message,
        )
        return error_response(e)

    # -- the tokenizer over HTTP ------------------------------------------------------------------
    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` text or chat `messages` -> token ids of the built-in tokenizer."""
        return await self._bytes_endpoint(request, tokenize_body)

    async def _detokenize(self, request: web.Request) -> web.Response:
        return await self._bytes_endpoint(request, detokenize_body)

    async def _bytes_endpoint(self, request: web.Request, fn: Callable[[bytes, int], bytes]) -> web.Response:
        try:
            out = await self._parsed(request, fn, self.limits.max_model_len)
        except BodyTimeout as e:
            return await refuse_and_close(request, e)
        except RequestError as e:
            return self._error(request, e)
        return web.Response(body=out, content_type=JSON)


async def serve_until_stopped(server: Server, stop: asyncio.Event, ready: Callable[[Server], None]) -> None:
    """Start `server`, call `ready`, run until `stop` is set, then shut down."""
    await server.start()
    try:
        ready(server)
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
