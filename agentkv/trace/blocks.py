"""Trace blocks -> deterministic token ids, and their chained keys without the tokens.

Traces carry `hash_ids` (prefix block ids), not text. To replay them against a real server or
engine we need token ids that share exactly where the trace's blocks are shared:

- every trace block (space key, hash id) gets a *base*, a 64-bit value, and its tokens are a
  counter-based hash (splitmix64) of (base, position): a pure function, so any process, any
  machine and any numpy version produce the same tokens; vectorised over whole requests.
- tokens past the blocks `hash_ids` cover (the trailing partial block of a trace) are filler:
  virtual blocks `m = 0, 1, ...` whose bases derive from (space key, last hash id, m).
- `chain_keys` maps a request to the chained keys of *engine* blocks of another size from the
  same bases, so the simulator need not materialise tokens.

A request's hash ids mean something within its hash space (`hash_space`: one live replay of a
trace, or a whole file for global ids); the space key is a stable 64-bit hash of that name
(XXH3, never Python's `hash()`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

DEFAULT_VOCAB = (1000, 31000)

_U = np.uint64
_M1, _M2 = _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_GOLDEN = _U(0x9E3779B97F4A7C15)  # odd: k + i * GOLDEN is injective in i (mod 2**64)
_POS = _U(0xD1B54A32D192ED03)
_REAL, _FILL, _EMPTY = 0x7265616C, 0x66696C6C, 0x656D7074  # domain tags: "real", "fill", "empt"


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (a bijection; wraps mod 2**64)."""
    x = (x ^ (x >> _U(30))) * _M1
    x = (x ^ (x >> _U(27))) * _M2
    return x ^ (x >> _U(31))


def _mix1(x: int) -> int:
    return int(_mix(np.array([x & 0xFFFFFFFFFFFFFFFF], dtype=_U))[0])


def space_key(space: str | int) -> int:
    """A stable 64-bit key of a hash space (XXH3-64 of its UTF-8); an int is used as the key."""
    if isinstance(space, str):
        return xxhash.xxh3_64_intdigest(space.encode("utf-8"))
    if isinstance(space, bool) or not isinstance(space, int | np.integer):
        raise TypeError(f"hash space must be a str or an int key, got {type(space).__name__}")
    return int(space) & 0xFFFFFFFFFFFFFFFF


def _slot_bases(key: int, hash_ids: Sequence[int] | np.ndarray, m: int) -> np.ndarray:
    """Bases of the first `m` trace-block slots: real blocks, then filler after the last one."""
    ids = np.asarray(hash_ids[:m] if len(hash_ids) > m else hash_ids, dtype=np.int64).view(_U)
    out = np.empty(m, dtype=_U)
    k = len(ids)
    if k:
        out[:k] = _mix(_U(_real(key)) + ids * _GOLDEN)
    if m > k:
        out[k:] = _mix(_U(_fill(key, hash_ids)) + np.arange(m - k, dtype=_U) * _GOLDEN)
    return out


def _real(key: int) -> int:
    """The base a request's real slots (its hash ids) count from, in space `key`."""
    return _mix1(key ^ _REAL)


def _fill(key: int, hash_ids: Sequence[int] | np.ndarray) -> int:
    """The base the filler slots after a request's last block count up from."""
    if len(hash_ids):
        last = int(hash_ids[-1]) & 0xFFFFFFFFFFFFFFFF
        return _mix1(_mix1(key ^ _FILL) + last * int(_GOLDEN))
    return _mix1(key ^ _FILL ^ _EMPTY)


def _tokens(bases: np.ndarray, n: int, vocab: tuple[int, int]) -> np.ndarray:
    """`n` tokens per base, uniform in [lo, hi): position-keyed hash of (base, position)."""
    lo, hi = vocab
    pos = (np.arange(n, dtype=_U) + _U(1)) * _POS
    x = _mix(bases[:, None] + pos[None, :])
    return ((x >> _U(32)) * _U(hi - lo) >> _U(32)).astype(np.int64).astype(np.int32) + np.int32(lo)


def _check(block_size: int, vocab: tuple[int, int]) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    lo, hi = vocab
    if not 0 <= lo < hi <= 2**31:
        raise ValueError(f"vocab must be (lo, hi) with 0 <= lo < hi <= 2**31, got {vocab!r}")


def trace_block_tokens(
    space: str | int, hash_id: int, block_size: int, vocab: tuple[int, int] = DEFAULT_VOCAB
) -> np.ndarray:
    """The `block_size` int32 token ids of trace block `hash_id` (deterministic, in [lo, hi))."""
    _check(block_size, vocab)
    return _tokens(_slot_bases(space_key(space), [hash_id], 1), block_size, vocab)[0]


def request_tokens(
    space: str | int,
    hash_ids: Sequence[int] | np.ndarray,
    input_tokens: int,
    block_size: int,
    vocab: tuple[int, int] = DEFAULT_VOCAB,
) -> np.ndarray:
    """A request's prompt: its trace blocks' tokens concatenated, cut to `input_tokens`.

    Tokens past the blocks `hash_ids` cover are filler derived from the last block, so two
    requests with the same blocks and lengths get the same prompt.
    """
    _check(block_size, vocab)
    if input_tokens < 0:
        raise ValueError(f"input_tokens must be >= 0, got {input_tokens}")
    m = -(-input_tokens // block_size)
    if m == 0:
        return np.empty(0, dtype=np.int32)
    return _tokens(_slot_bases(space_key(space), hash_ids, m), block_size, vocab).ravel()[:input_tokens]


def chain_keys(
    space: int | str,
    hash_ids: Sequence[int] | np.ndarray,
    trace_block_size: int,
    block_size: int,
    input_tokens: int,
) -> np.ndarray:
    """Chained uint64 keys of a request's full engine blocks of `block_size`, without tokens.

    Contract: with `request_tokens(space, hash_ids, input_tokens, trace_block_size)` as the
    prompt, there is one key per full engine block inside `input_tokens`, and two requests
    share their first k keys iff their prompts share the tokens of those k engine blocks (up
    to 64-bit collisions), as chained token hashes would. `block_size` must divide the trace's
    block size (each trace block splits into sub-blocks) or be a multiple of it (engine blocks
    group trace blocks), or neither (a hybrid model's aligned size: engine blocks group sub-blocks of
    gcd(block_size, trace block size) tokens). The keys live in their own key space: compare them
    with each other, not with `block_hashes` of the tokens.
    """
    return key_chain(space, hash_ids, trace_block_size, block_size, input_tokens).keys


class KeyChain(NamedTuple):
    """A request's `chain_keys` and what a later request of the same session needs to resume them
    where the two agree: its ids as uint64, its real slots' base, each block's prefix hash, its r and
    per (sub-blocks to a trace slot and to an engine block); `resumed`: its leading keys taken from
    the chain it resumed (0: none)."""

    keys: np.ndarray
    ids: np.ndarray
    real: int
    state: np.ndarray
    r: int
    per: int
    resumed: int = 0


def key_chain(
    space: int | str,
    hash_ids: Sequence[int] | np.ndarray,
    trace_block_size: int,
    block_size: int,
    input_tokens: int,
    prev: KeyChain | None = None,
) -> KeyChain:
    """`chain_keys` with its resume state; `prev` (an earlier request's chain, as a session's previous
    turn): its keys are taken for the leading blocks whose trace slots hold the same ids in the same
    space, and the chain goes on from there (the same keys as computed afresh)."""
    t, b = trace_block_size, block_size
    _check(t, DEFAULT_VOCAB)
    _check(b, DEFAULT_VOCAB)
    n = max(input_tokens, 0) // b
    # engine blocks fold sub-blocks of g = gcd(b, t) tokens: r of them to a trace block, per to an
    # engine block (an engine block dividing the trace's is one sub-block; a multiple, whole ones)
    g = math.gcd(b, t)
    r, per = t // g, b // g
    out, state = np.empty(n, dtype=_U), np.empty(n, dtype=_U)
    if n == 0:
        return KeyChain(out, out, 0, state, r, per)
    m = -(-n * per // r)  # trace slots the blocks cover: the request's ids, then filler
    key = space_key(space)
    ids = np.asarray(hash_ids[:m] if len(hash_ids) > m else hash_ids, dtype=np.int64).view(_U)
    real = _real(key)
    j0 = 0
    if prev is not None and prev.real == real and prev.r == r and prev.per == per:
        c = min(len(prev.ids), len(ids))  # the slots both fill with ids, up to the first that differs
        diff = np.flatnonzero(prev.ids[:c] != ids[:c])
        c = int(diff[0]) if len(diff) else c
        j0 = min(c * r // per, len(prev.keys), n)  # blocks whose every sub-block is in those slots
        out[:j0], state[:j0] = prev.keys[:j0], prev.state[:j0]
    fill = _U(_fill(key, hash_ids)) if m > len(ids) else _U(0)
    p0 = state[j0 - 1] if j0 else _U(0)
    (_chain or _load_chain())(ids, _U(real), fill, r, per, n, out, state, j0, p0)
    return KeyChain(out, ids, real, state, r, per, j0)


_chain = None  # chain_loops.chain, imported at the first chain_keys (numba loads it then)


def _load_chain():
    global _chain
    from agentkv.trace.chain_loops import chain

    _chain = chain
    return chain
