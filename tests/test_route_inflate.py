"""The router inflates a compressed body in its parse process, not on the event loop: the same caps
and answers as reading it inflated (413 past the cap, 400 for bad or truncated gzip), in a real
spawned worker process."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from agentkv.gate.body import inflate_body
from agentkv.gate.errors import RequestError
from agentkv.gate.work import Offload

CAP = 1 << 20


def test_inflate_body_caps_and_errors():
    text = b'{"prompt": "' + b"a" * 5000 + b'"}'
    assert inflate_body(gzip.compress(text), "gzip", CAP) == text
    assert inflate_body(zlib.compress(text), "deflate", CAP) == text
    assert inflate_body(gzip.compress(text) * 2, "gzip", CAP) == text * 2  # members one after another
    assert inflate_body(b"plain", None, CAP) == b"plain"
    cases = [
        (gzip.compress(b"\0" * (CAP + 1)), "gzip", 413),  # a bomb: stops at the cap
        (b"not gzip at all", "gzip", 400),
        (gzip.compress(text)[:-12], "gzip", 400),  # truncated
        (zlib.compress(text) + b"junk", "deflate", 400),
    ]
    for raw, enc, status in cases:
        with pytest.raises(RequestError) as e:
            inflate_body(raw, enc, CAP)
        assert e.value.status == status, (enc, e.value.message)


def test_run_raw_inflates_in_the_worker_process():
    async def main():
        off = Offload(1, 1, 1)
        try:
            body = b"x" * 100_000
            assert await off.run_raw(len, gzip.compress(body), "gzip", CAP) == len(body)
            assert await off.run_raw(len, body, None, CAP) == len(body)
            with pytest.raises(RequestError) as e:
                await off.run_raw(len, gzip.compress(b"\0" * (4 * CAP)), "gzip", CAP)
            assert e.value.status == 413
            with pytest.raises(RequestError) as e:
                await off.run_raw(len, b"\x1f\x8b garbage", "gzip", CAP)
            assert e.value.status == 400
        finally:
            off.close()

    asyncio.run(main())
