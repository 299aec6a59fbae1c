"""The per-group KV pool (vLLM's hybrid KV cache manager): each kind's prefix-hit rule on
constructed cases, window blocks freed as decode advances, states saved at aligned cuts, shared
capacity, and a one-full-group pool that behaves as BlockPool."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.models import get_model
from agentkv.engine.models.layout import is_hybrid, kv_layout
from agentkv.kv import group_rules as R
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool
from agentkv.kv.u64map import U64Map

BS = 4


def req(rid: str, n_blocks: int, base: int = 1000) -> PoolRequest:
    return PoolRequest(rid, [base + i for i in range(n_blocks)])


def cached(*idx: int, base: int = 1000) -> dict[int, int]:
    return {base + i: i for i in idx}


H = [1000 + i for i in range(12)]


@pytest.mark.parametrize(
    "present, limit, window, hit",
    [
        (range(12), 12, 8, 12),  # everything cached
        ((9, 10, 11), 12, 8, 12),  # only the last cdiv(7, 4) = 2 blocks matter: 10, 11
        ((10,), 12, 8, 0),  # one block is not a window; nothing leads from 0
        ((4, 5, 9), 12, 8, 6),  # right to left: 9 alone, then 4, 5 make the run ending at 6
        ((0, 1, 2), 12, 100, 3),  # no run of cdiv(99, 4) = 25: the leading run counts
        ((9, 10, 11), 11, 8, 11),  # the cut at 11: blocks 9 and 10 cover it
    ],
)
def test_sliding_window_hit_needs_only_the_last_window(present, limit, window, hit):
    assert R.sliding_hit(cached(*present), H, limit, window, BS) == hit


def test_sliding_window_hit_matches_vllms_right_to_left_scan():
    def reference(present, limit, need):  # SlidingWindowManager.find_longest_cache_hit, one block a step
        run = 0
        for i in range(limit - 1, -1, -1):
            run = run + 1 if i in present else 0
            if run >= need:
                return i + need
        return run

    rng = random.Random(3)
    for _ in range(400):
        present = {i for i in range(40) if rng.random() < rng.choice((0.3, 0.7, 0.95))}
        limit, window = rng.randrange(0, 41), rng.choice((2, 5, 8, 17, 33))
        got = R.sliding_hit({1000 + i: i for i in present}, [1000 + i for i in range(40)], limit, window, BS)
        assert got == reference(present, limit, R.window_blocks(window, BS)), (present, limit, window)


def test_full_attention_hit_needs_every_block_and_chunked_only_the_current_chunk():
    assert R.full_hit(cached(0, 1, 2, 4, 5), H, 12) == 3
    # chunk 16 tokens = 4 blocks; a cut at 10 blocks sits in the chunk of blocks 8..11
    assert R.chunked_hit(cached(8, 9), H, 10, 16, BS) == 10  # blocks before 8 are never read
    assert R.chunked_hit(cached(8), H, 10, 16, BS) == 9
    assert R.chunked_hit(cached(), H, 10, 16, BS) == 8  # the chunk start is a hit by itself
    assert R.chunked_hit(cached(), H, 8, 16, BS) == 8


def test_state_hit_is_the_rightmost_saved_state():
    assert R.state_hit(cached(2, 6), H, 12) == 7
    assert R.state_hit(cached(2, 6), H, 6) == 3  # a state past the limit cannot serve
    assert R.state_hit(cached(), H, 12) == 0


KIND = {
    "full": "full_attention",
    "sliding": "sliding_window",
    "chunked": "chunked_local_attention",
    "state": "mamba",
}


def hybrid(specs, capacity=10_000, bs=BS) -> HybridPool:
    groups = [GroupSpec(*s, event_kind=KIND.get(s[0], "")) for s in specs]
    return HybridPool(groups, capacity, bs, record_events=True)


def test_hit_is_what_every_group_serves():
    pool = hybrid([("full", 10), ("sliding", 10, 8)])
    a = req("a", 10)
    assert pool.allocate_slots(a, 40)
    pool.free("a")
    pool.check_invariants()
    assert pool.get_computed_blocks(a.block_hashes, 41).hit == 10
    # the window group cached only blocks 8 and 9, the window before the prompt's replay boundary
    assert sorted(pool.cached_maps[1]) == a.block_hashes[8:]
    pool.cached_maps[1].pop(a.block_hashes[9])  # then no window ends at any cut: no hit at all
    assert pool.get_computed_blocks(a.block_hashes, 41).hit == 0


def test_window_blocks_are_freed_as_decode_advances_and_stay_cached():
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=100_000)
    r = PoolRequest("r", [1000 + i for i in range(4)])
    assert pool.allocate_slots(r, 16)  # prompt of 16 tokens: 4 blocks in each group
    held = pool.capacity - pool.available_bytes
    assert held == 8 * 10
    for t in range(16, 64):  # decode one token a step
        assert pool.allocate_slots(r, 1, t)
        pool.check_invariants()
    full_t, win_t = pool.tables["r"]
    assert len(full_t) == 16 and all(b >= 0 for b in full_t)
    live = [b for b in win_t if b >= 0]
    assert len(live) <= R.window_blocks(8, BS) + 1  # only the window (and the block being filled)
    assert win_t[0] == -1 and sorted(pool.cached_maps[1]) == [1002, 1003]  # the prompt's last window
    assert pool.capacity - pool.available_bytes == (16 + len(live)) * 10


def test_a_window_caches_its_tail_at_a_shared_prefixs_junction():
    """Three 14-block prompts share 10 blocks. A caches its window (2 blocks) only before its replay
    boundary (13); B finds the 10 in the full group but not the window before them, hits 0, and
    caches that window too (vLLM's `shared_prefix_boundary`); C hits 10. Checked live in
    tests/vllm/test_vllm_kinds.py."""
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=100_000)
    hits = []
    for k in (100, 200, 300):
        r = PoolRequest(f"r{k}", [*range(10), *range(k, k + 4)], prompt_len=56)
        c = pool.get_computed_blocks(r.block_hashes, 56)
        assert c.longest == (10 if k == 200 else 0)  # the full group alone went further
        assert pool.allocate_slots(r, 56 - c.hit * BS, c.hit * BS, c)
        hits.append(c.hit)
        pool.free(r.request_id)
        pool.check_invariants()
    assert hits == [0, 0, 10]
    assert sorted(pool.cached_maps[1]) == [8, 9, 101, 102, 201, 202, 301, 302]  # blocks 11-12: before 13
    assert not pool.junction  # dropped with the request


def test_state_group_keeps_one_state_and_caches_only_the_replay_boundary():
    """vLLM 0.32's 'align' mode: a page for each block the tokens reach, the page a step read from held
    until the request's next step; of the states saved where chunks end, only the one at the
    prompt's replay boundary is cached (`prefix_cache_retention_interval` 0): the earlier one is
    freed uncached."""
    pool = hybrid([("full", 10), ("state", 50)], capacity=100_000)
    r = PoolRequest("r", [1000 + i for i in range(6)])  # 6 blocks, a prompt of 25 tokens (it does not say)
    assert pool.allocate_slots(r, 8)  # chunk ends at 8 tokens: a state saved at block 2, not cached
    assert pool.allocate_slots(r, 16, 8)  # ends at 24: block 6, the replay boundary ((25 - 1) // 4)
    assert set(pool.cached_maps[1]) == {1005}
    assert len(pool.tables["r"][1]) == 2  # the state at block 2 (read this step) and at block 6
    first = int(pool.tables["r"][1][0])
    assert pool.allocate_slots(r, 1, 24)  # a decode step into block 7: block 2's page freed uncached,
    # so reused at once (vLLM's `free_blocks` prepends uncached blocks) by this step's new blocks
    assert pool.tables["r"][1].tolist()[0] == pool.cached_maps[1][1005]
    assert first in pool.tables["r"][0].tolist() + pool.tables["r"][1].tolist()
    for t in range(25, 40):
        assert pool.allocate_slots(r, 1, t)
    assert pool.capacity - pool.available_bytes == 10 * 10 + 50  # decode adds no state
    pool.free("r")
    pool.check_invariants()
    assert pool.get_computed_blocks(r.block_hashes + [1, 2], 33).hit == 6
    pool.cached_maps[1].pop(1005)
    assert pool.get_computed_blocks(r.block_hashes, 25).hit == 0  # no state before it was kept


def test_a_state_is_cached_at_a_shared_prefix_junction():
    """A prompt that finds a longer prefix in the full-attention group than any state serves records
    that junction (vLLM's `shared_prefix_boundary`); the state its chunk saves there is cached, so a
    third prompt sharing the prefix hits it (live vLLM 0.32: [0, 0, 30 blocks] for three prompts
    sharing 30 of 50 blocks, tests/vllm/test_vllm_kinds.py)."""
    pool = hybrid([("full", 10), ("state", 50)], capacity=100_000)
    shared = [7, 8, 9]
    a, b, c = (
        PoolRequest(x, [*shared, *range(base, base + 3)]) for x, base in (("a", 100), ("b", 200), ("c", 300))
    )
    assert pool.allocate_slots(a, 24)  # one chunk to block 6: its replay boundary, cached
    pool.free("a")
    found = pool.get_computed_blocks(b.block_hashes, 25)
    assert (found.hit, found.longest) == (0, 3)  # the full group holds 3 blocks, no state serves them
    assert pool.allocate_slots(b, 12, 0, found)  # the chunk the scheduler cuts at the junction
    assert pool.allocate_slots(b, 12, 12)
    pool.free("b")
    assert set(pool.cached_maps[1]) == {102, 9, 202}  # a's and b's replay boundaries, b's junction
    assert pool.get_computed_blocks(c.block_hashes, 25).hit == 3
    pool.check_invariants()


def test_shared_pool_evicts_least_recently_freed_across_groups():
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=150)
    a = req("a", 5, base=0)
    assert pool.allocate_slots(a, 20)
    pool.free("a")
    b = req("b", 5, base=100)
    assert pool.allocate_slots(b, 20)  # 10 blocks: a's 3 uncached window blocks and 5 free ones, then
    # the two oldest cached (a's full-attention tail: its group was freed first)
    assert pool.get_computed_blocks(a.block_hashes, 21).hit == 0
    assert not pool.allocate_slots(req("c", 12, base=200), 48)  # more than the pool
    assert pool.stats.alloc_failures == 1
    pool.check_invariants()
    events = pool.take_events()
    stored = {(e.group_idx, e.kv_cache_spec_kind) for e in events if type(e).__name__ == "BlockStored"}
    assert stored == {(0, "full_attention"), (1, "sliding_window")}
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert [(e.group_idx, e.block_hashes) for e in removed] == [(0, [4, 3])]


def test_one_allocation_evicts_once_for_every_group_oldest_first():
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=200)
    for rid, base in (("a", 0), ("b", 100)):  # each frees 5 full then 2 cached window blocks, tails first
        assert pool.allocate_slots(req(rid, 5, base=base), 20)
        pool.free(rid)
    pool.take_events()
    assert pool.allocate_slots(req("c", 6, base=200), 24)  # 6 + 6 blocks: 6 free, the 6 oldest cached go
    removed = [
        (e.group_idx, e.block_hashes) for e in pool.take_events() if type(e).__name__ == "BlockRemoved"
    ]
    assert removed == [(0, [4, 3, 2, 1, 0]), (1, [4])]  # one eviction, per group, oldest first
    assert pool.get_computed_blocks(req("b", 5, base=100).block_hashes, 21).hit == 5  # b's untouched
    assert set(pool.cached_maps[1]) == {3, 103, 104, 204, 205}  # each prompt's last window
    pool.check_invariants()


def test_a_one_full_group_pool_behaves_as_block_pool():
    rng = random.Random(7)
    bp = BlockPool(60, BS)
    hp = HybridPool([GroupSpec("full", 1)], 60, BS)
    for i in range(300):
        sess = rng.randrange(6)
        n = rng.randrange(1, 30)
        hashes = [sess * 1000 + j for j in range(n)]
        results = []
        for pool in (bp, hp):
            c = pool.get_computed_blocks(hashes, n * BS + 1)
            ok = pool.allocate_slots(
                PoolRequest(f"r{i}", hashes), n * BS + 1 - c.num_blocks * BS, c.num_blocks * BS, c
            )
            results.append((c.num_blocks, ok))
            pool.free(f"r{i}")
        assert results[0] == results[1], i
    assert bp.stats.hits == hp.stats.hits and bp.stats.evicted == hp.stats.evicted
    hp.check_invariants()


def test_a_growing_table_leaves_handed_out_tables_alone():
    """Tables grow in place in a buffer: a full group's table handed out before (a lookup hint)
    keeps its blocks, and growth only appends (a window nulls what it passed, as before)."""
    pool = hybrid([("full", 10), ("sliding", 10, 8)])
    a = req("a", 40)
    assert pool.allocate_slots(a, 5 * BS)
    handed = []
    for done in range(5, 38, 3):  # growths of 3 blocks, well past the first buffers' sizes
        handed.append((pool.block_table("a"), pool.block_table("a").copy()))
        before = [t.copy() for t in pool.tables["a"]]
        assert pool.allocate_slots(a, 3 * BS, done * BS)
        for old, now in zip(before, pool.tables["a"], strict=True):
            assert len(now) == len(old) + 3
            kept = now[: len(old)]
            assert np.array_equal(kept[kept >= 0], old[: len(old)][kept >= 0])
        pool.check_invariants()
    for view, copy in handed:
        assert np.array_equal(view, copy)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="rule"):
        GroupSpec("windowed", 10)
    with pytest.raises(ValueError, match="window"):
        GroupSpec("sliding", 10)
    with pytest.raises(ValueError, match="multiple"):
        hybrid([("full", 10), ("chunked", 10, 6)])


def test_layout_bytes_per_group_match_hand_calculation():
    oss = get_model("gpt-oss-120b")  # 18 full + 18 sliding (128) layers, 8 KV heads x 64, bf16
    specs = kv_layout(oss, 16, "bf16", 1)
    assert [(s.rule, s.window) for s in specs] == [("full", 0), ("sliding", 128)]
    assert [s.block_bytes for s in specs] == [18 * 16 * 2 * 8 * 64 * 2] * 2
    gemma = kv_layout(get_model("gemma-3-27b"), 16, "fp8", 1)  # 10 full, 52 local padded to 60
    assert [s.block_bytes for s in gemma] == [10 * 16 * 2 * 16 * 128, 60 * 16 * 2 * 16 * 128]
    nxt = kv_layout(get_model("qwen3-next"), 16, "bf16", 2)
    assert nxt[1].rule == "state" and nxt[1].block_bytes == 36 * 1_097_728 // 2
    assert not is_hybrid(get_model("llama3-8b")) and not is_hybrid(get_model("DeepSeek-V3"))
    assert not is_hybrid(get_model("DeepSeek-V3.2-Exp"))  # latent + indexer keys: one table
    assert is_hybrid(get_model("DeepSeek-V4-Flash")) and is_hybrid(get_model("Llama-4-Scout"))


def test_v4s_compressor_buffers_are_window_groups_as_in_vllm():
    """V4's compressor buffers are vLLM `SlidingWindowMLASpec` groups of 8 (CSA, indexer) and 128 tokens
    (HCA, sharing the main window's rule): no Mamba state, so no block-aligned prefill chunks; each
    window group names the finer blocks vLLM runs it on (4, 8 and the main window's 64)."""
    specs = kv_layout(get_model("DeepSeek-V4-Flash"), 256, "fp8", 2)
    assert [(s.rule, s.window, s.page_tokens) for s in specs] == [
        ("full", 0, ()),
        ("sliding", 8, (4,)),
        ("sliding", 128, (8, 64)),
    ]
    assert specs[1].name == "CSA compressor state + indexer compressor state"
    assert not engine("DeepSeek-V4-Flash", tensor_parallel_size=2).pool.has_state


@pytest.mark.parametrize(
    ("window", "pages", "done", "cut", "serves"),
    [
        (8, (4,), 1026, 1024, True),  # arrived up to 1,026: its window's blocks start at 1,016 = 1,024 - 8
        (8, (4,), 1027, 1024, False),  # they start at 1,020: tokens 1,016-1,019 are gone
        (128, (8, 64), 1099, 1024, False),  # 8-token blocks from 968, 64-token from 960: past 896
        (128, (8, 64), 1030, 1024, True),  # from 896 in both
        (128, (), 1099, 1024, True),  # the pool's own blocks: nothing finer to check
    ],
)
def test_an_arrived_window_serves_a_cut_only_where_vllms_own_blocks_hold_it(window, pages, done, cut, serves):
    assert R.arrival_serves(window, pages, done, cut) is serves


def engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, max_model_len=131072, **kw))


def test_gpt_oss_fits_about_twice_the_tokens_of_its_all_full_equivalent():
    e = engine("gpt-oss-120b")
    pool = e.pool
    ctx = 100_000
    per_seq = sum(s.block_bytes * (-(-ctx // 16) if s.rule == "full" else 9) for s in pool.specs)
    all_full = pool.growth_bytes * -(-ctx // 16)
    assert 1.9 < all_full / per_seq < 2.0
    # and the engine really holds that many: fill it with 100K-token sequences
    n = 0
    while pool.allocate_slots(PoolRequest(f"s{n}", []), ctx):
        for t in range(ctx, ctx + 1):
            pool.allocate_slots(PoolRequest(f"s{n}", []), 1, t)
        n += 1
    assert n == pool.capacity // per_seq or n == pool.capacity // per_seq - 1
    assert n >= 1.9 * (pool.capacity // all_full)


def test_dense_models_keep_the_single_table_pool():
    assert isinstance(engine("llama3-8b").pool, BlockPool)
    e = engine("gemma-3-27b")
    assert isinstance(e.pool, HybridPool) and e.num_gpu_blocks > 1000


def test_hybrid_engine_takes_other_policies_and_a_cpu_tier():
    e = engine("gpt-oss-120b", eviction_policy="lfu", kv_offloading_size=8.0)
    assert e.pool.policy.name == "lfu" and e.pool.lower.group_bytes == tuple(
        s.block_bytes for s in e.pool.specs
    )


@dataclass(slots=True)
class _Hashed(PoolRequest):
    """A request that carries its hashes as uint64 too, as the engine's requests do."""

    hash_array: np.ndarray | None = None


@pytest.mark.parametrize(
    "events, arrays, wide_at",
    [(True, False, None), (False, True, None), (False, False, 300), (True, True, 300)],
    ids=["events", "uint64-arrays", "wide-hashes-mid-run", "events-arrays-wide"],
)
def test_random_admissions_chunks_decodes_and_frees_keep_the_invariants(events, arrays, wide_at):
    """Every kind at once, under memory pressure: chunked prefills from each lookup's hit, decodes,
    refusals and frees in random order; bytes, maps, tables and the LRU stay consistent. With and
    without events and uint64 hash arrays; from request `wide_at` on, hashes outside uint64 arrive
    and turn the first group's `U64Map` into a dict."""
    rng = random.Random(11)
    specs = [("full", 10), ("sliding", 7, 9), ("chunked", 5, 16), ("state", 40)]
    pool = HybridPool(
        [GroupSpec(*s, event_kind=KIND.get(s[0], "")) for s in specs], 1200, BS, record_events=events
    )
    assert type(pool.cached_maps[0]) is U64Map and type(pool.cached_maps[1]) is dict
    running: dict[str, tuple[PoolRequest, int, int]] = {}  # id -> (request, computed, prompt tokens)
    copies = 0  # group 0's younger copies seen after each operation
    for i in range(600):
        if running and rng.random() < 0.5:
            rid = rng.choice(sorted(running))
            r, done, n = running[rid]
            step = (
                min(rng.choice((1, 1, 4, 9)), n + 8 - done)
                if done >= n
                else min(rng.randrange(1, 12), n - done)
            )
            if step > 0 and pool.allocate_slots(r, step, done):
                running[rid] = (r, done + step, n)
            if rng.random() < 0.2 or done >= n + 8:
                pool.free(rid)
                del running[rid]
        else:
            sess, n_blocks = rng.randrange(4), rng.randrange(1, 14)
            base = sess * 100 + (2**70 if wide_at is not None and i >= wide_at and sess % 2 else 0)
            hashes = [base + j for j in range(n_blocks)]
            wide = base >= 2**64
            r = _Hashed(
                f"r{i}", hashes, hash_array=None if wide or not arrays else np.array(hashes, np.uint64)
            )
            n = n_blocks * BS + rng.randrange(0, BS)
            c = pool.get_computed_blocks(r.block_hashes, n)
            first = min(n - c.hit * BS, rng.randrange(1, 20))
            if first > 0 and pool.allocate_slots(r, first, c.hit * BS, c):
                running[r.request_id] = (r, c.hit * BS + first, n)
        pool.check_invariants()
        copies += sum(map(len, pool.group_copies(0).values()))
    for rid in list(running):
        pool.free(rid)
    pool.check_invariants()
    assert (
        pool.available_bytes == pool.capacity and pool.stats.evicted > 0 and copies > 0
    )  # copies evicted too
    assert pool.mirror is (wide_at is None) and (type(pool.cached_maps[0]) is U64Map) is pool.mirror
    if events:
        assert pool.take_events()


def test_block_arrays_grow_with_the_blocks_taken_not_with_the_capacity():
    """A pool sized for 10^8 blocks holds arrays for what it took: ids ascend as first taken, freed
    ids come back first (newest freed first), growth keeps the cache, and a full pool still refuses."""
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=10**9)
    a, b = PoolRequest("a", []), req("b", 3000, base=50_000)  # a's blocks: uncached, freed to the stack
    assert pool.allocate_slots(a, 3000 * BS) and pool.allocate_slots(b, 3000 * BS)  # 12,000 ids
    assert pool.tables["a"][0][:3].tolist() == [0, 1, 2] and pool.tables["b"][0][0] == 6000  # ascending
    assert 12_000 <= len(pool.ref) < 50_000
    pool.check_invariants()
    pool.free("a")
    size = len(pool.ref)
    c = req("c", 10, base=90_000)
    assert pool.allocate_slots(c, 10 * BS)
    assert len(pool.ref) == size  # a's freed ids, tail first per group, the last freed on top: no growth
    assert pool.tables["c"][0].tolist() == list(range(3000, 3010))
    assert pool.get_computed_blocks(b.block_hashes, 3000 * BS + 1).hit == 3000
    pool.check_invariants()
    small = hybrid([("full", 10)], capacity=95)  # 9 blocks: arrays of the capacity, and no more
    assert len(small.ref) == 10 and small.allocate_slots(req("x", 9), 9 * BS)
    assert not small.allocate_slots(req("y", 1, base=7), BS)
    small.check_invariants()


def test_grown_keeps_values_and_fills_the_rest():
    """The pool's per-block arrays keep their ids' values when they grow; new ids read as the fill."""
    import numpy as np

    from agentkv.kv.group_lru import grown

    ref = grown(np.array([3, 0, 7], dtype=np.int32), 6)
    assert ref.dtype == np.int32 and ref.tolist() == [3, 0, 7, 0, 0, 0]
    alias = grown(np.array([-1, 4], dtype=np.int64), 4, fill=-1)
    assert alias.tolist() == [-1, 4, -1, -1]
    bhash = grown(np.array([2**70, None], dtype=object), 3)
    assert bhash.tolist() == [2**70, None, None]


def test_a_recomputed_block_is_another_copy_that_outlives_the_first():
    """As vLLM's BlockPool: a block computed again under a cached hash is cached as another copy,
    stored and removed with its own events; evicting the older copy leaves the hash to the younger."""
    pool = hybrid([("full", 10), ("sliding", 10, 8)], capacity=300)
    a = req("a", 5)
    assert pool.allocate_slots(a, 20)
    pool.free("a")
    b = req("b", 5)  # the same prompt, computed again from scratch (no hit passed)
    assert pool.allocate_slots(b, 20)
    assert set(pool.group_copies(0)) == set(a.block_hashes)  # every full block twice
    stored = [e.block_hashes for e in pool.take_events() if type(e).__name__ == "BlockStored"]
    assert stored[0] == a.block_hashes and a.block_hashes in stored[2:]  # b's copies announced too
    pool.free("b")
    pool.check_invariants()
    copies = [pool.group_copies(0)[h][0] for h in a.block_hashes]  # b's blocks
    assert pool.allocate_slots(req("c", 11, base=5000), 44)  # 22 blocks: 16 free, a's copies go first
    events = pool.take_events()
    removed = [e.block_hashes for e in events if type(e).__name__ == "BlockRemoved" and e.group_idx == 0]
    assert removed == [a.block_hashes[::-1]]  # one copy of each (a's: the oldest), tail first
    assert [pool.cached_maps[0][h] for h in a.block_hashes] == copies and not pool.group_copies(0)
    assert pool.get_computed_blocks(a.block_hashes, 21).hit == 5  # still served, from b's copies
    pool.check_invariants()


@pytest.mark.parametrize("events", [True, False])
def test_three_copies_of_a_prompt_hand_each_hash_to_the_oldest_left_as_they_are_evicted(events):
    """Three requests compute one prompt from scratch: the map gives the first one's blocks, the
    others are its copies, oldest first. Evicting them block by block (a growing request's decode),
    each hash always answers from its oldest surviving copy, and the rest stay its copies."""
    specs = [GroupSpec("full", 10, event_kind="full_attention"), GroupSpec("sliding", 10, 8)]
    pool = HybridPool(specs, 300, BS, record_events=events)
    owners = []
    for rid in "abc":
        r = req(rid, 5)
        assert pool.allocate_slots(r, 20)
        owners.append(pool.block_table(rid).tolist())
        pool.free(rid)
    hashes = req("x", 5).block_hashes
    assert pool.group_copies(0) == {h: [owners[1][i], owners[2][i]] for i, h in enumerate(hashes)}
    d = req("d", 40, base=9000)
    done = 0
    while any(h in pool.cached_maps[0] for h in hashes):
        assert pool.allocate_slots(d, BS, done)
        done += BS
        for i, h in enumerate(hashes):
            alive = [o[i] for o in owners if pool.hash_of(o[i]) == h and pool.bgroup[o[i]] == 0]
            if alive:
                assert pool.cached_maps[0][h] == alive[0]
                assert pool.group_copies(0).get(h, []) == alive[1:]
            else:
                assert h not in pool.cached_maps[0] and h not in pool.group_copies(0)
        pool.check_invariants()
    assert pool.stats.evicted >= 15 and not pool.group_copies(0)  # every copy went as d grew


@pytest.mark.parametrize("events", [True, False])
def test_both_copies_of_a_hash_evicted_in_one_batch_leave_no_trace(events):
    """The older copy goes first and promotes the younger, which the same eviction then takes: the
    hash leaves the map, its copies list and group 0's uint64 mirror (the hint checks' table)."""
    specs = [GroupSpec("full", 10, event_kind="full_attention"), GroupSpec("sliding", 10, 8)]
    pool = HybridPool(specs, 300, BS, record_events=events)
    a = req("a", 5)
    assert pool.allocate_slots(a, 20)
    pool.free("a")
    b = req("b", 5)  # the same prompt from scratch: copies of every full block
    assert pool.allocate_slots(b, 20)
    pool.free("b")
    assert set(pool.group_copies(0)) == set(a.block_hashes)
    assert pool.allocate_slots(req("c", 1, base=5000), 60)  # every block of the pool, one cached again
    assert not pool.group_copies(0) and not any(h in pool.cached_maps[0] for h in a.block_hashes)
    pool.check_invariants()  # (the mirror: a nonzero entry names the block the map gives)


def test_a_state_page_is_padded_to_the_attention_page():
    """vLLM pads a Mamba/linear state's page up to the attention page ("Padding mamba page size"):
    at vLLM's 544-token blocks, Qwen3-Next's state costs a whole page (TP 2: 544 x 1,024 B)."""
    nxt = kv_layout(get_model("qwen3-next"), 544, "bf16", 2)
    assert nxt[1].rule == "state" and nxt[1].block_bytes == 36 * 544 * 1024
    assert nxt[0].block_bytes == 12 * 544 * 1024


def test_a_pool_nobody_listens_to_keeps_the_same_blocks_as_one_that_records_events(monkeypatch):
    """A pool without listeners evicts group 0's victims in a single compiled pass (`evict_first`),
    the other groups' after it; a recording pool takes the general path. A random run of shared,
    recomputed and growing prompts over a small pool leaves both with the same block ids, maps,
    copies, free-id stack and counts after every call."""
    from agentkv.kv.eviction.base import stamp_loops

    loops, one_pass = stamp_loops(), []
    evict_first = loops.evict_first

    def counted(*args):  # which evictions had group 0's victims alone (the others: group 1's too)
        n, zero, rest = evict_first(*args)
        one_pass.append(rest == 0)
        return n, zero, rest

    monkeypatch.setattr(loops, "evict_first", counted)
    rng = random.Random(11)  # (a window block the size of three: evictions free ids a take leaves)
    specs = [GroupSpec("full", 10, event_kind="full_attention"), GroupSpec("sliding", 30, 8)]
    quiet, loud = (HybridPool(specs, 1500, BS, record_events=r) for r in (False, True))
    running: dict[str, tuple[PoolRequest, int]] = {}
    most_copies = 0
    for i in range(600):
        op = rng.random()
        if op < 0.45 or not running:  # a prompt from one of a few bases: hits, misses, recomputes
            r = req(f"r{i}", rng.randint(1, 12), base=rng.choice((0, 0, 100, 200)) * 1000)
            use_hit = rng.random() < 0.7
            got = []
            for pool in (quiet, loud):
                c = pool.get_computed_blocks(r.block_hashes, len(r.block_hashes) * BS + 1)
                hit = c.hit if use_hit else 0
                new = len(r.block_hashes) * BS + 1 - hit * BS
                got.append((pool.allocate_slots(r, new, hit * BS, c if use_hit else None), hit))
            assert got[0] == got[1]
            if got[0][0]:
                running[r.request_id] = (r, len(r.block_hashes) * BS + 1)
        elif op < 0.75:  # a running request decodes a few tokens
            rid = rng.choice(sorted(running))
            r, done = running[rid]
            n = rng.randint(1, 6)
            ok = [pool.allocate_slots(r, n, done) for pool in (quiet, loud)]
            assert ok[0] == ok[1]
            if ok[0]:
                running[rid] = (r, done + n)
        else:
            rid = rng.choice(sorted(running))
            del running[rid]
            for pool in (quiet, loud):
                pool.free(rid)
        for rid in running:
            assert all(np.array_equal(a, b) for a, b in zip(quiet.tables[rid], loud.tables[rid], strict=True))
        assert dict(quiet.cached_maps[0].items()) == dict(loud.cached_maps[0].items())
        assert quiet.cached_maps[1] == loud.cached_maps[1]
        assert quiet.group_copies(0) == loud.group_copies(0)
        for name in ("ref", "hashed_blk", "bkey", "bh64", "bgroup", "cnext", "cprev", "ctail"):
            assert np.array_equal(getattr(quiet, name), getattr(loud, name)), name
        most_copies = max(most_copies, len(quiet.group_copies(0)))
        assert quiet._ids[: quiet._n_ids].tolist() == loud._ids[: loud._n_ids].tolist()
        assert (quiet._fresh, quiet.stats.evicted, quiet.stats.allocated) == (
            loud._fresh,
            loud.stats.evicted,
            loud.stats.allocated,
        )
    quiet.check_invariants()
    loud.check_invariants()
    assert quiet.stats.evicted > 100 and most_copies > 0  # (evictions of copies among them)
    assert any(one_pass) and not all(one_pass)  # evictions of group 0 alone and of both groups


def test_take_ids_pops_the_freed_stack_top_first_then_never_taken_ids():
    """A take's ids: the freed stack from its top, then never-taken ids ascending, each marked with
    one reference, no hash, its group and that group's block bytes (groups in turn)."""
    from agentkv.kv.eviction.base import stamp_loops

    take = stamp_loops().take_ids
    n = 12
    ref, hashed = np.zeros(n, np.int32), np.ones(n, bool)
    group, cost = np.full(n, 7, np.int16), np.zeros(n, np.int64)
    ids, out = np.array([5, 2, 9, 0], dtype=np.int64), np.empty(5, np.int64)
    counts, costs = np.array([2, 3], dtype=np.int64), np.array([10, 40], dtype=np.int64)
    assert take(ids, 3, 7, counts, costs, ref, hashed, group, cost, out) == (0, 9)
    assert out.tolist() == [9, 2, 5, 7, 8]
    assert ref[out].tolist() == [1] * 5 and not hashed[out].any() and hashed.sum() == n - 5
    assert group[out].tolist() == [0, 0, 1, 1, 1] and cost[out].tolist() == [10, 10, 40, 40, 40]
    one, c1 = np.empty(1, np.int64), np.array([1], dtype=np.int64)  # (counts add up to the ids taken)
    # a take the stack covers leaves the rest of it and no fresh id
    assert take(np.array([4, 6], dtype=np.int64), 2, 12, c1, costs, ref, hashed, group, cost, one) == (1, 12)
    assert one.tolist() == [6]
