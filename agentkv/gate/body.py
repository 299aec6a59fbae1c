"""Request bodies read under caps: the bytes on the wire and the inflated body each at most `limit`.

The server runs with aiohttp's automatic decompression off, so a `Content-Encoding: gzip` (or
`deflate`) body is inflated here, at most 1 MiB at a time with the event loop let through between
pieces, and reading stops the moment either count passes the cap (413). A body that is not what
its encoding says is a 400, an unknown encoding a 415, a body that takes longer than `timeout`
to arrive a 408 (and the connection is closed). Nothing past the cap is ever held in memory.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from agentkv.gate.errors import RequestError
from agentkv.gate.web import error_response

PIECE = 1 << 20  # inflate at most this much per step
_ENCODINGS = {"": None, "identity": None, "gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}


class BodyTimeout(RequestError):
    """The body did not arrive in time: answer 408 and close the connection."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g} s", None, 408)

    def __reduce__(self):
        return (RequestError, (self.message, self.param, self.status, self.err_type))


def too_large(limit: int, what: str = "request body") -> RequestError:
    return RequestError(f"{what} exceeds the {limit}-byte limit", None, 413)


def encoding_of(request: web.BaseRequest) -> str | None:
    """'gzip', 'deflate' or None (identity); RequestError 415 for anything else."""
    enc = request.headers.get("Content-Encoding", "").strip().lower()
    if enc not in _ENCODINGS:
        raise RequestError(
            "Content-Encoding must be gzip, deflate or identity",
            "Content-Encoding",
            415,
            "UnsupportedMediaType",
        )
    return _ENCODINGS[enc]


def likely_large(request: web.BaseRequest, threshold: int) -> bool:
    """Whether the body may be `threshold` bytes or more once read (unknown length or compressed)."""
    n = request.content_length
    return n is None or n >= threshold or encoding_of(request) is not None


async def read_body(request: web.BaseRequest, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, inflated; RequestError 408 / 413 / 400 / 415 as the module says."""
    enc = encoding_of(request)
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit, enc)
    except TimeoutError:
        raise BodyTimeout(timeout or 0) from None


async def _read(request: web.BaseRequest, limit: int, enc: str | None) -> bytes:
    out = bytearray()
    inflater = _Inflater(enc) if enc else None
    raw = 0
    async for chunk in request.content.iter_any():
        raw += len(chunk)
        if raw > limit:
            raise too_large(limit)
        if inflater is None:
            out += chunk
            continue
        for piece in inflater.feed(chunk):
            out += piece
            if len(out) > limit:
                raise too_large(limit, "inflated request body")
            await asyncio.sleep(0)  # a bomb inflates a piece per loop turn, never in one go
    if inflater is not None:
        inflater.finish()
    return bytes(out)


class _Inflater:
    """gzip (members one after another) or deflate (zlib-wrapped or raw), inflated PIECE by PIECE."""

    def __init__(self, enc: str) -> None:
        self.enc = enc
        self.d: zlib._Decompress | None = None
        self.ended = True  # no stream open: every member so far ended where the data did

    def _new(self, first: bytes) -> zlib._Decompress:
        if self.enc == "gzip":
            return zlib.decompressobj(31)
        return zlib.decompressobj(15 if first[:1] and first[0] & 0x0F == 8 else -15)

    def feed(self, data: bytes):
        """Yield the inflated pieces of `data`; RequestError 400 when it is not valid."""
        while data:
            if self.d is None:
                self.d, self.ended = self._new(data), False
            try:
                piece = self.d.decompress(data, PIECE)
                yield piece
                while self.d.unconsumed_tail:
                    piece = self.d.decompress(self.d.unconsumed_tail, PIECE)
                    yield piece
            except zlib.error:
                raise RequestError(f"the request body is not valid {self.enc} data", None, 400) from None
            self.ended = self.d.eof
            data = b""
            if self.d.eof:
                data = self.d.unused_data
                if data and self.enc != "gzip":
                    raise RequestError("trailing bytes after the deflate stream", None, 400)
                self.d = None

    def finish(self) -> None:
        if not self.ended:
            raise RequestError(f"the {self.enc} request body is truncated", None, 400)


async def refuse_and_close(request: web.BaseRequest, e: RequestError) -> web.Response:
    """Send the error now and close the connection (a client that stalled mid-body gets no lingering)."""
    resp = error_response(e, {"Connection": "close"})
    await resp.prepare(request)
    await resp.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return resp
