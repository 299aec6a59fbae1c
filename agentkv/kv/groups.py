"""A KV cache of several layer groups, in the shape of vLLM v1's hybrid KV cache manager
(`kv_cache_coordinator.HybridKVCacheCoordinator` over one `BlockPool`).

Each group has its own block table per request and its own hash -> block map; every group's
blocks come from one shared pool, sized in bytes (a group's block costs what its layers' pages
take, so capacity is shared as vLLM's unified pages share it). Per kind, as vLLM's managers:

- full attention / MLA keeps every block;
- sliding window and chunked local attention free the blocks a running request has moved past
  (`remove_skipped_blocks`), which stay cached and evictable;
- a linear-attention / SSM state group holds one running state per request; with prefix caching
  it saves the state at block boundaries a prefill chunk ends on (vLLM's 'align' mode), each an
  evictable cached block.

A prefix hit is what every group can serve (`group_rules`). Eviction is LRU over the freed cached
blocks of every group (vLLM's one free queue), or another policy (`group_tiers.PolicyQueue`);
unhashed blocks return to the free bytes at once. Evicted blocks go to the tiers below when given
(`lower`, a `TierStack` with per-group bytes), and a hit may read them back (`group_tiers`).
The verbs are `BlockPool`'s, so the engine's scheduler drives either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from agentkv.kv import group_rules as R
from agentkv.kv.events import EventLog, KVEvent
from agentkv.kv.eviction import make_policy
from agentkv.kv.eviction.base import Evictor, stamp_loops, warm_hybrid_loops
from agentkv.kv.group_state import GroupBlocks
from agentkv.kv.group_tiers import GroupHooks, GroupLower, PolicyQueue
from agentkv.kv.hashmap import find_run, prefix_len
from agentkv.kv.interface import ComputedBlocks, KVRequest, PoolStats
from agentkv.kv.u64map import U64Map


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of the pool: its prefix-cache rule, the bytes one of its blocks takes (all its
    layers), its window or chunk in tokens, and the `kv_cache_spec_kind` its events carry.
    `page_tokens`: DeepSeek-V4's window groups run on 64-, 8- and 4-token blocks in vLLM; a window
    that arrived from another engine serves a hit only where those finer blocks hold it."""

    rule: str
    block_bytes: int
    window: int = 0
    name: str = ""
    event_kind: str = "full_attention"
    page_tokens: tuple[int, ...] = ()  # vLLM's own block sizes for its layers, where finer than the pool's

    def __post_init__(self) -> None:
        if self.rule not in R.RULES:
            raise ValueError(f"group rule {self.rule!r} is not one of {', '.join(R.RULES)}")
        if self.block_bytes < 1:
            raise ValueError(f"group {self.name or self.rule}: block_bytes must be >= 1")
        if self.rule in ("sliding", "chunked") and self.window < 1:
            raise ValueError(f"group {self.name or self.rule}: a {self.rule} group needs a window")


@dataclass(slots=True)
class HybridComputed(ComputedBlocks):
    """A lookup's answer: `blocks` the first (full-attention) group's hit blocks, else a range of the
    hit's length; `hit` in blocks; `longest` the full-attention group's own hit where longer (vLLM's
    shared-prefix junction, else 0)."""

    hit: int = 0
    longest: int = 0


class HybridPool(GroupLower, GroupBlocks, EventLog):
    """Per-group block tables over one byte-sized pool; `BlockPool`'s verbs. `policy`: a name from
    `eviction.ENGINE_POLICIES` or an `Evictor`; `lower`: a `TierStack` made with `group_bytes`."""

    def __init__(
        self,
        specs: Sequence[GroupSpec],
        capacity_bytes: int,
        block_size: int = 16,
        *,
        unit_bytes: int | None = None,
        on_event: Callable[[KVEvent], None] | None = None,
        record_events: bool = False,
        policy: str | Evictor = "lru",
        lower=None,
        retention_interval: int = 0,
    ) -> None:
        if not specs or capacity_bytes < 1 or block_size < 1:
            raise ValueError("a hybrid pool needs groups, capacity_bytes >= 1 and block_size >= 1")
        if block_size > 1 and any(s.rule == "chunked" and s.window % block_size for s in specs):
            raise ValueError("a chunked-local group's chunk must be a multiple of the block size")
        self.specs = tuple(specs)
        self.block_size = block_size
        self.capacity = int(capacity_bytes)
        # a token's block in every group that grows with the sequence (what a decode step adds)
        self.growth_bytes = sum(s.block_bytes for s in self.specs if s.rule != "state")
        self.unit_bytes = unit_bytes or self.growth_bytes
        self.num_blocks = self.capacity // self.unit_bytes  # as vLLM counts pages
        self.has_state = any(s.rule == "state" for s in self.specs)
        self.group_bytes = tuple(s.block_bytes for s in self.specs)  # a block's bytes, per group
        self._costs = np.array(self.group_bytes, dtype=np.int64)  # (the same, for compiled loops)
        self.retention_interval = retention_interval  # vLLM's prefix_cache_retention_interval (tokens)
        if lower is not None and lower.group_bytes != self.group_bytes:
            raise ValueError("a hybrid pool's tiers need its groups' block bytes (TierStack group_bytes)")
        self.lower = lower
        self.policy = None if policy == "lru" else make_policy(policy) if isinstance(policy, str) else policy
        self.hooks = GroupHooks(self) if lower is not None or self.policy is not None else None
        self._sessions: dict[str, object] = {}  # running request -> its session (policies only)
        self.stats = PoolStats()
        self.last_promote_s = 0.0
        self._setup_events(on_event, record_events)
        self._reset_blocks()
        warm_hybrid_loops()  # the compiled block loops, loaded now (not at a served request's first step)

    def _reset_blocks(self) -> None:
        """Empty block bookkeeping, its LRU replaced by the policy when one is set."""
        self._setup_blocks()
        if self.policy is not None:
            self.lru = PolicyQueue(self.policy, self)

    # -- lookups -------------------------------------------------------------------------------
    def longest_hit(self, block_hashes: Sequence[int], limit: int, full: int | None = None, maps=None) -> int:
        """Blocks every group can serve (at most `limit`): each rule in turn until none lowers it.
        `full`: the full-attention groups' cached prefix when the caller knows it already; `maps`:
        each group's cached hashes (default: the GPU's)."""
        maps = self.cached_maps if maps is None else maps
        hit = limit if full is None else min(limit, full)
        while True:
            new = hit
            for g, s in enumerate(self.specs):
                if new == 0:
                    return 0
                cached = maps[g]
                if s.rule == "full":
                    if full is None:
                        new = R.full_hit(cached, block_hashes, new)
                elif s.rule == "sliding":
                    new = R.sliding_hit(cached, block_hashes, new, s.window, self.block_size)
                elif s.rule == "chunked":
                    new = R.chunked_hit(cached, block_hashes, new, s.window, self.block_size)
                else:
                    new = R.state_hit(cached, block_hashes, new)
            if new == hit:
                return hit
            hit = new

    def get_computed_blocks(
        self,
        block_hashes: Sequence[int],
        num_tokens: int | None = None,
        *,
        count: bool = True,
        hint=None,
        hash_array=None,
    ) -> HybridComputed:
        """The prompt's longest prefix every group can serve (at most `(num_tokens - 1) // block_size`
        blocks, as vLLM recomputes the last token); `hint` and `hash_array` only speed the search."""
        limit = len(block_hashes)
        if num_tokens is not None:
            limit = max(0, min(limit, (num_tokens - 1) // self.block_size))
        full = None
        if self.specs[0].rule == "full":  # found once here, shared at admission
            found = self._full_prefix(block_hashes, limit, hint, hash_array)
            full = len(found)
        hit = self.longest_hit(block_hashes, limit, full)
        computed = HybridComputed(
            found[:hit] if full is not None else range(hit),
            self._epoch,
            hit=hit,
            longest=full if full is not None and full > hit else 0,
        )
        if count:
            self.touch(block_hashes, computed.blocks)
            queries = num_tokens if num_tokens is not None else len(block_hashes) * self.block_size
            self.record_prefix_cache_stats(queries, hit * self.block_size)
        return computed

    def _full_prefix(self, block_hashes, limit: int, hint, hash_array):
        """Group 0's cached blocks of the leading hashes; `hint` (the session's last table) taken
        where it still holds them, as `BlockPool` does, in one compiled pass (`hinted_prefix`: past a
        failed block the hint may hold most of the rest, a recomputed copy's alias the one the map
        gives); the answer is the same."""
        first = self.cached_maps[0]
        if (
            hint is None
            or hash_array is None
            or not len(hint)
            or type(first) is not U64Map  # (a dict: the mirror is off)
            or len(hash_array) < limit
            or hash_array.dtype != np.uint64
        ):
            return find_run(first, block_hashes, limit, 0, hash_array)
        out = np.empty(limit, dtype=np.int64)
        mkeys, mvals, shift, mask = first.slots()
        m = min(len(hint), limit)
        n = stamp_loops().hinted_prefix(
            hint, m, hash_array, limit, self.bh64, self.alias, mkeys, mvals, shift, mask, out
        )
        if n < 0:  # a key 0 (the map's side dict): the map's own run
            return find_run(first, block_hashes, limit, 0, hash_array)
        return out[:n]

    def touch(self, block_hashes: Sequence[int], found) -> None:
        if self.policy is not None:
            self.policy.on_lookup(block_hashes, found)
        self.stats.lookups += 1

    def record_prefix_cache_stats(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        self.stats.record(num_tokens, num_hits, preempted)

    def is_current(self, computed: ComputedBlocks) -> bool:
        return computed.epoch == self._epoch

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks every group can serve from the GPU (counts nothing), then the blocks more
        that the tiers below add to it."""
        full = None
        if self.specs[0].rule == "full":  # by bisection, as BlockPool.cached_prefix
            full = prefix_len(self.cached_maps[0].__contains__, block_hashes, 0)
        gpu = self.longest_hit(block_hashes, len(block_hashes), full)
        if self.lower is None or gpu == len(block_hashes):
            return gpu, 0
        return gpu, self.either_hit(block_hashes, len(block_hashes)) - gpu

    @property
    def cached(self) -> dict[int, int]:
        """The first group's hash -> block map (full attention when the model has it)."""
        return self.cached_maps[0]

    # -- the scheduler's verbs -----------------------------------------------------------------
    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        num_computed_tokens: int = 0,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        """Room for `num_new_tokens` more tokens of `req` in every group; False (nothing taken) if full.
        Blocks a window or chunk has moved past are freed first, as vLLM does before its check."""
        rid = req.request_id
        total = num_computed_tokens + num_new_tokens
        if self.policy is not None:
            self.lru.session = self._sessions[rid] = req.session_id
        quiet = self.quiet.get(rid)
        # (the scheduler's decode loop makes this check itself through `quiet_ranges`: keep them alike)
        if quiet is not None and quiet[0] <= num_computed_tokens < quiet[1] and total <= quiet[2]:
            return True  # no block to free, take or cache (most decode steps)
        if rid not in self.tables:
            longest = getattr(computed, "longest", 0)
            if longest:  # where a window caches its tail too (vLLM's shared-prefix junction)
                self.junction[rid] = longest
            ok = self._admit(req, num_new_tokens, num_computed_tokens, computed)
            if not ok and longest:
                del self.junction[rid]
        else:
            self.remove_skipped(rid, num_computed_tokens)
            new = self.new_blocks(req, total)
            ok = self.blocks_bytes(new) <= self.available_bytes
            if ok:
                self.grow(req, new, total)
            else:
                self.stats.alloc_failures += 1
        if ok:
            self.quiet[rid] = self.quiet_range(req, num_computed_tokens, total)
        return ok

    def quiet_ranges(self) -> dict[str, tuple[int, int, int]] | None:
        """Each running request's quiet range, for a caller that answers `allocate_slots`' first
        check itself (the scheduler's decode loop); None while a policy must hear of every call."""
        return self.quiet if self.policy is None else None

    def quiet_decodes(self, req: KVRequest, num_computed: int) -> int:
        """How many decode steps from `num_computed` (one token each) `allocate_slots` would answer
        from the request's quiet range: no block freed, taken or cached (the engine skips them)."""
        q = self.quiet.get(req.request_id)
        if q is None or num_computed < q[0]:
            return 0
        return max(0, min(q[1] - num_computed, q[2] - num_computed))

    def surely_fits(self, grows: list[tuple[KVRequest, int]]) -> bool:
        """Whether running requests growing in turn to these token totals all get their blocks
        (counting none that a window or state frees first: the answer may be a false no)."""
        if self.has_state:
            need = sum(self.blocks_bytes(self.new_blocks(req, total)) for req, total in grows)
            return need <= self.available_bytes
        bs, tables, costs, need = self.block_size, self.tables, self.group_bytes, 0
        for req, total in grows:  # (`new_blocks` inline: every step of a decode burst asks)
            n_tok = -(-total // bs)
            for t, c in zip(tables[req.request_id], costs, strict=True):
                if n_tok > len(t):
                    need += (n_tok - len(t)) * c
        return need <= self.available_bytes

    def _admit(
        self, req: KVRequest, num_new_tokens: int, num_computed_tokens: int, computed: ComputedBlocks | None
    ) -> bool:
        """A request's first allocation: share each group's hit blocks, take the rest."""
        bs, rid = self.block_size, req.request_id
        if num_computed_tokens % bs:
            raise ValueError(
                f"request {rid}: num_computed_tokens {num_computed_tokens} "
                f"is not a multiple of block_size {bs} on its first allocation"
            )
        if computed is not None and computed.num_lower:
            if self.lower is None:
                raise ValueError(f"request {rid}: lower-tier blocks but the hybrid pool has no lower tiers")
            return self.admit_from_below(req, num_computed_tokens // bs, computed.num_lower, num_new_tokens)
        hit = num_computed_tokens // bs
        stale = computed is None or not self.is_current(computed) or len(computed.blocks) < hit
        if hit and stale and self.longest_hit(req.block_hashes, hit) < hit:
            raise ValueError(
                f"request {rid}: its computed prefix of {hit} blocks is not cached in every "
                "group (pass allocate_slots what get_computed_blocks found)"
            )
        current = computed is not None and self.is_current(computed) and len(computed.blocks) >= hit
        full = computed.blocks[:hit] if current and self.specs[0].rule == "full" else None
        skips = self.first_skips(req, hit)
        shared = self.shared_blocks(req.block_hashes, hit, skips, full)
        total = num_computed_tokens + num_new_tokens
        new = self.first_blocks(hit, total, skips)
        need = self.blocks_bytes(new)
        for s, blocks in zip(self.specs, shared, strict=True):
            if len(blocks):
                need += s.block_bytes * (len(blocks) - np.count_nonzero(self.ref[blocks]))
        if need > self.available_bytes:
            self.stats.alloc_failures += 1
            return False
        self.start(req, hit, shared, new, total, skips)
        return True

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request's blocks, each group's tail first."""
        if self.policy is not None:
            self.lru.session = self._sessions.pop(request_id, None)
        self.release(request_id)

    @property
    def available_bytes(self) -> int:
        """Bytes a new allocation can take: free ones plus evictable cached blocks."""
        return self.empty_bytes + self.evictable_bytes

    @property
    def num_free_blocks(self) -> int:
        """Free pages (vLLM's unit): free bytes plus evictable cached blocks over a page."""
        return self.available_bytes // self.unit_bytes

    @property
    def free_token_blocks(self) -> int:
        """How many more token blocks (one block in every growing group) fit: a decode burst's room."""
        return self.available_bytes // self.growth_bytes if self.growth_bytes else 1 << 62

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.available_bytes / self.capacity

    @property
    def num_cached_blocks(self) -> int:
        return sum(map(len, self.cached_maps))

    def block_table(self, request_id: str) -> np.ndarray | None:
        """A running request's first-group blocks (-1 where null), the next turn's lookup hint."""
        t = self.tables.get(request_id)
        if t is None:
            return None
        return t[0] if self.specs[0].rule == "full" else t[0].copy()  # full tables never change in place

    def reset(self) -> bool:
        """Drop the whole prefix cache (emits AllBlocksCleared); False if requests still hold blocks."""
        if self.tables:
            return False
        self._reset_blocks()
        self._cleared()
        return True

    # session hints, for the session-aware policy (LRU ignores them)
    def session_paused(self, session_id: object, now: float, reason: str = "tool_use") -> None:
        if self.policy is not None:
            self.policy.session_paused(session_id, now, reason)

    def session_resumed(self, session_id: object, now: float) -> None:
        if self.policy is not None:
            self.policy.session_resumed(session_id, now)

    def session_ended(self, session_id: object, now: float | None = None) -> None:
        if self.policy is not None:
            self.policy.session_ended(session_id, now)
