"""The ceiling's three views (agentkv/trace/ceiling.py) agree: one definition, checked on real traces."""

from __future__ import annotations

import pytest

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
