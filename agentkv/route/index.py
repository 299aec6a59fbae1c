"""The router's global block index: which worker caches which block, per tier, per tenant.

Design (measured against a hash -> worker-bitmask dict and a radix tree in
benchmarks/indexer.py, where it was fastest): block hashes are chained (equal hash at block i
means equal tokens in blocks 0..i), so a worker's cache is just the set of hashes it holds,
and its longest cached prefix of a request is the leading run of the request's hashes found in
that set. Every update is one C-level set operation per event (`update`, `difference_update`);
a query walks only the workers that hold the request's first block, each at C speed
(`takewhile`). AllBlocksCleared or a dead worker drops that worker's sets. The GPU tier is
separate from lower tiers (CPU, DISK, ...: the `medium` of vLLM/LMCache events); a lower-tier
run continues a GPU prefix, as a CPU-offload load would.

vLLM does not de-duplicate its cache: a block computed again under a cached hash (the last block
of a fully cached prompt is always recomputed) is another copy, stored and later removed with its
own event. Extra copies are
counted aside, so the first BlockRemoved of a duplicated block leaves it indexed until the last
copy goes; the common case (no copy held twice) stays one C-level set operation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import takewhile

from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from agentkv.route.groups import GPU_NAMES, GroupFilter

GPU = "GPU"


def tier_name(medium: str | None) -> str:
    """Canonical tier of an event's `medium`: None and device names are GPU, others upper-cased."""
    if medium is None:
        return GPU
    m = medium.upper()
    return GPU if m in GPU_NAMES else m


@dataclass(frozen=True, slots=True)
class Match:
    """A worker's cached prefix for one request: leading blocks on GPU, then in lower tiers."""

    gpu: int
    lower: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu + self.lower


def served(groups: GroupFilter, found: dict[int, Match], hashes: Sequence[int], tokens: int | None):
    """`found` with each hybrid worker's match cut to what its groups' rules serve (`groups.served`);
    a cut match keeps no lower-tier blocks (a hybrid pool has none)."""
    for w, m in found.items():
        hit = groups.served(w, hashes, m.gpu, tokens)
        if hit != m.gpu:
            found[w] = Match(hit)
    return found


def _prefix(held: set[int], hashes: Sequence[int], start: int = 0) -> int:
    """How many of `hashes[start:]`, from the front, are in `held`."""
    if start:
        hashes = hashes[start:]
    return len(list(takewhile(held.__contains__, hashes)))


class BlockIndex:
    """Each worker's held block hashes, per tier (workers are small ints, tiers names)."""

    def __init__(self) -> None:
        self._gpu: dict[int, set[int]] = {}  # worker -> GPU hashes (the hot path)
        self._lower: dict[int, dict[str, set[int]]] = {}  # worker -> tier -> hashes
        self._extra: dict[tuple[int, str], dict[int, int]] = {}  # (worker, tier) -> hash -> copies beyond one
        self.groups = GroupFilter()  # a hybrid model's events: only the full-attention group's apply

    def _set(self, worker: int, tier: str) -> set[int]:
        if tier == GPU:
            s = self._gpu.get(worker)
            if s is None:
                s = self._gpu[worker] = set()
            return s
        tiers = self._lower.setdefault(worker, {})
        s = tiers.get(tier)
        if s is None:
            s = tiers[tier] = set()
        return s

    # -- updates ---------------------------------------------------------------------------------
    def store(self, worker: int, hashes: Collection[int], tier: str = GPU) -> None:
        """`worker` now holds `hashes` in `tier` (a hash it already holds is one more copy; a hash
        repeated within one event counts once)."""
        s = self._set(worker, tier)
        if s.isdisjoint(hashes):
            s.update(hashes)
            return
        extra = self._extra.setdefault((worker, tier), {})
        for h in dict.fromkeys(hashes):
            if h in s:
                extra[h] = extra.get(h, 0) + 1
            else:
                s.add(h)

    def remove(self, worker: int, hashes: Collection[int], tier: str = GPU) -> None:
        """`worker` dropped one copy of each of `hashes` from `tier`, a hash listed twice two copies (vLLM
        sends one event a block; agentkv's pools one an eviction); hashes it did not hold are ignored."""
        s = self._gpu.get(worker) if tier == GPU else self._lower.get(worker, {}).get(tier)
        if not s:
            return
        extra = self._extra.get((worker, tier))
        if not extra:
            s.difference_update(hashes)
            return
        for h in hashes:
            n = extra.get(h)
            if n is None:
                s.discard(h)
            elif n > 1:
                extra[h] = n - 1
            else:
                del extra[h]

    def clear_worker(self, worker: int) -> int:
        """Drop everything `worker` holds, in every tier (AllBlocksCleared, or it died); returns blocks dropped."""
        n = len(self._gpu.pop(worker, ()))
        for s in self._lower.pop(worker, {}).values():
            n += len(s)
        for key in [k for k in self._extra if k[0] == worker]:
            del self._extra[key]
        return n

    def apply(self, worker: int, event: KVEvent) -> None:
        """Apply one vLLM KV event from `worker` (of a hybrid model's groups, the one `groups` follows)."""
        if isinstance(event, BlockStored):
            if self.groups.stored(worker, event):
                self.store(worker, event.block_hashes, tier_name(event.medium))
        elif isinstance(event, BlockRemoved):
            if self.groups.removed(worker, event):
                self.remove(worker, event.block_hashes, tier_name(event.medium))
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(worker)
            self.groups.forget(worker)

    # -- queries ---------------------------------------------------------------------------------
    def find_matches(self, hashes: Sequence[int], tokens: int | None = None) -> dict[int, Match]:
        """Longest cached prefix of `hashes` on every worker that has one (GPU, then lower tiers); on a
        hybrid worker, what its groups serve of a prompt of `tokens` tokens."""
        if not hashes:
            return {}
        if self.groups._others:
            return served(self.groups, self._find(hashes), hashes, tokens)
        return self._find(hashes)

    def _find(self, hashes: Sequence[int]) -> dict[int, Match]:
        out: dict[int, Match] = {}
        h0 = hashes[0]
        for w, held in self._gpu.items():
            if h0 in held:
                out[w] = Match(_prefix(held, hashes))
        for w, tiers in self._lower.items():
            start = out[w].gpu if w in out else 0
            if start >= len(hashes):
                continue
            n = 0
            h = hashes[start]
            while any(h in s for s in tiers.values()):
                n += 1
                if start + n == len(hashes):
                    break
                h = hashes[start + n]
            if n:
                out[w] = Match(start, n)
        return out

    def tier_prefix(self, worker: int, hashes: Sequence[int], tier: str = GPU) -> int:
        """Leading blocks of `hashes` that `worker` holds in `tier` alone."""
        s = self._gpu.get(worker) if tier == GPU else self._lower.get(worker, {}).get(tier)
        return _prefix(s, hashes) if s else 0

    def holds(self, worker: int, block_hash: int, tier: str = GPU) -> bool:
        s = self._gpu.get(worker) if tier == GPU else self._lower.get(worker, {}).get(tier)
        return bool(s) and block_hash in s

    def blocks(self, worker: int, tier: str | None = None) -> int:
        """Blocks `worker` holds in `tier` (None: all tiers)."""
        if tier == GPU:
            return len(self._gpu.get(worker, ()))
        lower = self._lower.get(worker)
        if tier is not None:
            return len(lower.get(tier, ())) if lower else 0
        n = len(self._gpu.get(worker, ()))
        return n + sum(map(len, lower.values())) if lower else n

    def workers(self) -> list[int]:
        """Workers that hold at least one block."""
        return sorted(
            {w for w, s in self._gpu.items() if s} | {w for w, t in self._lower.items() if any(t.values())}
        )

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in s for s in self._gpu.values()) or any(
            block_hash in s for t in self._lower.values() for s in t.values()
        )


DEFAULT_TENANT = ""
_EMPTY = Match(0)


class TenantIndex:
    """One BlockIndex per tenant, so a tenant's lookups only ever see that tenant's blocks.

    Events carry hashes, not tenants, so each stored run is attributed: a continuation goes to
    the tenant whose index holds its parent on that worker; a run that starts a sequence goes
    by its salt (vLLM reports `cache_salt` in the first block's `extra_keys`) or by its first
    hash, which the router registered (`expect`) when it hashed that tenant's request.
    Unattributed runs go to DEFAULT_TENANT, the unsalted namespace. Salted hashes already
    differ per tenant; separate indexes make isolation hold by construction, not only by hash,
    except for one case: a run another router replica routed carries no salt in agentkv serve's
    events and no root this replica registered, so it lands in DEFAULT_TENANT; a salted tenant's
    lookup reads that index too (its hashes, salted by its secret-derived salt, match only runs
    computed under that same salt), so replicas see each other's placements.
    A removal is applied to every tenant's sets for that worker (a C-level set difference each).
    """

    def __init__(
        self,
        salts: dict[str, str] | None = None,
        max_blocks: int | None = None,
        windows: dict[str, int] | None = None,
        block_size: int = 16,
        max_roots: int = 1 << 20,
    ) -> None:
        self.indexes: dict[str, BlockIndex] = {DEFAULT_TENANT: BlockIndex()}
        self.max_blocks = max_blocks  # per worker, all tenants and tiers: stores past it are dropped
        self.overflow = 0  # blocks dropped for that bound
        # a hybrid model's events: the full-attention group's are indexed, the others' kept by group
        self.groups = GroupFilter(windows, block_size, max_blocks or 1 << 22)
        self.salts = dict(salts or {})  # cache_salt -> tenant
        self._roots: OrderedDict[int, str] = OrderedDict()  # first hash of a request -> tenant
        self.max_roots = max_roots

    def index(self, tenant: str) -> BlockIndex:
        idx = self.indexes.get(tenant)
        if idx is None:
            idx = self.indexes[tenant] = BlockIndex()
        return idx

    def expect(self, tenant: str, hashes: Sequence[int]) -> None:
        """The router hashed a request of `tenant`: a stored run starting at hashes[0] is theirs."""
        if hashes:
            roots = self._roots
            roots[hashes[0]] = tenant
            roots.move_to_end(hashes[0])
            if len(roots) > self.max_roots:
                roots.popitem(last=False)

    def tenant_of(self, worker: int, event: BlockStored) -> str:
        """The tenant a BlockStored run from `worker` belongs to (DEFAULT_TENANT when unknown)."""
        parent = event.parent_block_hash
        tier = tier_name(event.medium)
        if parent is not None:
            if len(self.indexes) == 1:
                return DEFAULT_TENANT
            for t, idx in self.indexes.items():
                if idx.holds(worker, parent, tier) or (tier != GPU and idx.holds(worker, parent)):
                    return t
        else:
            ek = event.extra_keys
            if ek and self.salts:
                first = ek[0]  # the first block's keys; anything malformed simply matches no salt
                for key in first if isinstance(first, list | tuple) else (first,):
                    salt = key[-1] if isinstance(key, list | tuple) and key else key
                    if isinstance(salt, str) and salt in self.salts:
                        return self.salts[salt]
        if event.block_hashes:
            return self._roots.get(event.block_hashes[0], DEFAULT_TENANT)
        return DEFAULT_TENANT

    def apply(self, worker: int, event: KVEvent) -> None:
        """Apply one KV event from `worker` to the index of the tenant it belongs to."""
        if isinstance(event, BlockStored):
            if not self.groups.stored(worker, event):
                return
            if (
                self.max_blocks is not None
                and self.blocks(worker) + len(event.block_hashes) > self.max_blocks
            ):
                self.overflow += len(event.block_hashes)
                return
            self.index(self.tenant_of(worker, event)).store(
                worker, event.block_hashes, tier_name(event.medium)
            )
        elif isinstance(event, BlockRemoved):
            if not self.groups.removed(worker, event):
                return
            tier = tier_name(event.medium)
            for idx in self.indexes.values():
                idx.remove(worker, event.block_hashes, tier)
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(worker)

    def clear_worker(self, worker: int) -> int:
        """Drop every entry of `worker` in every tenant's index (AllBlocksCleared, death, restart)."""
        self.groups.forget(worker)
        return sum(idx.clear_worker(worker) for idx in self.indexes.values())

    def find_matches(self, tenant: str, hashes: Sequence[int], tokens: int | None = None) -> dict[int, Match]:
        """Longest cached prefix per worker, looked up in `tenant`'s index only; on a hybrid worker,
        what its groups serve of a prompt of `tokens` tokens (`served`)."""
        if not hashes:
            return {}
        if self.groups._others:  # a hybrid worker reported (dense: this one check)
            return served(self.groups, self._find(tenant, hashes), hashes, tokens)
        return self._find(tenant, hashes)

    def _find(self, tenant: str, hashes: Sequence[int]) -> dict[int, Match]:
        idx = self.indexes.get(tenant)
        own = idx._find(hashes) if idx is not None else {}  # the tenants' indexes hold no groups
        if tenant == DEFAULT_TENANT or not self.salts:
            return own
        loose = self.indexes[DEFAULT_TENANT]._find(hashes)  # other replicas' unattributed runs
        for w, m in loose.items():
            if m.blocks > own.get(w, _EMPTY).blocks:
                own[w] = m
        return own

    def blocks(self, worker: int) -> int:
        n = 0
        for idx in self.indexes.values():  # once per stored event: no generator
            n += idx.blocks(worker)
        return n

    def held(self, worker: int) -> set[int]:
        """Every GPU block hash indexed for `worker`, over all tenants."""
        return set().union(*(idx._gpu.get(worker, ()) for idx in self.indexes.values()))
