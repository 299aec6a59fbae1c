"""Trace requests -> exact prompts: token ids per trace block, or those blocks rendered as text.

Every trace block maps to its deterministic token block (`agentkv.trace.blocks`), so two
requests share a prompt prefix exactly where the trace says they share blocks. Text mode
renders block by block (cached), so shared blocks give byte-identical text prefixes.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import msgspec
import numpy as np

from agentkv.bench.client import BenchClient, StreamResult
from agentkv.errors import UserError
from agentkv.trace.blocks import DEFAULT_VOCAB, request_tokens, trace_block_tokens
from agentkv.trace.plan import PlanItem

_enc = msgspec.json.encode
_BLOCK_CACHE_MAX = 500_000  # rendered trace blocks kept; cleared wholesale past this


def _salt(text: str) -> str:
    """A vLLM-valid cache_salt: non-empty, at most 128 characters, none of @ / \\ or NUL."""
    for bad in "@/\\\0":
        text = text.replace(bad, "_")
    return text[-128:] or "_"


class _HfTokenizer:
    """A local Hugging Face tokenizer (tokenizer.json, or a folder holding one)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from None
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise UserError(f"--tokenizer {path}: no tokenizer.json found there")
        try:
            self.tok = Tokenizer.from_file(str(f))
        except Exception as e:  # the library raises a bare Exception for a bad file
            raise UserError(f"--tokenizer {f}: cannot load ({e})") from None
        self.vocab_size = self.tok.get_vocab_size()
        self.name = str(f)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class PromptBuilder:
    """Prompts, cache salts and the run's cache-bust marker for plan items.

    mode: "token-ids" (exact lengths) or "text"; `tokenizer` a tokenizer.json path or HF folder
    for text mode, else the built-in tokenizer (exact against `agentkv serve`, approximate elsewhere).
    """

    def __init__(
        self,
        mode: str = "token-ids",
        tokenizer: str | None = None,
        *,
        tenant_salts: bool = False,
        cache_bust: bool = False,
        bust_marker: str | None = None,
    ):
        if mode not in ("token-ids", "text"):
            raise UserError(f"--prompt-mode: expected token-ids or text, got {mode!r}")
        if tokenizer and mode != "text":
            raise UserError("--tokenizer is only used with --prompt-mode text")
        self.mode, self.tenant_salts = mode, tenant_salts
        self.marker = (bust_marker or secrets.token_hex(6)) if cache_bust else None
        self.vocab = DEFAULT_VOCAB
        self._hf: _HfTokenizer | None = None
        self._cache: dict[tuple[str, int], bytes | str] = {}
        if mode == "token-ids":
            self.description = "token ids (exact prompt lengths)"
        elif tokenizer:
            self._hf = _HfTokenizer(tokenizer)
            hi = min(DEFAULT_VOCAB[1], self._hf.vocab_size)
            if hi <= DEFAULT_VOCAB[0]:
                raise UserError(f"--tokenizer {tokenizer}: vocabulary of {self._hf.vocab_size} is too small")
            self.vocab = (DEFAULT_VOCAB[0], hi)
            self.description = (
                f"text rendered with the tokenizer {self._hf.name} "
                "(lengths as the server re-tokenizes them, close to the trace's)"
            )
        else:
            self.description = (
                "text rendered with the built-in tokenizer (exact against agentkv serve, "
                "approximate lengths on other servers)"
            )
        if self.marker:
            self.description += f"; cache-bust marker {self.marker}"

    def tokens(self, item: PlanItem) -> np.ndarray:
        """The request's exact prompt token ids (int32), with the cache-bust marker applied."""
        r = item.request
        ids = request_tokens(item.hash_space, r.hash_ids, r.input_tokens, item.trace.block_size, self.vocab)
        return self._bust(ids)

    def _bust(self, ids: np.ndarray) -> np.ndarray:
        """The run's marker in the first two tokens: same lengths, no prefix shared with other runs."""
        if not self.marker or not len(ids):
            return ids
        lo, hi = self.vocab
        m = int(self.marker, 16)
        ids = ids.copy()
        ids[0] = lo + m % (hi - lo)
        if len(ids) > 1:
            ids[1] = lo + (m // (hi - lo)) % (hi - lo)
        return ids

    def prompt(self, item: PlanItem) -> msgspec.Raw | str:
        """What goes into the request: the token ids as a raw JSON array, or text rendered block by block."""
        parts = self._blocks_of(item)
        if self.mode == "token-ids":
            return msgspec.Raw(b"[" + b",".join(parts) + b"]")
        return (" " if self._hf is None else "").join(parts)  # the built-in tokenizer splits on spaces

    def _blocks_of(self, item: PlanItem) -> list:
        """Per trace block, its rendering (JSON ids or text): cached for whole real blocks.

        Equal to rendering `tokens(item)` in one go, but a new turn only computes its new blocks,
        so a 150k-token prompt costs about a millisecond instead of tens.
        """
        r, b, key = item.request, item.trace.block_size, item.hash_space
        n, hs = r.input_tokens, r.hash_ids
        full = min(len(hs), n // b)
        cache = self._cache
        if len(cache) > _BLOCK_CACHE_MAX:
            cache.clear()
        parts = [cache.get((key, h)) for h in hs[:full]]
        missing = [i for i, v in enumerate(parts) if v is None]
        if missing:  # a real block's tokens depend on its hash id only: compute all misses in one go
            ids = [hs[i] for i in missing]
            toks = request_tokens(key, ids, len(ids) * b, b, self.vocab).reshape(len(ids), b)
            for i, h, t in zip(missing, ids, toks, strict=True):
                parts[i] = cache[(key, h)] = self._render(t)
        rest = n - full * b
        if rest > 0:  # a partial real block, then filler past the last hash id: a short computation
            if full < len(hs):
                tail = trace_block_tokens(key, hs[full], b, self.vocab)[:rest]
            elif hs:
                tail = request_tokens(key, hs[-1:], b + rest, b, self.vocab)[b:]
            else:
                tail = request_tokens(key, [], n, b, self.vocab)
            parts.extend(self._render(tail[i : i + b]) for i in range(0, len(tail), b))
        if self.marker and parts:
            first = (
                trace_block_tokens(key, hs[0], b, self.vocab)[: min(b, n)]
                if hs
                else request_tokens(key, [], min(b, n), b, self.vocab)
            )
            parts[0] = self._render(self._bust(first))
        return parts

    def _render(self, ids: np.ndarray):
        if self.mode == "token-ids":
            return _enc(ids.tolist())[1:-1]
        if self._hf is not None:
            return self._hf.decode(ids.tolist())
        from agentkv.trace.tokens import decode

        return decode(ids.tolist())

    def extra(self, item: PlanItem) -> dict:
        """Extra body fields: the session tree's `cache_salt` with --tenant-salts."""
        if not self.tenant_salts:
            return {}
        return {"cache_salt": _salt(f"{self.marker}-{item.tree_key}" if self.marker else item.tree_key)}

    def ceiling_key(self, item: PlanItem) -> str:
        """The ceiling's sharing domain: the trace's hash-id space, split per tenant when salted."""
        key = item.hash_space
        return f"{key}|{item.tree_key}" if self.tenant_salts and item.trace.hash_id_scope != "local" else key


_ID_RUN = re.compile(r"\d+(?:\s*,\s*\d+){3,}")  # four or more comma-separated integers: token ids
_W = 16  # an echo of >= 2 * _W - 1 characters holds an aligned window of _W


def redact_prompt(detail: str, prompt: msgspec.Raw | str) -> str:
    """`detail` (a server's error text) with what it quotes of `prompt` replaced by `[prompt]`, and
    runs of token ids by `[token ids]`: bench keeps server messages but never prompt text."""
    detail = _ID_RUN.sub("[token ids]", detail)
    text = bytes(prompt).decode("utf-8", "replace") if isinstance(prompt, msgspec.Raw) else prompt
    if not text or len(detail) < _W:
        return detail
    hit = [False] * len(detail)
    for a in range(0, len(detail) - _W + 1, _W):
        if detail[a : a + _W] in text:
            lo, hi = a, a + _W
            while lo > max(0, a - _W) and detail[lo - 1 : hi] in text:
                lo -= 1
            while hi < min(len(detail), a + 2 * _W) and detail[lo : hi + 1] in text:
                hi += 1
            hit[lo:hi] = [True] * (hi - lo)
    out, i = [], 0
    while i < len(detail):
        if hit[i]:
            while i < len(detail) and hit[i]:
                i += 1
            out.append("[prompt]")
        else:
            out.append(detail[i])
            i += 1
    return "".join(out)


async def send_item(
    client: BenchClient, prompts: PromptBuilder, model: str, item: PlanItem, max_tokens: int
) -> StreamResult:
    """Build the item's prompt and body and stream it. A prompt that cannot be built fails this
    request (`client_error`), not the run; a failure's detail never quotes the prompt or a credential."""
    prompt = ""
    try:
        prompt = prompts.prompt(item)
        body = client.body(model, prompt, max_tokens, prompts.extra(item))
    except Exception as e:
        now = client.clock()
        res = StreamResult(
            ok=False, error="client_error", detail=f"{type(e).__name__}: {e}", sent=now, end=now
        )
    else:
        res = await client.stream(body)
    if not res.ok:  # keep the server's message, never the prompt it may quote
        res.detail = client.redact(redact_prompt(res.detail, prompt))
    return res
