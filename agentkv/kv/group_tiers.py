"""The hybrid pool's eviction policy and its tiers below the GPU, kept apart from its block
bookkeeping (`group_state`), which tells them of stores and evictions through `GroupHooks`.

- Policies: any `eviction.Evictor` orders the freed cached blocks of every group (`PolicyQueue`,
  in the shape of `group_lru.ByteLRU`: victims taken until enough bytes are free). vLLM's GPU
  cache is LRU only; the others are agentkv's what-ifs, as for dense models.
- Tiers: as vLLM's offloading connector with hybrid groups (`OffloadKey` = hash + group), a GPU
  block a group evicts is kept below it under `(group, hash)` (`tiers.TierStack` with
  `group_bytes`: one byte capacity, one LRU over the groups). A prefix hit is what every group can
  serve from the GPU or below it, under each kind's rule (`group_rules`): a full-attention group
  loads every block it lacks, a window only its last window, a state group the state saved at the
  cut. Loading is priced by the tier's link model, per group (its bytes, one layer's page a copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentkv.kv import group_rules as R
from agentkv.kv.eviction.base import Evictor
from agentkv.kv.interface import KVRequest

EMPTY = np.zeros(0, dtype=np.int64)


class _PoolView:
    """What an `Evictor` reads of a pool (`bind`): block ids' range, reference counts, hashes."""

    __slots__ = ("num_blocks", "ref", "hash_of")

    def __init__(self, pool) -> None:
        self.num_blocks = len(pool.ref)
        self.ref = pool.ref
        self.hash_of = pool.hash_of  # block -> the hash it holds (None: none)


class PolicyQueue:
    """An eviction policy over the hybrid pool's freed cached blocks, with `ByteLRU`'s verbs.

    `pop_bytes` asks the policy for the fewest victims that could free the bytes (each at most the
    largest group's block), then for more until they do: exactly the victims one at a time would give.
    `session` is the request whose blocks are freed next (the pool sets it), for the session policy.
    """

    def __init__(self, policy: Evictor, pool) -> None:
        self.policy = policy
        self.cost = pool.bcost
        self.largest = max(s.block_bytes for s in pool.specs)
        self.session: object = None
        policy.bind(_PoolView(pool))

    def __len__(self) -> int:
        return len(self.policy)

    def _ids(self, blocks: np.ndarray):
        return blocks if self.policy.arrays else blocks.tolist()

    def add(self, blocks: np.ndarray) -> None:
        self.policy.add_many(self._ids(blocks), self.session)

    def removed(self, blocks: np.ndarray) -> None:
        self.policy.remove_many(self._ids(blocks))

    def pop_bytes(self, need: int) -> tuple[np.ndarray, int]:
        out, freed = [], 0
        while freed < need and len(self.policy):
            k = min(len(self.policy), -(-(need - freed) // self.largest))
            victims = np.asarray(self.policy.pop_victims(k), dtype=np.int64)
            freed += int(self.cost[victims].sum())
            out.append(victims)
        return (np.concatenate(out) if out else EMPTY), freed

    def blocks(self) -> list[int]:
        return [int(b) for b in self.policy.blocks()]

    def clear(self) -> None:
        self.policy.clear()


class GroupHooks:
    """Told by the pool of each store (the policy's `on_cached` hint) and eviction (kept below)."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def stored(self, g: int, blocks: list[int], lo: int, hashes: Sequence[int]) -> None:
        """Blocks of group `g` got the hashes at `lo..`: a full-attention group's chain has parents
        (radix keeps prefixes whole); window and state blocks stand alone, never read as a chain."""
        queue = self.pool.lru
        if not isinstance(queue, PolicyQueue):
            return
        policy = queue.policy
        if self.pool.specs[g].rule == "full":
            parent = self.pool.cached_maps[g].get(hashes[lo - 1]) if lo else None
            policy.on_cached(blocks, lo, parent, hashes)
        else:
            for i, b in enumerate(blocks):
                policy.on_cached([b], lo + i, None, hashes)

    def evicted(self, removed: dict[int, list[int]]) -> None:
        lower = self.pool.lower
        if lower is not None:
            for g, hs in removed.items():
                for h in hs:
                    lower.on_gpu_evict((g, h))


class _Either:
    """Group `g`'s hashes cached on the GPU or below it: a rule's `cached` map (`in`, `get`)."""

    __slots__ = ("gpu", "lower", "g")

    def __init__(self, gpu: dict[int, int], lower, g: int) -> None:
        self.gpu, self.lower, self.g = gpu, lower, g

    def __contains__(self, h: object) -> bool:
        return h in self.gpu or (self.g, h) in self.lower

    def get(self, h: int, default=None):
        b = self.gpu.get(h)
        if b is None and (self.g, h) in self.lower:
            return -1
        return default if b is None else b


def _runs(idx: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indices."""
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][-1] + 1 == i:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class GroupLower:
    """Mixin of `HybridPool`: prefix hits served from the GPU and the tiers below (`lower`)."""

    def either_maps(self) -> list[_Either]:
        """Each group's hashes cached on the GPU or below it, as its rule reads a `cached` map."""
        return [_Either(d, self.lower, g) for g, d in enumerate(self.cached_maps)]

    def either_hit(self, block_hashes: Sequence[int], limit: int) -> int:
        """Leading blocks every group can serve from the GPU or below it (at most `limit`)."""
        return self.longest_hit(block_hashes, limit, None, self.either_maps())

    def match_lower(self, block_hashes: Sequence[int], start: int, stop: int | None = None) -> list[str]:
        """Tier names of the blocks after the GPU hit (`start`) that a hit served from the GPU and
        below reaches, by where the first group's block is ([] without tiers)."""
        if self.lower is None:
            return []
        stop = len(block_hashes) if stop is None else min(stop, len(block_hashes))
        hit = self.either_hit(block_hashes, stop)
        where, top = self.lower.where, self.lower.names[0]
        return [where((0, block_hashes[i])) or top for i in range(start, hit)]

    def _plan(self, hashes: Sequence[int], hit: int) -> tuple[list[np.ndarray], list[list[int]]]:
        """Per group, for a hit of `hit` blocks: the GPU blocks it reads, the block indices to load."""
        held, load = [], []
        for g, s in enumerate(self.specs):
            d = self.cached_maps[g]
            idx = R.hit_blocks(s.rule, hit, s.window, self.block_size)
            on_gpu = [d.get(hashes[i], -1) for i in idx]
            held.append(np.asarray([b for b in on_gpu if b >= 0], dtype=np.int64))
            load.append([i for i, b in zip(idx, on_gpu, strict=True) if b < 0])
        return held, load

    def admit_from_below(self, req: KVRequest, nc: int, nl: int, num_new_tokens: int) -> bool:
        """A first allocation whose hit (`nc` GPU blocks, then `nl` more) reads blocks from below:
        hold the GPU ones, load the others into fresh blocks (cached again, as vLLM caches loaded
        blocks), then admit as a GPU hit. False (nothing changed) if the pool lacks the room."""
        rid, bs, hashes = req.request_id, self.block_size, req.block_hashes
        hit = nc + nl
        if hit > len(hashes) or self.either_hit(hashes, hit) < hit:
            raise ValueError(
                f"request {rid}: its prefix of {hit} blocks is not cached in every group on the GPU "
                "or below it (pass allocate_slots what get_computed_blocks and match_lower found)"
            )
        held, load = self._plan(hashes, hit)
        total = hit * bs + num_new_tokens
        skips = self.first_skips(req, hit)
        new = self.first_blocks(hit, total, skips)
        need = 0
        for s, n, h, ld in zip(self.specs, new, held, load, strict=True):
            need += s.block_bytes * (n + len(ld) + (int((self.ref[h] == 0).sum()) if len(h) else 0))
        if need > self.available_bytes:
            self.stats.alloc_failures += 1
            return False
        keys = [(g, hashes[i]) for g, ld in enumerate(load) for i in ld]
        self.last_promote_s = self.lower.promote(keys)  # read first: GPU evictions may push them out
        self.stats.lower_blocks += nl
        self.stats.promote_s += self.last_promote_s
        for g, h in enumerate(held):
            if len(h):
                self._pin(g, h)
        loaded = [self._load(req, g, ld) for g, ld in enumerate(load)]
        self.start(req, hit, self.shared_blocks(hashes, hit, skips), new, total, skips)
        for g in range(len(self.specs)):
            for arr in (held[g], loaded[g]):
                if len(arr):
                    self._unpin(arr)  # the request holds them now (a state: back to the LRU)
        return True

    def _load(self, req: KVRequest, g: int, idx: list[int]) -> np.ndarray:
        """Fresh blocks of group `g` for the prompt blocks `idx`, cached under their hashes."""
        if not idx:
            return EMPTY
        blocks = self._take(g, len(idx))
        hashes, pos = req.block_hashes, 0
        for run in _runs(idx):
            bl = blocks[pos : pos + len(run)].tolist()
            pos += len(run)
            self._store(g, [hashes[i] for i in run], bl, hashes, run[0], run[-1] + 1, req.token_ids)
        return blocks
