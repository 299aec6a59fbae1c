"""The pool's hash -> block map: prefix searches over it, and its duplicate copies (as in vLLM, a
block recomputed under a cached hash is another copy: `cached[h]` is the oldest, `dups[h]` the rest)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from agentkv.kv.u64map import U64Map, as_keys


def gallop(
    get: Callable[[int], int | None], block_hashes: Sequence[int], limit: int, start: int = 0
) -> list[int]:
    """The blocks `get` gives for the longest known run of block_hashes[start:limit], looked up in
    growing chunks through C-level `map` (an early miss does not cost a lookup of every later hash)."""
    found: list[int] = []
    lo, step = start, 32
    while lo < limit:
        hi = min(limit, lo + step)
        chunk = list(map(get, block_hashes[lo:hi]))
        if None in chunk:
            found += chunk[: chunk.index(None)]
            return found
        found += chunk
        lo, step = hi, step * 4
    return found


def gallop_map(
    m: U64Map, block_hashes: Sequence[int], limit: int, start: int = 0, hash_array: np.ndarray | None = None
) -> list[int]:
    """As `gallop`, through a `U64Map`'s compiled run: `hash_array` (the hashes as uint64) whole, or
    the hashes converted chunk by chunk (a hash outside uint64 is in no such map: the run ends there)."""
    if hash_array is not None and len(hash_array) >= limit:
        return m.run(hash_array[start:limit]).tolist()
    found: list[int] = []
    lo, step = start, 32
    while lo < limit:
        hi = min(limit, lo + step)
        ks = as_keys(block_hashes[lo:hi])
        if ks is None:
            return found + gallop(m.get, block_hashes, hi, lo)
        got = m.run(ks)
        found += got.tolist()
        if len(got) < hi - lo:
            return found
        lo, step = hi, step * 4
    return found


def find_run(
    cached: dict[int, int] | U64Map,
    block_hashes: Sequence[int],
    limit: int,
    start: int = 0,
    hash_array: np.ndarray | None = None,
) -> list[int]:
    """The cached blocks of the longest run of block_hashes[start:limit]: a `U64Map` through its
    compiled run (`gallop_map`), any other mapping through its `get` (`gallop`)."""
    if type(cached) is U64Map:
        return gallop_map(cached, block_hashes, limit, start, hash_array)
    return gallop(cached.get, block_hashes, limit, start)


def prefix_len(has: Callable[[int], bool], hashes: Sequence[int], start: int) -> int:
    """Index of the first hash at/after `start` that `has` lacks, by bisection: exact for sets that
    hold prefixes whole (what a cache with tail-first eviction keeps, and what an index knows)."""
    n = len(hashes)
    if start >= n or not has(hashes[start]):
        return start
    if has(hashes[n - 1]):
        return n
    lo, hi = start, n - 1  # has(lo), not has(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if has(hashes[mid]):
            lo = mid
        else:
            hi = mid
    return hi


def add_copies(
    dups: dict[int, list[int]], hashes: list[int], blocks: list[int], got: list[int]
) -> list[bool]:
    """Record as copies the blocks whose hash the map gave another block (`got`); which ones are first."""
    primary = [g == b for g, b in zip(got, blocks, strict=True)]
    for b, h, first in zip(blocks, hashes, primary, strict=True):
        if not first:
            dups.setdefault(h, []).append(b)
    return primary


def drop_copies(
    cached: dict[int, int] | U64Map,
    dups: dict[int, list[int]],
    has: np.ndarray | None,
    blocks: np.ndarray,
    hashes: list[int] | None,
    keys: np.ndarray | None = None,
    named: np.ndarray | None = None,
) -> list[int] | None:
    """Forget evicted blocks (`blocks`, `hashes` in step; `keys`: the hashes as uint64, given with
    a `U64Map`); a hash with other copies stays, its next oldest copy answering lookups (`has`, if
    given, marks it True; `named` gets its hash). Returns the hashes no block holds any more (what the
    tiers below and the policy hear of). When no victim's hash has copies, all at once; then
    `hashes` may be None with a `U64Map` (and None is returned)."""
    if not dups or not dups.keys() & hashes:  # (C-level: no victim's hash has another copy)
        if keys is not None:
            cached.delete_many(keys)
        else:
            deque(map(cached.__delitem__, hashes), 0)
        return hashes
    # the map is read before the walk (a U64Map in one compiled call) and written after it (one
    # key at a time from Python a U64Map costs about 0.7 us against a dict's 0.05)
    cur = None if keys is None else cached.run(keys)  # (a copy's hash is mapped to its oldest copy)
    if cur is not None and len(cur) < len(keys):
        raise KeyError(f"evicted block {int(blocks[len(cur)])}'s hash {hashes[len(cur)]} is not cached")
    cur = cur.tolist() if cur is not None else [cached[h] for h in hashes]
    final: dict[int, int] = {}  # hash -> the block the map gives after the walk (-1: none)
    gone = []
    for b, h, c in zip(blocks.tolist(), hashes, cur, strict=True):
        others = dups.get(h)
        if others is None:
            final[h] = -1
            gone.append(h)
            continue
        if final.get(h, c) == b:
            final[h] = nxt = others.pop(0)
            if has is not None:
                has[nxt] = True
            if named is not None:
                named[nxt] = h
        else:
            others.remove(b)
        if not others:
            del dups[h]
    if keys is None:
        for h, v in final.items():
            if v < 0:
                del cached[h]
            else:
                cached[h] = v
        return gone
    ks = np.fromiter(final.keys(), np.uint64, len(final))
    vs = np.fromiter(final.values(), np.int64, len(final))
    kept = vs >= 0
    cached.delete_many(ks[~kept])
    cached.assign_many(ks[kept], vs[kept])  # in place, as `cached[h] = nxt` one at a time
    return gone
