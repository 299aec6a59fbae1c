"""The hybrid pool's byte-sized LRU: its compiled pops take exactly the victims one-at-a-time
eviction would, oldest first, until their bytes reach the need."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.group_lru import ByteLRU


def _reference_pop(order: OrderedDict, cost: np.ndarray, need: int) -> tuple[list[int], int]:
    out, freed = [], 0
    while freed < need and order:
        b, _ = order.popitem(last=False)
        out.append(b)
        freed += int(cost[b])
    return out, freed


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "remove", "pop"]), st.integers(1, 6000), st.integers(0, 10**9)
        ),
        min_size=1,
        max_size=30,
    )
)
def test_pop_bytes_matches_one_at_a_time(ops) -> None:
    """Random frees, re-references and pops (some past the 4,096-victim buffer, some draining the
    LRU, some of a block freed twice) against an ordered dict popped one block at a time."""
    n_ids = 9000
    cost = np.array([(b % 3 + 1) * 100 for b in range(n_ids)], dtype=np.int64)  # three groups' sizes
    lru, ref = ByteLRU(cost), OrderedDict()
    free = list(range(n_ids))
    rng = np.random.default_rng(0)
    for kind, k, seed in ops:
        if kind == "add" and free:
            k = min(k, len(free))
            blocks = np.array(free[:k], dtype=np.int64)
            del free[:k]
            lru.add(blocks)
            ref.update((b, None) for b in blocks.tolist())
        elif kind == "remove" and ref:
            pick = np.random.default_rng(seed).choice(list(ref), size=min(k, len(ref)), replace=False)
            lru.removed(pick)
            for b in pick.tolist():
                del ref[b]
            free += pick.tolist()
        elif kind == "pop":
            need = int(rng.integers(1, 100 * k + 2)) if seed % 5 else 10**12  # 1 in 5 drains it
            victims, freed = lru.pop_bytes(need)
            want, want_freed = _reference_pop(ref, cost, need)
            assert victims.tolist() == want and freed == want_freed
            free += want
        assert len(lru) == len(ref) and lru.blocks() == list(ref)


def test_a_large_pop_and_an_exact_need() -> None:
    """One chunk of 10,000 freed blocks: a need met exactly by the first 5,000 takes those 5,000
    (not one more), past the scan's 4,096-victim buffer; the next pop starts right after them."""
    cost = np.array([(b % 3 + 1) * 100 for b in range(10_000)], dtype=np.int64)
    lru = ByteLRU(cost)
    lru.add(np.arange(10_000, dtype=np.int64))
    need = int(cost[:5000].sum())
    victims, freed = lru.pop_bytes(need)
    assert victims.tolist() == list(range(5000)) and freed == need and len(lru) == 5000
    victims, freed = lru.pop_bytes(1)
    assert victims.tolist() == [5000] and freed == int(cost[5000])
