"""vLLM's /tokenize and /detokenize bodies: bytes in, response bytes out, so a worker process can run
them (a long text costs about 1 us a token to encode). Both stop at the model's context length."""

from __future__ import annotations

import msgspec

from agentkv.gate.errors import RequestError
from agentkv.gate.jsonbody import decode_object
from agentkv.trace.tokens import apply_chat_template, decode, encode_bounded

_enc = msgspec.json.Encoder()


def tokenize_body(body: bytes, max_model_len: int) -> bytes:
    """`{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens"}`; RequestError otherwise."""
    data = decode_object(body)
    if isinstance(data.get("messages"), list):
        msgs = [m for m in data["messages"] if isinstance(m, dict)]
        try:
            text = apply_chat_template(msgs, bool(data.get("add_generation_prompt", True)))
        except (TypeError, ValueError):  # a message of an unexpected shape (e.g. tool_calls not a list)
            raise RequestError(
                "messages: each must be an object with a string role, string content and a list of tool_calls",
                "messages",
            ) from None
    elif isinstance(data.get("prompt"), str):
        text = data["prompt"]
    else:
        raise RequestError("give `prompt` (a string) or `messages` (a list)", "prompt")
    ids = encode_bounded(text, max_model_len)
    if ids is None:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens; the text has more", "prompt"
        )
    return _enc.encode({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})


def detokenize_body(body: bytes, max_model_len: int) -> bytes:
    """`{"tokens": [ids]}` -> `{"prompt": text}` (at most `max_model_len` ids)."""
    data = decode_object(body)
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise RequestError("`tokens` must be a list of non-negative token ids", "tokens")
    if len(tokens) > max_model_len:
        raise RequestError(
            f"at most {max_model_len} tokens (the context length) can be detokenized", "tokens"
        )
    return _enc.encode({"prompt": decode(tokens)})
