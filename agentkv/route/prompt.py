"""Request hashing for the router: a request body -> the block hashes the engine will store for it.

Exact when the engine's tokens are known: token-id prompts hash directly; text prompts (and chat
messages) are tokenized by the built-in tokenizer (`agentkv.trace.tokens`, what `agentkv serve`
uses) or by a HF `tokenizer.json` (`--tokenizer`; completions only, since a chat template needs
the model's Jinja template). Otherwise the router hashes the UTF-8 text itself in fixed-size
chunks: "approximate text-prefix matching", which cannot match engine events and so is served
from the router's own routing history (see `approx.py`), never from the event index.

Work is bounded by `limit`, the longest prompt any worker takes (its max_model_len): an id list
longer than that is not hashed, the built-in tokenizer stops as soon as a text passes it (both
`too_long`), a HF tokenizer is not run on text longer than `limit * HF_MAX_CHARS_PER_TOKEN`
characters (such text is matched approximately), and approximate keys cover the first `limit`
tokens' worth of text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.errors import UserError
from agentkv.kv.hashing import DEFAULT_HASHER, Hasher

log = logging.getLogger("agentkv.route")

TEXT_CHARS_PER_TOKEN = 4  # approximate mode: a "block" of text is block_size x this many characters
HF_MAX_CHARS_PER_TOKEN = 64  # a text longer than limit x this is not given to a HF tokenizer
NO_TEMPLATE: Any = object()  # the ids cannot be known exactly: approximate matching


@dataclass(frozen=True, slots=True)
class Hashed:
    """A request's block hashes, its prompt length in tokens (estimated when not exact), and whether
    the hashes are the engine's own (`exact`) or approximate text-prefix keys."""

    hashes: list[int]
    prompt_tokens: int
    exact: bool
    too_long: bool = False  # certainly more tokens than `limit`: not hashed


class Tokenizer:
    """Text -> token ids the way the workers tokenize: `builtin` (agentkv serve) or a HF tokenizer.json."""

    def __init__(self, spec: str | None) -> None:
        self.spec = spec
        self._hf = None
        if spec in (None, "", "none"):
            self.kind = "none"
        elif spec == "builtin":
            self.kind = "builtin"
            from agentkv.trace.tokens import encode_bounded  # bound once, not imported per request

            self._builtin = encode_bounded
        else:
            self.kind = "hf"
            self._hf = _load_hf(spec)

    def encode(self, text: str, limit: int = 1 << 62) -> list[int] | None:
        """Token ids of `text`, or None when they would pass `limit` (work stops early where it can)."""
        if self.kind == "builtin":
            return self._builtin(text, limit)
        if self._hf is not None:
            if len(text) > limit * HF_MAX_CHARS_PER_TOKEN:  # no sound bound: matched approximately
                return NO_TEMPLATE
            ids = self._hf.encode(text).ids
            return ids if len(ids) <= limit else None
        raise RuntimeError("no tokenizer")

    def chat_ids(self, messages: list[Any], add_generation_prompt: bool, limit: int = 1 << 62):
        """Token ids of a chat prompt; NO_TEMPLATE when this tokenizer cannot render the model's
        template, None when the prompt passes `limit`."""
        if self.kind != "builtin":
            return NO_TEMPLATE
        from agentkv.trace.tokens import apply_chat_template, encode_bounded

        rendered = []
        for m in messages:
            if not isinstance(m, dict):
                return NO_TEMPLATE
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
            rendered.append(
                {
                    "role": m.get("role", ""),
                    "content": content,
                    "name": m.get("name"),
                    "tool_calls": m.get("tool_calls"),
                }
            )
        return encode_bounded(
            apply_chat_template(rendered, add_generation_prompt=add_generation_prompt), limit
        )


def _load_hf(spec: str):
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"--tokenizer {spec}: no tokenizer.json there (give the file, a folder holding it, "
            "or 'builtin' for agentkv serve workers)"
        )
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise UserError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from None
    try:
        return HfTokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on a bad file
        raise UserError(f"--tokenizer {path}: cannot load: {e}") from None


class RequestHasher:
    """Hashes request bodies into engine block hashes (or approximate text keys), salt included."""

    def __init__(self, hasher: Hasher, block_size: int, tokenizer: Tokenizer) -> None:
        self.hasher, self.block_size, self.tokenizer = hasher, block_size, tokenizer
        self._warned = False

    def tokens(self, body: dict, chat: bool, limit: int = 1 << 62) -> list[int] | None:
        """The prompt's token ids when they can be known exactly; NO_TEMPLATE when they cannot, None
        when the prompt is longer than `limit` tokens."""
        tok = self.tokenizer
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                return NO_TEMPLATE
            return tok.chat_ids(msgs, bool(body.get("add_generation_prompt", True)), limit)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and len(prompt) > limit:
            return None
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str) and tok.kind != "none":
            return tok.encode(prompt, limit)
        return NO_TEMPLATE

    def hash(self, body: dict, chat: bool, salt: str | None, limit: int = 1 << 62) -> Hashed:
        """The block hashes of `body`'s prompt under `salt` (the tenant's, or the client's).

        A body whose prompt has an unexpected shape hashes to nothing (no prefix to match): the
        worker, not the router, is the judge of what it accepts and answers it with a 4xx.
        """
        try:
            return self._hash(body, chat, salt, limit)
        except (TypeError, ValueError, OverflowError, AttributeError, KeyError, IndexError):
            return Hashed([], 0, False)

    def _hash(self, body: dict, chat: bool, salt: str | None, limit: int) -> Hashed:
        ids = self.tokens(body, chat, limit)
        if ids is None:  # longer than any worker takes: not worth hashing
            return Hashed([], 0, False, too_long=True)
        if ids is not NO_TEMPLATE:
            return Hashed(self.hasher.hashes(ids, self.block_size, cache_salt=salt), len(ids), True)
        if not self._warned:
            self._warned = True
            log.warning(
                "text prompt without a tokenizer for it: approximate text-prefix matching "
                "(pass --tokenizer builtin for agentkv serve workers, or a tokenizer.json)"
            )
        text = _text_of(body, chat)
        data = text.encode("utf-8", "surrogatepass")
        step = self.block_size * TEXT_CHARS_PER_TOKEN  # bytes per block: one int32 "token" per 4
        used = min(len(data), limit * TEXT_CHARS_PER_TOKEN)  # a prefix is all routing needs
        arr = np.frombuffer(data[: used // step * step], dtype="<i4")
        keys = DEFAULT_HASHER.hashes(arr, self.block_size, cache_salt=f"text\x1f{salt or ''}")
        return Hashed(keys, -(-len(data) // TEXT_CHARS_PER_TOKEN), False)


def _text_of(body: dict, chat: bool) -> str:
    """The prompt's text for approximate matching (chat: role and content of every message)."""
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list):
            return "\x1e".join(x if isinstance(x, str) else " ".join(map(str, x)) for x in p)
        return p if isinstance(p, str) else ""
    parts: list[str] = []
    for m in body.get("messages") or ():
        if isinstance(m, dict):
            c = m.get("content")
            if isinstance(c, list):
                c = "\n".join(str(x.get("text") or "") for x in c if isinstance(x, dict))
            parts.append(f"{m.get('role', '')}\x1f{c or ''}")
    return "\x1e".join(parts)
