"""Fuzzing the HTTP request parsing of `agentkv serve` and `agentkv route`: arbitrary bodies, arbitrary
JSON, and mutations of valid completion and chat requests. Fast through the parser functions
(serve's `parse_completion` / `parse_chat`; the router's whole request path (`_limited`) up to the forward),
then fewer through real HTTP to real subprocesses. Each body gets a clear answer (a request or
a 4xx), never a 5xx or an exception; error messages never quote the prompt; servers stay up and
their memory flat.
"""

from __future__ import annotations

import asyncio
import json
import math

import msgspec
import pytest
from cluster import Cluster, post, tenant_flags, write_keys
from fuzzutil import byte_mutation, count, fuzz_settings, json_mutation, json_values, note, report, rss_bytes
from hypothesis import given
from hypothesis import strategies as st

from agentkv.gate.options import HttpLimits
from agentkv.route.proxy import Router, RouterConfig
from agentkv.route.workers import WorkerSpec
from agentkv.serve.protocol import GenRequest, Limits, RequestError, parse_chat, parse_completion

MARK = "Qzvx7marker"
LIMITS = Limits(("llama3-8b",), 4096, 128256)
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
REQUEST_KEYS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "include_usage",
    "continuous_usage_stats",
    "n",
    "best_of",
    "cache_salt",
    "model",
    "role",
    "content",
    "type",
    "text",
    "name",
    "tool_calls",
    "function",
    "arguments",
    "tool_call_id",
    "session_id",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "temperature",
    "stop",
    "ignore_eos",
    "logprobs",
    "seed",
    "tools",
    "tool_choice",
]
VALID = [
    {"prompt": f"hello {MARK} world", "max_tokens": 8},
    {
        "prompt": [11, 12, 13, 14] * 8,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    {"prompt": [[5, 6, 7]], "max_tokens": 2, "cache_salt": "abc", "session_id": "s1", "model": "llama3-8b"},
    {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {MARK}"}],
        "max_completion_tokens": 3,
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": MARK}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": MARK}}
                ],
            },
            {"role": "tool", "content": MARK, "tool_call_id": "c1"},
        ],
        "stream": True,
    },
]


@st.composite
def bodies(draw) -> bytes:
    """A request body: a mutated valid request (mostly), arbitrary JSON, or mutated bytes."""
    kind = draw(st.sampled_from(["json-mutation"] * 4 + ["json", "bytes"]))
    base = draw(st.sampled_from(VALID))
    if kind == "json-mutation":
        doc = base
        for _ in range(draw(st.integers(1, 2))):
            doc = draw(json_mutation(doc, REQUEST_KEYS))
        return json.dumps(doc).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    return draw(byte_mutation(json.dumps(base).encode()))


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    report(request.config, "http ")


# -- serve's parsers --------------------------------------------------------------------------------
def _check_gen(g: GenRequest) -> None:
    assert g.prompt_ids and all(0 <= t < LIMITS.vocab_size for t in g.prompt_ids)
    assert g.max_tokens >= 1 and len(g.prompt_ids) + g.max_tokens <= LIMITS.max_model_len


@given(body=bodies(), chat=st.booleans())
@fuzz_settings(250)
def test_serve_parsers_accept_or_refuse_with_a_4xx(body, chat):
    try:
        g = (parse_chat if chat else parse_completion)(body, LIMITS)
    except RequestError as e:
        assert 400 <= e.status < 500
        assert MARK not in e.message  # never the prompt
        count("http serve-parsers", f"{e.status}")
        return
    _check_gen(g)
    count("http serve-parsers", "accepted")


# -- the router's request path, up to the forward ----------------------------------------------------
class _Req:
    """The parts of an aiohttp request that `Router._limited` reads."""

    def __init__(self, body: bytes, headers: dict, path: str) -> None:
        self.headers, self.path = headers, path
        self.content_length = len(body)
        self.content = _Content(body)


class _Content:
    def __init__(self, body: bytes) -> None:
        self.body = body

    async def iter_any(self):
        yield self.body

    def is_eof(self) -> bool:  # as a body still arriving: read_body takes its read loop
        return False


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-fuzz")
    r = Router(
        RouterConfig(
            workers=[
                WorkerSpec("http://127.0.0.1:9"),
                WorkerSpec("http://127.0.0.1:10", "tcp://127.0.0.1:11"),
            ],
            api_keys=str(write_keys(tmp, KEYS)),
            secret="s",
            tokenizer="builtin",
            http=HttpLimits(parse_processes=0),
        )
    )
    forwarded: list[bytes] = []

    async def forward(sink, w, path, payload, headers, load):
        forwarded.append(payload)
        load.first_byte()  # as the real one does
        # while this request is in flight, another tenant's routing must still work
        r.choose("tenant-b", r.hasher.hash({"prompt": [1, 2, 3] * 16}, False, None), "", set())
        sink.begin(200, "application/json", 0)

    r._forward = forward
    loop = asyncio.new_event_loop()
    yield _Harness(r, loop, forwarded)
    loop.close()


class _Harness:
    def __init__(self, router: Router, loop, forwarded: list[bytes]) -> None:
        self.router, self.loop, self.forwarded = router, loop, forwarded

    def __repr__(self) -> str:  # hypothesis prints fixtures of a failing case: keep it short
        return f"<router harness, {len(self.forwarded)} forwarded>"


@given(body=bodies(), chat=st.booleans(), key=st.sampled_from(["key-a", "key-b", "nope", None]))
@fuzz_settings(250)
def test_router_request_path_never_fails(router, body, chat, key):
    r, loop, forwarded = router.router, router.loop, router.forwarded
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    n = len(forwarded)
    resp = loop.run_until_complete(
        r._limited(_Req(body, headers, "/v1/chat/completions" if chat else "/v1/completions"), chat)
    )
    assert resp.status < 500, resp.body
    if resp.status == 200:
        sent = msgspec.json.decode(forwarded[n])
        assert sent["cache_salt"] in r.tenants.salts()  # the tenant's salt, whatever the client sent
    else:
        assert MARK.encode() not in resp.body
    assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in r.pool.workers)
    count("http router-path", str(resp.status))


def test_router_survives_absurd_max_tokens(router):
    """A max_tokens of 10**400 (valid JSON) must not break load accounting for other requests."""
    r, loop = router.router, router.loop
    body = b'{"prompt": [1, 2, 3, 4], "max_tokens": 1' + b"0" * 400 + b"}"
    resp = loop.run_until_complete(
        r._limited(_Req(body, {"Authorization": "Bearer key-a"}, "/v1/completions"), False)
    )
    assert resp.status == 200  # forwarded: the worker judges it (and answers 400)


# -- real HTTP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http-fuzz")
    with Cluster(tmp, 1, replay=False) as c:
        c.start_workers(time_scale=50, extra=("--max-model-len", "4096"))
        c.start_router(tenant_flags(tmp, KEYS))
        c.wait_ready()
        yield c.procs, c.worker_url(0), c.router_url()


PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
RSS: dict[str, list[int]] = {}


@given(body=bodies(), path=st.sampled_from(PATHS), via_router=st.booleans())
@fuzz_settings(150)
def test_real_http_answers_every_body_without_a_5xx(live, body, path, via_router):
    procs, worker, router_url = live
    if via_router and path in ("/tokenize", "/detokenize"):
        path = "/v1/completions"
    if path == "/detokenize" and body[:1] == b"{":
        body = json.dumps({"tokens": json.loads(body) if _is_json(body) else []}).encode()
    status, out = post(
        (router_url if via_router else worker) + path, body, key="key-a" if via_router else None, timeout=30
    )
    assert status < 500, (path, body[:200], out[:300])
    if status >= 400:
        assert MARK.encode() not in out
    for name in ("worker0", "router"):
        assert procs.procs[name].poll() is None, f"{name} died"
        RSS.setdefault(name, []).append(rss_bytes(procs.procs[name].pid))
    count(f"http real-{'router' if via_router else 'serve'}", str(status))


def test_regressions_the_fuzzers_found(live):
    """Bodies that once gave a 500 (serve /tokenize) or an exception in the router's hashing."""
    _, worker, router_url = live
    assert post(worker + "/tokenize", {"messages": [{"role": "user", "tool_calls": 5}]})[0] == 400
    for body in (
        {"prompt": [None, 11, 12]},
        {"messages": [{"role": "user", "content": [{"text": 5}]}]},
        {"messages": [{"role": "user", "tool_calls": 5}]},
        {"prompt": [2**80, 5]},
    ):
        status, _ = post(router_url + "/v1/completions", body, key="key-a")
        assert status == 400  # the worker's verdict, forwarded; the router did not fail


def _is_json(b: bytes) -> bool:
    try:
        json.loads(b)
        return True
    except ValueError:
        return False


def test_servers_memory_stayed_flat(live):
    """After the fuzzed requests (run first, in file order), neither process kept growing."""
    if not RSS:
        pytest.skip("the real-HTTP fuzz did not run")
    for name, xs in RSS.items():
        warm = xs[min(len(xs) - 1, max(1, len(xs) // 4))]
        peak, kept = max(xs) - warm, xs[-1] - warm
        note(
            f"http rss-{name}",
            f"{len(xs)} samples, {warm / 2**20:.0f} MiB after warm-up, "
            f"+{peak / 2**20:.1f} MiB at peak, +{kept / 2**20:.1f} MiB at the end",
        )
        assert kept < 64 << 20 and peak < 256 << 20 and math.isfinite(peak)
