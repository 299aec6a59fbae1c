"""Memory tiers below the GPU: an evicted GPU block is demoted to CPU DRAM, then to SSD, then dropped.

GPU (HBM) blocks belong to the block pool, which calls this `TierStack` when it stores and evicts
blocks and when it finds a prefix run missing on the GPU. Invariants:

- Caching is inclusive: a promoted block is copied up and keeps its lower copies, so evicting it
  from the GPU again costs nothing while its CPU copy lives; a lower tier may hold blocks that are
  also on the GPU (and the DISK tier blocks also in CPU).
- A block enters the top lower tier when it leaves the GPU (write-back) or when it is stored on the
  GPU (write-through), unless already there. Each tier evicts by LRU (or FIFO) into the next one
  (skipping the copy when the next one already holds it); the last tier drops its victims.
- Every change of a tier's contents is reported through `on_event` as BlockStored/BlockRemoved with
  `medium` set to the tier name, a block being stored below before it is removed above.

Costs: promotion (the critical path) is returned by `promote`; demotion copies (device->host, disk
writes) are accumulated in the counters, since they may overlap compute.

A hybrid model's pool (`groups.HybridPool`) gives `group_bytes`: its blocks are then keyed
`(group, hash)`, as vLLM's offloading connector keys them (`OffloadKey`: hash and group index),
each costing its group's bytes; a tier's capacity is shared in bytes and one LRU spans the groups.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from agentkv.errors import UserError
from agentkv.kv.events import BlockRemoved, BlockStored, KVEvent
from agentkv.kv.transfer import DiskModel, LinkModel, h200_link
from agentkv.units import parse_capacity

MEDIA = ("CPU", "DISK")
WRITE_MODES = ("write_back", "write_through")
POLICIES = ("lru", "fifo")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier below the GPU: `name` ("CPU" or "DISK") and its capacity, in blocks or in bytes.

    `disk` is the SSD model of a DISK tier (default `DiskModel()`); CPU tiers use the stack's link.
    """

    name: str
    capacity_blocks: int | None = None
    capacity_bytes: int | None = None
    disk: DiskModel | None = None

    @classmethod
    def parse(cls, name: str, capacity: str | int, disk: DiskModel | None = None) -> TierSpec:
        """A spec from a capacity string like "512GB" or "200GiB" (see `agentkv.units`)."""
        return cls(name, capacity_bytes=parse_capacity(capacity, f"{name} tier capacity"), disk=disk)

    def blocks(self, block_bytes: int) -> int:
        """Capacity in blocks of `block_bytes`; UserError if unset, doubly set or under one block."""
        if (self.capacity_blocks is None) == (self.capacity_bytes is None):
            raise UserError(f"{self.name} tier: give exactly one of capacity_blocks and capacity_bytes")
        n = self.capacity_blocks if self.capacity_blocks is not None else self.capacity_bytes // block_bytes
        if n < 1:
            raise UserError(f"{self.name} tier: capacity holds no block of {block_bytes} bytes")
        return n


@dataclass(slots=True)
class TierCounters:
    """What one tier saw: blocks in and out, promotion hits, bytes and seconds moved."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds_up: float = 0.0
    seconds_down: float = 0.0


@dataclass(slots=True)
class StackCounters:
    """Totals over the stack: promotion time (critical path), demotion time (may overlap compute)."""

    promotions: int = 0
    promoted_blocks: int = 0
    promote_s: float = 0.0
    demote_s: float = 0.0
    store_copy_s: float = 0.0
    evict_copy_s: float = 0.0
    dropped_blocks: int = 0
    tiers: dict[str, TierCounters] = field(default_factory=dict)


class _Tier:
    """One lower tier's contents in eviction order (oldest first, each with its bytes), its
    capacity and use in bytes, and its counters."""

    __slots__ = ("name", "capacity", "used", "blocks", "disk", "counters")

    def __init__(self, name: str, capacity: int, disk: DiskModel | None) -> None:
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.blocks: OrderedDict[object, int] = OrderedDict()
        self.disk = disk
        self.counters = TierCounters()


class TierStack:
    """CPU and DISK tiers under the GPU pool: demote on eviction, match and promote on lookup.

    `chunk_bytes` is the size of one host<->device copy. Default: one block's KV for one layer,
    `block_bytes // num_layers`, since vLLM's offloading copies each layer's block separately (with
    K and V in separate tensors, as in FlashAttention's layout, pass half that). `link` defaults to
    the H200 measurements. `block_size` (tokens per block) fills token counters and events.
    `group_bytes` (and `group_chunks`, one copy each): a hybrid pool's per-group block bytes, its
    blocks keyed `(group, hash)`; `block_bytes` is then the unit `occupancy` counts in.
    """

    def __init__(
        self,
        specs: Sequence[TierSpec],
        block_bytes: int,
        chunk_bytes: int | None = None,
        write_mode: str = "write_back",
        policy: str = "lru",
        on_event: Callable[[KVEvent], None] | None = None,
        *,
        block_size: int = 0,
        num_layers: int = 1,
        link: LinkModel | None = None,
        group_bytes: Sequence[int] | None = None,
        group_chunks: Sequence[int] | None = None,
    ) -> None:
        if block_bytes <= 0 or num_layers <= 0:
            raise UserError(
                f"tiers: block_bytes and num_layers must be positive, got {block_bytes}, {num_layers}"
            )
        if write_mode not in WRITE_MODES:
            raise UserError(f"tiers: write_mode must be one of {', '.join(WRITE_MODES)}, got {write_mode!r}")
        if policy not in POLICIES:
            raise UserError(f"tiers: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        names = [s.name for s in specs]
        if (
            any(n not in MEDIA for n in names)
            or len(set(names)) != len(names)
            or names != sorted(names, key=MEDIA.index)
        ):
            raise UserError(f"tiers: expected CPU and/or DISK, each once, in that order; got {names}")
        self.block_bytes = block_bytes
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else max(1, block_bytes // num_layers)
        if self.chunk_bytes <= 0:
            raise UserError(f"tiers: chunk_bytes must be positive, got {chunk_bytes}")
        self.write_mode = write_mode
        self.policy = policy
        self.block_size = block_size
        self.link = link if link is not None else h200_link()
        self.on_event = on_event
        self._block_copy_s = self.link.seconds(block_bytes, self.chunk_bytes)  # one block, host<->GPU
        largest = self._setup_groups(group_bytes, group_chunks, num_layers)
        self._tiers = [
            _Tier(s.name, self._capacity(s, largest), (s.disk or DiskModel()) if s.name == "DISK" else None)
            for s in specs
        ]
        self._gpu: set[int] = set()
        self.counters = StackCounters(tiers={t.name: t.counters for t in self._tiers})

    def _setup_groups(self, group_bytes, group_chunks, num_layers: int) -> int:
        """Per-group sizes and copy times (a hybrid pool's); returns the largest block's bytes."""
        self.group_bytes = None if group_bytes is None else tuple(int(b) for b in group_bytes)
        self._group_copy_s: tuple[float, ...] = ()
        if self.group_bytes is None:
            return self.block_bytes
        chunks = list(group_chunks or [max(1, b // num_layers) for b in self.group_bytes])
        if (
            self.write_mode != "write_back"
            or not self.group_bytes
            or len(chunks) != len(self.group_bytes)
            or min(self.group_bytes + tuple(chunks)) < 1
        ):
            raise UserError(
                "tiers: per-group blocks need write_back, and a positive size and chunk per group"
            )
        self._group_copy_s = tuple(
            self.link.seconds(b, c) for b, c in zip(self.group_bytes, chunks, strict=True)
        )
        return max(self.group_bytes)

    def _capacity(self, spec: TierSpec, largest: int) -> int:
        """A tier's bytes: whole blocks (dense), or its bytes holding at least the largest group's block."""
        if self.group_bytes is None:
            return spec.blocks(self.block_bytes) * self.block_bytes
        n = spec.blocks(largest)  # the checks (set once, at least one block)
        return spec.capacity_bytes if spec.capacity_bytes is not None else n * largest

    def _cost(self, key) -> tuple[int, float]:
        """A block's bytes and its host<->GPU copy seconds."""
        if self.group_bytes is None:
            return self.block_bytes, self._block_copy_s
        g = key[0]
        return self.group_bytes[g], self._group_copy_s[g]

    def _stored_event(self, key, medium: str) -> BlockStored:
        """BlockStored for one block below the GPU; a group's carries its `group_idx` and no spec kind,
        as vLLM's offloading connector publishes an offloaded block (one hash, no tokens or parent)."""
        if self.group_bytes is None:
            return BlockStored(block_hashes=[key], block_size=self.block_size, medium=medium)
        return BlockStored(
            block_hashes=[key[1]],
            block_size=self.block_size,
            medium=medium,
            group_idx=key[0],
            kv_cache_spec_kind=None,
        )

    def _removed_events(self, keys: list, medium: str) -> list[BlockRemoved]:
        """BlockRemoved for blocks dropped from `medium`: one event, or one per group (in key order)."""
        if self.group_bytes is None:
            return [BlockRemoved(block_hashes=keys, medium=medium)]
        by: dict[int, list[int]] = {}
        for g, h in keys:
            by.setdefault(g, []).append(h)
        return [BlockRemoved(block_hashes=hs, medium=medium, group_idx=g) for g, hs in by.items()]

    # -- queries ---------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def where(self, block_hash: int) -> str | None:
        """The highest lower tier holding `block_hash` (where a promotion would read it), or None."""
        for t in self._tiers:
            if block_hash in t.blocks:
                return t.name
        return None

    def __contains__(self, block_hash: object) -> bool:
        return any(block_hash in t.blocks for t in self._tiers)

    def occupancy(self) -> dict[str, tuple[int, int]]:
        """Per tier: (blocks held, capacity in blocks of `block_bytes`)."""
        return {t.name: (len(t.blocks), t.capacity // self.block_bytes) for t in self._tiers}

    def used_bytes(self) -> dict[str, int]:
        """Per tier: the bytes its blocks take."""
        return {t.name: t.used for t in self._tiers}

    def blocks(self, name: str) -> list[int]:
        """The hashes tier `name` holds, next victim first."""
        return list(self._tier(name).blocks)

    def match(self, block_hashes: Sequence[int], start: int = 0) -> list[str]:
        """Tier names of the longest run of `block_hashes[start:]` held below the GPU.

        A lookup counts as a use: the run is touched (LRU), so the GPU evictions that make room for
        its promotion push other blocks down first. Promote before evicting to be sure of it.
        """
        if len(self._tiers) == 1:  # the common case, one CPU tier: both walks run in C
            t = self._tiers[0]
            run = list(takewhile(t.blocks.__contains__, block_hashes[start:]))
            if self.policy == "lru":
                deque(map(t.blocks.move_to_end, run), maxlen=0)
            return [t.name] * len(run)
        out: list[str] = []
        for h in block_hashes[start:]:
            for t in self._tiers:
                if h in t.blocks:
                    self._touch(t, h)
                    out.append(t.name)
                    break
            else:
                break
        return out

    # -- the pool's hooks ------------------------------------------------------------------------
    def on_gpu_store(self, block_hash: int) -> None:
        """A block became resident on the GPU; write-through copies it down now."""
        if block_hash in self._gpu:
            return
        self._gpu.add(block_hash)
        if self.write_mode == "write_through" and self._tiers:
            self.counters.store_copy_s += self._write_from_gpu(block_hash)

    def on_gpu_evict(self, block_hash: int) -> None:
        """The pool evicted a block from the GPU: keep it in the top lower tier (copied unless there)."""
        self._gpu.discard(block_hash)
        if self._tiers:
            self.counters.evict_copy_s += self._write_from_gpu(block_hash)

    def promote(self, block_hashes: Iterable[int]) -> float:
        """Copy blocks up to the GPU from the highest tier holding each; return the transfer seconds.

        Lower copies stay (inclusive) and are touched as recently used; the blocks count as
        GPU-resident afterwards. A DISK block is read into a host bounce buffer and then copied to
        the GPU, the two steps serial. KeyError if a block is in no lower tier (use `match` first).
        """
        per_tier: dict[str, list[int]] = {}
        for h in block_hashes:
            name = self.where(h)
            if name is None:
                raise KeyError(f"block {h:#x} is in no lower tier")
            per_tier.setdefault(name, []).append(h)
        total = 0.0
        for name, hashes in per_tier.items():
            tier = self._tier(name)
            n = len(hashes)
            if self.group_bytes is None:
                nbytes, seconds = n * self.block_bytes, n * self._block_copy_s
            else:
                costs = [self._cost(k) for k in hashes]
                nbytes, seconds = sum(c[0] for c in costs), sum(c[1] for c in costs)
            if tier.disk is not None:
                seconds += tier.disk.seconds(nbytes, n, write=False)
            for h in hashes:
                self._touch(tier, h)
                self._gpu.add(h)
            c = tier.counters
            c.hit_blocks += n
            c.hit_tokens += n * self.block_size
            c.bytes_up += nbytes
            c.seconds_up += seconds
            self.counters.promoted_blocks += n
            total += seconds
        self.counters.promotions += 1
        self.counters.promote_s += total
        return total

    def clear(self) -> None:
        """Drop every block of every lower tier (a cache reset), reporting each tier's removal."""
        for t in self._tiers:
            if t.blocks:
                hashes = list(t.blocks)
                t.blocks.clear()
                t.used = 0
                t.counters.removed_blocks += len(hashes)
                if self.on_event is not None:
                    for ev in self._removed_events(hashes, t.name):
                        self.on_event(ev)
        self._gpu.clear()

    # -- internals -------------------------------------------------------------------------------
    def _tier(self, name: str) -> _Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no {name} tier (tiers: {self.names})")

    def _touch(self, tier: _Tier, block_hash: int) -> None:
        if self.policy == "lru":
            tier.blocks.move_to_end(block_hash)

    def _write_from_gpu(self, block_hash: int) -> float:
        """Put a GPU block into the top lower tier; return the demotion seconds (0 if already there)."""
        top = self._tiers[0]
        if block_hash in top.blocks:
            self._touch(top, block_hash)
            return 0.0
        nbytes, seconds = self._cost(block_hash)
        if top.disk is not None:
            seconds += top.disk.seconds(nbytes, 1, write=True)
        top.counters.bytes_down += nbytes
        top.counters.seconds_down += seconds
        self.counters.demote_s += seconds
        self._insert(0, block_hash, nbytes)
        return seconds

    def _insert(self, level: int, block_hash, nbytes: int) -> None:
        """Store a block at `level`, first demoting that tier's victims one level down (or dropping
        them) until its bytes fit (one victim when every block is the same size)."""
        tier = self._tiers[level]
        while tier.used + nbytes > tier.capacity:
            victim, vbytes = tier.blocks.popitem(last=False)
            tier.used -= vbytes
            self._demote(level + 1, victim, vbytes)
            tier.counters.removed_blocks += 1
            if self.on_event is not None:
                self.on_event(self._removed_events([victim], tier.name)[0])
        tier.blocks[block_hash] = nbytes
        tier.used += nbytes
        tier.counters.stored_blocks += 1
        if self.on_event is not None:
            self.on_event(self._stored_event(block_hash, tier.name))

    def _demote(self, level: int, block_hash, nbytes: int) -> None:
        """Move a victim into tier `level` (a DISK write), or drop it past the last tier."""
        if level >= len(self._tiers):
            self.counters.dropped_blocks += 1
            return
        tier = self._tiers[level]
        if block_hash in tier.blocks:
            self._touch(tier, block_hash)
            return
        seconds = tier.disk.seconds(nbytes, 1, write=True) if tier.disk is not None else 0.0
        tier.counters.bytes_down += nbytes
        tier.counters.seconds_down += seconds
        self.counters.demote_s += seconds
        self._insert(level, block_hash, nbytes)
