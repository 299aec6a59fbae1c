"""Request bodies read under caps: the bytes on the wire and the inflated body each at most `limit`.

The server runs with aiohttp's automatic decompression off, so a `Content-Encoding: gzip` (or
`deflate`) body is inflated here, in a thread (zlib lets go of the GIL) 1 MiB at a time, and
reading stops the moment either count passes the cap (413). A body that is not what
its encoding says is a 400, an unknown encoding a 415, a body that takes longer than `timeout`
to arrive a 408 (and the connection is closed). Nothing past the cap is ever held in memory.
The router reads a large body as sent and has `inflate_body` run in its parse process instead.
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


async def read_body(
    request: web.BaseRequest, limit: int, timeout: float | None = None, *, inflate: bool = True
) -> bytearray:
    """The whole body, inflated (a bytearray, or bytes when it was all there: no copy of a large body);
    RequestError 408 / 413 / 400 /
    415 as the module says. `inflate=False`: the bytes as sent, for `inflate_body` in a parse process."""
    enc = encoding_of(request)
    n = request.content_length
    if n is not None and n > limit:
        raise too_large(limit)
    content = request.content
    if (enc is None or not inflate) and n is not None and content.is_eof():
        return content.read_nowait()  # all of it arrived with the head (the usual small request)
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit, enc if inflate else None)
    except TimeoutError:
        raise BodyTimeout(timeout or 0) from None


def inflate_body(raw: bytes, enc: str | None, limit: int) -> bytes:
    """`raw` as sent with Content-Encoding `enc`, inflated under the same cap and errors as
    `read_body` (for a parse process, so a gzip bomb burns its CPU there, not the event loop's)."""
    if enc is None:
        return raw
    inflater = _Inflater(enc)
    out = b"".join(inflater.feed(raw, limit))
    if len(out) > limit:
        raise too_large(limit, "inflated request body")
    inflater.finish()
    return out


async def _read(request: web.BaseRequest, limit: int, enc: str | None) -> bytearray:
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
        for piece in await asyncio.to_thread(inflater.feed, chunk, limit - len(out)):
            out += piece
        if len(out) > limit:
            raise too_large(limit, "inflated request body")
    if inflater is not None:
        inflater.finish()
    return out


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

    def feed(self, data: bytes, room: int) -> list[bytes]:
        """The inflated pieces of `data`, stopping once they pass `room` bytes; RequestError 400 when
        it is not valid."""
        out: list[bytes] = []
        n = 0
        try:
            while data and n <= room:
                if self.d is None:
                    self.d, self.ended = self._new(data), False
                out.append(piece := self.d.decompress(data, PIECE))
                n += len(piece)
                while self.d.unconsumed_tail and n <= room:
                    out.append(piece := self.d.decompress(self.d.unconsumed_tail, PIECE))
                    n += len(piece)
                data = b""
                if self.d.eof:
                    self.ended, data = True, self.d.unused_data
                    if data and self.enc != "gzip":
                        raise RequestError("trailing bytes after the deflate stream", None, 400)
                    self.d = None
        except zlib.error:
            raise RequestError(f"the request body is not valid {self.enc} data", None, 400) from None
        return out

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
