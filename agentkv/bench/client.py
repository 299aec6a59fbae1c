"""Async streaming client for OpenAI-compatible servers: keep-alive connections, every token timed.

Streams go through `http1.Http1Pool` (fast enough for 100,000+ tokens/s on one core), or through
aiohttp (`transport="aiohttp"`, kept to measure against: benchmarks/client_overhead.py
--client); the occasional GET (/v1/models, /metrics) through aiohttp. A stream's chunks are timed as they are
read: every SSE event in one socket read shares that read's arrival time. Failures never raise; they come back as a `StreamResult` with a reason
(`http_500`, `context_overflow`, `reset`, `timeout`, ...), so one bad request cannot stop a run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import msgspec

from agentkv.bench.http1 import KEEP_BYTES, Http1Pool, HttpError, OnLines
from agentkv.bench.request_opts import REDACTED, api_key, auth_headers, secret_header
from agentkv.errors import UserError

# a 400 whose body mentions one of these is a prompt longer than the server's context window
_OVERFLOW_HINTS = (
    "max_model_len",
    "context length",
    "context window",
    "maximum context",
    "too long",
    "context_length_exceeded",
    "max_position_embeddings",
)
DETAIL_BYTES = 512  # of a failed request's error body kept in its record


def _head(text: str) -> str:
    """The first DETAIL_BYTES of `text` (UTF-8), cut on a character boundary."""
    return text.encode()[:DETAIL_BYTES].decode("utf-8", "ignore")


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class EngineTimes(msgspec.Struct):
    """agentkv serve's `agentkv` object: the request on the engine's own clock (engine seconds);
    `token_times` are each output token's, in seconds after `arrival`."""

    arrival: float
    first_token: float
    end: float
    token_times: list[float] = []
    clock: str = "engine"
    time_scale: float | None = None
    first_scheduled: float | None = None
    preemptions: int = 0
    engine_id: str = ""  # whose clock: one id per agentkv serve engine


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: object = None
    agentkv: msgspec.Raw = msgspec.Raw()  # decoded apart: a malformed one is ignored, not a failure


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_decode_chunks = msgspec.json.Decoder(list[_Chunk]).decode
_decode_times = msgspec.json.Decoder(EngineTimes).decode


def engine_times(raw: bytes | msgspec.Raw) -> EngineTimes | None:
    """The `agentkv` object of a response, or None when it is not one agentkv serve writes."""
    try:
        t = _decode_times(raw)
    except msgspec.DecodeError:
        return None
    return t if t.clock == "engine" and t.token_times else None


class StreamResult(msgspec.Struct, kw_only=True):
    """What one streamed request gave: times on the client's clock, tokens, usage, or why it failed."""

    ok: bool = True
    error: str = ""  # reason when not ok
    detail: str = ""  # the first DETAIL_BYTES of the error body, or the exception, when not ok
    status: int = 0  # the HTTP status (0: no answer)
    sent: float = 0.0
    end: float = 0.0
    token_times: list[float] = []  # arrival time of every chunk that carried output
    output_tokens: int = 0  # usage.completion_tokens when reported, else chunks with output
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    engine: EngineTimes | None = None  # the server's own timestamps (agentkv serve), when it sent them


def _has_delta(d: _Delta) -> bool:
    return bool(d.content or d.reasoning_content or d.reasoning)


def classify_http_error(status: int, body: str) -> str:
    """A reason for an HTTP error: `context_overflow` for a too-long prompt, else `http_<status>`."""
    low = body.lower()
    if status in (400, 413, 422) and any(h in low for h in _OVERFLOW_HINTS):
        return "context_overflow"
    return f"http_{status}"


def normalize_target(url: str) -> str:
    """`http://host:port[/v1][/]` -> `http://host:port` (the base that /v1/... and /metrics hang off)."""
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    if u.endswith("/v1"):
        u = u[:-3]
    return u


class AiohttpStreams:
    """`Http1Pool.post_stream` through aiohttp: the same SSE lines to the same callback, a batch per read."""

    _headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}

    def __init__(self, session: aiohttp.ClientSession, base: str):
        u = urlsplit(base)
        self.session, self.origin = session, f"{u.scheme}://{u.netloc}"

    async def post_stream(
        self, path: str, body: bytes, on_lines: OnLines, clock: Callable[[], float]
    ) -> tuple[int, bytes]:
        """POST `body`; returns (status, body of a non-200 answer); raises HttpError as Http1Pool does."""
        try:
            async with self.session.post(self.origin + path, data=body, headers=self._headers) as resp:
                if resp.status != 200 or resp.content_type == "application/json":
                    return resp.status, await resp.content.read(KEEP_BYTES)
                lbuf = b""
                async for data in resp.content.iter_any():
                    now = clock()
                    buf = lbuf + data if lbuf else data
                    lines = buf.split(b"\n")
                    lbuf = lines.pop()  # a partial line waits for the next read
                    batch = [ln[5:] for ln in lines if ln[:5] == b"data:"]
                    if batch:
                        on_lines(batch, now)
                if lbuf.startswith(b"data:"):
                    on_lines([lbuf[5:]], clock())
                return 200, b""
        except aiohttp.ClientConnectorError as e:  # refused or unreachable: nothing was sent
            raise HttpError("connect_error", f"{type(e).__name__}: {e}") from None
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            ConnectionError,
        ) as e:
            raise HttpError("reset", f"{type(e).__name__}: {e}") from None
        except aiohttp.ClientError as e:
            raise HttpError("client_error", f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        """Nothing to close: the connections belong to the session."""


class BenchClient:
    """Streams completions from one target over a shared, keep-alive connection pool."""

    def __init__(
        self,
        target: str,
        *,
        api: str = "completions",
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
        max_connections: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        transport: str = "http1",
        headers: dict[str, str] | None = None,
        extra_body: dict | None = None,
    ):
        """`headers`: sent with every request (Authorization included; None: the key in the
        environment); `extra_body`: merged into every request body (--extra-body)."""
        if api not in ("completions", "chat"):
            raise UserError(f"--api: expected completions or chat, got {api!r}")
        if transport not in ("http1", "aiohttp"):
            raise UserError(f"transport: expected http1 or aiohttp, got {transport!r}")
        self.base = normalize_target(target)
        self.path = (
            f"{urlsplit(self.base).path}/v1/{'completions' if api == 'completions' else 'chat/completions'}"
        )
        self.api, self.timeout, self.connect_timeout, self.clock = api, timeout, connect_timeout, clock
        self._max_connections, self.transport = max_connections, transport
        self.session: aiohttp.ClientSession | None = None
        self.pool: Http1Pool | AiohttpStreams | None = None
        self.headers = auth_headers(api_key(None, None), {}) if headers is None else dict(headers)
        self.extra_body = dict(extra_body or {})
        self._secrets = [v for k, v in self.headers.items() if secret_header(k)]

    async def __aenter__(self) -> BenchClient:
        conn = aiohttp.TCPConnector(
            limit=self._max_connections, limit_per_host=0, ttl_dns_cache=None, enable_cleanup_closed=False
        )
        self.session = aiohttp.ClientSession(
            connector=conn,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            skip_auto_headers=("User-Agent",),
            headers={"User-Agent": "agentkv-bench", **self.headers},
            auto_decompress=False,
        )
        if self.transport == "aiohttp":
            self.pool = AiohttpStreams(self.session, self.base)
        else:
            self.pool = Http1Pool(
                self.base,
                limit=self._max_connections,
                connect_timeout=self.connect_timeout,
                headers=self.headers,
            )
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    async def models(self) -> list[str]:
        """The target's served model ids (GET /v1/models); one clear UserError when it is down."""
        assert self.session is not None
        url = f"{self.base}/v1/models"
        try:
            async with asyncio.timeout(self.connect_timeout), self.session.get(url) as resp:
                if resp.status != 200:
                    raise UserError(f"target {self.base}: GET /v1/models answered HTTP {resp.status}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UserError(
                f"target {self.base} is not reachable ({type(e).__name__}: {e}); is the server up?"
            ) from None
        try:
            return [m["id"] for m in data.get("data", [])]
        except (AttributeError, KeyError, TypeError):
            raise UserError(
                f"target {self.base}: GET /v1/models did not return an OpenAI model list"
            ) from None

    async def get_json(self, path: str):
        """GET `<base><path>` as JSON, or None when the target does not answer it (optional endpoints)."""
        assert self.session is not None
        try:
            async with asyncio.timeout(self.connect_timeout), self.session.get(self.base + path) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    def redact(self, text: str) -> str:
        """`text` (a server's error) without the credential headers' values, should it echo them."""
        for v in self._secrets:
            for part in {v, v.removeprefix("Bearer ")}:
                if len(part) >= 4:
                    text = text.replace(part, REDACTED)
        return text

    def body(self, model: str, prompt, max_tokens: int, extra: dict | None = None) -> bytes:
        """The request JSON: streamed, usage included, `ignore_eos` so exactly `max_tokens` come back;
        then --extra-body's fields, then the item's own (`cache_salt`)."""
        b: dict = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.api == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if self.extra_body:
            b.update(self.extra_body)
        if extra:
            b.update(extra)
        return msgspec.json.encode(b)

    async def stream(self, body: bytes) -> StreamResult:
        """Send one request and read its stream to the end; never raises for a failed request."""
        assert self.pool is not None
        clock = self.clock
        res = StreamResult(sent=clock())
        on_lines, st = _sse_reader(res)
        try:
            async with asyncio.timeout(self.timeout):
                status, err = await self.pool.post_stream(self.path, body, on_lines, clock)
        except TimeoutError:
            res.ok, res.error, res.detail = False, "timeout", f"no end within {self.timeout:g} s"
        except HttpError as e:
            res.ok, res.error, res.detail = False, e.kind, _head(str(e))
        else:
            _settle(res, status, err, st)
        res.end = clock()
        return res


def _sse_reader(res: StreamResult) -> tuple[OnLines, list]:
    """The callback that reads a stream's SSE payloads into `res` (a batch per read, all at its
    arrival time), and its state: [chunks with output, [DONE] seen, SSE events seen]."""
    times = res.token_times
    st = [0, False, 0]

    def on_lines(payloads: list[bytes], now: float) -> None:
        st[2] += len(payloads)
        if payloads[-1].strip() == b"[DONE]":
            st[1] = True
            payloads = [p for p in payloads if p.strip() != b"[DONE]"]
            if not payloads:
                return
        try:  # one decode for the whole read: far cheaper than one per chunk
            chunks = _decode_chunks(b"[" + b",".join(payloads) + b"]")
        except msgspec.DecodeError:
            chunks = []
            for p in payloads:
                if not p.strip():
                    continue  # an empty data line
                try:
                    chunks.append(_decode_chunk(p))
                except msgspec.DecodeError as e:
                    res.ok, res.error, res.detail = False, "bad_chunk", _head(f"{e} (a {len(p)}-byte chunk)")
        k = 0
        for c in chunks:
            ch = c.choices
            if ch:
                x = ch[0]
                if x.text or (x.delta is not None and _has_delta(x.delta)):
                    k += 1
            if c.usage is not None or c.error is not None:
                _usage(res, c)
            if c.agentkv:  # an empty Raw when absent
                res.engine = engine_times(c.agentkv)
        if k:
            st[0] += k
            times.extend([now] * k)

    return on_lines, st


def _usage(res: StreamResult, c: _Chunk) -> None:
    """Take a chunk's error and usage (prompt, completion and cached tokens) into `res`."""
    if c.error is not None:
        res.ok, res.error, res.detail = False, "stream_error", _head(str(c.error))
    u = c.usage
    if u is not None:
        res.prompt_tokens = u.prompt_tokens
        if u.completion_tokens is not None:
            res.output_tokens = u.completion_tokens
        if u.prompt_tokens_details is not None:
            res.cached_tokens = u.prompt_tokens_details.cached_tokens


def _settle(res: StreamResult, status: int, err: bytes, st: list) -> None:
    """Judge a stream that ended: an HTTP error, a stream without [DONE], or the tokens it counted."""
    res.status = status
    text = err.decode("utf-8", "replace")
    if status != 200:
        res.ok, res.error, res.detail = False, classify_http_error(status, text), _head(text)
        return
    if err or not st[2]:  # one JSON document, or nothing: the server ignored `stream: true`
        res.ok, res.error = False, "not_streamed"
        res.detail = _head(text) if err else "HTTP 200 without any SSE event (data: line)"
        return
    if not res.output_tokens:
        res.output_tokens = st[0]
    if res.ok and not st[1]:
        res.ok, res.error, res.detail = False, "incomplete", "stream ended without [DONE]"
