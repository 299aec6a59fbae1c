"""The shared HTTP/1.1 response framing (gate/http1.py): how a body ends, and hostile or broken
input refused as FramingError; the bench's client turns that into a `reset`, never a traceback."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agentkv.bench.http1 import HttpError, _Exchange
from agentkv.gate.http1 import (
    MAX_HEAD_BYTES,
    ChunkDecoder,
    FramingError,
    head_end,
    parse_head,
    parse_request_head,
)


@pytest.mark.parametrize(
    "head, status, length, chunked, keep",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5", 200, 5, False, True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5", 200, None, True, True),
        (b"HTTP/1.1 200 OK", 200, None, False, False),  # to the close
        (b"HTTP/1.1 204 No Content", 204, 0, False, True),  # no body at all
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close", 200, 0, False, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2", 200, 2, False, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive", 200, 2, False, True),
    ],
)
def test_the_head_says_how_the_body_ends(head, status, length, chunked, keep):
    h = parse_head(head)
    assert (h.status, h.length, h.chunked, h.keep) == (status, length, chunked, keep)
    assert h.to_close == (length is None and not chunked)


@pytest.mark.parametrize(
    "head",
    [
        b"SSH-2.0-OpenSSH",
        b"HTTP/2 200",
        b"HTTP/1.1 abc OK",
        b"HTTP/1.1",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nContent-Length: lots",
    ],
)
def test_a_head_that_is_not_http1_is_refused(head):
    with pytest.raises(FramingError, match="not HTTP/1.x"):
        parse_head(head)


def test_the_request_head_parser_refuses_what_the_fast_path_does_not_take():
    routes = {b"/p": "handler"}
    ok = b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 3"
    assert parse_request_head(ok + b"\r\n", routes, 10)[1:] == (
        "/p",
        {"host": "h", "content-length": "3"},
        True,
        3,
    )
    assert parse_request_head(ok + b"\r\nConnection: close\r\n", routes, 10)[3] is False
    assert parse_request_head(ok + b"\r\nX-Api-Key:  k 1 \t\r\n", routes, 10)[2]["x-api-key"] == "k 1"
    h = parse_request_head(ok + b"\r\nX-Session-Id: a:B\tc\r\nX-Empty:\r\nCONTENT-length: 3\r\n", routes, 10)
    assert h is None  # Content-Length twice, in two spellings
    h = parse_request_head(ok + b" \r\nX-Session-Id: a:B\tc\r\nX-Empty:\r\n", routes, 10)[2]
    assert h == {"host": "h", "content-length": "3", "x-session-id": "a:B\tc", "x-empty": ""}
    for tail in (
        b"\r\nHost: h",  # a repeated header
        b"\r\nContent-Length: 3",
        b"\r\n folded",
        b"\r\nX: \x00",
        b"\nX: y",  # a bare LF
        b"\r\nX: y\r",
        b"\r\nExpect: 100-continue",
        b"\r\nContent-Encoding: gzip",
        b"\r\nTransfer-Encoding: chunked",
        b"\r\nX: \xff",
        b"\r\nBad Name: v",
        b"\r\nX(y): v",
        b"\r\nnocolon",
    ):
        assert parse_request_head(ok + tail + b"\r\n", routes, 10) is None, tail
    for head in (
        b"POST /p HTTP/1.0\r\nHost: h\r\nContent-Length: 3",
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 30",  # over max_body
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: -3",
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 0x3",
        b"POST /p HTTP/1.1\r\nHost: h",  # no length
        b"POST /p?q=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3",
        b"POST  /p HTTP/1.1\r\nHost: h\r\nContent-Length: 3",
        b"GET /p HTTP/1.1\r\nHost: h\r\nContent-Length: 3",
        b"POST /p HTTP/1.1\r\nContent-Length: 3",  # no Host
    ):
        assert parse_request_head(head + b"\r\n", routes, 10) is None, head


def test_an_endless_head_is_refused_once_past_the_cap():
    assert head_end(b"HTTP/1.1 200 OK\r\n" + b"x" * 100) == -1  # still arriving
    with pytest.raises(FramingError, match="too long"):
        head_end(b"x" * (MAX_HEAD_BYTES + 1))


def _decode(raw: bytes, step: int) -> tuple[bytes, ChunkDecoder]:
    dec, out = ChunkDecoder(), b""
    for i in range(0, len(raw), step):
        out += dec.feed(raw[i : i + step])
    return out, dec


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_chunk_decoding_ends_at_the_last_chunk_and_notes_bytes_after_it(step):
    out, dec = _decode(b"3\r\nabc\r\n2;ext=1\r\nde\r\n00\r\nX-T: 1\r\n\r\n", step)
    assert out == b"abcde" and dec.done and not dec.extra  # "00" is a last chunk too
    out, dec = _decode(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", step)
    assert out == b"abc" and dec.done and dec.extra  # the connection must not be reused


def test_chunks_decode_the_same_however_the_reads_are_cut():
    rng = random.Random(3)
    pieces = [b"data: x\n\n", b"a\r\nb", b"\r\n", b"\r", b"\n", b"z" * 300]
    for _ in range(300):
        datas = [b"".join(rng.choices(pieces, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 8))]
        ext = b";x=1" if rng.random() < 0.2 else b""
        raw = b"".join(b"%x%s\r\n%s\r\n" % (len(d), ext, d) for d in datas) + b"0\r\nT: 1\r\n\r\n"
        cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 6))))
        dec, out, prev = ChunkDecoder(), b"", 0
        for c in [*cuts, len(raw)]:
            out += dec.feed(raw[prev:c])
            prev = c
        assert (out, dec.done, dec.extra) == (b"".join(datas), True, False), (raw, cuts)


@pytest.mark.parametrize(
    "raw",
    [
        b"zz\r\nhello\r\n",  # not a chunk size
        b"-5\r\nhello\r\n",  # a negative one
        b"5\r\nhelloXX0\r\n\r\n",  # no CRLF after the data
        b"3\r\nabcd\r\n",  # more data than the size (the fast path must not take it)
        b"1" * (MAX_HEAD_BYTES + 10),  # a size line that never ends
    ],
)
def test_bad_chunk_framing_is_refused(raw):
    with pytest.raises(FramingError, match="bad chunk framing"):
        _decode(raw, len(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndata: x\n\n\r\n",
    ],
)
def test_the_bench_client_records_a_malformed_answer_as_a_reset(raw):
    loop = asyncio.new_event_loop()
    try:
        ex = _Exchange(lambda ps, now: None, time.perf_counter, loop.create_future())
        ex.feed(raw)
        ex.feed(b"more")  # bytes after the failure are ignored
        err = ex.done.exception()
        assert isinstance(err, HttpError) and err.kind == "reset" and "bad response" in str(err)
        assert ex.close  # the connection is not reused
    finally:
        loop.close()
