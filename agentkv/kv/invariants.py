"""The block pool's invariants, stated and asserted (`BlockPool.check_invariants`, for tests).

- `ref[b]` equals the number of running requests whose block table holds `b`.
- A block is free iff `ref[b] == 0`; a free block is either *empty* (no hash: on the empty stack) or
  *cached* (has a hash: held by the eviction policy), never both; in-use blocks are in neither.
- Only full blocks get hashes. `cached[h]` is the oldest block holding hash `h`, the one a lookup
  returns; `dups[h]` lists its other copies, oldest first: like vLLM, the pool does not
  de-duplicate, so a block computed again under a cached hash (the last block of a fully cached
  prompt is always recomputed) is a cached copy too, stored and evicted with its own events.
  Every block with a hash is in exactly one of the two.
- Eviction only takes free cached blocks, and only when no empty block is left.

This is the pool's own checker, in a module of its own for size: it reads the pool's private state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentkv.kv.u64map import U64Map

if TYPE_CHECKING:
    from agentkv.kv.pool import BlockPool


def check_pool(pool: BlockPool) -> None:
    """Assert every invariant of `pool` and of its eviction policy (O(num_blocks))."""
    _check_tables(pool)
    _check_free(pool)
    _check_hashes(pool)
    pool.policy.check()


def _check_tables(pool: BlockPool) -> None:
    """Reference counts equal the running requests' block tables."""
    counts = np.zeros(pool.num_blocks, dtype=np.int64)
    for rid, blocks in pool._req_blocks.items():
        assert len(set(blocks.tolist())) == len(blocks), f"request {rid} holds a block twice"
        counts[blocks] += 1
        assert pool._req_hashed[rid] <= len(blocks), rid
        buf = pool._req_buf.get(rid)  # a grown table is its buffer's head (`tables.appended`)
        assert buf is None or (blocks.base is buf and np.shares_memory(blocks[:1], buf[:1])), rid
    assert pool._req_buf.keys() <= pool._req_blocks.keys(), "a table buffer outlived its request"
    assert (counts == pool.ref).all(), "ref counts differ from the requests' block tables"


def _check_free(pool: BlockPool) -> None:
    """A block is free iff it is empty (no hash) or evictable (a hash), never both."""
    empty_list = pool._empty[: pool._n_empty].tolist()
    empty, evictable = set(empty_list), {int(b) for b in pool.policy.blocks()}
    assert len(empty) == len(empty_list), "a block is twice in the empty stack"
    assert len(evictable) == len(pool.policy), "policy size differs from its blocks"
    assert not empty & evictable, "a block is both empty and evictable"
    for b in range(pool.num_blocks):
        free = pool.ref[b] == 0
        assert free == (b in empty or b in evictable), f"block {b}: free iff in empty/policy"
        if b in empty:
            assert pool.hash_of(b) is None, f"empty block {b} has a hash"
        if b in evictable:
            assert pool.hash_of(b) is not None, f"evictable block {b} has no hash"


def _check_hashes(pool: BlockPool) -> None:
    """Every hashed block is the one `cached` names or one of its `dups`; the numpy mirror agrees."""
    bh = [pool.hash_of(b) for b in range(pool.num_blocks)]
    assert pool.num_cached_blocks == sum(h is not None for h in bh)
    if pool._obj is not None:
        assert [h is not None for h in pool._obj.tolist()] == pool._hashed.tolist(), (
            "hashed flags out of step"
        )
    for h, b in pool.cached.items():
        assert bh[b] == h, f"cached hash {h} -> block {b}, which holds {bh[b]}"
    for h, others in pool.dups.items():
        assert others and h in pool.cached and pool.cached[h] not in others, f"copies of {h}: {others}"
        assert all(bh[b] == h for b in others), f"a copy of {h} holds another hash"
    if pool._mirror:
        firsts = set(pool.cached.values())
        has = [b in firsts for b in range(pool.num_blocks)]
        assert pool._has.tolist() == has, "hash mirror out of step"
        assert all(int(pool._bh[b]) == h for h, b in pool.cached.items()), "hash mirror value differs"


def check_hybrid(pool) -> None:
    """A hybrid pool's (`HybridPool.check_invariants`): bytes add up, the LRU holds exactly the
    unreferenced cached blocks, maps, tables and group 0's uint64 mirror agree, and no free id is
    live (O(blocks))."""
    held = np.zeros_like(pool.ref)
    for tables in pool.tables.values():
        for t in tables:
            for b in t.tolist():
                if b >= 0:  # -1: the null block
                    held[b] += 1
    assert (held == pool.ref).all(), "reference counts differ from the block tables"
    used = sum(pool.block_cost(b) for b in np.flatnonzero(pool.ref > 0).tolist())
    lru_blocks = pool.lru.blocks()
    assert len(lru_blocks) == len(pool.lru), "the LRU's count is off"
    lru = sum(pool.block_cost(b) for b in lru_blocks)
    assert lru == pool.evictable_bytes, "evictable bytes differ from the LRU"
    assert used + lru + pool.empty_bytes == pool.capacity, "bytes do not add up to the capacity"
    for b in lru_blocks:
        assert pool.ref[b] == 0 and pool.hashed_blk[b], f"block {b} in the LRU is held or unhashed"
    for g, d in enumerate(pool.cached_maps):
        for h, b in d.items():
            assert pool.hash_of(b) == h and pool.bgroup[b] == g, f"group {g}: hash {h} maps to block {b}"
    for g in range(len(pool.specs)):  # younger copies hold their hash too, never the map's block
        for h, bs in pool.group_copies(g).items():
            assert bs and pool.cached_maps[g][h] not in bs, f"group {g}: hash {h}'s copies are off"
            assert all(pool.hash_of(b) == h and pool.bgroup[b] == g for b in bs)
    _check_chains(pool)
    if pool.mirror:  # a nonzero mirror entry names a block that group 0's map gives for that hash
        first = pool.cached_maps[0]
        for b in np.flatnonzero(pool.bh64).tolist():
            assert first.get(int(pool.bh64[b])) == b, f"block {b}: uint64 mirror out of step"
    free = pool._ids[: pool._n_ids].tolist()
    assert len(set(free)) == len(free), "a block id is free twice"
    assert all(0 <= b < pool._fresh <= len(pool.ref) for b in free), "a free id was never taken"
    live = set(np.flatnonzero(pool.ref > 0).tolist()) | set(lru_blocks)
    assert not live & set(free), "a held or cached block id is also free"


def _check_chains(pool) -> None:
    """Group 0's copy chains (while its map is a U64Map): each links both ways from the map's block
    to its tail, holds only cached blocks, and no other block is linked."""
    chained = pool.group_copies(0) if type(pool.cached_maps[0]) is U64Map else {}  # (else none linked)
    linked = 0
    for h, bs in chained.items():
        head = pool.cached_maps[0][h]
        prev = head
        for b in bs:
            assert int(pool.cprev[b]) == prev, f"block {b}: its chain's back link is off"
            prev = b
        assert int(pool.ctail[head]) == bs[-1], f"hash {h}: its chain's tail is off"
        linked += len(bs)
    assert np.count_nonzero(pool.cprev >= 0) == linked, "a block outside the chains is linked"
    assert np.count_nonzero(pool.cnext >= 0) == linked, "a chain's forward links are off"
    assert np.count_nonzero(pool.ctail >= 0) == len(chained), "a tail outside the chains"
    assert all(pool.ctail[b] < 0 for bs in chained.values() for b in bs), "a copy has a tail"
