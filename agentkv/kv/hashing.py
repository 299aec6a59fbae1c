"""Chained prefix hashes over full blocks of token ids: the one home for block hashing.

`h_i = H(h_{i-1}, tokens_i, extra_i)`: equal hashes at block i mean equal tokens in blocks 0..i,
so a prefix cache looks blocks up by hash. Only full blocks are hashed. Two families:

- `xxhash` (fast default): XXH3-64 over each block's int32 little-endian bytes, seeded with
  the parent hash; the first block's parent is a root derived from the seed and the tenant
  salt; a LoRA name is folded into every block's seed. 64-bit unsigned ints throughout.
- `sha256` / `sha256_cbor` (vLLM-exact, see `VllmHasher`): bit-for-bit vLLM's prefix-caching
  hashes, so a router can match the `block_hashes` of live vLLM KV events.

Every hasher gives 64-bit keys (`Hasher.hashes`) and a `BlockChain` whose `tail` is the parent
a continuation passes on (the full 32-byte digest for the vLLM families). `cache_salt` enters
only the first block of a chain, i.e. only when no `parent` is given, as in vLLM.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np
import xxhash

from agentkv.errors import UserError
from agentkv.kv import HASH_ALGOS

ALGOS = HASH_ALGOS
MASK64 = (1 << 64) - 1

Parent = int | bytes
Tokens = Sequence[int] | np.ndarray

_xxh = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class BlockChain:
    """The 64-bit keys of a run of full blocks, and `tail`: the parent for the next block.

    `tail` is the last block's hash in the family's native form (int for xxhash, the 32-byte
    digest for vLLM), or the given parent (None at the start) when no block was full.
    """

    keys: list[int]
    tail: Parent | None


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def as_token_array(tokens: Tokens) -> np.ndarray:
    """Token ids as a 1-D contiguous little-endian int32 array (no copy when already one)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.dtype != np.dtype("<i4"):
            if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
                raise ValueError("token id out of int32 range")
            arr = arr.astype("<i4")
        return np.ascontiguousarray(arr)
    try:
        if isinstance(tokens, list | tuple):  # fromiter: about 1.3x faster than asarray on lists
            return np.fromiter(tokens, dtype="<i4", count=len(tokens))
        arr = np.asarray(tokens, dtype="<i4")
    except OverflowError:
        raise ValueError("token id out of int32 range") from None
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    return arr


class Hasher(ABC):
    """One hash family behind one interface, so pool, engine and router can take either."""

    algo: str

    @abstractmethod
    def chain(
        self,
        tokens: Tokens,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> BlockChain:
        """Hash the full blocks of `tokens` after `parent` (None: start of a sequence)."""

    def hashes(
        self,
        tokens: Tokens,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """64-bit keys of the full blocks of `tokens` (the trailing partial block is not hashed)."""
        return self.chain(tokens, block_size, parent=parent, cache_salt=cache_salt, lora_name=lora_name).keys

    def sequence(
        self,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> SequenceHasher:
        """An incremental hasher for one growing sequence (prompt, then decoded tokens)."""
        return SequenceHasher(self, block_size, parent=parent, cache_salt=cache_salt, lora_name=lora_name)


class XxHasher(Hasher):
    """The fast family: `h_i = XXH3_64(int32 LE bytes of block i, seed=h_{i-1} ^ lora_key)`.

    The first block's parent is `XXH3_64("agentkv-root" [+ NUL + salt], seed)`; `lora_key` is
    `XXH3_64("agentkv-lora" + NUL + name, seed)` (0 without a LoRA). `seed` plays the role of
    vLLM's NONE_HASH seed: fixed by default, so every process agrees.
    """

    algo = "xxhash"

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK64:
            raise ValueError(f"xxhash seed must be an int in [0, 2**64), got {seed!r}")
        self.seed = seed
        self._root = _xxh(b"agentkv-root", seed)

    def root(self, cache_salt: str | None = None) -> int:
        """The parent of a sequence's first block; a salt gives each tenant its own root."""
        if not cache_salt:
            return self._root
        return _xxh(b"agentkv-root\0" + cache_salt.encode("utf-8"), self.seed)

    def lora_key(self, lora_name: str | None) -> int:
        return _xxh(b"agentkv-lora\0" + lora_name.encode("utf-8"), self.seed) if lora_name else 0

    def chain(
        self,
        tokens: Tokens,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> BlockChain:
        _check_block_size(block_size)
        if parent is not None and (
            isinstance(parent, bool) or not isinstance(parent, int) or not 0 <= parent <= MASK64
        ):
            raise TypeError(f"xxhash parent must be a 64-bit unsigned int, got {parent!r}")
        arr = as_token_array(tokens)
        n = len(arr) // block_size
        if n == 0:
            return BlockChain([], parent)
        h = self.root(cache_salt) if parent is None else parent
        lk = self.lora_key(lora_name)
        mv = memoryview(arr[: n * block_size]).cast("B")
        step = block_size * 4
        keys: list[int] = []
        append = keys.append
        if lk:
            for off in range(0, n * step, step):
                h = _xxh(mv[off : off + step], h ^ lk)
                append(h)
        else:
            for off in range(0, n * step, step):
                h = _xxh(mv[off : off + step], h)
                append(h)
        return BlockChain(keys, h)


# vLLM ------------------------------------------------------------------------------------------

VLLM_DEFAULT_SEED = "vllm-none-hash"
_FROM_ENV: Any = object()


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


class VllmHasher(Hasher):
    """vLLM's prefix-caching block hashes, bit for bit (`--prefix-caching-hash-algo`).

    What vLLM does (vllm/v1/core/kv_cache_utils.py and vllm/utils/hashing.py, read via the code
    index; the unsalted and salted vectors of ../shared/vllm/README.md, observed on vLLM 0.32,
    are checked in tests/test_hashing.py):
    - `H(x) = sha256(pickle.dumps(x, HIGHEST_PROTOCOL))` for `sha256`, and
      `sha256(cbor2.dumps(x, canonical=True))` for `sha256_cbor`.
    - block hash `H((parent or NONE_HASH, tuple(tokens), extra_keys))`; the parent is the previous
      block's full 32-byte digest; the KV event carries its low 64 bits (big-endian digest).
    - `NONE_HASH = H(seed)` with the same H (the seed string itself is pickled or CBOR-encoded):
      `resolve_none_hash_seed` returns `PYTHONHASHSEED` when set (even ""), otherwise the fixed
      `DEFAULT_NONE_HASH_SEED = "vllm-none-hash"` for the cryptographic algorithms (older vLLM,
      before that helper, drew `os.urandom(32)` instead, so unseeded hashes did not reproduce).
    - extra keys, in vLLM's order `lora + mm + cache_salt + prompt_embeds`: `("lora", name)` on
      every block and `("cache_salt", salt)` on the first block only; `None` when empty. The
      tagged salt is confirmed by the live vectors; the tagged LoRA key is inferred from the same
      change (vllm PR #44706) and not yet checked against a live LoRA event. `tagged=False` gives
      the earlier bare-string keys (`name`, `salt`), for vLLM releases before that change.
    """

    def __init__(self, algo: str = "sha256", hash_seed: str | None = _FROM_ENV, *, tagged: bool = True):
        if algo == "sha256":
            self._ser = _pickle_bytes
        elif algo == "sha256_cbor":
            self._ser = _cbor_bytes
        else:
            raise UserError(f"unknown vLLM hash algorithm '{algo}' (expected sha256 or sha256_cbor)")
        self.algo = algo
        if hash_seed is _FROM_ENV:
            hash_seed = os.environ.get("PYTHONHASHSEED")
        self.seed: str = VLLM_DEFAULT_SEED if hash_seed is None else str(hash_seed)
        self.tagged = tagged
        self.none_hash: bytes = self._h(self.seed)

    def _h(self, obj: Any) -> bytes:
        return hashlib.sha256(self._ser(obj)).digest()

    def extra_keys(self, first: bool, cache_salt: str | None, lora_name: str | None) -> tuple | None:
        """The `extra_keys` vLLM hashes with a block (first: the block starts the sequence)."""
        keys: list[Any] = []
        if lora_name:
            keys.append(("lora", lora_name) if self.tagged else lora_name)
        if first and cache_salt:
            keys.append(("cache_salt", cache_salt) if self.tagged else cache_salt)
        return tuple(keys) if keys else None

    def block_hashes(
        self,
        tokens: Tokens,
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        *,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The full 32-byte digests of the full blocks of `tokens` (vLLM's `BlockHash`es)."""
        _check_block_size(block_size)
        if parent is not None and not isinstance(parent, bytes):
            raise TypeError(
                f"a vLLM parent is the previous block's 32-byte digest, got {type(parent).__name__}"
                " (a 64-bit event hash cannot be extended; pass BlockChain.tail)"
            )
        toks = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        n = len(toks) // block_size
        first_extra = self.extra_keys(not parent, cache_salt, lora_name)
        rest_extra = self.extra_keys(False, cache_salt, lora_name)
        h = parent or self.none_hash
        ser, sha = self._ser, hashlib.sha256
        out: list[bytes] = []
        for i in range(n):
            block = tuple(toks[i * block_size : (i + 1) * block_size])
            h = sha(ser((h, block, first_extra if i == 0 else rest_extra))).digest()
            out.append(h)
        return out

    def event_hashes(
        self,
        tokens: Tokens,
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        *,
        parent: bytes | None = None,
    ) -> list[int]:
        """The 64-bit `block_hashes` vLLM's KV events carry for these blocks."""
        return [
            event_hash(d) for d in self.block_hashes(tokens, block_size, cache_salt, lora_name, parent=parent)
        ]

    def chain(
        self,
        tokens: Tokens,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> BlockChain:
        digests = self.block_hashes(tokens, block_size, cache_salt, lora_name, parent=parent)  # type: ignore[arg-type]
        return BlockChain([event_hash(d) for d in digests], digests[-1] if digests else parent)


def event_hash(digest: bytes) -> int:
    """A vLLM digest's event form: the low 64 bits of the big-endian digest, unsigned."""
    return int.from_bytes(digest[-8:], "big")


# Incremental hashing and the factory ------------------------------------------------------------


class SequenceHasher:
    """Hashes one growing sequence block by block: each block once, when its last token arrives.

    `extend` returns the keys of the blocks it completed; `keys` holds them all, `tail` the
    parent of the next block. Equal to one-shot hashing of the whole sequence.
    """

    def __init__(
        self,
        hasher: Hasher,
        block_size: int,
        *,
        parent: Parent | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ):
        _check_block_size(block_size)
        self.hasher, self.block_size = hasher, block_size
        self.cache_salt, self.lora_name = cache_salt, lora_name
        self.tail: Parent | None = parent
        self.keys: list[int] = []
        self.num_tokens = 0
        self._pending: list[int] = []  # tokens of the block not yet full

    def extend(self, tokens: Tokens) -> list[int]:
        """Add tokens; return the keys of the blocks they completed (often none in decode)."""
        if len(self._pending) + len(tokens) < self.block_size:  # decode's common case: no new block
            self._pending.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
            self.num_tokens += len(tokens)
            return []
        new = as_token_array(tokens)
        self.num_tokens += len(new)
        buf = np.concatenate((as_token_array(self._pending), new)) if self._pending else new
        full = len(buf) // self.block_size * self.block_size
        self._pending = buf[full:].tolist()
        ch = self.hasher.chain(
            buf[:full],
            self.block_size,
            parent=self.tail,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
        )
        self.tail = ch.tail
        self.keys.extend(ch.keys)
        return ch.keys


def make_hasher(algo: str = "xxhash", seed: int | str | None = None) -> Hasher:
    """A hasher by name: `xxhash` (seed: int, default 0) or vLLM's `sha256` / `sha256_cbor`
    (seed: the PYTHONHASHSEED string; None reads the environment as vLLM does)."""
    if algo == "xxhash":
        if isinstance(seed, str):
            seed = _xxh(seed.encode("utf-8"))
        return XxHasher(0 if seed is None else seed)
    if algo in ("sha256", "sha256_cbor"):
        return VllmHasher(algo) if seed is None else VllmHasher(algo, str(seed))
    raise UserError(f"unknown hash algorithm '{algo}' (expected one of: {', '.join(ALGOS)})")


DEFAULT_HASHER = XxHasher()


def block_hashes(
    tokens: Tokens,
    block_size: int,
    *,
    parent: int | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """Fast (xxhash) 64-bit hashes of the full blocks of `tokens`; pass `parent` to continue."""
    return DEFAULT_HASHER.hashes(
        tokens, block_size, parent=parent, cache_salt=cache_salt, lora_name=lora_name
    )


__all__ = [
    "ALGOS",
    "DEFAULT_HASHER",
    "BlockChain",
    "Hasher",
    "SequenceHasher",
    "VllmHasher",
    "XxHasher",
    "as_token_array",
    "block_hashes",
    "event_hash",
    "make_hasher",
]
