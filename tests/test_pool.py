"""The block pool: prefix reuse, partial blocks, sharing, clean failure, events, tiers, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool, kv_bytes_per_token, num_blocks_for
from agentkv.kv.tiers import TierSpec, TierStack


def chain(tag: int, n: int, start: int = 0) -> list[int]:
    """n made-up block hashes of one prompt family `tag` (equal prefixes share their hashes)."""
    return [(tag << 20) | i for i in range(start, start + n)]


def run(pool: BlockPool, rid: str, hashes: list[int], tokens: int, session_id: object = None) -> int:
    """Look up, allocate a whole prompt of `tokens` tokens; return the cached prefix in blocks."""
    computed = pool.get_computed_blocks(hashes, tokens)
    n, bs = computed.num_blocks, pool.block_size
    assert pool.allocate_slots(PoolRequest(rid, hashes, session_id), tokens - n * bs, n * bs, computed)
    return n


def hits(pool: BlockPool, hashes: list[int], tokens: int | None = None) -> int:
    """The cached prefix a lookup finds, in blocks."""
    return pool.get_computed_blocks(hashes, tokens).num_blocks


def test_kv_bytes_llama_8b() -> None:
    assert kv_bytes_per_token(32, 8, 128, "bf16") == 128 * 1024
    assert kv_bytes_per_token(32, 8, 128, "fp8") == 64 * 1024
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
    # 80 GiB of bf16 KV in blocks of 16 tokens: 80 GiB / (16 x 128 KiB)
    assert num_blocks_for(80 << 30, 16, 32, 8, 128, "bf16") == 40960
    assert num_blocks_for(80 << 30, 16, 32, 8, 128, "fp8") == 81920
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_bytes_per_token(32, 8, 128, "int3")
    with pytest.raises(ValueError, match="layers"):
        kv_bytes_per_token(0, 8, 128)


@pytest.mark.parametrize("bs", [16, 32, 64, 256])
def test_second_turn_reuses_first_turns_full_blocks(bs: int) -> None:
    pool = BlockPool(64, bs)
    turn1 = chain(1, 5)
    assert run(pool, "t1", turn1, 5 * bs + bs // 2, session_id="s") == 0
    pool.free("t1")
    turn2 = turn1 + chain(1, 3, start=5)
    assert run(pool, "t2", turn2, 8 * bs + 3, session_id="s") == 5
    assert pool.stats.hits == 5 * bs
    assert pool.stats.queries == 5 * bs + bs // 2 + 8 * bs + 3
    pool.check_invariants()


def test_partial_blocks_are_never_cached_until_full() -> None:
    pool = BlockPool(16, 16)
    hashes = chain(1, 3)
    r = PoolRequest("r", hashes)
    assert pool.allocate_slots(r, 40)  # 2.5 blocks: the third is partial
    assert pool.num_cached_blocks == 2 and len(pool.request_blocks("r")) == 3
    assert hits(pool, hashes) == 2
    assert pool.allocate_slots(r, 8, num_computed_tokens=40)  # decode fills block 3
    assert pool.num_cached_blocks == 3 and len(pool.request_blocks("r")) == 3
    assert pool.allocate_slots(r, 1, num_computed_tokens=48)  # a 4th, partial block
    assert len(pool.request_blocks("r")) == 4 and pool.num_cached_blocks == 3
    pool.free("r")
    pool.check_invariants()
    assert pool.num_free_blocks == 16


def test_last_prompt_token_is_recomputed() -> None:
    pool = BlockPool(8, 16)
    hashes = chain(1, 2)
    run(pool, "a", hashes, 32)
    pool.free("a")
    assert hits(pool, hashes, 32) == 1  # as vLLM: at most (num_tokens - 1) // bs
    assert hits(pool, hashes, 33) == 2


def test_concurrent_requests_share_prefix_blocks() -> None:
    pool = BlockPool(32, 16)
    prefix = chain(7, 4)
    run(pool, "a", prefix + chain(8, 2), 6 * 16)
    assert run(pool, "b", prefix + chain(9, 2), 6 * 16 + 5) == 4
    a, b = pool.request_blocks("a"), pool.request_blocks("b")
    assert a[:4] == b[:4] and not set(a[4:]) & set(b[4:])
    assert all(pool.ref[x] == 2 for x in a[:4])
    assert pool.num_free_blocks == 32 - 4 - 2 - 3
    pool.check_invariants()
    pool.free("a")  # the shared prefix stays pinned by b
    assert all(pool.ref[x] == 1 for x in a[:4]) and pool.num_free_blocks == 32 - 7
    pool.check_invariants()
    pool.free("b")
    assert pool.num_free_blocks == 32 and pool.usage == 0.0
    assert hits(pool, prefix + chain(9, 2)) == 6
    pool.check_invariants()


def test_a_growing_table_keeps_earlier_views_and_grows_in_place() -> None:
    """Decode growth appends to a request's table without copying it each block, while a table
    handed out earlier (a lookup hint, `block_table`) keeps its length and content."""
    pool = BlockPool(64, 16)
    prefix = chain(3, 4)
    run(pool, "x", prefix, 4 * 16)  # cache a prefix, then share it
    pool.free("x")
    req = PoolRequest("a", prefix)
    computed = pool.get_computed_blocks(prefix, 4 * 16 + 1)
    assert pool.allocate_slots(req, 16, 3 * 16, computed)  # three hits, the fourth recomputed
    first = pool.block_table("a")
    seen, expect = [first.copy()], first.tolist()
    views = [first]
    for k in range(1, 21):  # one decode block at a time
        assert pool.allocate_slots(req, 16, (3 + k) * 16)
        t = pool.block_table("a")
        assert len(t) == 4 + k and t[:-1].tolist() == expect  # one block appended, the rest kept
        expect = expect + [int(t[-1])]
        assert t.tolist() == pool.request_blocks("a")
        views.append(t)
        seen.append(t.copy())
    for v, s in zip(views, seen, strict=True):  # no view changed under its holder
        assert v.tolist() == s.tolist()
    grown = [v for v in views[1:] if v.base is not None]
    assert len({id(v.base) for v in grown}) < len(grown) / 3  # a few buffers, not one copy a block
    assert len(set(expect)) == len(expect)
    pool.check_invariants()
    pool.free("a")
    assert views[-1].tolist() == seen[-1].tolist()  # freed: the last view still reads as it was
    pool.check_invariants()


def test_allocation_fails_cleanly_when_full() -> None:
    pool = BlockPool(8, 16, record_events=True)
    run(pool, "a", chain(1, 6), 96)
    before = (pool.ref.tolist(), pool.num_free_blocks, pool.num_cached_blocks)
    assert not pool.allocate_slots(PoolRequest("b", chain(2, 3)), 48)  # needs 3, only 2 free
    assert (pool.ref.tolist(), pool.num_free_blocks, pool.num_cached_blocks) == before
    assert pool.stats.alloc_failures == 1 and pool.request_blocks("b") == []
    assert not pool.allocate_slots(PoolRequest("a", chain(1, 6)), 48, num_computed_tokens=96)  # growth too
    assert len(pool.request_blocks("a")) == 6
    pool.check_invariants()
    pool.free("a")
    # free cached hits count against the room: 2 hits (free) + 7 new > 8
    c = PoolRequest("c", chain(1, 2) + chain(3, 7))
    computed = pool.get_computed_blocks(c.block_hashes)
    assert computed.num_blocks == 2 and not pool.allocate_slots(c, 7 * 16, 32, computed)
    assert pool.num_cached_blocks == 6 and pool.num_free_blocks == 8
    assert not any(isinstance(e, BlockRemoved) for e in pool.take_events())
    pool.check_invariants()


def test_a_retried_admission_counts_its_free_hits_again_after_a_free_or_an_admission() -> None:
    """A refused queue head asks again with the same lookup: its cached hits that nobody holds (they
    leave the free queue when it is admitted) are counted anew once a request frees or takes them."""
    pool = BlockPool(16, 16)
    run(pool, "a", chain(1, 4), 64)  # the head's 4-block prefix, held by "a"
    head = PoolRequest("h", chain(1, 4) + chain(2, 6))
    computed = pool.get_computed_blocks(head.block_hashes, 10 * 16)
    assert computed.num_blocks == 4
    need, free_hits = pool.admission_blocks(head, 64, 6 * 16, computed)
    assert need == 6 and len(free_hits) == 0  # held: shared, not taken from the free queue
    assert pool.admission_blocks(head, 64, 6 * 16, computed)[0] == 6  # (a retry, unchanged)
    pool.free("a")  # the prefix is free (cached, in the LRU): admitting the head takes it too
    need, free_hits = pool.admission_blocks(head, 64, 6 * 16, computed)
    assert need == 10 and sorted(free_hits.tolist()) == sorted(computed.blocks[:4])
    c = PoolRequest("c", chain(1, 4) + chain(3, 1))  # holds the prefix again, found by the pool
    assert pool.allocate_slots(c, 16, 64)  # (no lookup passed: the head's check stays the last one)
    assert pool.admission_blocks(head, 64, 6 * 16, computed)[0] == 6
    assert pool.allocate_slots(head, 6 * 16, 64, computed)
    assert pool.num_free_blocks == 16 - 4 - 1 - 6
    pool.check_invariants()


def test_a_retried_admission_after_an_eviction_takes_the_copy_that_answers_for_an_evicted_hit() -> None:
    """The same lookup asked again after an eviction: a hit block evicted whose hash has another
    copy is found in that copy, and the copy is what the admission takes from the free queue."""
    pool = BlockPool(7, 4)
    prompt = chain(1, 4)
    run(pool, "r0", prompt, 16)
    b = pool.request_blocks("r0")
    pool.free("r0")
    run(pool, "r1", prompt, 16)  # a fully cached prompt: its last block computed again, a copy
    copy = pool.request_blocks("r1")[3]
    pool.free("r1")  # the LRU, oldest first: b[3], the copy, b[2], b[1], b[0]
    run(pool, "x", chain(9, 2), 8)  # the two empty blocks
    head = PoolRequest("h", prompt + chain(5, 2))
    computed = pool.get_computed_blocks(head.block_hashes, 24)
    need, free_hits = pool.admission_blocks(head, 16, 8, computed)
    assert free_hits.tolist() == b and need == 6 > pool.num_free_blocks == 5
    assert pool.allocate_slots(PoolRequest("x", chain(9, 2)), 4, 8)  # a block more: b[3] evicted
    need, free_hits = pool.admission_blocks(head, 16, 8, computed)
    assert free_hits.tolist() == b[:3] + [copy] and need == 6
    pool.check_invariants()


def test_lru_evicts_tail_first_and_oldest_request_first() -> None:
    pool = BlockPool(6, 4, "lru", record_events=True)
    a, b = chain(1, 3), chain(2, 3)
    run(pool, "a", a, 12)
    pool.free("a")
    run(pool, "b", b, 12)
    pool.free("b")
    pool.take_events()
    run(pool, "c", chain(3, 4), 16)  # 4 victims: a's tail first, then b's tail
    removed = [h for e in pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [a[2], a[1], a[0], b[2]]
    assert hits(pool, b) == 2
    pool.check_invariants()


def test_events_in_order_with_parent_hashes() -> None:
    seen = []
    pool = BlockPool(4, 4, on_event=seen.append)
    hashes = chain(1, 4)
    tokens = list(range(100, 116))
    a = PoolRequest("a", hashes, token_ids=tokens)
    assert pool.allocate_slots(a, 6)  # chunked prefill: 6 tokens
    assert pool.allocate_slots(a, 10, 6)  # the other 10
    assert seen == [
        BlockStored(block_hashes=hashes[:1], parent_block_hash=None, token_ids=tokens[:4], block_size=4),
        BlockStored(block_hashes=hashes[1:], parent_block_hash=hashes[0], token_ids=tokens[4:], block_size=4),
    ]
    assert seen[0].medium == "GPU"
    pool.free("a")
    seen.clear()
    run(pool, "b", chain(2, 2), 8)  # evicts a's last two blocks, tail first
    assert seen[0] == BlockRemoved(block_hashes=[hashes[3], hashes[2]])
    assert seen[1] == BlockStored(block_hashes=chain(2, 2), parent_block_hash=None, block_size=4)
    assert not pool.reset()  # b still holds blocks
    pool.free("b")
    assert pool.reset() and seen[-1] == AllBlocksCleared()
    assert pool.num_cached_blocks == 0 and hits(pool, hashes) == 0
    pool.check_invariants()


def test_recomputed_block_under_a_cached_hash_is_another_copy() -> None:
    """LFU can orphan a child (parent evicted first); recomputing the chain then meets its hash.
    As vLLM, the new block is cached too, as a second copy; lookups keep finding the older one."""
    pool = BlockPool(4, 4, "lfu")
    p, c = chain(1, 2)
    run(pool, "r1", [p], 4)  # holds p
    run(pool, "r2", [p, c], 8)  # p shared (no reuse counted), c new
    pool.free("r2")
    assert run(pool, "r3", [p, c], 9) == 2  # c is reused from the free pool: frequency 2
    pool.free("r3")
    pool.free("r1")  # p joins the free pool with frequency 1
    run(pool, "r4", chain(2, 3), 12)  # 2 empty blocks + 1 victim: p, the least used
    assert hits(pool, [p, c]) == 0 and c in pool.cached
    pool.free("r4")
    assert run(pool, "r5", [p, c], 9) == 0
    blocks = pool.request_blocks("r5")
    assert pool.cached[p] == blocks[0] and pool.cached[c] not in blocks  # lookups find the older c
    assert pool.hash_of(blocks[1]) == c and pool.dups[c] == [blocks[1]]  # r5's copy: cached as well
    pool.check_invariants()
    pool.free("r5")
    pool.check_invariants()
    assert hits(pool, [p, c]) == 2


def test_a_fully_cached_prompt_leaves_a_copy_of_its_last_block_as_vllm_does() -> None:
    """vLLM recomputes the last token of a fully cached prompt, so its last block is computed again
    into a new block, cached beside the old one. Four identical 4-block prompts leave 4 copies of
    the last block (what tests/vllm/test_vllm_hashing.py saw on a live vLLM); each copy is stored
    and evicted with its own event, and the hash stays cached until its last copy goes."""
    events = []
    pool = BlockPool(7, 4, on_event=events.append)  # exactly the 4 + 3 blocks the prompts fill
    prompt = chain(1, 4)
    for i in range(4):
        assert run(pool, f"r{i}", prompt, 16) == (0 if i == 0 else 3)
        pool.free(f"r{i}")
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored.count(prompt[3]) == 4 and all(stored.count(h) == 1 for h in prompt[:3])
    assert len(pool.dups[prompt[3]]) == 3 and pool.num_cached_blocks == 7
    pool.check_invariants()
    for k in range(1, 4):  # evicting (LRU) the three oldest copies leaves the last block findable
        run(pool, f"x{k}", chain(10 + k, 1), 4)
        assert hits(pool, prompt, 17) == 4 and len(pool.dups.get(prompt[3], ())) == 3 - k
        pool.check_invariants()
    run(pool, "x4", chain(20, 4), 16)  # evicts the rest
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed.count(prompt[3]) == 4 and prompt[3] not in pool.cached and not pool.dups
    pool.check_invariants()


def test_lookup_then_eviction_then_allocate_is_caught() -> None:
    pool = BlockPool(4, 4)
    run(pool, "a", chain(1, 2), 8)
    pool.free("a")
    computed = pool.get_computed_blocks(chain(1, 2))
    assert computed.num_blocks == 2 and pool.is_current(computed)
    run(pool, "b", chain(2, 4), 16)  # evicts a's blocks in between
    assert not pool.is_current(computed)
    c = PoolRequest("c", chain(1, 2))
    with pytest.raises(ValueError, match="not cached"):
        pool.allocate_slots(c, 4, 8, computed)  # stale: looked up again, and the blocks are gone
    with pytest.raises(ValueError, match="not cached"):
        pool.allocate_slots(c, 4, 8)  # no lookup passed: the same
    with pytest.raises(ValueError, match="multiple of block_size"):
        pool.allocate_slots(c, 4, 3)
    computed = pool.get_computed_blocks(chain(1, 2))
    computed.num_lower = 1
    with pytest.raises(ValueError, match="no lower tiers"):
        pool.allocate_slots(c, 4, 0, computed)
    pool.check_invariants()


def test_lower_tiers_demote_match_and_promote() -> None:
    events = []
    tiers = TierStack(
        [TierSpec("CPU", capacity_blocks=16)],
        block_bytes=4 * 128 * 1024,
        block_size=4,
        on_event=events.append,
    )
    pool = BlockPool(5, 4, lower=tiers)
    a = chain(1, 4)
    run(pool, "a", a, 16)
    pool.free("a")
    run(pool, "b", chain(2, 5), 20)  # a's four blocks go down to CPU
    pool.free("b")
    assert set(tiers.blocks("CPU")) == set(a)
    computed = pool.get_computed_blocks(a, 17)
    assert computed.num_blocks == 0 and pool.match_lower(a, 0) == ["CPU"] * 4
    assert pool.match_lower(a, 1, 3) == ["CPU"] * 2
    assert pool.is_current(computed)  # write-back: the tiers change only when the GPU evicts
    computed.num_lower = 4
    assert pool.allocate_slots(PoolRequest("c", a), 1, 0, computed)
    assert pool.last_promote_s > 0 and pool.stats.lower_blocks == 4
    assert tiers.counters.tiers["CPU"].hit_blocks == 4
    assert hits(pool, a) == 4 and len(pool.request_blocks("c")) == 5
    pool.check_invariants()
    assert BlockPool(4, 4).match_lower(a, 0) == []
    through = TierStack([TierSpec("CPU", capacity_blocks=4)], block_bytes=1024, write_mode="write_through")
    pool = BlockPool(4, 4, lower=through)
    assert not pool.is_current(pool.get_computed_blocks(a))  # stores fill the tiers too: look again


POLICY_NAMES = ["lru", "lfu", "radix", "arc", "session"]


@st.composite
def op_sequences(draw):
    """Random requests over a few prompt families: new, grow, free, pause hints, reset."""
    ops = []
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["new", "new", "grow", "free", "free", "pause", "reset"]))
        ops.append((kind, draw(st.integers(0, 3)), draw(st.integers(1, 9)), draw(st.integers(0, 7))))
    return ops


@pytest.mark.parametrize(
    ("policy", "events", "big"),
    [(p, True, False) for p in POLICY_NAMES]
    + [("lru", False, False), ("lru", False, True), ("arc", True, True)],
)
@settings(max_examples=25, deadline=None)
@given(ops=op_sequences())
def test_invariants_hold_under_random_operations(policy: str, events: bool, big: bool, ops) -> None:
    """Without events the pool keeps no Python ints for evicted hashes; with `big` family 3's hashes
    lie outside uint64, so the map becomes a dict mid-run and the block -> hash table moves with it."""
    pool = BlockPool(12, 4, policy, record_events=events)
    running: dict[str, tuple[list[int], int]] = {}
    for i, (kind, fam, nblk, slot) in enumerate(ops):
        if kind == "new":
            hashes = chain(fam, nblk)
            if big and fam == 3:
                hashes = [h + 2**64 for h in hashes]
            tokens = nblk * 4 + slot % 4
            computed = pool.get_computed_blocks(hashes, tokens)
            n = computed.num_blocks
            rid = f"r{i}"
            if pool.allocate_slots(PoolRequest(rid, hashes, fam), tokens - 4 * n, 4 * n, computed):
                running[rid] = (hashes, tokens)
        elif kind == "grow" and running:
            rid = sorted(running)[slot % len(running)]
            hashes, tokens = running[rid]
            if pool.allocate_slots(PoolRequest(rid, hashes), 3, tokens):
                running[rid] = (hashes, tokens + 3)
        elif kind == "free" and running:
            rid = sorted(running)[slot % len(running)]
            pool.free(rid)
            del running[rid]
        elif kind == "pause":
            pool.session_paused(fam, float(i), "tool_use" if slot % 2 else "end_turn")
        elif kind == "reset":
            assert pool.reset() == (not running)
        pool.check_invariants()
    for rid in running:
        pool.free(rid)
    pool.check_invariants()
    assert pool.usage == 0.0
