"""The ceiling's three views (agentkv/trace/ceiling.py) agree: one definition, checked on real traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.ceiling import CeilingTracker, cache_hits, ceiling_tokens
from agentkv.trace.formats import bundled_sample, load_paths


@pytest.fixture(scope="module")
def traces():
    return load_paths(bundled_sample(), "auto")


def test_tracker_one_request_at_a_time_equals_the_vectorised_count(traces) -> None:
    for t in traces:
        reqs = [x.request for x in t.timeline()]
        tracker = CeilingTracker()
        one_by_one = [tracker.hit_tokens(t.id, r.hash_ids, r.input_tokens, t.block_size) for r in reqs]
        assert one_by_one == cache_hits(reqs, t.block_size).tolist()
        assert sum(one_by_one) > 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_key_ceiling_equals_the_tracker_with_the_last_token_recomputed(traces, block_size) -> None:
    """On chained engine keys, ceiling_tokens is the tracker's count with the pool's limit."""
    accesses = block_accesses(arrivals(traces), block_size)
    tracker = CeilingTracker()
    expected = 0
    for r in accesses:
        limit = max(0, (r.input_tokens - 1) // block_size)
        expected += tracker.hit_tokens("all", r.hashes[:limit], limit * block_size, block_size)
        tracker.hit_tokens("all", r.hashes, r.input_tokens, block_size)  # then all its keys are cached
    assert ceiling_tokens(accesses, block_size) == expected > 0


def test_a_request_never_hits_its_own_blocks() -> None:
    tracker = CeilingTracker()
    assert tracker.hit_tokens("s", [1, 2, 2, 3], 64, 16) == 0  # repeats inside one request are misses
    assert tracker.hit_tokens("s", [1, 2, 9], 48, 16) == 32
    assert tracker.hit_tokens("other", [1, 2], 32, 16) == 0  # another hash space shares nothing


def _reference(seen: set, hash_ids: list[int], input_tokens: int, block_size: int) -> int:
    run = 0
    while run < len(hash_ids) and hash_ids[run] in seen:
        run += 1
    seen.update(hash_ids)
    return min(run * block_size, input_tokens)


IDS = st.one_of(st.integers(0, 6), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), 2**64, 2**70]))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.lists(IDS, max_size=8), st.sampled_from(["list", "i8", "u8"]))
    )
)
def test_the_tracker_answers_as_a_set_for_any_ids_and_forms(calls) -> None:
    """The tracker's compiled run (ids in [0, 2**64)) gives a plain set's answers, as lists or as
    int64 / uint64 arrays, and a space that meets a negative or wider id goes on as a set."""
    tracker, ref = CeilingTracker(), {"a": set(), "b": set()}
    for space, ids, form in calls:
        arg = ids
        if form == "i8" and all(-(2**63) <= h < 2**63 for h in ids):
            arg = np.array(ids, dtype=np.int64)
        elif form == "u8" and all(0 <= h < 2**64 for h in ids):
            arg = np.array(ids, dtype=np.uint64)
        want = _reference(ref[space], ids, 1000, 16)
        assert tracker.hit_tokens(space, arg, 1000, 16) == want
