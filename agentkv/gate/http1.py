"""HTTP/1.1 head parsing and framing without I/O: a response's head (status line, headers, how the
body ends) and chunked transfer decoding, for both clients (the router's gate/upstream.py and the
bench's bench/http1.py), and the request heads the server's fast path takes (gate/fastpath.py).
Each caller keeps its own I/O, buffering and body handling.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import repeat
from typing import TypeVar

MAX_HEAD_BYTES = 1 << 16  # a response head (or a chunk-size line) longer than this is refused


# request header lines the fast path takes: a token, a colon, printable ASCII or tabs, CRLF (no obs-fold)
_STRICT_FIELDS = re.compile(rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[\t\x20-\x7e]*\r\n)*").fullmatch
# (name, value) of each line _STRICT_FIELDS passed; greedy, so no backtracking (trailing blanks: rstrip)
_FIELD = re.compile(r"([^:\r\n]+):[ \t]*([^\r]*)\r\n").findall
_REFUSE = frozenset({"transfer-encoding", "expect", "upgrade", "content-encoding"})
T = TypeVar("T")


class FramingError(ValueError):
    """The bytes are not an HTTP/1.x response: a bad status line, Content-Length or chunk framing."""


class Head:
    """A parsed response head. The body ends after `length` bytes (Content-Length, or 0 for a
    204/304/1xx), with the last chunk (`chunked`), or when the connection closes (`to_close`)."""

    __slots__ = ("status", "content_type", "length", "chunked", "keep")

    def __init__(self, status: int, content_type: str, length: int | None, chunked: bool, keep: bool):
        self.status, self.content_type, self.length = status, content_type, length
        self.chunked, self.keep = chunked, keep  # keep: the server keeps the connection alive

    @property
    def to_close(self) -> bool:
        return not self.chunked and self.length is None


def head_end(buf: bytes) -> int:
    """Where the head in `buf` ends (its blank line's index), -1 while incomplete; FramingError when
    it has grown past MAX_HEAD_BYTES without ending."""
    end = buf.find(b"\r\n\r\n")
    if end < 0 and len(buf) > MAX_HEAD_BYTES:
        raise FramingError("the response head is too long")
    return end


def parse_head(head: bytes) -> Head:
    """The status line and headers before the blank line; FramingError when they are not HTTP/1.x."""
    try:
        return _parse_head(head.decode("latin-1"))
    except (ValueError, IndexError):
        raise FramingError("the response is not HTTP/1.x") from None


def _parse_head(text: str) -> Head:
    first, _, rest = text.partition("\r\n")
    version, status = first.split(" ", 2)[:2]
    if not version.startswith("HTTP/1."):
        raise ValueError(version)
    ctype, length, chunked, close = "application/octet-stream", None, False, version == "HTTP/1.0"
    for line in rest.split("\r\n"):
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-type":
            ctype = value.split(";", 1)[0].strip().lower() or ctype
        elif name == "content-length":
            length = int(value)
            if length < 0:
                raise ValueError(length)
        elif name == "transfer-encoding":
            chunked = value.strip().lower().endswith("chunked")
        elif name == "connection":
            v = value.lower()
            close = "close" in v if version != "HTTP/1.0" else "keep-alive" not in v
    code = int(status)
    if chunked:
        length = None
    elif length is None and (code in (204, 304) or code < 200):
        length = 0
    elif length is None:
        close = True  # the body ends when the connection closes
    return Head(code, ctype, length, chunked, not close)


def parse_request_head(head: bytes, routes: Mapping[bytes, T], max_body: int):
    """(route's value, path, headers, keep-alive, body length) for a request head (up to its blank
    line, every line ending in CRLF) that a lean server path takes: POST to one of `routes`, HTTP/1.1,
    header lines of `token: printable ASCII`, Host, each name once, a Content-Length up to `max_body`,
    no Transfer-Encoding, Expect, Upgrade or Content-Encoding. None for anything else (the caller
    hands it to a full server). Header names lower-cased, values without surrounding blanks; the
    checks run in C (regular expressions, str methods), not per byte in Python."""
    line = head.find(b"\r\n")
    parts = head[:line].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    route = routes.get(parts[1])
    if route is None or not _STRICT_FIELDS(head, line + 2):
        return None  # another route, or a field that is not `token: printable ASCII`
    pairs = _FIELD(head.decode("latin-1"), line + 2)
    headers = {k.lower(): v.rstrip(" \t") for k, v in pairs}
    if len(headers) != len(pairs) or not _REFUSE.isdisjoint(headers):
        return None  # a repeated header (smuggling's favourite) or framing a full server reads
    n = headers.get("content-length", "")
    if "host" not in headers or not n.isdigit() or len(n) > 12 or int(n) > max_body:
        return None
    keep = "close" not in headers.get("connection", "").lower()
    return route, parts[1].decode(), headers, keep, int(n)


def whole_chunks(data: bytes) -> tuple[bytes, bytes] | None:
    """Fast path: `data` begins with whole non-final chunks without CRLF inside (one SSE event
    each, as servers send them): their joined payloads, checked against the sizes, and the bytes
    after them (a chunk cut by the read, the last chunk); else None."""
    parts = data.split(b"\r\n")
    k = (len(parts) - 1) & ~1  # parts that form whole (size, data) pairs, each followed by a CRLF
    datas = parts[1:k:2]
    lens = list(map(len, datas))
    if 0 in lens:  # the last chunk (or an empty line): the slow path reads from there
        k = 2 * lens.index(0)
        datas, lens = datas[: k // 2], lens[: k // 2]
    if not k:
        return None
    try:  # compared in C (map), not in a Python loop: this runs once per read
        if lens != list(map(int, parts[0:k:2], repeat(16))):
            return None  # a CRLF inside a chunk's data (its first piece never matches its size)
    except ValueError:  # chunk extensions: the slow path reads them
        return None
    rest = parts[k:]
    return b"".join(datas), rest[0] if len(rest) == 1 else b"\r\n".join(rest)


class ChunkDecoder:
    """De-frames a chunked body fed in pieces as they arrive. `feed` returns the data bytes; `done`
    once the last chunk and its trailers are in; `extra` when bytes followed them (the connection
    must not be reused). FramingError on bad framing."""

    __slots__ = ("buf", "left", "done", "extra")

    def __init__(self) -> None:
        self.buf = b""  # framing bytes not yet complete (a size line, a CRLF, trailers)
        self.left = 0  # > 0: data owed of the current chunk; -1: its CRLF; -2: trailers; 0: a size line
        self.done = self.extra = False

    def feed(self, data: bytes) -> bytes:
        if not self.left and not self.buf:  # at a chunk-size line
            fast = whole_chunks(data)
            if fast is not None:
                if not fast[1]:
                    return fast[0]  # the common case: a read of whole chunks
                return self._feed(fast[1], [fast[0]], False)
            return self._feed(data, [], False)
        return self._feed(self.buf + data if self.buf else data, [], True)

    def _feed(self, buf: bytes, out: list[bytes], fast: bool) -> bytes:
        """The general case (`fast`: the fast path may still apply once open data is done)."""
        if self.done:
            self.extra = self.extra or bool(buf)
            return b""
        i = self._owed(buf, out) if self.left else 0
        if not self.left:  # at a chunk-size line
            rest = whole_chunks(buf[i:] if i else buf) if fast else None
            if rest is not None:
                out.append(rest[0])
                buf, i = rest[1], 0
            i, self.left = _whole(buf, i, out)
        if self.left == -2:
            i = self._trailers(buf, i)
        self.buf = buf[i:] if i < len(buf) else b""
        return out[0] if len(out) == 1 else b"".join(out)

    def _owed(self, buf: bytes, out: list[bytes]) -> int:
        """Finish what an earlier read left open: a chunk's data, then its CRLF; where that ends."""
        i, left = 0, self.left
        if left > 0:
            i = min(left, len(buf))
            out.append(buf[:i])
            left -= i
            if left:
                self.left = left
                return i
            left = -1
        if left == -1:
            if len(buf) - i < 2:
                self.left = -1
                return i
            if buf[i : i + 2] != b"\r\n":
                raise FramingError("bad chunk framing: no CRLF after a chunk's data")
            i, left = i + 2, 0
        self.left = left
        return i

    def _trailers(self, buf: bytes, i: int) -> int:
        """Skip trailer lines up to the empty one that ends the body; where reading stopped."""
        n = len(buf)
        while True:
            j = buf.find(b"\r\n", i)
            if j < 0:
                if n - i > MAX_HEAD_BYTES:
                    raise FramingError("bad chunk framing: a trailer too long")
                return i
            if j == i:
                self.done, self.extra = True, j + 2 < n
                return n
            i = j + 2


def _whole(buf: bytes, i: int, out: list[bytes]) -> tuple[int, int]:
    """Chunks from `i` on (size line, data, CRLF), their data appended to `out`; returns where
    reading stopped and the decoder's state there (ChunkDecoder.left)."""
    n, find, append = len(buf), buf.find, out.append
    while True:
        j = find(b"\r\n", i)
        if j < 0:
            if n - i > MAX_HEAD_BYTES:
                raise FramingError("bad chunk framing: a line too long")
            return i, 0
        try:
            size = int(buf[i:j], 16)
        except ValueError:  # a chunk extension (";name=value"), or not a size at all
            size = _chunk_size(buf[i:j])
        if size <= 0:
            if size:
                raise FramingError(f"bad chunk framing: size line {buf[i:j][:40]!r}")
            return j + 2, -2  # the last chunk; trailers (if any) end with an empty line
        start = j + 2
        stop = start + size
        if stop + 2 > n:  # this chunk (or its closing CRLF) continues in a later read
            if stop <= n:
                append(buf[start:stop])
                return stop, -1
            append(buf[start:])
            return n, stop - n
        if buf[stop : stop + 2] != b"\r\n":
            raise FramingError("bad chunk framing: no CRLF after a chunk's data")
        append(buf[start:stop])
        i = stop + 2


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (hex, chunk extensions after ';' ignored)."""
    try:
        size = int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise FramingError(f"bad chunk framing: size line {line[:40]!r}") from None
    if size < 0:
        raise FramingError(f"bad chunk framing: size line {line[:40]!r}")
    return size
