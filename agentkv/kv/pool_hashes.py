"""`BlockPool`'s hash bookkeeping: full blocks get their hashes (cached, announced, told to the
policy and the lower tiers) and evicted blocks lose them. The hash -> block map takes a batch's
uint64 hashes in one compiled loop (`U64Map`; a dict, one hash at a time through C-level `map`,
once a hash outside uint64 arrives); the block -> hash tables are arrays updated in bulk."""

from __future__ import annotations

import numpy as np

from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.kv.hashmap import add_copies, drop_copies
from agentkv.kv.interface import KVRequest


class PoolHashes:
    """Mixin of `BlockPool`: `_cache` and `_uncache` over its `cached`, `dups`, `block_hash` and
    the uint64 mirror (`_bh`, `_has`)."""

    def _uncache(self, victims: np.ndarray) -> None:
        """Drop the hashes of evicted blocks, telling listeners and the lower tiers."""
        bh, cached, dups = self.block_hash, self.cached, self.dups
        hashes = bh[victims].tolist()
        keys = self._bh[victims] if self._mirror else None  # (a U64Map's keys: the mirror holds them)
        gone = drop_copies(cached, dups, self._has, victims, hashes, keys)
        bh[victims] = None
        self._has[victims] = False
        self._epoch += 1  # earlier lookups may name these blocks
        self.stats.evicted += len(victims)
        if self._emit is not None and hashes:
            self._emit(BlockRemoved(block_hashes=hashes, medium="GPU"))  # one per copy, as vLLM
        if self.lower is not None:
            for h in gone:
                self.lower.on_gpu_evict(h)

    def _cache(self, req: KVRequest, blocks: np.ndarray, lo: int, hi: int) -> None:
        """Give blocks[lo:hi] (full now) their hashes. As vLLM, a hash cached already (a fully
        cached prompt recomputes its last block; a prefix evicted and recomputed) gets this block as
        another copy: stored and announced like any block, found by lookups once its elders are gone."""
        cached, bh = self.cached, self.block_hash
        block_hashes, token_ids = req.block_hashes, req.token_ids
        seg_hashes = block_hashes[lo:hi]  # a list's slice is a copy already
        if type(seg_hashes) is not list:
            seg_hashes = list(seg_hashes)
        idx = blocks[lo:hi]
        seg_blocks = idx.tolist()
        keys = None
        if self._mirror:
            arr = getattr(req, "hash_array", None)  # uint64 hashes: no per-int conversion
            try:
                keys = arr[lo:hi] if arr is not None and len(arr) >= hi else np.array(seg_hashes, np.uint64)
            except (OverflowError, TypeError, ValueError):
                self._to_dict()  # hashes outside uint64: a dict map, plain lookups only
                cached = self.cached
        if keys is not None:  # (a U64Map) inserts only absent hashes
            got = cached.setdefault_many(keys, idx).tolist()
        else:
            got = list(map(cached.setdefault, seg_hashes, seg_blocks))
        bh[idx] = np.fromiter(seg_hashes, dtype=object, count=len(seg_hashes))
        primary = True if got == seg_blocks else add_copies(self.dups, seg_hashes, seg_blocks, got)
        if keys is not None:
            self._bh[idx] = keys
            self._has[idx] = primary
        parent = cached.get(block_hashes[lo - 1]) if lo else None
        self.policy.on_cached(seg_blocks, lo, parent, block_hashes)
        self.stats.stored += len(seg_blocks)
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
