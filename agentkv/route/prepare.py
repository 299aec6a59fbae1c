"""A request body made ready to forward: decoded (depth-checked, an object), the tenant's salt
injected, re-encoded, and hashed as the engine will hash it. Small bodies are prepared on the
event loop; large ones in a parser process (`prepare_in_child`, set up by `init_child`), since
decoding and tokenizing hold the GIL."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from agentkv.gate.errors import RequestError
from agentkv.gate.jsonbody import decode_object, long_int_list
from agentkv.kv.hashing import make_hasher
from agentkv.route.prompt import Hashed, RequestHasher, Tokenizer

_encode = msgspec.json.Encoder().encode
MAX_SESSION_CHARS = 256  # a longer session_id is not forwarded as a header (the body still has it)


@dataclass(slots=True)
class Prepared:
    """What the proxy needs of a body: the bytes to send, the hashes, the session, the output bound."""

    payload: bytes
    hashed: Hashed
    session: str  # the body's session_id ('' when none or unusable as a header)
    max_out: int  # max output tokens for load accounting (0 when absent or absurd)


def prepare(
    body: bytes, chat: bool, tenant_salt: str | None, hasher: RequestHasher, limit: int, refuse: bool
) -> Prepared:
    """The Prepared form of `body`; RequestError 400 when it is not a JSON object, nests too deep, or
    (with `refuse`: `limit` is the workers' own max_model_len) its prompt certainly has more than
    `limit` tokens: no worker would take it, so it is not re-encoded and sent on. A token-id list
    that long is refused on its raw bytes, before it is decoded."""
    if refuse and (n := long_int_list(body, limit)):
        raise _too_long(limit, f"a list of {n} token ids", chat)
    data = decode_object(body)
    if tenant_salt:
        data["cache_salt"] = tenant_salt  # the tenant's namespace, whatever the client sent
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    hashed = hasher.hash(data, chat, salt, limit)
    if refuse and hashed.too_long:
        raise _too_long(limit, f"more than {limit} input tokens", chat)
    payload = _encode(data)
    sid = data.get("session_id")
    session = str(sid) if type(sid) in (str, int) else ""
    if len(session) > MAX_SESSION_CHARS or not session.isprintable():
        session = ""
    out = data.get("max_completion_tokens") or data.get("max_tokens") or (256 if chat else 16)
    max_out = out if type(out) is int and 0 < out < 1 << 32 else 0
    return Prepared(payload, hashed, session, max_out)


def _too_long(limit: int, what: str, chat: bool) -> RequestError:
    """vLLM's 400 for a prompt past the context length."""
    return RequestError(
        f"This model's maximum context length is {limit} tokens. However, your request has {what}. "
        "Please reduce the length of the input.",
        "messages" if chat else "prompt",
    )


_child: RequestHasher | None = None


def init_child(hash_algo: str, hash_seed, block_size: int, tokenizer: str | None) -> None:
    """In a parser process: the router's hasher, built once."""
    global _child
    _child = RequestHasher(make_hasher(hash_algo, hash_seed), block_size, Tokenizer(tokenizer))
    if _child.tokenizer.kind == "builtin":
        from agentkv.trace.tokens import warm_up

        warm_up()


def prepare_in_child(body: bytes, chat: bool, tenant_salt: str | None, limit: int, refuse: bool) -> Prepared:
    assert _child is not None, "init_child did not run"
    return prepare(body, chat, tenant_salt, _child, limit, refuse)
