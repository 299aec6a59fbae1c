"""The error shape at the HTTP level: `error_response` renders a RequestError, `error_middleware` gives
aiohttp's own refusals (404, 405, 413 ...) the same JSON body, `quiet_probes` keeps unparsable
requests (bad request lines, HTTP/2 and gRPC probes) from logging tracebacks."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from agentkv.gate.errors import JSON, RequestError, error_body

log = logging.getLogger("agentkv.gate")


def error_response(e: RequestError, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=error_body(e.message, e.err_type, e.status, e.param),
        status=e.status,
        content_type=JSON,
        headers=headers,
    )


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own HTTP errors (unknown path, wrong method, body too large) in the JSON shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        return error_response(RequestError(e.reason or "error", None, e.status), headers)


class QuietProbes(logging.Filter):
    """Drop aiohttp's traceback for unparsable requests (bad request lines, HTTP/2 and gRPC probes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            log.debug("answered 400 to a request that is not HTTP/1.1 (%s)", str(exc).split(":", 1)[0])
            return False
        return True


_quiet = QuietProbes()


def quiet_probes() -> None:
    """Install the filter on aiohttp's server logger (once)."""
    logging.getLogger("aiohttp.server").addFilter(_quiet)
