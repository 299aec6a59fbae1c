"""Which KV cache group of a hybrid model the router's index follows.

A hybrid model (gpt-oss, Gemma 3, Qwen3-Next, DeepSeek-V4) keeps one block table per KV cache
group, and vLLM (0.32) publishes each group's events with its `group_idx` and, on BlockStored, its
`kv_cache_spec_kind`. The groups share block hashes, so a sliding-window group dropping blocks
that fell out of its window would, applied to one set, drop blocks the full-attention group still
holds. A prefix hit is decided by the full-attention group (the window and state groups only need
the last blocks, which vLLM recomputes or restores), so the index follows one group per worker:
the first group of kind full_attention, mla_attention or sink_full_attention it reports (llm-d's
and vLLM's other event consumers admit the same kinds). Events of every other group are skipped
and counted. Events without a group (`group_idx` nil: older vLLM, SGLang, offload tiers) apply as
before; a group without a kind counts as full attention when it is group 0 (a dense model).
"""

from __future__ import annotations

from agentkv.kv.events import BlockRemoved, BlockStored

PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class GroupFilter:
    """Per worker: the group the index follows, learned from its BlockStored events."""

    def __init__(self) -> None:
        self._follow: dict[int, int] = {}  # worker -> the group_idx the index follows
        self._seen: dict[int, set[int]] = {}  # worker -> every group_idx it stored under
        self.skipped_stores = 0  # blocks stored by groups the index does not follow
        self.skipped_removals = 0  # blocks removed by them

    def stored(self, worker: int, event: BlockStored) -> bool:
        """Whether the index applies this BlockStored (and learn its group)."""
        g = event.group_idx
        if g is None:
            return True
        self._seen.setdefault(worker, set()).add(g)
        kind = event.kv_cache_spec_kind
        follow = self._follow.get(worker)
        if follow is None and (kind in PREFIX_KINDS or (kind is None and g == 0)):
            follow = self._follow[worker] = g
        if g == follow:
            return True
        self.skipped_stores += len(event.block_hashes)
        return False

    def removed(self, worker: int, event: BlockRemoved) -> bool:
        """Whether the index applies this BlockRemoved: from the followed group, or from group 0 of a
        worker whose stores it has not seen yet (a dense server's removal of blocks stored earlier)."""
        g = event.group_idx
        follow = self._follow.get(worker)
        if g is None or g == follow or (follow is None and g == 0 and g not in self._seen.get(worker, ())):
            return True
        self.skipped_removals += len(event.block_hashes)
        return False

    def forget(self, worker: int) -> None:
        """The worker was cleared (restart, death): its groups are learned again from its events."""
        self._follow.pop(worker, None)
        self._seen.pop(worker, None)
