"""What `agentkv cache analyze` finds: a cell per replay, the ceilings, the whole analysis (its
`--json`), and for a hybrid model each KV group's own figure."""

from __future__ import annotations

import msgspec


class GroupFigure(msgspec.Struct, kw_only=True):
    """What one KV group alone could serve: its own rule on its own cached blocks."""

    group: str  # e.g. "sliding_window 128"
    rule: str  # full | sliding | chunked | state
    hit_tokens: int
    hit_rate: float


class CellResult(msgspec.Struct, kw_only=True):
    """One replay: a policy at a capacity and block size; `tier_hit_tokens` splits the hits by tier."""

    block_size: int
    capacity: str  # as the user wrote it, e.g. "100GB"
    capacity_bytes: int
    num_blocks: int
    policy: str
    hit_rate: float
    hit_tokens: int
    query_tokens: int
    tier_hit_tokens: dict[str, int]  # "GPU", and "CPU" with a CPU tier
    too_big: int  # requests larger than the whole pool: not replayed, all their tokens missed
    evicted: int
    seconds: float
    groups: list[GroupFigure] = []  # a hybrid model: what each KV group alone could serve


class Ceiling(msgspec.Struct, kw_only=True):
    """The unbounded-cache hit rate at one block size (same accesses, same counting)."""

    block_size: int
    hit_rate: float
    hit_tokens: int
    query_tokens: int
    groups: list[GroupFigure] = []  # a hybrid model: each KV group's own unbounded hit


class KVGroup(msgspec.Struct, kw_only=True):
    """One KV group of a hybrid model's pool, as the engine lays it out."""

    name: str
    rule: str  # full | sliding | chunked | state
    window: int  # tokens of a sliding window or a chunk (0: none)
    block_bytes: list[int]  # one block of the group, at each of `block_sizes`


class Analysis(msgspec.Struct, kw_only=True):
    """What `agentkv cache analyze --json` prints."""

    model: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    traces: int
    requests: int
    input_tokens: int
    order: str  # "timestamps" (every session from t=0) or "concurrency"
    concurrency: int | None
    cpu: str | None
    cpu_bytes: int | None
    capacities: list[str]
    block_sizes: list[int]
    policies: list[str]
    ceilings: list[Ceiling]
    results: list[CellResult]
    seconds: float
    interrupted: bool = False  # stopped by Ctrl-C: `results` holds the cells that finished
    kv_groups: list[KVGroup] = []  # a hybrid model's groups (empty: one table, every layer full)
