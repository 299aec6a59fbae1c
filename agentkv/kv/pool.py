"""The paged KV block pool with a prefix cache, in the shape of vLLM v1's BlockPool + KVCacheManager.

Blocks are ints `0..num_blocks-1`. Per-block Python work is what limits a pure-Python pool
(benchmarks/kv_pool.py measures it), so reference counts, the empty-block stack and each
request's block table are numpy arrays updated in bulk, and the hash -> block map is a `U64Map`
(agentkv.kv.u64map) that takes a batch's uint64 hashes in one compiled loop (a dict, used through
C-level `map`, once a hash outside uint64 arrives). The verbs are the scheduler's: `get_computed_blocks`,
`allocate_slots`, `free`, `usage`, `reset`; the types they exchange are in agentkv.kv.interface.

The hash -> block map's searches and duplicate copies are in agentkv.kv.hashmap; the invariants
are stated and checked (`check_invariants`) in agentkv.kv.invariants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from agentkv.kv.events import EventLog, KVEvent
from agentkv.kv.eviction import make_policy
from agentkv.kv.eviction.base import Evictor, stamp_loops
from agentkv.kv.hashmap import find_run, prefix_len
from agentkv.kv.interface import ComputedBlocks, KVRequest, LowerTier, PoolStats
from agentkv.kv.invariants import check_pool
from agentkv.kv.pool_hashes import PoolHashes
from agentkv.kv.sizing import kv_bytes_per_token, num_blocks_for
from agentkv.kv.tables import appended
from agentkv.kv.u64map import U64Map

__all__ = ["BlockPool", "kv_bytes_per_token", "num_blocks_for"]  # the boundary types: agentkv.kv.interface


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool(PoolHashes, EventLog):
    """Fixed-size KV blocks with reference counts, a prefix cache and a pluggable eviction policy.

    `policy` is a name from `agentkv.kv.eviction.POLICIES` or an `Evictor` (e.g. `Belady`).
    Events (BlockStored/BlockRemoved/AllBlocksCleared, medium "GPU") go to `on_event` when given,
    else are buffered for `take_events()` when `record_events`. `lower` is a tier stack below
    the GPU: it is told of stores and evictions, and `allocate_slots` promotes from it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        policy: str | Evictor = "lru",
        *,
        on_event: Callable[[KVEvent], None] | None = None,
        record_events: bool = False,
        lower: LowerTier | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self._hashed = np.zeros(num_blocks, dtype=bool)  # whether each block holds a hash (`hash_of`)
        self._obj: np.ndarray | None = None  # each block's hash as an object, once the map is a dict
        # hash -> the block a lookup returns (its oldest copy): uint64 hashes in a U64Map, updated a
        # batch at a time by compiled loops; a dict from the first hash outside uint64 on
        self.cached: U64Map | dict[int, int] = U64Map(num_blocks)
        self.dups: dict[int, list[int]] = {}  # hash -> its other copies, oldest first (vLLM keeps them)
        # while the map is a U64Map: each hashed block's hash as uint64, and whether the block is
        # the one `cached` names (the map's keys are these values, so no object array is kept)
        self._bh = np.zeros(num_blocks, dtype=np.uint64)
        self._has = np.zeros(num_blocks, dtype=bool)
        self._empty = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)  # a stack, top at the end
        self._n_empty = num_blocks
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(self)
        stamp_loops()  # the compiled free and admission loops, loaded now (not at a request's first free)
        # the policy's on_cached, unless it is Evictor's no-op (LRU): no parent lookup for it then
        self._on_cached = None if type(self.policy).on_cached is Evictor.on_cached else self.policy.on_cached
        self.lower = lower
        self.stats = PoolStats()
        self.last_promote_s = 0.0
        self._setup_events(on_event, record_events)
        self._req_blocks: dict[str, np.ndarray] = {}  # once grown, each the head of its `_req_buf`
        self._req_buf: dict[str, np.ndarray] = {}  # room to grow a table in place (`tables.appended`)
        self._req_hashed: dict[str, int] = {}  # leading blocks whose caching was decided
        self._req_session: dict[str, object] = {}
        self._epoch = 0  # moves on at each eviction and reset: older lookups' blocks may be gone
        self._ref_moves = 0  # moves on at each free and admission: blocks' references changed
        # the last admission check's (lookup, its hit count, epoch, ref moves, hits nobody holds): a
        # refused queue head's retry reuses them while nothing was evicted, freed or admitted since
        self._held: tuple | None = None

    # -- the scheduler's verbs -------------------------------------------------------------------
    def get_computed_blocks(
        self,
        block_hashes: Sequence[int],
        num_tokens: int | None = None,
        *,
        count: bool = True,
        hint: np.ndarray | None = None,
        hash_array: np.ndarray | None = None,
    ) -> ComputedBlocks:
        """The leading blocks of `block_hashes` cached on the GPU (a query: nothing is pinned), for
        `allocate_slots`.

        With `num_tokens` (the prompt length), at most `(num_tokens - 1) // block_size` blocks
        count, as vLLM recomputes the last prompt token. Tells the policy of the access (`touch`)
        and counts queries and hits in tokens, unless `count=False` (the engine's scheduler touches
        on a request's first try and counts at its admission, as vLLM does).
        `hint` (block ids likely holding the leading hashes, e.g. the session's previous turn) with
        `hash_array` (the hashes as uint64) checks that run in bulk first; the result is the same.
        """
        limit = len(block_hashes)
        if num_tokens is not None:
            limit = max(0, min(limit, (num_tokens - 1) // self.block_size))
        keys = hash_array if hint is not None and len(hint) and self._mirror else None
        if keys is not None and keys.dtype == np.uint64 and len(keys) >= limit:
            # one compiled pass: the hint's blocks while they hold the keys, then the map (a miss of
            # the hint's may hit elsewhere)
            found = self.cached.hinted_run(keys, limit, hint, self._has, self._bh)
        else:
            found = self._found(block_hashes, limit, 0, hash_array)
        computed = ComputedBlocks(found, self._epoch)
        if count:
            self.touch(block_hashes, found)
            queries = num_tokens if num_tokens is not None else len(block_hashes) * self.block_size
            self.record_prefix_cache_stats(queries, len(found) * self.block_size)
        return computed

    def touch(self, block_hashes: Sequence[int], found: Sequence[int] | np.ndarray) -> None:
        """Tell the eviction policy that a request looked up `block_hashes` and found `found`."""
        self.policy.on_lookup(block_hashes, found)
        self.stats.lookups += 1

    def record_prefix_cache_stats(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        """Count one request's prefix lookup at admission (`PoolStats.record`, as vLLM's)."""
        self.stats.record(num_tokens, num_hits, preempted)

    def is_current(self, computed: ComputedBlocks) -> bool:
        """True while a lookup's answer stands: nothing evicted since, so (under write-back, where
        only evictions fill them) the tiers below are unchanged too; a retry may reuse it."""
        lower = self.lower
        return computed.epoch == self._epoch and (lower is None or lower.write_mode == "write_back")

    def match_lower(self, block_hashes: Sequence[int], start: int, stop: int | None = None) -> list[str]:
        """Tier names of the longest run of `block_hashes[start:stop]` held below the GPU ([] without tiers)."""
        if self.lower is None:
            return []
        return self.lower.match(block_hashes if stop is None else block_hashes[:stop], start)

    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        num_computed_tokens: int = 0,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `req`; False (nothing changed) if full.

        First call for a request: its first `num_computed_tokens // block_size` blocks are the
        prefix hits `computed` holds (looked up again if it is stale or absent) and are shared; the
        next `computed.num_lower` are promoted from the lower tiers (seconds in `last_promote_s`).
        Later calls (chunked prefill, decode) pass the tokens computed so far. Blocks that become
        full and have a hash in `req.block_hashes` are cached; `req.token_ids` fill BlockStored events.
        """
        blocks = self._req_blocks.get(req.request_id)
        if blocks is None:
            return self._admit(req, num_new_tokens, num_computed_tokens, computed)
        total = num_computed_tokens + num_new_tokens
        bs = self.block_size
        need = _cdiv(total, bs) - len(blocks)
        if need > 0:
            if need > self._n_empty + len(self.policy):
                self.stats.alloc_failures += 1
                return False
            rid = req.request_id
            self._req_buf[rid], blocks = appended(self._req_buf.get(rid), blocks, self._take(need))
            self._req_blocks[rid] = blocks
        hashed = self._req_hashed[req.request_id]
        if total // bs > hashed and hashed < len(req.block_hashes):  # a block filled: maybe one to cache
            self._cache_full(req, blocks, total)  # (decode past the prompt's hashes has none)
        return True

    def quiet_decodes(self, req: KVRequest, num_computed: int) -> int:
        """How many decode steps from `num_computed` (one token each) `allocate_slots` would run as
        no-ops: no block taken, none filled and cached (the engine's deferred decodes skip them)."""
        blocks = self._req_blocks.get(req.request_id)
        if blocks is None:
            return 0
        bs, hashed = self.block_size, self._req_hashed[req.request_id]
        k = len(blocks) * bs - num_computed  # totals up to the held blocks' end
        if hashed < len(req.block_hashes):  # and short of filling the next block to cache
            k = min(k, (hashed + 1) * bs - 1 - num_computed)
        return max(0, k)

    def surely_fits(self, grows: list[tuple[KVRequest, int]]) -> bool:
        """Whether running requests growing in turn to these token totals all get their blocks."""
        bs, need = self.block_size, 0
        for req, total in grows:
            need += max(0, _cdiv(total, bs) - len(self._req_blocks[req.request_id]))
        return need <= self._n_empty + len(self.policy)

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request's blocks, tail first (its tail is evicted first)."""
        blocks = self._req_blocks.pop(request_id, None)
        if blocks is None:
            return
        self._req_buf.pop(request_id, None)
        self._ref_moves += 1
        hashed = self._req_hashed.pop(request_id)
        session = self._req_session.pop(request_id)
        # the first `hashed` blocks are cached, the rest not; shared ones stay with their other users;
        # the empty ones go straight onto the empty stack (it has room for every block)
        m, freed_cached = self._n_empty, np.empty(hashed, dtype=np.int64)
        nc, ne = stamp_loops().release(blocks, hashed, self.ref, freed_cached, self._empty[m:])
        self._n_empty = m + ne
        if nc:
            self.policy.add_many(self._ids(freed_cached[:nc]), session)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: empty ones plus evictable cached ones."""
        return self._n_empty + len(self.policy)

    @property
    def num_empty_blocks(self) -> int:
        """Blocks holding nothing: taking up to this many evicts no cached block."""
        return self._n_empty

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash (free or in use), copies included."""
        return len(self.cached) + sum(map(len, self.dups.values()))

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks cached on the GPU, then the run after them below it, by bisection (counts
        nothing): exact when the cache holds prefixes whole, as LRU with tail-first freeing keeps it."""
        gpu = prefix_len(self.cached.__contains__, block_hashes, 0)
        lower = self.lower
        return gpu, (prefix_len(lower.__contains__, block_hashes, gpu) - gpu if lower is not None else 0)

    def holds(self, block: int, block_hash: int) -> bool:
        """Whether lookups of `block_hash` find `block` (a hint's check; False without the uint64 mirror)."""
        return bool(self._mirror and self._has[block] and int(self._bh[block]) == block_hash)

    def block_table(self, request_id: str) -> np.ndarray | None:
        """A running request's blocks as an int64 array (not a copy: do not modify), or None.

        Kept from one turn to the next, it is the `hint` that makes the next lookup a bulk check.
        """
        return self._req_blocks.get(request_id)

    def request_blocks(self, request_id: str) -> list[int]:
        """The block ids a running request holds, in token order (a copy)."""
        blocks = self._req_blocks.get(request_id)
        return [] if blocks is None else blocks.tolist()

    def reset(self) -> bool:
        """Drop the whole prefix cache (emits AllBlocksCleared); False if requests still hold blocks."""
        if self._req_blocks:
            return False
        self.cached.clear()
        self.dups.clear()
        self._hashed[:] = False
        if self._obj is not None:
            self._obj[:] = None
        self._has[:] = False
        self._empty = np.arange(self.num_blocks - 1, -1, -1, dtype=np.int64)
        self._n_empty = self.num_blocks
        self.policy.clear()
        self._cleared()
        return True

    # -- hints for session-aware policies --------------------------------------------------------
    def session_paused(self, session_id: object, now: float, reason: str = "tool_use") -> None:
        """A session's request finished at `now`; it waits on a tool ("tool_use") or on its user."""
        self.policy.session_paused(session_id, now, reason)

    def session_resumed(self, session_id: object, now: float) -> None:
        """A session's next request arrived at `now`."""
        self.policy.session_resumed(session_id, now)

    def session_ended(self, session_id: object, now: float | None = None) -> None:
        """A session will send no more requests; its cached blocks are the cheapest to lose."""
        self.policy.session_ended(session_id, now)

    # -- internals -------------------------------------------------------------------------------
    def _admit(
        self, req: KVRequest, num_new_tokens: int, num_computed_tokens: int, computed: ComputedBlocks | None
    ) -> bool:
        """A request's first allocation: share its prefix hits, promote its lower run, take the rest."""
        bs, ref, rid = self.block_size, self.ref, req.request_id
        if num_computed_tokens % bs:
            raise ValueError(
                f"request {rid}: num_computed_tokens {num_computed_tokens} "
                f"is not a multiple of block_size {bs} on its first allocation"
            )
        nc = num_computed_tokens // bs
        nl = computed.num_lower if computed is not None else 0
        if nl and (self.lower is None or nc + nl > len(req.block_hashes)):
            raise ValueError(
                f"request {rid}: {nl} lower-tier blocks but "
                f"{'no lower tiers' if self.lower is None else 'too few block hashes'}"
            )
        total = num_computed_tokens + nl * bs + num_new_tokens
        hit, free_hits, need = self._admission(req, nc, total, computed)
        if need + len(free_hits) > self._n_empty + len(self.policy):
            self.stats.alloc_failures += 1
            return False
        self.last_promote_s = 0.0
        if nl:  # before taking blocks: the evictions that make room may push these out of the tier
            self.last_promote_s = self.lower.promote(req.block_hashes[nc : nc + nl])
            self.stats.lower_blocks += nl
            self.stats.promote_s += self.last_promote_s
        if len(free_hits):
            self.policy.remove_many(self._ids(free_hits))
        stamp_loops().pin(hit, ref)
        self._ref_moves += 1
        blocks = np.concatenate((hit, self._take(need))) if need > 0 else hit.copy()  # tables never alias
        self._req_blocks[rid] = blocks
        self._req_hashed[rid] = nc
        self._req_session[rid] = req.session_id
        self._cache_full(req, blocks, total)
        return True

    def _cache_full(self, req: KVRequest, blocks: np.ndarray, total: int) -> None:
        """Cache the request's blocks that `total` tokens fill and that have a hash, if not yet done."""
        full = min(total // self.block_size, len(req.block_hashes), len(blocks))
        hashed = self._req_hashed[req.request_id]
        if full > hashed:
            self._cache(req, blocks, hashed, full)
            self._req_hashed[req.request_id] = full

    def admission_blocks(
        self, req: KVRequest, num_computed_tokens: int, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> tuple[int, np.ndarray]:
        """Free blocks a first allocation (no lower-tier run) would take, as `allocate_slots` counts
        them: fresh ones plus its cached hits nobody else holds (they leave the free queue); and those hits."""
        nc = num_computed_tokens // self.block_size
        _, free_hits, need = self._admission(req, nc, num_computed_tokens + num_new_tokens, computed)
        return need + len(free_hits), free_hits

    def _admission(
        self, req: KVRequest, nc: int, total: int, computed: ComputedBlocks | None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """A first allocation of `total` tokens after `nc` hit blocks: the hit blocks, those of them no
        other request holds, and how many fresh blocks it takes."""
        hit = self._prefix_blocks(req, nc, computed)
        need = _cdiv(total, self.block_size) - nc
        if not len(hit):
            return hit, hit, need
        last = self._held
        if (
            last is not None
            and last[0] is computed
            and last[1] == nc
            and last[2] == self._epoch
            and last[3] == self._ref_moves
        ):
            return hit, last[4], need  # a retry: the same hits, none freed or taken since
        free_hits = np.empty(len(hit), dtype=np.int64)
        free_hits = free_hits[: stamp_loops().unheld(hit, self.ref, free_hits)]
        if computed is not None:
            self._held = (computed, nc, self._epoch, self._ref_moves, free_hits)
        return hit, free_hits, need

    def _prefix_blocks(self, req: KVRequest, n: int, computed: ComputedBlocks | None) -> np.ndarray:
        """The cached blocks of the request's first `n` hashes: `computed`'s unless stale or short."""
        if computed is not None and computed.epoch == self._epoch and len(computed.blocks) >= n:
            found = computed.blocks[:n]
        else:
            found = self._found(req.block_hashes, n, 0, getattr(req, "hash_array", None))
            if len(found) < n:
                raise ValueError(
                    f"request {req.request_id}: block {len(found)} of its computed prefix is not "
                    "cached (pass allocate_slots what get_computed_blocks found)"
                )
        if isinstance(found, np.ndarray):
            return found.astype(np.int64, copy=False)  # (may be a view: `_admit` copies it to a table)
        return np.fromiter(found, np.int64, n)

    def _found(
        self, block_hashes: Sequence[int], limit: int, start: int, hash_array: np.ndarray | None
    ) -> list[int]:
        """The cached blocks of the longest run of block_hashes[start:limit] (the map's search)."""
        return find_run(self.cached, block_hashes, limit, start, hash_array)

    @property
    def _mirror(self) -> bool:
        """Whether the uint64 mirror (`_bh`, `_has`) is kept: while every hash fits in uint64, which is
        while the map is a `U64Map`."""
        return type(self.cached) is not dict

    def _to_dict(self) -> None:
        """A hash outside uint64 arrived: the map becomes a dict (and the uint64 mirror goes off)."""
        if self._mirror:
            self.cached = dict(self.cached.items())
            self._obj = np.full(self.num_blocks, None, dtype=object)
            held = np.flatnonzero(self._hashed)
            self._obj[held] = np.fromiter(self._bh[held].tolist(), dtype=object, count=len(held))

    def _ids(self, blocks: np.ndarray) -> np.ndarray | list[int]:
        """Block ids in the form the policy takes: the array itself, or a list of ints."""
        return blocks if self.policy.arrays else blocks.tolist()

    def _take(self, n: int) -> np.ndarray:
        """`n` blocks for fresh content (ref set to 1): empty blocks first, then evicted victims."""
        m = self._n_empty
        if n <= m:
            new = self._empty[m - n : m][::-1].copy()
            self._n_empty = m - n
        else:
            victims = np.asarray(self.policy.pop_victims(n - m), dtype=np.int64)
            self._uncache(victims)
            new = np.concatenate((self._empty[:m][::-1], victims)) if m else victims  # (a fresh array)
            self._n_empty = 0
        self.ref[new] = 1
        self.stats.allocated += n
        return new

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (for tests; O(num_blocks))."""
        check_pool(self)
