"""Replay block accesses through a `BlockPool`: lookup, allocate, free per request.

Used by `cache analyze`, benchmarks/kv_pool.py and the tests to compare eviction policies on the
same accesses (agentkv.trace.accesses makes them from traces).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool
from agentkv.trace.accesses import BlockRequest


@dataclass(slots=True)
class ReplayResult:
    """Hit rate in prompt tokens, block counts and the wall time of one replay."""

    policy: str
    num_blocks: int
    requests: int = 0
    failed: int = 0  # requests larger than the free room (skipped)
    query_tokens: int = 0
    hit_tokens: int = 0
    request_blocks: int = 0  # sum of hash-list lengths: one lookup+allocate+free cycle each
    block_ops: int = 0  # hashes probed (hits + first miss) + blocks shared or allocated + blocks freed
    seconds: float = 0.0  # wall time of the replay loop
    cpu_seconds: float = 0.0  # CPU time of the replay loop (steadier on a shared machine)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def replay(
    pool: BlockPool, requests: Sequence[BlockRequest], *, hints: bool = True, lookup_hints: bool = False
) -> ReplayResult:
    """Run each request through the pool in order: lookup, allocate prompt + output, free.

    With `hints`, sessions are reported resumed on arrival, paused at their end (reason: the
    request's stop reason) and ended after their last request. With `lookup_hints`, each lookup
    first checks, in bulk, the blocks of the session's previous request (as the engine does;
    the hashes' uint64 arrays are made before the clock starts, as a hasher can emit them).
    """
    res = ReplayResult(pool.policy.name, pool.num_blocks)
    bs = pool.block_size
    before_q, before_h = pool.stats.queries, pool.stats.hits
    get, alloc, free = pool.get_computed_blocks, pool.allocate_slots, pool.free
    ops = nblocks = failed = 0
    arrays = [np.asarray(r.hashes, dtype=np.uint64) for r in requests] if lookup_hints else None
    prev: dict[str, np.ndarray] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for i, r in enumerate(requests):
        rid = str(i)
        if hints:
            pool.session_resumed(r.session, r.time)
        hs = r.hashes
        if arrays is not None:
            computed = get(hs, r.input_tokens, hint=prev.get(r.session), hash_array=arrays[i])
        else:
            computed = get(hs, r.input_tokens)
        n = computed.num_blocks
        ops += n + (n < len(hs))  # hashes probed: the hits and the first miss
        total = r.input_tokens + r.output_tokens
        if alloc(
            PoolRequest(rid, hs, r.session, prompt_len=r.input_tokens), total - n * bs, n * bs, computed
        ):
            ops += 2 * -(-total // bs)  # blocks shared or allocated, then freed
            if arrays is not None:
                prev[r.session] = pool.block_table(rid)
            free(rid)
        else:
            failed += 1
        nblocks += len(hs)
        if hints:
            pool.session_paused(r.session, r.end, r.stop)
            if r.last:
                pool.session_ended(r.session, r.end)
    res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    res.requests, res.failed, res.block_ops, res.request_blocks = len(requests), failed, ops, nblocks
    res.query_tokens = pool.stats.queries - before_q
    res.hit_tokens = pool.stats.hits - before_h
    return res
