"""A built-in deterministic tokenizer: text <-> token ids without downloading a vocabulary.

Every token id renders as a unique pseudo-word of consonant-vowel syllables (bijective base 64:
ids 0-63 are one syllable, the next 4,096 two, the next 262,144 three, ...), and `encode` maps
such words back, so `encode(decode(ids)) == ids` for every list of non-negative ids (in
particular all of `[0, VOCAB_SIZE)`). That lets a benchmark send a trace's exact token ids as
text, and lets a router hash text prompts the way the server does. Other text is split into
special markers (`<|user|>`, at most 32 characters between the bars), letter runs (cut into
pieces of at most 5 letters), digit groups of at most 3, and single punctuation characters; each
piece hashes (XXH3) into `[0, VOCAB_SIZE)`. Whitespace only separates pieces. No BOS token is ever
added. A token covers at most MAX_TOKEN_CHARS characters and at least one, so `encode_bounded`
can stop as soon as a text is known to be too long, whatever its size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import xxhash

VOCAB_SIZE = 128256  # Llama 3's vocabulary size: hashed pieces land in [0, VOCAB_SIZE)
UNK = "<|unk|>"  # one token for our encode too; only in the exported HF tokenizer (write_hf_tokenizer), as id VOCAB_SIZE
CONSONANTS = "bdfghjklmnprstvz"
VOWELS = "aiou"
SYLLABLES = tuple(c + v for c in CONSONANTS for v in VOWELS)  # 64
_BASE = len(SYLLABLES)
_SYL_INDEX = {s: i for i, s in enumerate(SYLLABLES)}
_PIECE = re.compile(r"<\|[A-Za-z0-9_]{1,32}\|>|[A-Za-z]+|[0-9]{1,3}|[^\sA-Za-z0-9]")
_PSEUDO = re.compile(f"(?:[{CONSONANTS}][{VOWELS}])+")
_WORD = re.compile(r"\S+")  # what str.split() splits on (both use Py_UNICODE_ISSPACE)
MAX_PSEUDO = 16  # letters of a pseudo-word read back as its id: every id below 64**8 spells in 8 syllables
MAX_TOKEN_CHARS = 36  # the most characters one token covers: a marker, <|32 characters|>
_LONG_WORD = 64  # words longer than this are encoded piece by piece, with an early stop
_CHUNK = 5  # letters per hashed piece: about one token per short word, as BPE tokenizers give
_FILLER_SEED = 0x6F7574  # "out": output token ids are a fixed pseudo-random sequence
# a text this long is encoded by whole-array passes (`_encode_long`): its pseudo-words' ids are
# computed, not looked up in the 266K-entry table (about one cache miss a word, ~1-2 us on a busy
# host); below it the fixed cost of those passes (~10-40 us) is more than the lookups
_ARRAY_CHARS = 1024
_ASCII_SPACE = np.zeros(256, bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True  # what str.split() splits ASCII on
_CON = np.full(256, -1, np.int64)  # a consonant's syllable value (1-based), -1 for other bytes
_CON[list(CONSONANTS.encode())] = np.arange(1, 4 * len(CONSONANTS) + 1, len(VOWELS))
_VOW = np.full(256, -1, np.int64)
_VOW[list(VOWELS.encode())] = np.arange(len(VOWELS))
_KIND = np.zeros(256, np.uint8)
_KIND[list(CONSONANTS.encode())], _KIND[list(VOWELS.encode())] = 1, 2
_POW = _BASE ** np.arange(MAX_PSEUDO // 2, dtype=np.int64)
_PAST: list[int] = []  # `_encode_long`'s answer for a text past its limit (told apart by identity)


def token_text(token_id: int) -> str:
    """The pseudo-word of one id (no spaces; `encode` maps it back to the id)."""
    if token_id < 0:
        raise ValueError(f"token id must be >= 0, got {token_id}")
    words = _tables()[0]
    return words[token_id] if token_id < len(words) else _spell(token_id)


@lru_cache(maxsize=1)
def _tables() -> tuple[list[str], dict[str, int]]:
    """All pseudo-words of up to three syllables in id order, and their inverse (built once, ~50 ms)."""
    two = [a + b for a in SYLLABLES for b in SYLLABLES]
    words = [*SYLLABLES, *two, *(a + b for a in two for b in SYLLABLES)]
    return words, {w: i for i, w in enumerate(words)}


def warm_up() -> None:
    """Build the word tables now (~0.3 s once per process) so the first request does not pay for it."""
    _tables()


def _spell(n: int) -> str:
    """Bijective base-64 numeral of n + 1, most significant syllable first."""
    n += 1
    out: list[str] = []
    while n > 0:
        n, r = divmod(n - 1, _BASE)
        out.append(SYLLABLES[r])
    return "".join(reversed(out))


def _parse(word: str) -> int:
    """Inverse of `_spell` for a pseudo-word."""
    n = 0
    for i in range(0, len(word), 2):
        n = n * _BASE + _SYL_INDEX[word[i : i + 2]] + 1
    return n - 1


def _hash_piece(piece: str) -> int:
    return xxhash.xxh3_64_intdigest(piece.encode("utf-8")) % VOCAB_SIZE


@lru_cache(maxsize=1 << 16)
def _encode_word(word: str) -> tuple[int, ...]:
    """Ids of one whitespace-free word that is not a short pseudo-word."""
    ids: list[int] = []
    for piece in _PIECE.findall(word):
        ids.extend(_piece_ids(piece))
    return tuple(ids)


def _piece_ids(piece: str):
    """The ids of one piece: a pseudo-word's own id, 5-letter chunks of other letter runs, else a hash."""
    c = piece[0]
    if c.isascii() and c.isalpha():
        if len(piece) <= MAX_PSEUDO and _PSEUDO.fullmatch(piece):
            return (_parse(piece),)
        return (_hash_piece(piece[i : i + _CHUNK]) for i in range(0, len(piece), _CHUNK))
    return (_hash_piece(piece),)


def encode(text: str) -> list[int]:
    """Token ids of `text`: pseudo-words exactly, other pieces hashed into `[0, VOCAB_SIZE)`."""
    if len(text) >= _ARRAY_CHARS and (ids := _encode_long(text, len(text))) is not None:
        return ids
    lookup = _tables()[1].get
    words = text.split()
    ids: list[int] = list(map(lookup, words))  # at C speed: text rendered from ids is all pseudo-words
    if None not in ids:
        return ids
    ids = []
    append, extend = ids.append, ids.extend
    for word in words:
        i = lookup(word)
        if i is not None:
            append(i)
        elif len(word) <= _LONG_WORD:
            extend(_encode_word(word))
        else:  # not cached: a cache of long words would hold every client's text
            for m in _PIECE.finditer(word):
                extend(_piece_ids(m.group()))
    return ids


def _encode_long(text: str, limit: int) -> list[int] | None:
    """`encode(text)` of an ASCII text by whole-array passes: each word that is a pseudo-word of at
    most MAX_PSEUDO letters gets its id by arithmetic, the others go word by word as in `encode`.
    `_PAST` once past `limit` tokens (a word is at least one); None for non-ASCII text."""
    try:
        raw = np.frombuffer(text.encode("ascii"), np.uint8)
    except UnicodeEncodeError:
        return None
    in_word = ~_ASCII_SPACE[raw]
    edges = np.flatnonzero(np.diff(in_word, prepend=False, append=False))
    starts, lens = edges[0::2], edges[1::2] - edges[0::2]
    if len(starts) > limit:
        return _PAST
    if not len(starts):
        return []
    chars = raw[in_word]  # every word's letters, end to end
    kind = _KIND[chars]  # 1 consonant, 2 vowel, 0 anything else
    first = np.cumsum(lens) - lens
    # a pseudo-word starts with a consonant, ends with a vowel and alternates (so its length is even)
    same = np.empty(len(chars), bool)
    same[:-1] = kind[:-1] == kind[1:]
    same[first[1:] - 1] = False  # the pair across two words does not count
    same[-1] = False
    same |= kind == 0
    pseudo = (
        ~np.logical_or.reduceat(same, first) & (kind[first] == 1) & (lens & 1 == 0) & (lens <= MAX_PSEUDO)
    )
    letters = chars[np.repeat(pseudo, lens)]  # the pseudo-words' letters (whole syllables)
    syl = _CON[letters[0::2]] + _VOW[letters[1::2]]
    n = lens[pseudo] >> 1
    at = np.cumsum(n) - n
    ids: list[int] = []
    if len(at):
        place = _POW[np.repeat(at + n - 1, n) - np.arange(len(syl))]  # 64 ** syllables after this one
        ids = (np.add.reduceat(syl * place, at) - 1).tolist()
    if len(ids) == len(starts):
        return ids
    out: list[int] = []
    before = (np.cumsum(pseudo) - pseudo).tolist()  # pseudo-words ahead of each word
    done = 0
    for w in np.flatnonzero(~pseudo).tolist():
        out += ids[done : before[w]]
        done = before[w]
        word = text[int(starts[w]) : int(starts[w] + lens[w])]
        if len(word) <= _LONG_WORD:
            out += _encode_word(word)
        elif not _extend_long(out, word, limit):
            return _PAST
        if len(out) > limit:
            return _PAST
    out += ids[done:]
    return out


def encode_bounded(text: str, limit: int) -> list[int] | None:
    """`encode(text)`, or None as soon as it is known to pass `limit` tokens: the work done is at most
    about `limit` tokens' worth plus a C-speed scan of the text, however long it is."""
    if len(text) <= limit:  # a token covers at least one character
        return encode(text)
    if len(text) >= _ARRAY_CHARS and (ids := _encode_long(text, limit)) is not None:
        return None if ids is _PAST or len(ids) > limit else ids
    lookup = _tables()[1].get
    ids: list[int] = []
    append, extend = ids.append, ids.extend
    for m in _WORD.finditer(text):
        word = m.group()
        i = lookup(word)
        if i is not None:
            append(i)
        elif len(word) <= _LONG_WORD:
            extend(_encode_word(word))
        elif not _extend_long(ids, word, limit):
            return None
        if len(ids) > limit:
            return None
    return ids


def _extend_long(ids: list[int], word: str, limit: int) -> bool:
    """Append a long word's ids piece by piece; False once `ids` passes `limit`."""
    for m in _PIECE.finditer(word):
        for t in _piece_ids(m.group()):
            ids.append(t)
            if len(ids) > limit:
                return False
    return True


def decode(ids: Iterable[int]) -> str:
    """The ids' pseudo-words joined by single spaces (`encode` of it gives the ids back)."""
    words = _tables()[0]
    ids = ids if isinstance(ids, list | tuple) else list(ids)
    if ids and (min(ids) < 0 or max(ids) >= len(words)):
        return " ".join(map(token_text, ids))
    return " ".join(map(words.__getitem__, ids))


def output_ids(n: int, start: int = 0) -> list[int]:
    """Ids of output tokens `start .. start+n-1`: the same deterministic filler for every request."""
    return [_output_id(i) for i in range(start, start + n)]


@lru_cache(maxsize=4096)
def _output_id(i: int) -> int:
    return xxhash.xxh3_64_intdigest(i.to_bytes(8, "little"), seed=_FILLER_SEED) % VOCAB_SIZE


def output_text(index: int) -> str:
    """Text of output token `index` as a stream delta: its word, with a leading space after the first."""
    word = token_text(_output_id(index))
    return word if index == 0 else " " + word


def apply_chat_template(messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True) -> str:
    """Render chat messages as text, deterministically: a `<|role|>` marker line, the content, `<|end|>`.

    Each message's rendering depends only on that message, so a conversation's next turn starts
    with the previous turn's rendering (prefix caching across turns works). An assistant
    message's `tool_calls` render as `<|tool_call|> name arguments` lines.
    """
    parts: list[str] = []
    for m in messages:
        role = str(m.get("role", ""))
        parts.append(f"<|{role}|>\n")
        name = m.get("name")
        if name:
            parts.append(f"<|name|> {name}\n")
        content = m.get("content")
        if content:
            parts.append(f"{content}\n")
        for call in m.get("tool_calls") or ():
            if isinstance(call, Mapping):
                fn = call.get("function") or {}
                if isinstance(fn, Mapping):
                    parts.append(f"<|tool_call|> {fn.get('name', '')} {fn.get('arguments', '')}\n")
        parts.append("<|end|>\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def write_hf_tokenizer(directory: str | Path) -> Path:
    """Save this vocabulary as a Hugging Face fast tokenizer (WordLevel, split on whitespace).

    For peers that load a tokenizer by path (AIPerf, transformers): on pseudo-word text it gives
    exactly our ids, other words map to `<unk>` (id VOCAB_SIZE). Plain JSON: no dependency.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    words = _tables()[0][:VOCAB_SIZE]
    vocab = {w: i for i, w in enumerate(words)}
    vocab[UNK] = VOCAB_SIZE
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": VOCAB_SIZE,
                "content": UNK,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec, separators=(",", ":")), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out
