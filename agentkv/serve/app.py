"""The HTTP server: vLLM's OpenAI endpoints over aiohttp, in front of one real-time engine.

`Server(config, options)`: `await start()` binds and starts the engine loop, `await stop()`
shuts down. A client that disconnects cancels its handler (aiohttp `handler_cancellation`),
which aborts its request in the engine and frees its blocks. Logs never carry prompt or
completion text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from agentkv import __version__
from agentkv.engine.config import EngineConfig
from agentkv.events.curve import CurveServer
from agentkv.events.publisher import DEFAULT_TOPIC, ZmqEventPublisher
from agentkv.kv.digest import block_digest
from agentkv.serve.metrics import CONTENT_TYPE, ServerMetrics
from agentkv.serve.protocol import GenRequest, Limits, RequestError, parse_chat, parse_completion
from agentkv.serve.responses import DONE, ChunkWriter, error_body, full_response
from agentkv.serve.runner import EngineRunner, RequestStream
from agentkv.trace.tokens import apply_chat_template, decode, encode, warm_up

log = logging.getLogger("agentkv.serve")
_enc = msgspec.json.Encoder()
JSON = "application/json"
OFFLOAD_BYTES = 256 << 10  # bodies this large are parsed in a worker thread


class _QuietProbes(logging.Filter):
    """Drop aiohttp's traceback for unparsable requests (sglang-router probes for HTTP/2 and gRPC)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            log.debug("answered 400 to a request that is not HTTP/1.1 (%s)", str(exc).split(":", 1)[0])
            return False
        return True


_quiet_probes = _QuietProbes()


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
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as vLLM)


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
        logging.getLogger("aiohttp.server").addFilter(_quiet_probes)  # idempotent: a filter is added once
        self.app = self._make_app()
        self._site_runner: web.AppRunner | None = None
        self.port: int | None = None
        self.created = int(time.time())

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind, start the engine loop; the base URL (the real port when `port` was 0)."""
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.options.host, self.options.port, backlog=1024)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            await self.runner.stop()
            from agentkv.errors import UserError

            raise UserError(
                f"cannot listen on {self.options.host}:{self.options.port}: {e.strerror}"
            ) from None
        self._site_runner = runner
        self.port = runner.addresses[0][1]
        self.runner.start()
        return self.url

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    async def stop(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.shutdown()
        await self.runner.stop()
        if self._site_runner is not None:
            await self._site_runner.cleanup()
            self._site_runner = None

    # -- routes -----------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.options.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/debug/kv_blocks", self._debug_kv_blocks)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl")

    async def _generate(
        self, request: web.Request, parse: Callable[[bytes, Limits], GenRequest], prefix: str
    ) -> web.StreamResponse:
        try:
            body = await self._body(request)
            if len(body) < OFFLOAD_BYTES:
                gen = parse(body, self.limits)
            else:  # tokenizing a long text prompt takes ~1 us/token: keep the streams flowing meanwhile
                gen = await asyncio.to_thread(parse, body, self.limits)
        except RequestError as e:
            return self._error(request, e)
        if gen.session_id is None:
            gen.session_id = request.headers.get("x-session-id")  # what agentkv route forwards
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = self.runner.submit(rid, gen)
        except ValueError as e:  # the engine's own checks (lengths): a bad request all the same
            return self._error(request, RequestError(str(e)))
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
            return web.Response(body=full_response(rid, gen, n, stream.cached_tokens), content_type=JSON)
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
                tail = writer.usage_chunk(stream.sent, stream.cached_tokens) + DONE
            await resp.write(tail)
            await resp.write_eof()
        except (ConnectionError, RuntimeError) as e:  # peer gone: the finally in _generate aborts
            log.info("%s: client disconnected mid-stream (%s)", rid, type(e).__name__)
        return resp

    async def _body(self, request: web.Request) -> bytes:
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(
                f"request body of {request.content_length} bytes exceeds the {limit}-byte limit",
                None,
                413,
                "RequestEntityTooLarge",
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(
                f"request body exceeds the {limit}-byte limit", None, 413, "RequestEntityTooLarge"
            ) from None

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
        return web.Response(
            body=error_body(e.message, e.err_type, e.status, e.param), status=e.status, content_type=JSON
        )

    # -- small endpoints --------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.Response(body=_enc.encode({"version": __version__}), content_type=JSON)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agentkv",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.limits.max_model_len,
            "permission": [],
        }
        return web.Response(body=_enc.encode({"object": "list", "data": [card]}), content_type=JSON)

    async def _debug_kv_blocks(self, request: web.Request) -> web.Response:
        """The count and an order-free digest of the GPU prefix cache's block hashes (what the KV
        events announced), to check a router's index against; no hash is revealed."""
        return web.json_response({"GPU": block_digest(self.runner.engine.cached_block_hashes())})

    async def _server_info(self, request: web.Request) -> web.Response:
        """sglang-router probes this: the server's settings, in sglang's key names where it has them."""
        eng = self.runner.engine
        cfg = self.config
        info = {
            "model_path": self.config.model,
            "served_model_name": self.model_name,
            "tokenizer_path": None,
            "skip_tokenizer_init": True,
            "tp_size": cfg.tensor_parallel_size,
            "dp_size": 1,
            "page_size": cfg.block_size,
            "context_length": self.limits.max_model_len,
            "max_total_num_tokens": eng.num_gpu_blocks * cfg.block_size,
            "max_running_requests": cfg.max_num_seqs,
            "chunked_prefill_size": cfg.max_num_batched_tokens,
            "gpu": cfg.gpu,
            "time_scale": self.options.time_scale,
            "kv_events_endpoint": self.publisher.endpoint if self.publisher else None,
            "version": __version__,
            "engine": "agentkv",
        }
        return web.Response(body=_enc.encode(info), content_type=JSON)

    async def _model_info(self, request: web.Request) -> web.Response:
        info = {
            "model_path": self.config.model,
            "tokenizer_path": None,
            "is_generation": True,
            "served_model_name": self.model_name,
            "max_model_len": self.limits.max_model_len,
            "vocab_size": self.limits.vocab_size,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
        }
        return web.Response(body=_enc.encode(info), content_type=JSON)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` text or chat `messages` -> token ids of the built-in tokenizer."""
        try:
            data = msgspec.json.decode(await self._body(request))
            if not isinstance(data, dict):
                raise RequestError("the body must be a JSON object")
            if isinstance(data.get("messages"), list):
                msgs = [m for m in data["messages"] if isinstance(m, dict)]
                ids = encode(apply_chat_template(msgs, bool(data.get("add_generation_prompt", True))))
            elif isinstance(data.get("prompt"), str):
                ids = encode(data["prompt"])
            else:
                raise RequestError("give `prompt` (a string) or `messages` (a list)", "prompt")
        except msgspec.DecodeError as e:
            return self._error(request, RequestError(f"malformed JSON body: {e}"))
        except RequestError as e:
            return self._error(request, e)
        except (TypeError, ValueError):  # a message of an unexpected shape (e.g. tool_calls not a list)
            return self._error(
                request,
                RequestError(
                    "messages: each must be an object with a string role, "
                    "string content and a list of tool_calls",
                    "messages",
                ),
            )
        body = {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}
        return web.Response(body=_enc.encode(body), content_type=JSON)

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            data = msgspec.json.decode(await self._body(request))
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise RequestError("`tokens` must be a list of non-negative token ids", "tokens")
        except msgspec.DecodeError as e:
            return self._error(request, RequestError(f"malformed JSON body: {e}"))
        except RequestError as e:
            return self._error(request, e)
        return web.Response(body=_enc.encode({"prompt": decode(tokens)}), content_type=JSON)


async def serve_until_stopped(server: Server, stop: asyncio.Event, ready: Callable[[Server], None]) -> None:
    """Start `server`, call `ready`, run until `stop` is set, then shut down."""
    await server.start()
    try:
        ready(server)
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
