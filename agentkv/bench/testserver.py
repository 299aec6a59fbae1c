"""A tiny OpenAI-compatible streaming server with fault injection, for the bench tests and smoke runs.

It streams one token per SSE chunk like vLLM (usage in a last chunk, `cached_tokens` from a
prefix cache of 16-token blocks), serves `/metrics` under vLLM's names, and lets a test choose
per request: an HTTP error, a context overflow, a reset mid-stream, a hang, or slow tokens.
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


Behave = Callable[[dict, int], Behaviour]


def _prompt_tokens(body: dict) -> list:
    p = body.get("prompt")
    if p is None:
        p = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, str):
        return [p[i : i + 4] for i in range(0, len(p), 4)]  # ~4 characters a token
    return list(p)


class StreamTestServer:
    """The server; `await start()` binds a free loopback port and returns its base URL."""

    def __init__(
        self,
        *,
        model: str = "test-model",
        behave: Behave | None = None,
        max_model_len: int = 1 << 20,
        serial: bool = False,
    ):
        self.model, self.behave, self.max_model_len = model, behave, max_model_len
        self.cache: set[int] = set()
        self.queries = self.hits = 0
        self.running = self.waiting = 0
        self.seen: list[dict] = []  # every request body, in arrival order
        self._count = itertools.count()
        self._serial = asyncio.Semaphore(1) if serial else None
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.health_status = 200  # what GET /health answers (a test may fail it)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
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

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

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
        body = msgspec.json.decode(await request.read())
        self.seen.append(body)
        n = next(self._count)
        b = self.behave(body, n) if self.behave else Behaviour()
        tokens = _prompt_tokens(body)
        max_tokens = int(body.get("max_tokens") or 16)
        if b.hang:
            await self._closing.wait()
            raise web.HTTPServiceUnavailable()
        if b.status != 200:
            return web.json_response({"error": {"message": f"injected error {b.status}"}}, status=b.status)
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

    async def _stream(self, request, body, b: Behaviour, tokens, max_tokens) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        with contextlib.suppress(ConnectionResetError):  # the client left mid-stream: not an error here
            await self._stream_body(request, resp, body, b, tokens, max_tokens)
        return resp

    async def _stream_body(self, request, resp, body, b: Behaviour, tokens, max_tokens) -> None:
        cached = self._lookup(tokens)
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
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": max_tokens,
            "total_tokens": len(tokens) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
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
    a = ap.parse_args(argv)

    async def run() -> None:
        srv = StreamTestServer(
            behave=lambda body, n: Behaviour(ttft=a.ttft, itl=a.itl), max_model_len=a.max_model_len
        )
        print(await srv.start(a.port), flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
