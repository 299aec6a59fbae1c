"""The bench client against a real local streaming server: token timing, usage, and every failure kind."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from agentkv.bench.client import BenchClient, StreamResult, _sse_reader, classify_http_error, normalize_target
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.errors import UserError


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["http1", "aiohttp"])
def transport(request):
    """Every streaming test runs on both transports: the same results through either."""
    return request.param


async def _one(
    behave=None,
    *,
    max_tokens=5,
    prompt=None,
    api="completions",
    timeout=30.0,
    max_model_len=1 << 20,
    repeat=1,
    transport="http1",
):
    async with (
        StreamTestServer(behave=behave, max_model_len=max_model_len) as srv,
        BenchClient(srv.url, api=api, timeout=timeout, transport=transport) as c,
    ):
        p = prompt if prompt is not None else list(range(100, 164))
        if api == "chat":
            p = "hello there " * 20
        body = c.body("test-model", p, max_tokens)
        out = [await c.stream(body) for _ in range(repeat)]
        return out, srv


def test_tokens_are_timed_one_by_one(transport):
    (res,), srv = _run(_one(lambda b, n: Behaviour(itl=0.02), max_tokens=6, transport=transport))
    assert res.ok and res.error == ""
    assert res.output_tokens == 6 and len(res.token_times) == 6
    gaps = [b - a for a, b in zip(res.token_times, res.token_times[1:], strict=False)]
    assert all(g >= 0.015 for g in gaps), gaps  # the server sleeps 20 ms between tokens
    assert res.sent <= res.token_times[0] <= res.end
    assert res.prompt_tokens == 64
    body = srv.seen[0]
    assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True}


def test_cached_tokens_reported_on_repeat(transport):
    (first, second), _ = _run(_one(repeat=2, transport=transport))
    assert first.cached_tokens == 0
    assert second.cached_tokens == 64


def test_chat_api_streams_deltas(transport):
    (res,), srv = _run(_one(api="chat", max_tokens=4, transport=transport))
    assert res.ok and res.output_tokens == 4 and len(res.token_times) == 4
    assert "messages" in srv.seen[0]


@pytest.mark.parametrize(
    "behave, reason",
    [
        (lambda b, n: Behaviour(status=500), "http_500"),
        (lambda b, n: Behaviour(status=429), "http_429"),
        (lambda b, n: Behaviour(reset_after=3), "reset"),
    ],
)
def test_failures_are_reported_not_raised(behave, reason, transport):
    (res,), _ = _run(_one(behave, max_tokens=8, transport=transport))
    assert not res.ok
    assert res.error == reason
    assert res.end >= res.sent
    if reason == "reset":
        assert len(res.token_times) == 3  # the tokens before the reset were still timed


def test_context_overflow_is_classified(transport):
    (res,), _ = _run(_one(max_tokens=8, max_model_len=32, transport=transport))
    assert not res.ok and res.error == "context_overflow" and res.status == 400
    assert "maximum context length" in res.detail


def test_timeout(transport):
    (res,), _ = _run(_one(lambda b, n: Behaviour(hang=True), timeout=0.3, transport=transport))
    assert not res.ok and res.error == "timeout"
    assert res.end - res.sent >= 0.25


def test_connection_refused_is_a_failed_request(transport):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def go():
        async with BenchClient(f"http://127.0.0.1:{port}", transport=transport) as c:
            return await c.stream(c.body("m", [1, 2, 3], 2))

    res = _run(go())
    assert not res.ok and res.error == "connect_error"


def test_down_target_gives_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with BenchClient(f"http://127.0.0.1:{port}/v1/") as c:
            await c.models()

    with pytest.raises(UserError, match=rf"target http://127.0.0.1:{port} is not reachable"):
        _run(go())


def test_raw_token_prompt_is_sent_verbatim(transport):
    async def go():
        async with StreamTestServer() as srv, BenchClient(srv.url, transport=transport) as c:
            await c.stream(c.body("test-model", msgspec.Raw(b"[7,8,9]"), 2, {"cache_salt": "s"}))
            return srv.seen[0]

    body = _run(go())
    assert body["prompt"] == [7, 8, 9] and body["cache_salt"] == "s"


def test_helpers():
    assert normalize_target("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_target("https://x.example/") == "https://x.example"
    assert (
        classify_http_error(400, "This model's maximum context length is 8192 tokens") == "context_overflow"
    )
    assert classify_http_error(400, "max_model_len exceeded") == "context_overflow"
    assert classify_http_error(400, "bad temperature") == "http_400"
    assert classify_http_error(503, "context length") == "http_503"
    with pytest.raises(UserError, match="--api"):
        BenchClient("http://x", api="embeddings")
    with pytest.raises(UserError, match="transport"):
        BenchClient("http://x", transport="h2")


def test_engine_times_are_read_and_a_malformed_object_is_ignored():
    """agentkv serve's `agentkv` object (its own clock) is kept; another shape is no failure."""
    good = {"clock": "engine", "arrival": 5.0, "first_token": 5.1, "end": 5.3, "token_times": [0.1, 0.2, 0.3]}
    cases = [(good, 0.1), ({"clock": "engine", "arrival": "soon"}, None), ([1, 2], None), (None, None)]
    for obj, ttft in cases:
        res = StreamResult()
        on_lines, _ = _sse_reader(res)
        usage = {"prompt_tokens": 4, "completion_tokens": 3}
        last = {"choices": [], "usage": usage, **({"agentkv": obj} if obj is not None else {})}
        on_lines([b'{"choices":[{"text":"a"}]}', msgspec.json.encode(last), b"[DONE]"], 1.0)
        assert res.ok and res.output_tokens == 3, res
        assert (res.engine.token_times[0] if res.engine else None) == ttft
