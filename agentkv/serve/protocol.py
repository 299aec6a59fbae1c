"""OpenAI request bodies (as vLLM accepts them): typed parsing, vLLM's validation rules, one clear error.

Bodies decode straight into msgspec structs, so a known key of the wrong type is a 400 naming
the key, and unknown keys (sglang-router adds some) are ignored. Sampling parameters are
checked for type and otherwise ignored: outputs are deterministic filler, always `max_tokens`
long. Error messages never quote prompt or message content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from agentkv.gate.errors import RequestError
from agentkv.gate.jsonbody import decode, long_int_list
from agentkv.trace.tokens import apply_chat_template, encode_bounded

__all__ = ["RequestError", "Limits", "GenRequest", "parse_completion", "parse_chat", "check_cache_salt"]

MAX_SALT_LEN = 128
_BAD_SALT = re.compile(r"[@/\\\x00]")


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool | None = False


class KVTransferParams(msgspec.Struct, kw_only=True):
    """vLLM's `kv_transfer_params` (its NIXL connector's fields) for disaggregated prefill/decode:
    `do_remote_decode` asks a prefill to hand its KV on; `do_remote_prefill` with the prefill's
    `remote_block_ids` tells a decode that the prompt's KV is coming. Other keys are ignored."""

    do_remote_decode: bool | None = False
    do_remote_prefill: bool | None = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Keys both endpoints share; types as in vLLM's protocol, nulls allowed where it allows them."""

    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = None
    ignore_eos: bool | None = False
    cache_salt: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    user: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    session_id: str | int | None = None  # agentkv's own: a hint for session-aware eviction
    kv_transfer_params: KVTransferParams | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[int | str | list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts: its model names, context length, vocabulary, default output lengths."""

    served_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    default_completion_tokens: int = 16  # vLLM's and OpenAI's default for /v1/completions
    default_chat_tokens: int = 256


@dataclass(slots=True)
class GenRequest:
    """A validated generation request: the prompt as token ids and what to send back."""

    kind: Literal["completion", "chat"]
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None
    session_id: str | None
    kv_transfer: KVTransferParams | None = None


def parse_completion(body: bytes, limits: Limits) -> GenRequest:
    """A /v1/completions body as a GenRequest, or RequestError. A token-id list of max_model_len
    ids or more is refused on the raw bytes, before it is decoded into Python ints."""
    if n := long_int_list(body, limits.max_model_len - 1):
        raise _too_long(limits.max_model_len, f"{n}")
    req: CompletionBody = decode(body, _completion_decoder)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if len(prompt) >= limits.max_model_len:  # before anything looks at each id
            raise _too_long(limits.max_model_len, f"{len(prompt)}")
        if prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif len(prompt) == 1 and isinstance(prompt[0], str):
            ids = _text_ids(prompt[0], limits.max_model_len)
        elif len(prompt) > 1 and all(isinstance(t, str | list) for t in prompt):
            raise RequestError("batched prompts are not supported: send one prompt per request", "prompt")
        elif not prompt:
            raise RequestError("the prompt is empty", "prompt")
        else:
            raise RequestError(
                "prompt must be a string, a list of token ids, or a one-element list of either", "prompt"
            )
        _check_ids(ids, limits.vocab_size)
    else:
        ids = _text_ids(prompt, limits.max_model_len)
    if req.echo:
        raise RequestError("echo is not supported", "echo")
    return _finish(req, "completion", ids, req.max_tokens, limits.default_completion_tokens, limits)


def parse_chat(body: bytes, limits: Limits) -> GenRequest:
    """A /v1/chat/completions body as a GenRequest (messages rendered by the built-in template)."""
    req: ChatBody = decode(body, _chat_decoder)
    if not req.messages:
        raise RequestError("messages must not be empty", "messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise RequestError(
            "cannot set both continue_final_message and add_generation_prompt to true",
            "continue_final_message",
        )
    rendered = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}", "messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"messages[{i}]: only content parts of type 'text' are supported", "messages"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        rendered.append({"role": m.role, "content": content, "name": m.name, "tool_calls": m.tool_calls})
    text = apply_chat_template(rendered, add_generation_prompt=bool(req.add_generation_prompt))
    ids = _bounded(text, limits.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _finish(req, "chat", ids, max_tokens, limits.default_chat_tokens, limits)


def _bounded(text: str, max_len: int) -> list[int]:
    """Token ids of `text`; a 400 as soon as they reach `max_len` (the tokenizer stops there)."""
    ids = encode_bounded(text, max_len)
    if ids is None:
        raise _too_long(max_len, f"more than {max_len}")
    return ids


def _text_ids(text: str, max_len: int) -> list[int]:
    ids = _bounded(text, max_len)
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    return ids


def _too_long(max_len: int, n: str) -> RequestError:
    return RequestError(
        f"This model's maximum context length is {max_len} tokens. However, your request "
        f"has {n} input tokens. Please reduce the length of the input.",
        "prompt",
    )


def _check_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(f"token id {bad} is out of vocabulary (0 .. {vocab_size - 1})", "prompt")


def check_cache_salt(salt: str | None) -> None:
    """vLLM's rule: a non-empty string of at most 128 characters without `@ / \\` or NUL."""
    if salt is None:
        return
    if not salt:
        raise RequestError("cache_salt must be a non-empty string if provided", "cache_salt")
    if len(salt) > MAX_SALT_LEN:
        raise RequestError(f"cache_salt is longer than {MAX_SALT_LEN} characters", "cache_salt")
    if _BAD_SALT.search(salt):
        raise RequestError("cache_salt must not contain '@', '/', '\\' or NUL", "cache_salt")


def _finish(
    req: _Common,
    kind: Literal["completion", "chat"],
    ids: list[int],
    max_tokens: int | None,
    default_tokens: int,
    limits: Limits,
) -> GenRequest:
    """Checks both endpoints share (model, n, stream options, salt, lengths); the GenRequest."""
    model = limits.served_names[0]
    if req.model is not None and req.model not in limits.served_names:
        raise RequestError(f"The model `{req.model}` does not exist.", "model", 404, "NotFoundError")
    if req.n not in (None, 1):
        raise RequestError("n must be 1: agentkv serve generates one choice per request", "n")
    if req.best_of not in (None, 1):
        raise RequestError("best_of must be 1", "best_of")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.", "stream_options")
    check_cache_salt(req.cache_salt)
    n_prompt = len(ids)
    max_len = limits.max_model_len
    if n_prompt >= max_len:
        raise _too_long(max_len, str(n_prompt))
    if max_tokens is None:
        max_tokens = min(default_tokens, max_len - n_prompt)
    elif max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    elif n_prompt + max_tokens > max_len:
        raise RequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_len} tokens and your request has {n_prompt} input "
            f"tokens ({max_tokens} > {max_len} - {n_prompt}).",
            "max_tokens",
        )
    opts = req.stream_options
    session = None if req.session_id is None else str(req.session_id)
    return GenRequest(
        kind,
        model,
        ids,
        max_tokens,
        stream,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        cache_salt=req.cache_salt,
        session_id=session,
        kv_transfer=_kv_transfer(req.kv_transfer_params),
    )


def _kv_transfer(kt: KVTransferParams | None) -> KVTransferParams | None:
    """The transfer parameters a request carries, checked as far as the emulation relies on them."""
    if kt is None or not (kt.do_remote_decode or kt.do_remote_prefill):
        return None
    if kt.do_remote_decode and kt.do_remote_prefill:
        raise RequestError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive", "kv_transfer_params"
        )
    if kt.do_remote_prefill and kt.remote_block_ids is None:
        raise RequestError(
            "kv_transfer_params.remote_block_ids is required with do_remote_prefill", "kv_transfer_params"
        )
    if kt.tp_size is not None and kt.tp_size < 1:
        raise RequestError("kv_transfer_params.tp_size must be >= 1", "kv_transfer_params")
    return kt
