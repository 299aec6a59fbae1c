"""The workers' /v1/models: answered to clients from a healthy worker, and read for the context
length (`max_model_len`) that bounds the router's hashing work."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from agentkv.gate.errors import RequestError
from agentkv.gate.web import error_response
from agentkv.route.forward import CONNECT_ERRORS

if TYPE_CHECKING:
    from agentkv.route.proxy import Router

log = logging.getLogger("agentkv.route")


async def models(router: Router, request: web.Request) -> web.StreamResponse:
    """The first healthy worker's /v1/models, as it answered (401 without a valid key)."""
    if router.tenants.authenticate(request.headers) is None:
        router.stats.unauthorized += 1
        return error_response(RequestError("missing or invalid API key", None, 401, "AuthenticationError"))
    for w in router.pool.healthy():
        try:
            async with router.session.get(w.spec.url + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except CONNECT_ERRORS:
            continue
    return error_response(RequestError("no healthy worker", None, 503, "ServiceUnavailableError"))


async def learn_max_model_len(router: Router) -> None:
    """The largest `max_model_len` the workers' /v1/models report (vLLM's and agentkv serve's
    card carry it): the bound on hashing work. Asked every second or so until one answers."""
    while True:
        found = []
        for w in router.pool.workers:
            try:
                async with router.session.get(
                    w.spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    cards = (await r.json()).get("data") or []
                found += [c["max_model_len"] for c in cards if type(c.get("max_model_len")) is int]
            except (aiohttp.ClientError, *CONNECT_ERRORS, ValueError, AttributeError, TypeError):
                continue
        if found:
            router.max_model_len, router.max_model_len_known = max(found), True
            log.info("prompts over %d tokens (the workers' max_model_len) are refused", max(found))
            return
        await asyncio.sleep(1)
