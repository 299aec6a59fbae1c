"""Continuous batching as vLLM v1 does it: running requests first, then FCFS waiting ones.

One step has a token budget (`max_num_batched_tokens`) shared by decodes (one token each) and
chunked-prefill pieces. When blocks run out, the most recently started running request is
preempted by recompute (its blocks freed, it goes back to the head of the queue). New requests
are admitted only in steps without preemption, as in vLLM.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from agentkv.engine.config import EngineConfig
from agentkv.engine.request import EngineRequest, Status
from agentkv.kv.group_rules import chunk_stop
from agentkv.kv.hints import PrefixHints
from agentkv.kv.pool import BlockPool


class Scheduler:
    """Chooses each step's batch: `schedule()` returns [(request, new tokens)] and the preempted."""

    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        self.hints = PrefixHints()  # requests' block tables, by the keys they share with later ones
        self.lower_tier_tokens: dict[str, int] = {}
        # a linear-attention/SSM state is saved only where a chunk ends: cut prefill chunks at block
        # boundaries, the replay boundary and a junction (vLLM's mamba 'align' mode,
        # `_mamba_block_aligned_split`)
        self._align = bool(getattr(pool, "has_state", False)) and config.enable_prefix_caching
        self._quiet = hasattr(pool, "quiet_ranges")  # a hybrid pool's decodes that change nothing

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest]]:
        budget = self.config.max_num_batched_tokens
        pool = self.pool
        batch: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []

        # decode (and unfinished chunked prefills) of running requests
        running, align, alloc = self.running, self._align, pool.allocate_slots
        quiet = pool.quiet_ranges() if self._quiet else None
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            nc = req.num_computed
            n = req.prompt_len + req.num_output - nc  # (req.num_tokens - nc: a step's hot loop)
            if n > budget:
                n = budget
            if align and not (n := self._aligned(req, n, nc)):
                i += 1
                continue
            if (
                quiet is not None
                and (q := quiet.get(req.request_id))
                and q[0] <= nc < q[1]
                and nc + n <= q[2]
            ):
                batch.append((req, n))  # HybridPool.allocate_slots' own first check, without the call
                budget -= n
                i += 1
                continue
            while not alloc(req, n, nc):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.append((req, n))
                budget -= n
                i += 1
                continue
            break

        # prefill: admit waiting requests in arrival order
        if not preempted:
            max_seqs = self.config.max_num_seqs
            while self.waiting and budget > 0 and len(running) < max_seqs:
                req = self.waiting[0]
                self._lookup(req)  # again on every try: blocks found last step may be gone
                have = req.num_computed + req.num_lower_tokens  # GPU hits, then the CPU tier's blocks
                ext = max(0, req.external_tokens - have)
                start = have + ext  # the chunk computes from here (arrived KV: allocated, not computed)
                n = min(req.num_tokens - start, budget)
                if self._align and not (n := self._aligned(req, n, start)):
                    break
                if not pool.allocate_slots(req, ext + n, req.num_computed, req.computed):
                    break
                self.waiting.popleft()
                if req.hash_array is not None:  # its blocks, a hint for later lookups while it runs
                    self.hints.add(req.hash_array, pool.block_table(req.request_id))
                if self.config.enable_prefix_caching:  # vLLM: "Record at admission so unscheduled
                    # lookups are not counted"; a preempted request's re-admission is counted apart
                    pool.record_prefix_cache_stats(req.num_tokens, req.num_computed, req.num_preemptions > 0)
                if req.num_lower_tokens:
                    req.promote_s = pool.last_promote_s
                    req.num_computed += req.num_lower_tokens
                req.num_computed += ext  # arrived KV: allocated, not computed
                req.status = Status.RUNNING
                if req.first_scheduled is None:
                    req.first_scheduled = now
                    for tier, n_tok in req.lower_tier_tokens.items():
                        self.lower_tier_tokens[tier] = self.lower_tier_tokens.get(tier, 0) + n_tok
                running.append(req)
                batch.append((req, n))
                budget -= n
        return batch, preempted

    def burst_room(self, want: int) -> int | None:
        """Blocks (up to about `want`) the running requests' decodes may take while no step could
        admit the waiting queue's head: all free ones when the batch is full; when (a retry, on a
        plain pool without tiers) it needs more than the free blocks, as many as can be taken
        before one of its cached prefix blocks would be evicted (its need stays, the room only
        shrinks); None when a step might admit it. Call it only when every running request decodes
        (then no block gets cached)."""
        req, pool, cfg = self.waiting[0], self.pool, self.config
        budget = cfg.max_num_batched_tokens - len(self.running)
        if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
            return pool.num_free_blocks  # the head is not even looked at
        if not isinstance(pool, BlockPool) or pool.lower is not None or req.external_tokens:
            return None
        if cfg.enable_prefix_caching and req.computed is None:
            return None  # its first lookup tells the eviction policy: a step makes it
        self._lookup(req)  # a retry, as the step's own would be
        n_new = min(req.num_tokens - req.num_computed, budget)
        need, free_hits = pool.admission_blocks(req, req.num_computed, n_new, req.computed)
        if need <= pool.num_free_blocks:
            return None
        empty = pool.num_empty_blocks
        if want <= empty or not len(free_hits):
            return pool.num_free_blocks if not len(free_hits) else empty
        room = pool.policy.room_before(free_hits, want - empty)
        return empty if room is None else empty + room

    def _aligned(self, req: EngineRequest, n: int, computed: int) -> int:
        """A prefill chunk cut where a state is saved (`group_rules.chunk_stop`; 0: none fits)."""
        if computed >= max(req.prompt_len, req.num_tokens - 1):
            return n  # decoding
        bs = self.pool.block_size
        junction = getattr(req.computed, "longest", 0) * bs  # the lookup's shared-prefix junction
        return chunk_stop(computed, n, req.num_tokens, bs, junction)

    def _lookup(self, req: EngineRequest) -> None:
        """Find the request's cached prefix (`req.computed`): GPU blocks first, then a run below."""
        if not self.config.enable_prefix_caching:
            return
        pool = self.pool
        bs = pool.block_size
        first_try = req.computed is None
        if not first_try and pool.is_current(req.computed):
            return  # a retry, and nothing was evicted since (tiers change only then): same prefix
        hint = req.hint  # a preempted request's own blocks
        if first_try and hint is None and req.hash_array is not None:
            hint = self.hints.get(req.hash_array, pool.holds if isinstance(pool, BlockPool) else None)
        if not first_try and req.hash_array is not None:  # a retry: last try's blocks, checked in
            last = req.computed.blocks  # bulk, then the walk goes on from the first gone (same answer)
            if isinstance(last, list) and last:
                last = np.fromiter(last, np.int64, len(last))
            hint = last if isinstance(last, np.ndarray) else hint
        computed = req.computed = pool.get_computed_blocks(
            req.block_hashes, req.num_tokens, count=False, hint=hint, hash_array=req.hash_array
        )
        if first_try:  # the policy hears of each request once (and again after a preemption)
            pool.touch(req.block_hashes, computed.blocks)
        n_gpu = computed.num_blocks
        req.num_computed = n_gpu * bs
        limit = (req.num_tokens - 1) // bs
        lower = pool.match_lower(req.block_hashes, n_gpu, limit) if n_gpu < limit else []
        computed.num_lower = len(lower)
        req.num_lower_tokens = len(lower) * bs
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed
            req.lower_tier_tokens = {}
            for tier in lower:
                req.lower_tier_tokens[tier] = req.lower_tier_tokens.get(tier, 0) + bs

    def _preempt(self, req: EngineRequest) -> None:
        """Recompute-style preemption: drop its blocks; it starts over from the queue head. Its
        block table becomes its lookup hint: its prefix, freed last, is the cache's freshest."""
        pool = self.pool
        if req.hash_array is not None and isinstance(pool, BlockPool):
            req.hint = pool.block_table(req.request_id)  # never changed in place, as `_finish`'s
        pool.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_lower_tokens = 0
        req.computed = None
        req.num_preemptions += 1
        req.external_tokens = 0  # its arrived KV is gone with its blocks: recomputed here
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: EngineRequest, status: Status = Status.FINISHED) -> None:
        self.pool.free(req.request_id)
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
