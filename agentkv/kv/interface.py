"""The block pool's boundary types (as vLLM v1's `KVCacheBlocks` between scheduler and cache manager):
what a request gives the pool, what a lookup gives back, what the pool calls below, its counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class KVRequest(Protocol):
    """What the pool reads of a request (the engine's `EngineRequest` is one; `PoolRequest` another)."""

    request_id: str
    block_hashes: Sequence[int]  # the prompt's full-block hashes: the prefix-cache keys
    session_id: object  # for session-aware eviction policies
    token_ids: Sequence[int] | None  # fill BlockStored events when given
    external_tokens: int  # leading prompt tokens whose KV arrived from another engine (disaggregated decode)
    prompt_len: int  # the prompt's tokens (0: not known, taken as its full blocks and a partial one)


@dataclass(slots=True)
class PoolRequest:
    """A plain `KVRequest`, for callers without an engine (cache replay, benchmarks, tests)."""

    request_id: str
    block_hashes: Sequence[int] = ()
    session_id: object = None
    token_ids: Sequence[int] | None = None
    external_tokens: int = 0
    prompt_len: int = 0


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix lookup's answer for `allocate_slots`: the GPU blocks holding the leading hashes, and
    the run after them to promote from the lower tiers (`num_lower`, set by the caller)."""

    blocks: np.ndarray | list[int]  # block ids, in prefix order (may alias the pool's arrays: read only)
    epoch: int  # the pool's epoch at the lookup; it moves on at each eviction and reset
    num_lower: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class LowerTier(Protocol):
    """What the pool and the engine use of the tiers below the GPU (`agentkv.kv.tiers.TierStack`)."""

    write_mode: str  # "write_back" (stored below on eviction) or "write_through" (also on store)

    def __contains__(self, block_hash: object) -> bool: ...
    def on_gpu_store(self, block_hash: int) -> None: ...
    def on_gpu_evict(self, block_hash: int) -> None: ...
    def match(self, block_hashes: Sequence[int], start: int = 0) -> list[str]: ...
    def promote(self, block_hashes: Sequence[int]) -> float: ...


@dataclass(slots=True)
class PoolStats:
    """Counters: prefix-cache queries/hits in tokens (as vLLM's metrics), and block traffic."""

    queries: int = 0  # tokens looked up (vllm:prefix_cache_queries_total), once per request
    hits: int = 0  # tokens found cached (vllm:prefix_cache_hits_total)
    requests: int = 0  # requests counted in queries and hits
    preempted_requests: int = 0  # re-admissions after preemption (vLLM counts them apart, unexported)
    preempted_queries: int = 0
    preempted_hits: int = 0
    lookups: int = 0  # lookups the eviction policy was told of (`touch`)
    allocated: int = 0  # blocks handed to requests fresh (not prefix hits)
    stored: int = 0  # blocks that got a hash (became cached)
    evicted: int = 0  # cached blocks whose content was dropped to make room
    alloc_failures: int = 0  # allocate_slots calls refused for lack of room
    lower_blocks: int = 0  # blocks promoted from lower tiers
    promote_s: float = 0.0  # seconds spent promoting them

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        """One request's prefix lookup in tokens, as vLLM's `PrefixCacheStats.record`: a
        re-admission after preemption goes to the `preempted_*` counters, not to queries and hits."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
