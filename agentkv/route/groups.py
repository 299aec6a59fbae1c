"""How the router's index reads a hybrid model's KV cache groups, and what hit it predicts there.

A hybrid model (gpt-oss, Gemma 3, Qwen3-Next, DeepSeek-V4) keeps one block table per KV cache
group, and vLLM (0.32) publishes each group's events with its `group_idx` and, on BlockStored, its
`kv_cache_spec_kind`. The groups share block hashes, so a sliding-window group dropping blocks
that fell out of its window would, applied to one set, drop blocks the full-attention group still
holds. So the index follows one group per worker: the first group of kind full_attention,
mla_attention or sink_full_attention it reports (llm-d's and vLLM's other event consumers admit the
same kinds). Every other group's GPU blocks are kept here, apart, per worker and group, and the
hit a worker serves is the full group's prefix trimmed by each group's rule (`agentkv.kv.group_rules`,
as vLLM's `HybridKVCacheCoordinator`): a window group needs the blocks covering the last window
before the cut, a state group (mamba) a state at the cut, all within `(prompt_tokens - 1) //
block_size` blocks. A window the router was not told (`--sliding-window`) is taken as one block:
an upper bound. Events without a group (`group_idx` nil: older vLLM, SGLang, offload tiers) apply
as before; a group without a kind counts as full attention when it is group 0 (a dense model).
A store whose kind contradicts what its group reported first, or of a kind without a prefix rule,
is refused and counted. Groups are learned from their stores (vLLM announces none up front): a
window or state group's worker looks dense until that group's first store (docs/route.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile

from agentkv.kv import group_rules as R
from agentkv.kv.events import BlockRemoved, BlockStored

PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
RULE_OF_KIND = {  # vLLM's KVCacheSpecKind -> its prefix-cache rule (encoder and cross attention: none)
    **dict.fromkeys(PREFIX_KINDS, "full"),
    "sliding_window": "sliding",
    "sliding_window_mla": "sliding",
    "chunked_local_attention": "chunked",
    "mamba": "state",
}
GPU_NAMES = frozenset({"GPU", "DEVICE", "CUDA", "HBM"})
log = logging.getLogger("agentkv.route")


@dataclass(slots=True)
class _Group:
    """One group of a worker that the index does not follow: its rule and cached block hashes."""

    kind: str
    rule: str
    window: int  # tokens; 0 when not told
    block_size: int
    cached: set[int] = field(default_factory=set)
    copies: dict[int, int] = field(default_factory=dict)  # hash -> copies beyond one (vLLM duplicates)

    def add(self, hashes: Sequence[int]) -> None:
        if self.cached.isdisjoint(hashes):
            self.cached.update(hashes)
            return
        for h in dict.fromkeys(hashes):  # as BlockIndex.store: a hash repeated in one event counts once
            if h in self.cached:
                self.copies[h] = self.copies.get(h, 0) + 1
            else:
                self.cached.add(h)

    def drop(self, hashes: Iterable[int]) -> None:
        if not self.copies:
            self.cached.difference_update(hashes)
            return
        for h in hashes:  # each listed copy goes (agentkv's pools list two copies evicted at once)
            n = self.copies.pop(h, 0)
            if n > 1:
                self.copies[h] = n - 1
            elif not n:
                self.cached.discard(h)

    def hit(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks (at most `limit`) this group can serve, by its kind's rule."""
        c, bs = self.cached, self.block_size
        if self.rule == "full":
            return sum(1 for _ in takewhile(c.__contains__, islice(hashes, limit)))
        if self.rule == "sliding":  # an unknown window: its last block before the cut, an upper bound
            return R.sliding_hit(c, hashes, limit, self.window or 2, bs)
        if self.rule == "chunked":
            return R.chunked_hit(c, hashes, limit, self.window, bs) if self.window else limit
        return R.state_hit(c, hashes, limit)


def _on_gpu(medium: str | None) -> bool:
    return medium is None or medium.upper() in GPU_NAMES


class GroupFilter:
    """Per worker: the group the index follows, and the other groups' blocks for the hit rule."""

    def __init__(
        self, windows: dict[str, int] | None = None, block_size: int = 16, max_blocks: int = 1 << 22
    ):
        self.windows = dict(windows or {})  # rule ("sliding", "chunked") -> tokens
        self.block_size = block_size
        self.max_blocks = max_blocks  # per worker, over its other groups (stores past it are dropped)
        self._follow: dict[int, int] = {}  # worker -> the group_idx the index follows
        self._seen: dict[int, set[int]] = {}  # worker -> every group_idx it stored under
        self._others: dict[int, dict[int, _Group]] = {}  # worker -> group_idx -> its blocks
        self.skipped_stores = 0  # blocks stored by groups the index does not follow
        self.skipped_removals = 0  # blocks removed by them
        self.refused = 0  # blocks stored under a kind that contradicts their group's, or past max_blocks
        self._warned = False

    def stored(self, worker: int, event: BlockStored) -> bool:
        """Whether the index applies this BlockStored (else keep it with its group)."""
        g = event.group_idx
        if g is None:
            return True
        kind = event.kv_cache_spec_kind
        follow = self._follow.get(worker)
        if g == follow:
            if kind is None or kind in PREFIX_KINDS:
                return True
            self.refused += len(event.block_hashes)
            return False
        self._seen.setdefault(worker, set()).add(g)
        if follow is None and (kind in PREFIX_KINDS or (kind is None and g == 0)):
            self._follow[worker] = g
            return True
        self.skipped_stores += len(event.block_hashes)
        self._keep(worker, g, kind, event)
        return False

    def _keep(self, worker: int, g: int, kind: str | None, event: BlockStored) -> None:
        """Add a store of a group the index does not follow to that group's blocks."""
        groups = self._others.setdefault(worker, {})
        grp = groups.get(g)
        if grp is None:
            rule = RULE_OF_KIND.get(kind) if isinstance(kind, str) else None
            if rule is None:
                return
            window = self.windows.get(rule, 0)
            if rule == "sliding" and not window and not self._warned:
                self._warned = True
                log.warning(
                    "worker %d reports a %s group: pass --sliding-window TOKENS (the model's sliding_window) "
                    "so the predicted hit follows its rule (now an upper bound)",
                    worker,
                    kind,
                )
            bs = event.block_size if 0 < event.block_size <= 1 << 20 else self.block_size
            grp = groups[g] = _Group(kind, rule, window, bs)
        elif kind is not None and kind != grp.kind:
            self.refused += len(event.block_hashes)
            return
        if not _on_gpu(event.medium):
            return
        if sum(len(o.cached) for o in groups.values()) + len(event.block_hashes) > self.max_blocks:
            self.refused += len(event.block_hashes)
            return
        grp.add(event.block_hashes)

    def removed(self, worker: int, event: BlockRemoved) -> bool:
        """Whether the index applies this BlockRemoved: from the followed group, or from group 0 of a
        worker whose stores it has not seen yet (a dense server's removal of blocks stored earlier)."""
        g = event.group_idx
        follow = self._follow.get(worker)
        if g is None or g == follow or (follow is None and g == 0 and g not in self._seen.get(worker, ())):
            return True
        self.skipped_removals += len(event.block_hashes)
        grp = self._others.get(worker, {}).get(g)
        if grp is not None and _on_gpu(event.medium):
            grp.drop(event.block_hashes)
        return False

    def forget(self, worker: int) -> None:
        """The worker was cleared (restart, death): its groups are learned again from its events."""
        self._follow.pop(worker, None)
        self._seen.pop(worker, None)
        self._others.pop(worker, None)

    @property
    def hybrid(self) -> bool:
        """Whether any worker reported a group besides the one followed (else predictions are as dense)."""
        return bool(self._others)

    def served(self, worker: int, hashes: Sequence[int], full: int, tokens: int | None = None) -> int:
        """Blocks of `hashes` the worker serves, given `full` (the followed group's cached prefix) and
        the prompt's `tokens`: every group's rule in turn until none lowers it, within
        `(tokens - 1) // block_size` (the last token is always computed). Unchanged for a dense worker."""
        groups = self._others.get(worker)
        if not groups:
            return full
        hit = full if tokens is None else max(0, min(full, (tokens - 1) // self.block_size))
        while True:
            new = hit
            for grp in groups.values():
                if new == 0:
                    return 0
                new = grp.hit(hashes, new)
            if new == hit:
                return hit
            hit = new

    def counts(self) -> dict[str, int]:
        """The /debug/index figures: blocks of other groups stored, removed, refused; and held now."""
        held = sum(len(g.cached) for gs in self._others.values() for g in gs.values())
        return {
            "stored": self.skipped_stores,
            "removed": self.skipped_removals,
            "refused": self.refused,
            "held": held,
        }
