"""Eviction policies: each one's rule on hand-made sequences, and Belady as the ceiling on real traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentkv.cache.replay import replay
from agentkv.kv.events import BlockRemoved
from agentkv.kv.eviction import POLICIES, make_policy
from agentkv.kv.eviction.arc import ARC
from agentkv.kv.eviction.base import ChunkQueue
from agentkv.kv.eviction.belady import Belady, next_use_keys
from agentkv.kv.eviction.radix import RadixLRU
from agentkv.kv.eviction.session import SessionAware
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.formats import load_paths

BS = 4


def use(pool: BlockPool, rid: str, hashes: list[int], session: object = None) -> int:
    """One whole request of full blocks: look up, allocate, free; return its cached prefix."""
    computed = pool.get_computed_blocks(hashes)
    n = computed.num_blocks
    assert pool.allocate_slots(PoolRequest(rid, hashes, session), (len(hashes) - n) * BS, n * BS, computed)
    pool.free(rid)
    return n


def cached(pool: BlockPool, *hashes: int) -> list[bool]:
    return [h in pool.cached for h in hashes]


def evicted(pool: BlockPool) -> list[int]:
    return [h for e in pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_make_policy_names_and_errors() -> None:
    for name in POLICIES:
        if name != "belady":
            assert make_policy(name).name == name
    assert make_policy("belady", accesses=[[1, 2]]).name == "belady"
    with pytest.raises(ValueError, match="access sequence"):
        make_policy("belady")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru")


@pytest.mark.parametrize(("policy", "survivor", "victim"), [("lru", 2, 1), ("lfu", 1, 2)])
def test_lfu_keeps_the_often_reused_block_lru_the_recent_one(policy: str, survivor: int, victim: int) -> None:
    pool = BlockPool(2, BS, policy)
    for i in range(3):
        assert use(pool, f"a{i}", [1]) == min(i, 1)  # block 1: reused twice
    use(pool, "b", [2])  # block 2: used once, but last
    use(pool, "c", [3])  # one victim
    assert cached(pool, survivor, victim, 3) == [True, False, True]


def test_lru_frees_a_request_tail_first() -> None:
    pool = BlockPool(4, BS, "lru", record_events=True)
    use(pool, "a", [10, 11, 12, 13])
    pool.take_events()
    use(pool, "b", [20, 21])
    assert evicted(pool) == [13, 12]
    assert pool.get_computed_blocks([10, 11, 12, 13]).num_blocks == 2


def test_a_mostly_stale_free_queue_pops_its_live_blocks_oldest_first() -> None:
    q = ChunkQueue()
    blocks = np.arange(20_000, dtype=np.int64)
    live_mask = blocks % 97 == 5  # 1% live: what an overloaded pool's queue looks like
    q.push(blocks[:15_000], blocks[:15_000].copy())
    q.push(blocks[15_000:], blocks[15_000:].copy())
    # as a stamped evictor sees them: an entry is live while its stamp is the block's latest and
    # the block is unused (the stale 99% carry a stamp their block has moved past)
    stamp = np.where(live_mask, blocks, -1)
    ref = np.zeros(len(blocks), dtype=np.int32)

    def live(bl: np.ndarray, st: np.ndarray) -> np.ndarray:
        return (stamp[bl] == st) & (ref[bl] == 0)

    want = blocks[live_mask].tolist()
    assert q.peek(150, live).tolist() == want[:150]  # across both chunks
    got = q.pop(3, stamp, ref).tolist() + q.pop(150, stamp, ref).tolist()
    assert got == want[:153]
    assert q.pop(10_000, stamp, ref).tolist() == want[153:]  # the queue runs dry
    assert q.queued == 0 and not q.q


def test_radix_evicts_only_leaves_and_parents_after_their_children() -> None:
    pol = RadixLRU()
    BlockPool(8, BS, pol)
    pol.on_cached([0, 1, 2], 0, None)  # chain 0 -> 1 -> 2
    pol.on_cached([3], 1, 0)  # 3: a second child of 0
    pol.add_many([0])  # the root freed first: LRU would take it first
    pol.add_many([1, 2, 3])
    assert pol.pop_victims(4) == [2, 1, 3, 0]
    pol.check()


def test_radix_hands_back_a_parent_when_its_last_child_goes() -> None:
    pool = BlockPool(3, BS, "radix", record_events=True)
    use(pool, "a", [1, 2])
    use(pool, "b", [1, 3])  # 1 now has two cached children
    pool.take_events()
    use(pool, "c", [7, 8])
    assert evicted(pool) == [2, 3]  # never the shared parent 1 while a child is cached
    use(pool, "d", [9, 10, 11])
    assert 1 in evicted(pool)


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    for policy, kept in (("arc", True), ("lru", False)):
        pool = BlockPool(4, BS, policy)
        use(pool, "a0", [1])
        use(pool, "a1", [1])  # reused: ARC's T2
        for i in range(6):
            use(pool, f"s{i}", [100 + i])  # a scan of blocks used once
        assert (1 in pool.cached) is kept, policy


def test_arc_ghost_hits_adapt_the_target() -> None:
    pol = ARC()
    pool = BlockPool(2, BS, pol, record_events=True)
    use(pool, "a0", [1])
    use(pool, "a1", [1])  # 1 reused: T2
    use(pool, "b", [2])  # T1
    use(pool, "c", [3])  # T1 is over its target (0): 2 goes, remembered in ghost B1
    assert evicted(pool) == [2] and 2 in pol.b1 and pol.p == 0
    use(pool, "b2", [2])  # a B1 ghost hit: recency pays, T1's target grows
    assert pol.p == 1 and pol._cls[pool.cached[2]] == 2
    use(pool, "d", [4])  # T1 has no free block: T2's oldest, 1, goes to ghost B2
    assert evicted(pool) == [3, 1] and 1 in pol.b2
    use(pool, "a2", [1])  # T1 (1 block) is within its target: T2's 2 goes; B2 ghost hit shrinks it
    assert evicted(pool) == [2] and pol.p == 0
    pol.check()


def test_session_policy_evicts_the_session_expected_back_last() -> None:
    pool = BlockPool(6, BS, "session", record_events=True)
    pol: SessionAware = pool.policy
    for t, (s, hashes, reason) in enumerate(
        [("A", [1, 2], "tool_use"), ("B", [3, 4], "end_turn"), ("C", [5, 6], "tool_use")]
    ):
        pool.session_resumed(s, 2.0 * t)
        use(pool, s, hashes, session=s)
        pool.session_paused(s, 2.0 * t + 1, reason)
    pool.take_events()
    pool.session_resumed("D", 6.0)
    use(pool, "d1", [7, 8], session="D")
    # LRU would take A's blocks (freed first); B waits on its user (120 s), A on a tool (10 s)
    assert evicted(pool) == [4, 3]
    assert pol.time_to_return("A") == pytest.approx(5 + 10)  # waited 5 s, tool waits take 10 s
    pool.session_ended("C", 6.5)
    assert pol.time_to_return("C") == math.inf
    use(pool, "d2", [9, 10], session="D")
    assert evicted(pool) == [6, 5]  # an ended session goes before everyone
    pool.session_resumed("A", 4.0)  # A's tool call took 3 s: learnt
    assert pol.expected_gap("A", "tool_use") == pytest.approx(3.0)
    pool.session_paused("A", 5.0, "tool_use")
    pool.session_paused("D", 7.0, "tool_use")
    pool.session_resumed("E", 1000.0)  # both long idle: A longer
    assert pol.time_to_return("A") == pytest.approx(995.0 + 3.0)
    assert pol.time_to_return("A") > pol.time_to_return("D")
    pool.check_invariants()


def test_session_policy_learns_each_sessions_tool_gaps() -> None:
    def evict_after(order: list[tuple[str, str, list[int]]]) -> list[int]:
        """ "fast" learns 2 s tool gaps and "slow" 50 s; each then runs a call and pauses for tools
        in `order`; a third session needs room: which blocks go?"""
        pool = BlockPool(4, BS, "session", record_events=True)
        for s, gap in (("fast", 2.0), ("slow", 50.0)):
            pool.session_paused(s, 0.0, "tool_use")
            pool.session_resumed(s, gap)
        t = 100.0
        for session, req, blocks in order:
            pool.session_resumed(session, t)
            use(pool, req, blocks, session=session)
            pool.session_paused(session, t + 1.0, "tool_use")
            t += 2.0
        pool.take_events()
        use(pool, "x", [5, 6], session="other")
        return evicted(pool)

    slow, fast = ("slow", "s", [1, 2]), ("fast", "f", [3, 4])
    assert evict_after([slow, fast]) == [2, 1]  # LRU would take slow's (older); slow's tools are slow
    assert evict_after([fast, slow]) == [2, 1]  # still slow's, though freed last


def test_session_policy_stale_context_first_shared_blocks_stay_with_the_sooner_user() -> None:
    pool = BlockPool(6, BS, "session", record_events=True)
    pool.session_resumed("A", 0.0)
    use(pool, "a1", [1, 2, 3], session="A")  # 2, 3 are dropped by A's next call
    pool.session_paused("A", 1.0, "tool_use")
    pool.session_resumed("A", 2.0)
    use(pool, "a2", [1, 9], session="A")
    pool.session_paused("A", 3.0, "tool_use")
    pool.session_resumed("B", 4.0)
    use(pool, "b", [1, 8], session="B")  # B shares block 1 with A, then waits on its user
    pool.session_paused("B", 5.0, "end_turn")
    pool.take_events()
    pool.session_resumed("C", 6.0)
    use(pool, "c", [20, 21, 22, 23, 24], session="C")
    # stale 3, 2 first; B (a user wait) loses its block 8 but not 1, which A, back sooner, keeps
    assert evicted(pool) == [3, 2, 8, 9]
    assert 1 in pool.cached
    pool.check_invariants()


def test_session_policy_without_hints_is_lru() -> None:
    orders = []
    for policy in ("session", "lru"):
        pool = BlockPool(4, BS, policy, record_events=True)
        use(pool, "a", [1, 2])
        use(pool, "b", [3, 4])
        use(pool, "a2", [1, 2])
        use(pool, "c", [5, 6, 7])
        orders.append(evicted(pool))
    assert orders[0] == orders[1] == [4, 3, 2]


def test_next_use_keys() -> None:
    keys, nxt_pos, offsets = next_use_keys([[5, 6], [5], [7, 6, 7], [6]])
    nxt = (keys >> 20).tolist()
    assert offsets.tolist() == [0, 2, 3, 6, 7]
    assert nxt == [1, 2, 4, 4, 3, 4, 4]  # a repeat inside one request is not a next use
    assert (keys & 0xFFFFF).tolist() == [0, 1, 0, 0, 1, 2, 0]
    assert nxt_pos.tolist() == [2, 4, -1, -1, 6, -1, -1]


def test_belady_evicts_the_farthest_next_use() -> None:
    seq = [[1], [2], [3], [1], [2], [1]]
    hits = {}
    for policy in ("belady", "lru"):
        pol = Belady(seq) if policy == "belady" else policy
        pool = BlockPool(2, BS, pol, record_events=True)
        hits[policy] = sum(use(pool, str(i), s) for i, s in enumerate(seq))
        if policy == "belady":
            assert evicted(pool) == [2, 3]  # at [3]: 1 is back at 3, 2 at 4; at [2]: 3 never
    assert hits == {"belady": 2, "lru": 1}


def test_belady_refuses_a_diverging_replay() -> None:
    pool = BlockPool(4, BS, Belady([[1, 2], [3]]))
    pool.get_computed_blocks([1, 2])
    with pytest.raises(ValueError, match="diverged"):
        pool.get_computed_blocks([3, 4])


def test_belady_keeps_invariants_on_random_sequences() -> None:
    rng = np.random.default_rng(7)
    seq = [[(int(f) << 8) | i for i in range(int(rng.integers(1, 6)))] for f in rng.integers(0, 5, 60)]
    pool = BlockPool(8, BS, Belady(seq))
    for i, s in enumerate(seq):
        use(pool, str(i), s)
        pool.check_invariants()


TRACES = ["trace_0624", "trace_0449", "trace_0684", "trace_0462"]


@pytest.mark.shared
def test_belady_is_the_ceiling_on_real_traces(shared_dir) -> None:
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{n}.json.gz" for n in TRACES])
    reqs = block_accesses(arrivals(traces), traces[0].block_size)
    capacity = 2 * max(len(r.hashes) for r in reqs)
    rates = {}
    for name in POLICIES:
        pol = Belady([r.hashes for r in reqs]) if name == "belady" else name
        pool = BlockPool(capacity, traces[0].block_size, pol)
        res = replay(pool, reqs)
        assert res.failed == 0
        pool.check_invariants()
        rates[name] = res.hit_rate
    assert all(rates["belady"] >= r for r in rates.values()), rates
    assert rates["belady"] > rates["lru"]
    assert 0.5 < rates["lru"] < rates["belady"] <= 1.0


@pytest.mark.shared
def test_block_accesses_interleave_traces_with_distinct_hashes(shared_dir) -> None:
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{n}.json.gz" for n in TRACES[:2]])
    reqs = block_accesses(arrivals(traces), traces[0].block_size)
    assert len(reqs) == sum(t.num_requests for t in traces)
    assert [r.time for r in reqs] == sorted(r.time for r in reqs)
    first: dict[str, int] = {}
    for r in reqs:
        first.setdefault(r.session.split(":")[0], r.hashes[0])
    assert traces[0].timeline()[0].request.hash_ids[0] == traces[1].timeline()[0].request.hash_ids[0]
    assert len(first) == 2 and len(set(first.values())) == 2  # the same local id in two traces: two keys
    assert all(0 <= h < 1 << 64 for r in reqs for h in r.hashes)
    lanes = {r.session for r in reqs}
    assert sum(r.last for r in reqs) == len(lanes)
    sides = sum(tr.request.kind == "s" for t in traces for tr in t.timeline())
    assert sum(r.session.endswith("/side") for r in reqs) == sides


@pytest.mark.shared
def test_lookup_hints_change_nothing_but_speed(shared_dir) -> None:
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{n}.json.gz" for n in TRACES])
    reqs = block_accesses(arrivals(traces), traces[0].block_size)
    capacity = 2 * max(len(r.hashes) for r in reqs)
    for name in ("lru", "session"):
        out = []
        for hinted in (False, True):
            pool = BlockPool(capacity, traces[0].block_size, name)
            res = replay(pool, reqs, lookup_hints=hinted)
            out.append((res.hit_tokens, res.block_ops, pool.stats.evicted, sorted(pool.cached.items())))
        assert out[0] == out[1], name
