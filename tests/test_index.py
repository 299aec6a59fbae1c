"""The router's block index: prefixes per worker and tier, removals, clears, tenants, real ZMQ feed."""

from __future__ import annotations

import random
import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.events.publisher import ZmqEventPublisher
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from agentkv.kv.hashing import make_hasher
from agentkv.route.index import DEFAULT_TENANT, GPU, BlockIndex, Match, TenantIndex, tier_name


def test_longest_prefix_per_worker():
    idx = BlockIndex()
    idx.apply(0, BlockStored(block_hashes=[1, 2, 3, 4]))
    idx.apply(1, BlockStored(block_hashes=[1, 2]))
    idx.apply(2, BlockStored(block_hashes=[9, 10]))
    assert idx.find_matches([1, 2, 3, 5]) == {0: Match(3), 1: Match(2)}
    assert idx.find_matches([1, 2, 3, 4, 7]) == {0: Match(4), 1: Match(2)}
    assert idx.find_matches([7, 1, 2]) == {}
    assert idx.find_matches([]) == {}
    idx.apply(0, BlockRemoved(block_hashes=[3]))
    assert idx.find_matches([1, 2, 3, 4]) == {0: Match(2), 1: Match(2)}
    assert idx.tier_prefix(0, [1, 2, 3]) == 2 and idx.blocks(0) == 3 and idx.workers() == [0, 1, 2]


def test_a_block_held_twice_stays_until_its_last_copy_goes():
    """vLLM keeps duplicate copies (two requests filling the same block in one step) and sends a
    BlockStored and a BlockRemoved for each: the block is cached until both copies are gone."""
    idx = BlockIndex()
    idx.apply(0, BlockStored(block_hashes=[1, 2, 3]))
    idx.apply(0, BlockStored(block_hashes=[1, 2]))  # the second request's copies of blocks 1 and 2
    idx.apply(0, BlockRemoved(block_hashes=[2]))
    assert idx.find_matches([1, 2, 3]) == {0: Match(3)}
    idx.apply(0, BlockRemoved(block_hashes=[2, 3]))
    assert idx.find_matches([1, 2, 3]) == {0: Match(1)}
    idx.apply(0, BlockRemoved(block_hashes=[1]))
    assert idx.find_matches([1, 2]) == {0: Match(1)}
    idx.apply(0, BlockRemoved(block_hashes=[1]))
    assert idx.find_matches([1]) == {} and idx.blocks(0) == 0
    idx.apply(0, BlockStored(block_hashes=[5]))
    idx.apply(0, BlockStored(block_hashes=[5]))
    idx.apply(0, AllBlocksCleared())  # copies go with the rest
    idx.apply(0, BlockStored(block_hashes=[5]))
    idx.apply(0, BlockRemoved(block_hashes=[5]))
    assert 5 not in idx


def test_both_copies_evicted_in_one_event_leave_nothing():
    """agentkv's own pools announce one eviction as one BlockRemoved, so two copies of a hash that go
    together arrive as the hash twice (vLLM sends one event a block): both copies are gone."""
    idx = BlockIndex()
    idx.apply(0, BlockStored(block_hashes=[1, 2]))
    idx.apply(0, BlockStored(block_hashes=[1, 2]))
    idx.apply(0, BlockRemoved(block_hashes=[2, 1, 2]))
    assert idx.find_matches([1, 2]) == {0: Match(1)}
    idx.apply(0, BlockRemoved(block_hashes=[1]))
    assert idx.find_matches([1]) == {} and idx.blocks(0) == 0


def test_all_blocks_cleared_and_dead_worker_touch_only_that_worker():
    idx = BlockIndex()
    for w in range(3):
        idx.apply(w, BlockStored(block_hashes=[1, 2, 3]))
    idx.apply(1, AllBlocksCleared())
    assert set(idx.find_matches([1, 2, 3])) == {0, 2}
    assert idx.clear_worker(2) == 3
    assert idx.find_matches([1, 2, 3]) == {0: Match(3)}
    assert 1 in idx and idx.clear_worker(0) == 3 and 1 not in idx


def test_lower_tiers_continue_the_gpu_prefix():
    idx = BlockIndex()
    idx.apply(0, BlockStored(block_hashes=[1, 2], medium="GPU"))
    idx.apply(0, BlockStored(block_hashes=[3, 4], medium="cpu"))
    idx.apply(1, BlockStored(block_hashes=[1, 2, 3], medium="CPU"))
    idx.apply(1, BlockStored(block_hashes=[4], medium="DISK"))
    assert idx.find_matches([1, 2, 3, 4, 5]) == {0: Match(2, 2), 1: Match(0, 4)}
    idx.apply(0, BlockRemoved(block_hashes=[3], medium="CPU"))
    assert idx.find_matches([1, 2, 3, 4]) == {0: Match(2, 0), 1: Match(0, 4)}
    assert idx.blocks(0, "CPU") == 1 and idx.blocks(1) == 4 and idx.tier_prefix(1, [1, 2], "CPU") == 2
    assert tier_name(None) == tier_name("device") == GPU and tier_name("cpu") == "CPU"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.booleans(), st.lists(st.integers(0, 20), max_size=6)), max_size=40
    ),
    st.lists(st.integers(0, 20), max_size=8),
)
def test_matches_agree_with_a_reference_model(ops, query):
    """Random store/remove streams: find_matches equals a naive walk over per-worker copy counts
    (each event stores or removes one copy of each distinct hash it names)."""
    idx = BlockIndex()
    ref: dict[int, Counter[int]] = {w: Counter() for w in range(4)}
    for w, store, hashes in ops:
        if store:
            idx.store(w, hashes)
            ref[w].update(set(hashes))
        else:
            idx.remove(w, hashes)
            ref[w].subtract(set(hashes))
            ref[w] = +ref[w]  # a copy count never goes below zero
    expect = {}
    for w, copies in ref.items():
        held = set(copies)
        n = 0
        while n < len(query) and query[n] in held:
            n += 1
        if n:
            expect[w] = Match(n)
    assert idx.find_matches(query) == expect


def test_tenants_are_isolated_and_events_attributed():
    h = make_hasher("xxhash")
    tokens = list(range(64))
    ha, hb = h.hashes(tokens, 16, cache_salt="salt-a"), h.hashes(tokens, 16, cache_salt="salt-b")
    tix = TenantIndex(salts={"salt-a": "a", "salt-b": "b"})
    tix.expect("a", ha)  # the router routed tenant a's request; the engine then reports the run
    tix.apply(0, BlockStored(block_hashes=ha[:2]))
    tix.apply(0, BlockStored(block_hashes=ha[2:], parent_block_hash=ha[1]))  # continuation: parent's tenant
    tix.apply(1, BlockStored(block_hashes=hb, extra_keys=[[["cache_salt", "salt-b"]], None, None, None]))
    assert tix.find_matches("a", ha) == {0: Match(4)}
    assert tix.find_matches("b", hb) == {1: Match(4)}
    assert tix.find_matches("b", ha) == {} and tix.find_matches("a", hb) == {}
    assert tix.find_matches("nobody", ha) == {}
    tix.apply(1, BlockStored(block_hashes=[77, 78]))  # unknown root: the unsalted namespace
    assert tix.find_matches(DEFAULT_TENANT, [77, 78]) == {1: Match(2)}
    tix.apply(0, BlockRemoved(block_hashes=ha[3:]))
    assert tix.find_matches("a", ha) == {0: Match(3)}
    assert tix.blocks(1) == 6 and tix.clear_worker(1) == 6 and tix.find_matches("b", hb) == {}


def test_fed_from_a_real_zmq_publisher():
    """Events published on a real socket, received by the subscriber, applied to the index."""
    idx = BlockIndex()
    rng = random.Random(1)
    stored = [rng.getrandbits(64) for _ in range(32)]
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        sub.recv(0.05)
        assert pub.wait_for_subscribers(timeout=5)
        pub.publish([BlockStored(block_hashes=stored[:16], block_size=16)])
        pub.publish(
            [
                BlockStored(block_hashes=stored[16:], parent_block_hash=stored[15], block_size=16),
                BlockRemoved(block_hashes=stored[20:]),
            ]
        )
        deadline = time.monotonic() + 5
        got = 0
        while got < 2 and time.monotonic() < deadline:
            r = sub.recv(0.5)
            if r is not None:
                got += 1
                for ev in r.batch.events:
                    idx.apply(7, ev)
    assert got == 2
    assert idx.find_matches(stored) == {7: Match(20)}
