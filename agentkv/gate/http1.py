"""HTTP/1.1 response framing without I/O: the head (status line, headers, how the body ends) and the
chunked transfer decoding. One home for both clients: the router's (gate/upstream.py) and the
bench's streaming client (bench/http1.py); each keeps its own I/O, buffering and body handling.
"""

from __future__ import annotations

from itertools import repeat

MAX_HEAD_BYTES = 1 << 16  # a response head (or a chunk-size line) longer than this is refused


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


def whole_chunks(data: bytes) -> bytes | None:
    """Fast path: `data` is whole non-final chunks without CRLF inside (one SSE event each, as
    servers send them): their joined payloads, checked against the sizes; else None."""
    parts = data.split(b"\r\n")
    if not len(parts) & 1 or parts[-1]:
        return None
    sizes, datas = parts[0:-1:2], parts[1::2]
    try:  # compared in C (map), not in a Python loop: this runs once per read
        lens = list(map(len, datas))
        if 0 in lens or lens != list(map(int, sizes, repeat(16))):
            return None
    except ValueError:  # chunk extensions: the slow path reads them
        return None
    return b"".join(datas)


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
        if self.done:
            self.extra = self.extra or bool(data)
            return b""
        if not self.buf and not self.left:
            body = whole_chunks(data)
            if body is not None:
                return body
        return self._feed(self.buf + data if self.buf else data)

    def _feed(self, buf: bytes) -> bytes:
        pos, n, left, out = 0, len(buf), self.left, []
        find, append = buf.find, out.append
        while pos < n:
            if left > 0:
                end = min(pos + left, n)
                append(buf[pos:end])
                left -= end - pos
                pos = end
                if not left:
                    left = -1
                continue
            end = find(b"\r\n", pos)
            if end < 0:
                if n - pos > MAX_HEAD_BYTES:
                    raise FramingError("bad chunk framing: a line too long")
                break
            if left == -1:  # the CRLF closing a chunk
                if end != pos:
                    raise FramingError("bad chunk framing: no CRLF after a chunk's data")
                left = 0
            elif left == -2:  # trailers, up to an empty line
                if end == pos:
                    self.done, self.extra = True, end + 2 < n
                    pos = n
                    break
            else:
                left = _chunk_size(buf[pos:end]) or -2
            pos = end + 2
        self.left = left
        self.buf = buf[pos:] if pos < n else b""
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (hex, chunk extensions after ';' ignored)."""
    try:
        size = int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise FramingError(f"bad chunk framing: size line {line[:40]!r}") from None
    if size < 0:
        raise FramingError(f"bad chunk framing: size line {line[:40]!r}")
    return size
