"""The engine's KV pool from its config: vLLM's memory budget, then one `BlockPool` for a dense
model (a single full-attention or MLA table, unchanged) or a `HybridPool` with a block table per
layer group (sliding window, chunked local, compressed, linear-attention state) sharing the bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentkv.engine.config import EngineConfig
from agentkv.engine.cost import CostModel
from agentkv.engine.models.layout import group_size, is_hybrid, kv_layout, page_bytes
from agentkv.engine.models.shape import ModelShape
from agentkv.errors import UserError
from agentkv.kv.events import KVEvent
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.pool import BlockPool
from agentkv.kv.tiers import TierSpec, TierStack

GIB = 1 << 30


@dataclass(slots=True)
class PoolSetup:
    pool: BlockPool | HybridPool
    num_gpu_blocks: int  # as vLLM reports it (cache_config_info), null block included
    block_bytes: int  # one block's bytes (dense: every layer; hybrid: one page, vLLM's unit)


def _capacity(cfg: EngineConfig, shape: ModelShape, cost: CostModel, hybrid: bool) -> float:
    capacity = cost.kv_capacity_bytes(
        cfg.gpu_memory_utilization, cfg.max_num_batched_tokens, cfg.max_num_seqs
    )
    if capacity <= 0:
        raise UserError(
            f"{shape.name} does not fit on {cost.gpu.name} x{cfg.tensor_parallel_size} "
            f"at --gpu-memory-utilization {cfg.gpu_memory_utilization}: no memory left for KV"
        )
    if hybrid:  # states live in the shared pool, one running state per sequence, not a reserve
        capacity += cost.state_reserve_bytes(cfg.max_num_seqs)
    return capacity


def make_pool(
    cfg: EngineConfig,
    shape: ModelShape,
    cost: CostModel,
    max_model_len: int,
    on_event: Callable[[KVEvent], None] | None = None,
) -> PoolSetup:
    """The pool `cfg` describes; a UserError when the cache cannot hold one batch or one sequence."""
    if is_hybrid(shape):
        return _hybrid(cfg, shape, cost, max_model_len, on_event)
    _check_retention(cfg, shape.name, ())
    block_bytes = int(cost.kv_bytes_per_token * cfg.block_size)
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
    else:
        num_blocks = int(_capacity(cfg, shape, cost, False) // block_bytes)
    usable = num_blocks - 1  # vLLM's BlockPool keeps one null block out of the free queue for good
    if usable * cfg.block_size < min(max_model_len, cfg.max_num_batched_tokens):
        raise UserError(
            f"the KV cache holds {max(0, usable) * cfg.block_size} tokens ({num_blocks} blocks "
            f"less vLLM's null block), fewer than one batch or --max-model-len "
            f"({max_model_len}); lower --max-model-len or give more memory"
        )
    lower = None
    specs = _tier_specs(cfg)
    if specs:
        lower = TierStack(
            specs, block_bytes, block_size=cfg.block_size, num_layers=shape.layers, on_event=on_event
        )
    pool = BlockPool(usable, cfg.block_size, cfg.eviction_policy, on_event=on_event, lower=lower)
    return PoolSetup(pool, num_blocks, block_bytes)


def _tier_specs(cfg: EngineConfig) -> list[TierSpec]:
    """The tiers below the GPU the flags ask for (CPU, then DISK)."""
    specs = []
    if cfg.kv_offloading_size > 0:
        specs.append(TierSpec("CPU", capacity_bytes=int(cfg.kv_offloading_size * GIB)))
    if cfg.kv_disk_size > 0:
        specs.append(TierSpec("DISK", capacity_bytes=int(cfg.kv_disk_size * GIB)))
    return specs


def hybrid_pool(
    specs: Sequence[GroupSpec],
    capacity: int,
    block_size: int,
    unit: int,
    page_layers: int,
    tiers: Sequence[TierSpec] = (),
    policy: str = "lru",
    on_event: Callable[[KVEvent], None] | None = None,
    retention_interval: int = 0,
) -> HybridPool:
    """A `HybridPool` of `capacity` bytes (vLLM's page `unit`, `page_layers` layers of the largest
    group) with `tiers` below it, blocks kept per group as vLLM's offloading connector keeps them,
    one layer's page a copy: the engine's pool, and `cache analyze`'s for a hybrid model."""
    lower = None
    if tiers:
        page = unit // page_layers
        lower = TierStack(
            list(tiers),
            unit,
            block_size=block_size,
            on_event=on_event,
            group_bytes=[s.block_bytes for s in specs],
            group_chunks=[max(1, min(page, s.block_bytes)) for s in specs],
        )
    return HybridPool(
        specs,
        capacity,
        block_size,
        unit_bytes=unit,
        on_event=on_event,
        policy=policy,
        lower=lower,
        retention_interval=retention_interval,
    )


def _hybrid(cfg: EngineConfig, shape: ModelShape, cost: CostModel, max_model_len: int, on_event) -> PoolSetup:
    """Per-group tables over one pool; vLLM's page (`group_size` layers of the largest page) is the unit."""
    name = shape.name
    dtype, tp, bs = cost.kv_dtype, cfg.tensor_parallel_size, cfg.block_size
    specs = kv_layout(shape, bs, dtype, tp)
    unit = page_bytes(shape, bs, dtype, tp)
    if cfg.num_gpu_blocks_override is not None:
        capacity = cfg.num_gpu_blocks_override * unit
    else:
        capacity = int(_capacity(cfg, shape, cost, True))
    capacity -= unit  # vLLM's null block
    need = min(max_model_len, cfg.max_num_batched_tokens)
    one_seq = sum(s.block_bytes * (1 if s.rule == "state" else -(-need // bs)) for s in specs)
    if capacity < one_seq:
        raise UserError(
            f"the KV cache holds {max(0, capacity) / GIB:.2f} GiB, less than one sequence of "
            f"{need} tokens needs in {name}'s groups ({one_seq / GIB:.2f} GiB); "
            "lower --max-model-len or give more memory"
        )
    layers = group_size(shape.groups)
    _check_retention(cfg, name, specs)
    interval = cfg.prefix_cache_retention_interval
    pool = hybrid_pool(
        specs, capacity, bs, unit, layers, _tier_specs(cfg), cfg.eviction_policy, on_event, interval
    )
    return PoolSetup(pool, capacity // unit + 1, unit)


def _check_retention(cfg: EngineConfig, name: str, specs: Sequence[GroupSpec]) -> None:
    """vLLM refuses a retention interval for a model without a window or Mamba-state group."""
    if cfg.prefix_cache_retention_interval and not any(
        s.rule == "sliding" or s.rule == "state" for s in specs
    ):
        raise UserError(
            f"--prefix-cache-retention-interval {cfg.prefix_cache_retention_interval}: {name} has no "
            "sliding-window or Mamba KV cache group, so retention has no effect (set it to 0)"
        )


def seq_token_capacity(pool: BlockPool | HybridPool) -> int:
    """The most tokens one sequence can hold with the whole pool to itself; a longer request could
    never be scheduled (vLLM refuses to start when max_model_len needs more)."""
    bs = pool.block_size
    if isinstance(pool, BlockPool):
        return pool.num_blocks * bs

    def bytes_for(n: int) -> int:
        return sum(
            s.block_bytes
            * (
                1
                if s.rule == "state"
                else -(-n // bs)
                if s.rule == "full"
                else -(-min(n, s.window) // bs) + 1
            )
            for s in pool.specs
        )

    lo, hi = 0, 1 << 40  # no full-attention group: any length fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if bytes_for(mid) <= pool.capacity else (lo, mid - 1)
    return lo
