"""The front of `agentkv serve --disagg prefill=P,decode=D`: one OpenAI endpoint over P prefill and D
decode workers, driving them as vLLM's disaggregated-serving proxy drives its NIXL workers
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): the request goes to a prefill worker
with `max_tokens: 1`, no streaming and `kv_transfer_params.do_remote_decode`; the `kv_transfer_params`
of its response go with the original request to a decode worker, whose response is the client's.

A session (`x-session-id` header, or the body's `session_id` / `user`) keeps its prefill worker, so
its prefix cache there counts (Dynamo's and llm-d's routers pick by cached prefix; a session is the
simple form of it); other requests and every decode go to the worker with the fewest in flight. A
prefill worker's refusal (4xx, 5xx) is the client's answer as it was sent.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Sequence

import aiohttp
import msgspec
from aiohttp import web

from agentkv.gate.body import BodyTimeout, read_body, refuse_and_close
from agentkv.gate.conn import base_url, make_runner, start_site
from agentkv.gate.errors import JSON, RequestError
from agentkv.gate.options import HttpLimits
from agentkv.gate.web import error_middleware, error_response

log = logging.getLogger("agentkv.serve")
_HANDOFF = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
_FORWARD = ("authorization", "x-request-id", "x-session-id", "content-type")


class _Pool:
    """Workers of one role: in-flight counts, fewest first (ties in turn)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.inflight = [0] * len(urls)
        self._turn = itertools.count()

    def pick(self, session: str | None = None) -> int:
        n = len(self.urls)
        if session is not None:
            return int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest()) % n
        start = next(self._turn) % n
        return min(((start + k) % n for k in range(n)), key=self.inflight.__getitem__)


class PDProxy:
    """The proxy's HTTP server: `await start()`, `await stop()`; prefill and decode worker base URLs."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], host: str, port: int, http: HttpLimits
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a disaggregated proxy needs at least one prefill and one decode worker")
        self.prefill, self.decode = _Pool(prefill), _Pool(decode)
        self.host, self.port, self.http = host, port, http
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=http.max_body_bytes, middlewares=[error_middleware])
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self._runner = make_runner(self.app, self.http)
        await self._runner.setup()
        await start_site(self._runner, self.host, self.port, self.http)
        self.port = self._runner.addresses[0][1]
        return base_url(self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._two_step(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._two_step(request, "/v1/chat/completions")

    async def _models(self, request: web.Request) -> web.Response:
        async with self.session.get(self.decode.urls[0] + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type=JSON)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _two_step(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = _object(await read_body(request, self.http.max_body_bytes, self.http.body_timeout))
        except BodyTimeout as e:
            return await refuse_and_close(request, e)
        except RequestError as e:
            return error_response(e)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        session = request.headers.get("x-session-id") or body.get("session_id") or body.get("user")
        p = self.prefill.pick(None if session is None else str(session))
        self.prefill.inflight[p] += 1
        try:
            async with self.session.post(
                self.prefill.urls[p] + path, json=_prefill_body(body), headers=headers
            ) as r:
                handoff = await r.read()
                if r.status != 200:
                    return web.Response(body=handoff, status=r.status, content_type=JSON)
        finally:
            self.prefill.inflight[p] -= 1
        params = msgspec.json.decode(handoff).get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
        return await self._decode(request, path, body, headers)

    async def _decode(self, request: web.Request, path: str, body: dict, headers: dict) -> web.StreamResponse:
        """The decode worker's response, streamed through as it comes."""
        d = self.decode.pick()
        self.decode.inflight[d] += 1
        try:
            async with self.session.post(self.decode.urls[d] + path, json=body, headers=headers) as r:
                ctype = r.headers.get("content-type", JSON)
                resp = web.StreamResponse(status=r.status, headers={"Content-Type": ctype})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            self.decode.inflight[d] -= 1


def _object(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 naming what is wrong."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _prefill_body(body: dict) -> dict:
    """The prefill's request: one output token, not streamed, asking for the KV hand-off."""
    out = {
        k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(_HANDOFF))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out
