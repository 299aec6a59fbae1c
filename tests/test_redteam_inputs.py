"""The red team's malformed inputs (issue #18), replayed over real HTTP against real `agentkv serve`
and `agentkv route` processes: 43 hand-made bodies and 12 raw requests per server (JSON nested
1,000 deep, gzip that is not, bombs, huge numbers and ids, header injection, HTTP/2 preludes,
duplicate Content-Length ...), then 2,000 hypothesis bodies sent plain, gzip'd, deflated,
corrupted or mislabelled. Every answer is below 500, and no process logs a traceback or an ERROR.
"""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import pytest
from cluster import Cluster
from fuzzutil import count, fuzz_settings, report
from hypothesis import given
from hypothesis import strategies as st
from redteam import BAD_LOG, gzip_text_body, red_cluster
from test_fuzz_http import MARK, bodies


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    report(request.config, "redteam ")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with red_cluster(tmp_path_factory.mktemp("redteam-inputs")) as c:
        yield c


def _gz(b: bytes) -> bytes:
    return gzip.compress(b)


HAND: list[tuple[str, bytes, dict]] = [  # (path, body, extra headers)
    ("/v1/completions", b'{"x":' + b"[" * 1000 + b"]" * 1000 + b', "prompt": "hi"}', {}),
    ("/v1/completions", b'{"x":' + b"{" * 5000, {}),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 300 + b"]" * 300 + b"}", {}),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Encoding": "gzip"}),
    ("/v1/completions", _gz(b'{"prompt": "hi"}')[:-6], {"Content-Encoding": "gzip"}),
    ("/v1/completions", _gz(b'{"prompt": "hi"}') + b"\x00junk", {"Content-Encoding": "gzip"}),
    ("/v1/completions", zlib.compress(b'{"prompt": "hi"}')[:-3], {"Content-Encoding": "deflate"}),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Encoding": "br"}),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Encoding": "gzip, identity"}),
    ("/v1/completions", gzip_text_body(40), {"Content-Encoding": "gzip"}),
    ("/v1/completions", _gz(b"[" * 100_000), {"Content-Encoding": "gzip"}),
    ("/v1/completions", b"", {}),
    ("/v1/completions", b"null", {}),
    ("/v1/completions", b'"just a string"', {}),
    ("/v1/completions", b"\xef\xbb\xbf{}", {}),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', {}),
    ("/v1/completions", b'{"prompt": "\\ud800"}', {}),
    ("/v1/completions", b'{"prompt": [1e999]}', {}),
    ("/v1/completions", b'{"prompt": NaN}', {}),
    ("/v1/completions", b'{"prompt": [' + b"9" * 5000 + b"]}", {}),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", {}),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', {}),
    ("/v1/completions", b'{"prompt": "hi", "session_id": "a\\r\\nX-Injected: 1"}', {}),
    ("/v1/completions", b'{"prompt": "hi", "session_id": "' + b"s" * 100_000 + b'"}', {}),
    ("/v1/completions", b'{"prompt": "hi", "model": "' + b"m" * 100_000 + b'"}', {}),
    ("/v1/completions", b'{"prompt": "hi", "cache_salt": "a/b"}', {}),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', {}),
    ("/v1/completions", b'{"prompt": "hi", "prompt": [1, 2]}', {}),
    ("/v1/completions", b'{"prompt": ' + json.dumps(list(range(10_000))).encode() + b"}", {}),
    ("/v1/completions", b'{"prompt": "' + b"<|" + b"a" * 200_000 + b'|>"}', {}),
    ("/v1/completions", b'{"prompt": "' + b"ba" * 300_000 + b'"}', {}),
    ("/v1/completions", b'{"prompt": "' + b"!" * 1_000_000 + b'"}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "tool_calls": {"a": 1}}]}', {}),
    ("/v1/chat/completions", b'{"messages": "hi"}', {}),
    ("/v1/chat/completions", b'{"messages": [null]}', {}),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}),
    ("/v1/completions", b'{"prompt": "hi"}', {"X-Session-Id": "s" * 4000}),
    ("/tokenize", b'{"prompt": "' + b"word " * 200_000 + b'"}', {}),
    ("/tokenize", b'{"messages": [{"role": "user", "tool_calls": 5}]}', {}),
    ("/detokenize", b'{"tokens": ' + json.dumps(list(range(20_000))).encode() + b"}", {}),
    ("/detokenize", b'{"tokens": [-1]}', {}),
    ("/v1/nope", b"{}", {}),
]

RAW = [  # whole requests on a socket
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(300)) + b"\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 20_000 + b"\r\n\r\n",
    b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Encoding: gzip\r\n\r\n{}",
]


def _raw_status(port: int, data: bytes) -> int:
    """The status of the first answer to `data`; 0 when the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        head = b""
        try:
            while b"\r\n" not in head and (chunk := s.recv(4096)):
                head += chunk
        except ConnectionResetError:
            pass
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _send(url: str, path: str, body: bytes, headers: dict, key: str | None) -> int:
    import urllib.error
    import urllib.request

    h = {"Content-Type": "application/json", **headers}
    if key:
        h["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + path, data=body, headers=h), timeout=60
        ) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        out = e.read()
        assert MARK.encode() not in out
        return e.code


def _targets(c: Cluster):
    return (
        ("serve", c.worker_url(0), c.http[0], None),
        ("router", c.router_url(), c.router_ports[0], "key-a"),
    )


def test_hand_made_adversarial_inputs_get_4xx(live):
    for name, url, port, key in _targets(live):
        for path, body, headers in HAND:
            if name == "router" and path in ("/tokenize", "/detokenize"):
                path = "/v1/completions"
            status = _send(url, path, body, headers, key)
            assert status < 500, (name, path, headers, body[:80], status)
            count(f"redteam inputs-{name}", str(status))
        for data in RAW:
            status = _raw_status(port, data)
            assert status < 500, (name, data[:60], status)
            count(f"redteam inputs-{name}", f"raw {status}")


ENCODINGS = ["none", "none", "gzip", "deflate", "gzip-corrupt", "says-gzip"]


def _encode(body: bytes, how: str, flip: int) -> tuple[bytes, dict]:
    if how == "gzip":
        return gzip.compress(body), {"Content-Encoding": "gzip"}
    if how == "deflate":
        return zlib.compress(body), {"Content-Encoding": "deflate"}
    if how == "gzip-corrupt":
        z = bytearray(gzip.compress(body))
        z[flip % len(z)] ^= 0x5A
        return bytes(z), {"Content-Encoding": "gzip"}
    if how == "says-gzip":
        return body, {"Content-Encoding": "gzip"}
    return body, {}


@given(
    body=bodies(),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    how=st.sampled_from(ENCODINGS),
    flip=st.integers(0, 1 << 16),
    via_router=st.booleans(),
)
@fuzz_settings(2000)
def test_fuzzed_inputs_over_http_never_5xx(live, body, path, how, flip, via_router):
    name, url, _, key = _targets(live)[1 if via_router else 0]
    if via_router and path in ("/tokenize", "/detokenize"):
        path = "/v1/completions"
    data, headers = _encode(body, how, flip)
    status = _send(url, path, data, headers, key)
    assert status < 500, (name, path, how, body[:200], status)
    count(f"redteam inputs-{name}", str(status))


def test_no_traceback_or_error_in_any_log(live):
    """After the inputs above (file order): every process's output holds no traceback, no ERROR."""
    bad = {
        n: [ln for ln in live.procs.output(n).splitlines() if any(b in ln for b in BAD_LOG)]
        for n in live.procs.procs
    }
    assert not any(bad.values()), {k: v[:5] for k, v in bad.items()}
    for name in ("router", "worker0"):
        assert live.procs.procs[name].poll() is None
