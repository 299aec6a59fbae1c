"""`BlockPool`'s hash bookkeeping: full blocks get their hashes (cached, announced, told to the
policy and the lower tiers) and evicted blocks lose them. While the hash -> block map is a
`U64Map`, a batch's uint64 hashes go into its table and onto the block -> hash arrays in one
compiled pass (`stamp_loops.cache_marks`; an eviction nobody listens to, `uncache_marks`); once a
hash outside uint64 arrives it is a dict, one hash at a time through C-level `map`, and the arrays
are updated in bulk."""

from __future__ import annotations

import numpy as np

from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.kv.eviction.base import stamp_loops
from agentkv.kv.hashmap import add_copies, drop_copies
from agentkv.kv.interface import KVRequest
from agentkv.kv.u64map import as_keys


class PoolHashes:
    """Mixin of `BlockPool`: `_cache` and `_uncache` over its `cached`, `dups`, `_hashed` and the
    block -> hash tables: the uint64 mirror (`_bh`, `_has`) while the map is a `U64Map`, the object
    array `_obj` once it is a dict."""

    def hash_of(self, block: int) -> int | None:
        """The hash `block` holds (None: none), from whichever table the pool keeps."""
        if not self._hashed[block]:
            return None
        return int(self._bh[block]) if self._obj is None else self._obj[block]

    def _uncache(self, victims: np.ndarray) -> None:
        """Drop the hashes of evicted blocks, telling listeners and the lower tiers."""
        cached, dups, emit, lower = self.cached, self.dups, self._emit, self.lower
        if self._obj is None and not dups and emit is None and lower is None:
            # a U64Map, and nobody asks which hashes went: out of the table and unmarked in one
            # compiled pass, no Python ints at all
            mk, mv, shift, mask = cached.slots()
            loops = stamp_loops()
            gone, zero = loops.uncache_marks(victims, self._bh, self._has, self._hashed, mk, mv, shift, mask)
            cached.live_changed(-gone)
            if zero and 0 in cached:  # (hash 0 lives beside the table)
                del cached[0]
            self._epoch += 1  # earlier lookups may name these blocks
            self.stats.evicted += len(victims)
            return
        if self._obj is None:  # a U64Map: the mirror holds the keys
            keys = self._bh[victims]
            hashes = keys.tolist()  # (Python ints: the values the requests gave)
            gone = drop_copies(cached, dups, self._has, victims, hashes, keys)
        else:
            hashes = self._obj[victims].tolist()
            gone = drop_copies(cached, dups, self._has, victims, hashes)
            self._obj[victims] = None
        self._has[victims] = False
        self._hashed[victims] = False
        self._epoch += 1  # earlier lookups may name these blocks
        self.stats.evicted += len(victims)
        if emit is not None and hashes:
            emit(BlockRemoved(block_hashes=hashes, medium="GPU"))  # one per copy, as vLLM
        if lower is not None:
            for h in gone:
                lower.on_gpu_evict(h)

    def _cache(self, req: KVRequest, blocks: np.ndarray, lo: int, hi: int) -> None:
        """Give blocks[lo:hi] (full now) their hashes. As vLLM, a hash cached already (a fully
        cached prompt recomputes its last block; a prefix evicted and recomputed) gets this block as
        another copy: stored and announced like any block, found by lookups once its elders are gone."""
        block_hashes, token_ids = req.block_hashes, req.token_ids
        idx = blocks[lo:hi]
        seg_blocks = seg_hashes = None  # as lists, made only where something needs them
        keys = None
        if self._obj is None:
            arr = getattr(req, "hash_array", None)  # uint64 hashes: no per-int conversion
            keys = arr[lo:hi] if arr is not None and len(arr) >= hi else as_keys(block_hashes[lo:hi])
            if keys is None:
                self._to_dict()  # hashes outside uint64: a dict map, plain lookups only
        cached = self.cached
        if keys is not None:  # (a U64Map) inserts only absent hashes, marks all in one compiled pass
            cached.reserve(len(idx))
            mk, mv, shift, mask = cached.slots()
            got = np.empty(len(idx), dtype=np.int64)
            loops = stamp_loops()
            new, copies = loops.cache_marks(
                idx, keys, mk, mv, shift, mask, got, self._bh, self._has, self._hashed
            )
            if new >= 0:
                cached.live_changed(new)
                if copies:
                    seg_blocks, seg_hashes = idx.tolist(), _as_list(block_hashes[lo:hi])
                    add_copies(self.dups, seg_hashes, seg_blocks, got.tolist())
            else:  # a hash of 0 (the map keeps it aside): in steps
                got = cached.setdefault_many(keys, idx)
                primary = True
                if np.count_nonzero(got != idx):  # (count_nonzero: cheaper than .all() on short arrays)
                    seg_blocks, seg_hashes = idx.tolist(), _as_list(block_hashes[lo:hi])
                    primary = add_copies(self.dups, seg_hashes, seg_blocks, got.tolist())
                self._bh[idx] = keys
                self._has[idx] = primary
                self._hashed[idx] = True
        else:
            seg_blocks, seg_hashes = idx.tolist(), _as_list(block_hashes[lo:hi])
            got = list(map(cached.setdefault, seg_hashes, seg_blocks))
            self._obj[idx] = np.fromiter(seg_hashes, dtype=object, count=len(seg_hashes))
            if got != seg_blocks:
                add_copies(self.dups, seg_hashes, seg_blocks, got)
            self._hashed[idx] = True
        if self._on_cached is not None:
            parent = cached.get(block_hashes[lo - 1]) if lo else None
            self._on_cached(idx.tolist() if seg_blocks is None else seg_blocks, lo, parent, block_hashes)
        self.stats.stored += len(idx)
        if self._emit is None and self.lower is None:
            return
        if seg_hashes is None:
            seg_hashes = _as_list(block_hashes[lo:hi])
        if self._emit is not None:
            seg = token_ids[lo * self.block_size : hi * self.block_size] if token_ids is not None else []
            toks = seg.tolist() if hasattr(seg, "tolist") else list(seg)  # plain ints for msgpack
            self._emit(
                BlockStored(
                    block_hashes=seg_hashes,
                    parent_block_hash=block_hashes[lo - 1] if lo else None,
                    token_ids=toks,
                    block_size=self.block_size,
                    medium="GPU",
                )
            )
        if self.lower is not None:
            for h in seg_hashes:
                self.lower.on_gpu_store(h)


def _as_list(hashes) -> list:
    """A slice of a request's hashes as a list (a list's slice is a copy already)."""
    return hashes if type(hashes) is list else list(hashes)
