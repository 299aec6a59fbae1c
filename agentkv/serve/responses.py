"""Response bodies and SSE chunks in vLLM's OpenAI shapes, pre-rendered per request so a chunk is one concat."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from agentkv.engine.request import EngineRequest
from agentkv.serve.protocol import GenRequest
from agentkv.trace.tokens import output_text

_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """OpenAI usage, with `prompt_tokens_details.cached_tokens` (vLLM: prefix-cache hits)."""
    u = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def engine_times(req: EngineRequest | None, time_scale: float, engine_id: str = "") -> dict | None:
    """agentkv's own `agentkv` object: the request's times on the engine's clock (engine seconds),
    each output token's as seconds after `arrival`; what `agentkv bench` measures latency from.
    `engine_id` names the engine whose clock it is (behind a router, workers' clocks differ)."""
    if req is None or req.first_token is None:
        return None
    a = req.arrival
    times = req.token_times or [req.first_token]
    end = req.finished_at if req.finished_at is not None else req.last_token
    return {
        "clock": "engine",
        "time_scale": time_scale,
        "arrival": a,
        "first_scheduled": req.first_scheduled,
        "first_token": req.first_token,
        "end": end,
        "token_times": np.round(np.asarray(times) - a, 9).tolist(),
        "preemptions": req.num_preemptions,
        "engine_id": engine_id,
    }


def text_of(start: int, n: int) -> str:
    """The filler text of output tokens start .. start+n-1."""
    return "".join(output_text(i) for i in range(start, start + n))


class ChunkWriter:
    """Renders one request's stream: `chunk(start, n, finished)`, `usage_chunk(...)`, and `DONE`."""

    __slots__ = ("chat", "head", "_role_sent", "prompt_tokens", "continuous")

    def __init__(self, request_id: str, gen: GenRequest, created: int | None = None) -> None:
        self.chat = gen.kind == "chat"
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        created = int(time.time()) if created is None else created
        self.head = (
            f'data: {{"id":"{request_id}","object":"{obj}","created":{created},'
            f'"model":{_enc.encode(gen.model).decode()},"choices":['
        ).encode()
        self._role_sent = False
        self.prompt_tokens = len(gen.prompt_ids)
        self.continuous = gen.continuous_usage

    def chunk(self, start: int, n: int, finished: bool) -> bytes:
        """Tokens start .. start+n-1 as one chunk (with the role chunk before the first, for chat)."""
        text = _enc.encode(text_of(start, n))
        fin = b'"length"' if finished else b"null"
        tail = b"]}\n\n"
        if self.continuous:
            tail = b'],"usage":' + _enc.encode(usage(self.prompt_tokens, start + n, None)) + b"}\n\n"
        if self.chat:
            out = b""
            if not self._role_sent:
                self._role_sent = True
                out = (
                    self.head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                    b'"finish_reason":null}' + tail
                )
            return (
                out + self.head + b'{"index":0,"delta":{"content":' + text + b'},"logprobs":null,'
                b'"finish_reason":' + fin + b"}" + tail
            )
        return (
            self.head
            + b'{"index":0,"text":'
            + text
            + b',"logprobs":null,"finish_reason":'
            + fin
            + b',"stop_reason":null}'
            + tail
        )

    def usage_chunk(self, completion_tokens: int, cached_tokens: int, engine: dict | None = None) -> bytes:
        """The final chunk of `stream_options.include_usage`: no choices, the usage (and the
        `agentkv` object of `engine_times`, a key OpenAI clients ignore)."""
        extra = b',"agentkv":' + _enc.encode(engine) if engine is not None else b""
        return (
            self.head
            + b'],"usage":'
            + _enc.encode(usage(self.prompt_tokens, completion_tokens, cached_tokens))
            + extra
            + b"}\n\n"
        )


def full_response(
    request_id: str,
    gen: GenRequest,
    n_out: int,
    cached_tokens: int,
    finish_reason: str = "length",
    engine: dict | None = None,
    kv_transfer_params: dict | None = None,
) -> bytes:
    """The non-streaming body of a completion or chat completion (with `engine_times` as `agentkv`)."""
    text = text_of(0, n_out)
    if gen.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    body = {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": gen.model,
        "choices": [choice],
        "usage": usage(len(gen.prompt_ids), n_out, cached_tokens),
    }
    if kv_transfer_params is not None:  # a disaggregated prefill's hand-off, as vLLM's response field
        body["kv_transfer_params"] = kv_transfer_params
    if engine is not None:
        body["agentkv"] = engine
    return _enc.encode(body)
