"""Hinted prefix lookups (the session's previous blocks checked in bulk) give exactly the plain result."""

import random

import numpy as np

from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool


def test_hinted_lookup_equals_plain_lookup_under_churn():
    rng = random.Random(7)
    pool = BlockPool(400, 16, "lru")
    sessions = {s: [rng.getrandbits(64) for _ in range(rng.randint(5, 60))] for s in range(12)}
    last_blocks: dict[int, np.ndarray] = {}
    for step in range(300):
        s = rng.randrange(12)
        chain = sessions[s]
        if rng.random() < 0.7:  # the session grows, sometimes diverging after a prefix
            cut = len(chain) if rng.random() < 0.8 else rng.randint(1, len(chain))
            chain = chain[:cut] + [rng.getrandbits(64) for _ in range(rng.randint(1, 20))]
            sessions[s] = chain
        hint = last_blocks.get(s)
        if hint is not None and rng.random() < 0.2:  # a wrong hint must not change the answer
            hint = np.asarray(rng.sample(range(400), min(len(hint), 50)), dtype=np.int64)
        arr = np.asarray(chain, dtype=np.uint64)
        tokens = len(chain) * 16 + 5
        plain = pool.get_computed_blocks(chain, tokens, count=False)
        hinted = pool.get_computed_blocks(chain, tokens, hint=hint, hash_array=arr)
        assert list(hinted.blocks) == list(plain.blocks), step
        rid = f"r{step}"
        n = hinted.num_blocks
        if pool.allocate_slots(PoolRequest(rid, chain), tokens - n * 16, n * 16, hinted):
            last_blocks[s] = np.asarray(pool.request_blocks(rid), dtype=np.int64)
            pool.free(rid)
    pool.check_invariants()


def test_retried_lookups_of_waiting_requests_equal_plain_lookups():
    """Under preemption and eviction churn the scheduler retries the queue head's lookup with last
    step's blocks as the hint: every answer equals a plain lookup's, and retries did happen."""
    from agentkv.engine.config import EngineConfig
    from agentkv.engine.engine import Engine

    rng = random.Random(3)
    eng = Engine(EngineConfig(num_gpu_blocks_override=700, max_model_len=20_000, max_num_batched_tokens=2048))
    pool, plain_lookup = eng.pool, eng.pool.get_computed_blocks
    seen = {"hinted_retries": 0}

    def checked(block_hashes, num_tokens=None, *, count=True, hint=None, hash_array=None):
        got = plain_lookup(block_hashes, num_tokens, count=count, hint=hint, hash_array=hash_array)
        want = plain_lookup(block_hashes, num_tokens, count=False)
        assert list(np.asarray(got.blocks)) == list(np.asarray(want.blocks))
        seen["hinted_retries"] += hint is not None and len(hint) > 0
        return got

    pool.get_computed_blocks = checked
    prefixes = [[rng.getrandbits(63) for _ in range(rng.randint(100, 300))] for _ in range(5)]
    for i in range(60):
        chain = prefixes[i % 5] + [rng.getrandbits(63) for _ in range(rng.randint(10, 120))]
        eng.add_request(
            f"r{i}",
            max_tokens=rng.randint(20, 200),
            prompt_len=len(chain) * 16 + 7,
            block_hashes=chain,
            session_id=i % 5,
            hash_array=np.asarray(chain, dtype=np.uint64),
        )
    steps = 0
    while eng.has_work() and steps < 100_000:
        res = eng.step()
        steps += 1
        if res is not None:
            eng.clock.advance_to(res.end)
    assert not eng.has_work()
    assert eng.num_preemptions > 0 and seen["hinted_retries"] > 0, (eng.num_preemptions, seen)
    pool.check_invariants()


def test_hybrid_hint_with_stale_blocks_in_the_middle_equals_plain_lookup():
    """A hybrid pool's hint whose blocks fail the check here and there (a recomputed copy of a
    cached block is unhashed; an evicted block was reused): the lookup patches those from the map
    and gives exactly the plain answer, also when the prefix runs past the failed ones."""
    from agentkv.kv.groups import GroupSpec, HybridPool

    rng = random.Random(11)
    pool = HybridPool([GroupSpec("full", 2), GroupSpec("sliding", 3, window=32)], 2400, 16)
    sessions = {s: [rng.getrandbits(63) for _ in range(rng.randint(5, 60))] for s in range(10)}
    last: dict[int, np.ndarray] = {}
    past_a_failure = 0
    for step in range(300):
        s = rng.randrange(10)
        chain = sessions[s] = sessions[s] + [rng.getrandbits(63) for _ in range(rng.randint(1, 20))]
        hint = last.get(s)
        if hint is not None and len(hint) > 2:
            hint = hint.copy()
            for i in rng.sample(range(len(hint)), rng.randint(1, len(hint) // 2)):
                hint[i] = rng.randrange(-1, 600)  # stale ids, nulls and others' blocks
        arr = np.asarray(chain, dtype=np.uint64)
        tokens = len(chain) * 16 + 5
        plain = pool.get_computed_blocks(chain, tokens, count=False)
        hinted = pool.get_computed_blocks(chain, tokens, count=False, hint=hint, hash_array=arr)
        assert list(hinted.blocks) == list(plain.blocks), step
        if hint is not None and len(plain.blocks) > 1:
            h = hint[: len(plain.blocks)]
            past_a_failure += bool((h != np.asarray(plain.blocks)).any()) and h[-1] == plain.blocks[-1]
        rid, n = f"r{step}", hinted.hit
        if pool.allocate_slots(PoolRequest(rid, chain), tokens - n * 16, n * 16, hinted):
            last[s] = pool.block_table(rid).copy()
            pool.free(rid)
        pool.check_invariants()
    assert past_a_failure > 0  # the prefix did run on past failed hint blocks


def test_hybrid_hint_resolves_a_recomputed_copy_and_falls_back_once_it_is_gone():
    """A fully cached prompt recomputes its last block (a copy, unhashed); the next turn's hint holds
    that copy: the hinted lookup gives the plain answer (the cached original), also after the
    original was evicted and the prompt cached again elsewhere, and with a hint of nulls and others'
    blocks."""
    from agentkv.kv.groups import GroupSpec, HybridPool

    rng = random.Random(5)
    pool = HybridPool([GroupSpec("full", 2), GroupSpec("sliding", 3, window=32)], 200, 16)  # 40 blocks
    chain = [rng.getrandbits(63) for _ in range(10)]

    def run(rid, hashes, tokens):
        got = pool.get_computed_blocks(hashes, tokens)
        req = PoolRequest(rid, hashes, prompt_len=tokens)
        assert pool.allocate_slots(req, tokens - got.hit * 16, got.hit * 16, got)
        table = pool.block_table(rid).copy()
        pool.free(rid)
        return table

    first = run("r1", chain, 160)
    copy = run("r2", chain, 160)  # hit of 9 blocks: block 9 is recomputed, a copy of first[9]
    assert copy[9] != first[9] and list(copy[:9]) == list(first[:9])
    longer = chain + [rng.getrandbits(63) for _ in range(3)]
    arr = np.asarray(longer, dtype=np.uint64)

    def check(hint):
        plain = pool.get_computed_blocks(longer, len(longer) * 16, count=False)
        hinted = pool.get_computed_blocks(longer, len(longer) * 16, count=False, hint=hint, hash_array=arr)
        assert list(hinted.blocks) == list(plain.blocks)
        pool.check_invariants()
        return plain

    # the window group cached its tail before the cut at 9, so the hit is 9
    assert list(check(copy).blocks) == list(first[:9])
    run("r3", [rng.getrandbits(63) for _ in range(40)], 640)  # evicts every cached block of the chain
    assert check(copy).hit == 0
    again = run("r4", chain, 160)
    plain = check(copy)  # the old hint's copy and original are stale now: the map answers
    assert list(plain.blocks) == list(again[:9])
    bad = np.asarray([-1, 10**6 % 40, 39, -1, 0, 1, 2, 3, 4, 5], dtype=np.int64)  # nulls, others' ids
    check(bad)


def test_hinted_prefix_takes_a_copys_alias_without_the_map():
    """The hybrid pool's compiled hinted lookup: a hint block whose mirror holds the key, else the
    block its copy aliases when that one's does (a key the map lacks is still found so: the map is
    not asked), else the map; it stops at the first key none of them holds, and leaves key 0 (the
    map's side dict) to the caller."""
    from agentkv.kv.eviction.base import stamp_loops
    from agentkv.kv.u64map import U64Map

    look = stamp_loops().hinted_prefix
    m = U64Map(16)
    m[11] = 3  # the map holds only key 11 (at block 3)
    mkeys, mvals, shift, mask = m.slots()
    bh64 = np.array([7, 0, 9, 0], dtype=np.uint64)  # block 0 named 7, 1 an unnamed copy, 2 named 9
    alias = np.array([-1, 2, -1, -1], dtype=np.int64)  # block 1 copies block 2
    ks, out = np.array([7, 9, 11, 12], dtype=np.uint64), np.empty(4, np.int64)
    hint = np.array([0, 1, 1], dtype=np.int64)
    assert look(hint, 3, ks, 4, bh64, alias, mkeys, mvals, shift, mask, out) == 3
    assert out[:3].tolist() == [0, 2, 3]  # 7 and 9 from the hint (9 through the alias), 11 the map's
    assert look(hint[:1], 1, ks, 2, bh64, alias, mkeys, mvals, shift, mask, out) == 1  # 9: not in the map
    zero = np.array([7, 0], dtype=np.uint64)
    assert look(hint, 2, zero, 2, bh64, alias, mkeys, mvals, shift, mask, out) == -1
