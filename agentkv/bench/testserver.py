"""A tiny OpenAI-compatible streaming server with fault injection, for the bench tests and smoke runs.

It streams one token per SSE chunk like vLLM (usage in a last chunk, `cached_tokens` from a
prefix cache of 16-token blocks), serves `/metrics` under vLLM's names, and lets a test choose
per request: an HTTP error, a context overflow, a reset mid-stream, a hang, slow tokens, a JSON
answer that ignores `stream`, or a cached count that lies; and per server (`Quirks`): chat only,
no token-id prompts, no chat template, a chat template's extra tokens, no cached_tokens in usage.
`python -m agentkv.bench.testserver --port P` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

BLOCK = 16


@dataclass(slots=True)
class Behaviour:
    """How to answer one request; the default streams every token at once."""

    status: int = 200  # != 200: answer this HTTP error instead
    ttft: float = 0.0  # seconds before the first token
    itl: float = 0.0  # seconds between tokens
    reset_after: int | None = None  # drop the connection after this many tokens
    hang: bool = False  # never answer (for client timeouts)
    ignore_stream: bool = False  # answer one JSON completion, as a server that ignores `stream`
    cached_bonus: int = 0  # report this many cached tokens more than were cached (a lying server)


@dataclass(slots=True)
class Quirks:
    """How the whole server departs from vLLM's defaults (each a way real targets refuse the bench)."""

    completions: bool = True  # False: chat only, /v1/completions answers 404
    token_ids: bool = True  # False: a prompt of token ids answers 400
    chat_template: bool = True  # False: chat answers vLLM's 400 for a model without a template
    template_tokens: int = 0  # tokens a chat template puts before the user's message
    chars_per_token: int | None = 4  # text prompts: ~N characters a token; None: the built-in tokenizer
    usage_cached: bool = True  # False: no prompt_tokens_details (vLLM without the flag)


Behave = Callable[[dict, int], Behaviour]
NO_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
    "template if the tokenizer does not define one."
)


def _prompt_tokens(body: dict, q: Quirks) -> list:
    p = body.get("prompt")
    if p is None:
        p = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return [f"<tpl{i}>" for i in range(q.template_tokens)] + _prompt_tokens({"prompt": p}, q)
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, str) and q.chars_per_token is None:
        from agentkv.trace.tokens import encode

        return list(encode(p))
    if isinstance(p, str):
        n = q.chars_per_token
        return [p[i : i + n] for i in range(0, len(p), n)]
    return list(p)


def _refusal(body: dict, q: Quirks) -> web.Response | None:
    """The 4xx a server with these quirks answers this request with, or None when it serves it."""
    if "messages" in body and not q.chat_template:
        return _error(400, NO_TEMPLATE)
    if isinstance(body.get("prompt"), list) and not q.token_ids:
        return _error(
            400,
            "[{'type': 'string_type', 'loc': ('body', 'prompt'), 'msg': 'Input should be a valid string'}]",
        )
    return None


async def _not_found(request: web.Request) -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


def _error(status: int, msg: str) -> web.Response:
    """An error answered as vLLM does."""
    body = {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": status}
    return web.json_response(body, status=status)


class StreamTestServer:
    """The server; `await start()` binds a free loopback port and returns its base URL."""

    def __init__(
        self,
        *,
        model: str = "test-model",
        behave: Behave | None = None,
        max_model_len: int = 1 << 20,
        serial: bool = False,
        max_running: int | None = None,
        quirks: Quirks | None = None,
        api_key: str | None = None,
    ):
        self.model, self.behave, self.max_model_len = model, behave, max_model_len
        self.api_key = api_key  # as vllm serve --api-key: /v1/* answers 401 without this bearer key
        self.seen_headers: list[dict[str, str]] = []  # every completion request's headers
        self.quirks = quirks or Quirks()
        self.cache: set[int] = set()
        self.queries = self.hits = 0
        self.running = self.waiting = 0
        self.seen: list[dict] = []  # every request body, in arrival order
        self._count = itertools.count()
        # a known capacity: at most this many requests stream at once, the rest wait (serial: 1)
        cap = 1 if serial else max_running
        self._serial = asyncio.Semaphore(cap) if cap else None
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.health_status = 200  # what GET /health answers (a test may fail it)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self.quirks.completions:
            app.router.add_post("/v1/completions", self._complete)
        else:  # as FastAPI answers a route it does not have
            app.router.add_post("/v1/completions", _not_found)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        self._closing = asyncio.Event()
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            self._closing.set()
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> StreamTestServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return None

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        usage = min(1.0, len(self.cache) / 100_000)
        lbl = f'{{engine="0",model_name="{self.model}"}}'
        text = (
            f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{lbl} "
            f"{float(self.queries)}\n# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{lbl} {float(self.hits)}\n"
            f"vllm:kv_cache_usage_perc{lbl} {usage}\nvllm:num_requests_running{lbl} {float(self.running)}\n"
            f"vllm:num_requests_waiting{lbl} {float(self.waiting)}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    def _lookup(self, tokens: list) -> int:
        """Cached prompt tokens (full blocks already seen), then remember this prompt's blocks."""
        h, hit, matching = 0, 0, True
        for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            h = hash((h, tuple(tokens[i : i + BLOCK])))
            if matching and h in self.cache:
                hit += BLOCK
            else:
                matching = False
                self.cache.add(h)
        self.queries += len(tokens)
        self.hits += hit
        return hit

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.seen_headers.append(dict(request.headers))
        if (denied := self._unauthorized(request)) is not None:
            return denied
        body = msgspec.json.decode(await request.read())
        self.seen.append(body)
        n = next(self._count)
        b = self.behave(body, n) if self.behave else Behaviour()
        tokens = _prompt_tokens(body, self.quirks)
        max_tokens = int(body.get("max_tokens") or 16)
        if b.hang:
            await self._closing.wait()
            raise web.HTTPServiceUnavailable()
        if b.status != 200:
            return web.json_response({"error": {"message": f"injected error {b.status}"}}, status=b.status)
        if (refused := _refusal(body, self.quirks)) is not None:
            return refused
        if len(tokens) + max_tokens > self.max_model_len:
            msg = (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens. Please reduce the length of the messages."
            )
            return web.json_response(
                {"object": "error", "message": msg, "type": "BadRequestError", "code": 400}, status=400
            )
        self.waiting += 1
        try:
            if self._serial is not None:
                await self._serial.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await self._stream(request, body, b, tokens, max_tokens)
        finally:
            self.running -= 1
            if self._serial is not None:
                self._serial.release()

    def _usage(self, tokens: list, max_tokens: int, b: Behaviour) -> dict:
        """The usage of one answer, looking the prompt up in the prefix cache."""
        cached = self._lookup(tokens) + b.cached_bonus
        usage: dict = {
            "prompt_tokens": len(tokens),
            "completion_tokens": max_tokens,
            "total_tokens": len(tokens) + max_tokens,
        }
        if self.quirks.usage_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _stream(self, request, body, b: Behaviour, tokens, max_tokens) -> web.StreamResponse:
        if b.ignore_stream:  # the whole answer as one JSON document, `stream` ignored
            text = "".join(f" t{i}" for i in range(max_tokens))
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            usage = self._usage(tokens, max_tokens, b)
            return web.json_response({"object": "text_completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        with contextlib.suppress(ConnectionResetError):  # the client left mid-stream: not an error here
            await self._stream_body(request, resp, body, b, tokens, max_tokens)
        return resp

    async def _stream_body(self, request, resp, body, b: Behaviour, tokens, max_tokens) -> None:
        usage = self._usage(tokens, max_tokens, b)
        chat = "messages" in body
        await resp.prepare(request)
        if b.ttft:
            await asyncio.sleep(b.ttft)
        for i in range(max_tokens):
            if b.reset_after is not None and i >= b.reset_after:
                request.transport.abort()  # type: ignore[union-attr]
                return
            if i and b.itl:
                await asyncio.sleep(b.itl)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            await resp.write(
                b"data: " + msgspec.json.encode({"object": "chunk", "choices": [choice]}) + b"\n\n"
            )
        end = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
        await resp.write(b"data: " + msgspec.json.encode({"choices": [end]}) + b"\n\n")
        await resp.write(b"data: " + msgspec.json.encode({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    ap.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument("--max-running", type=int, default=None, help="stream at most N requests at once")
    ap.add_argument("--ignore-stream", action="store_true", help="answer one JSON document, not SSE")
    ap.add_argument("--chat-only", action="store_true", help="/v1/completions answers 404")
    ap.add_argument("--no-token-ids", action="store_true", help="token-id prompts answer 400")
    ap.add_argument("--no-chat-template", action="store_true", help="chat requests answer 400")
    ap.add_argument("--template-tokens", type=int, default=0, help="a chat template's extra tokens")
    ap.add_argument("--api-key", default=None, help="answer 401 without 'Authorization: Bearer KEY'")
    a = ap.parse_args(argv)
    quirks = Quirks(
        completions=not a.chat_only,
        token_ids=not a.no_token_ids,
        chat_template=not a.no_chat_template,
        template_tokens=a.template_tokens,
    )

    async def run() -> None:
        srv = StreamTestServer(
            behave=lambda body, n: Behaviour(ttft=a.ttft, itl=a.itl, ignore_stream=a.ignore_stream),
            max_model_len=a.max_model_len,
            max_running=a.max_running,
            quirks=quirks,
            api_key=a.api_key,
        )
        print(await srv.start(a.port), flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
