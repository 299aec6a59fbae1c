"""The per-group pool with a CPU tier and with non-LRU eviction policies: constructed cases per
kind (a window hit served from CPU, a saved state offloaded and reloaded), the CPU events vLLM's
offloading connector publishes, random operations keeping the invariants, and refusals."""

from __future__ import annotations

import random

import pytest

from agentkv.errors import UserError
from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.interface import PoolRequest
from agentkv.kv.tiers import TierSpec, TierStack

BS = 4
KIND = {"full": "full_attention", "sliding": "sliding_window", "chunked": "chunked_local_attention"}


def pool_with_cpu(specs, capacity: int, cpu_bytes: int, policy="lru") -> HybridPool:
    groups = [GroupSpec(*s, event_kind=KIND.get(s[0], "mamba")) for s in specs]
    events: list = []
    lower = TierStack(
        [TierSpec("CPU", capacity_bytes=cpu_bytes)],
        10,
        block_size=BS,
        on_event=events.append,
        group_bytes=[g.block_bytes for g in groups],
    )
    pool = HybridPool(groups, capacity, BS, on_event=events.append, lower=lower, policy=policy)
    pool.events = events
    return pool


def run(pool: HybridPool, r: PoolRequest, tokens: int, chunk: int | None = None) -> tuple[int, int]:
    """Look up, admit (loading from below what the GPU lacks), prefill in chunks, free: (GPU, CPU) blocks hit."""
    c = pool.get_computed_blocks(r.block_hashes, tokens)
    lower = pool.match_lower(r.block_hashes, c.hit, (tokens - 1) // BS)
    c.num_lower = len(lower)
    done = (c.hit + c.num_lower) * BS
    step = min(tokens - done, chunk or tokens)
    assert pool.allocate_slots(r, step, c.hit * BS, c)
    done += step
    while done < tokens:
        step = min(tokens - done, chunk or tokens)
        assert pool.allocate_slots(r, step, done)
        done += step
    pool.free(r.request_id)
    pool.check_invariants()
    return c.hit, c.num_lower


def stored(events, medium: str, group: int) -> list[int]:
    return [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium and e.group_idx == group
        for h in e.block_hashes
    ]


def test_a_window_hit_after_gpu_eviction_is_served_from_cpu_with_the_window_rule():
    # full + sliding window of 8 tokens (the last 2 blocks before a cut), 10 bytes a block each
    pool = pool_with_cpu([("full", 10), ("sliding", 10, 8)], capacity=250, cpu_bytes=1000)
    a = PoolRequest("a", [100 + i for i in range(10)])
    assert run(pool, a, 41) == (0, 0)
    for other in (500, 700):  # two runs push all of a's blocks to the CPU (a run's uncached window
        run(pool, PoolRequest(f"b{other}", [other + i for i in range(10)]), 41)  # blocks are reused first)
    assert pool.get_computed_blocks(a.block_hashes, 41, count=False).hit == 0
    assert pool.cached_prefix(a.block_hashes) == (0, 10)
    pool.events.clear()
    up = pool.lower.counters.tiers["CPU"].bytes_up
    assert run(pool, PoolRequest("a2", a.block_hashes), 41) == (0, 10)
    # full attention loads every block; the window only the 2 before the cut, 8 and 9
    assert stored(pool.events, "GPU", 0) == a.block_hashes
    assert stored(pool.events, "GPU", 1) == [108, 109]
    assert pool.lower.counters.tiers["CPU"].bytes_up - up == 12 * 10
    assert pool.last_promote_s > 0 and pool.stats.lower_blocks == 10
    assert pool.get_computed_blocks(a.block_hashes, 41).hit == 10  # back on the GPU


def test_a_linear_state_saved_at_the_cut_is_offloaded_and_reloaded():
    pool = pool_with_cpu([("full", 10), ("state", 40)], capacity=250, cpu_bytes=2000)
    a = PoolRequest("a", [100 + i for i in range(8)])
    run(pool, a, 33, chunk=16)  # chunks end at blocks 4 and 8: the state at 8 (its replay boundary) kept
    assert set(pool.cached_maps[1]) == {107}
    run(pool, PoolRequest("b", [500 + i for i in range(16)]), 65, chunk=16)  # needs all but 10 bytes
    assert (1, 107) in pool.lower and 107 not in pool.cached_maps[1]
    assert stored(pool.events, "CPU", 1) == [107]  # b's states at blocks 4, 8 and 12 were not cached
    pool.events.clear()
    # a's next turn: its cut at block 8 reads the state saved there, from the CPU
    nxt = PoolRequest("a2", a.block_hashes + [200, 201])
    assert run(pool, nxt, 41) == (0, 8)
    assert stored(pool.events, "GPU", 1)[0] == 107  # reloaded, cached on the GPU again
    assert 107 in pool.cached_maps[1]


def test_offloaded_blocks_publish_the_events_vllm_does():
    pool = pool_with_cpu([("full", 10), ("sliding", 10, 8)], capacity=250, cpu_bytes=100)
    run(pool, PoolRequest("a", [100 + i for i in range(10)]), 41)
    pool.events.clear()
    for other in (500, 700):  # the second run reaches a's window blocks too
        run(pool, PoolRequest(f"b{other}", [other + i for i in range(10)]), 41)
    cpu = [e for e in pool.events if e.medium == "CPU"]
    first = next(e for e in cpu if isinstance(e, BlockStored))
    # vLLM's offloading connector: one hash a block, no tokens or parent, its group, no spec kind
    assert len(first.block_hashes) == 1 and first.token_ids == [] and first.parent_block_hash is None
    assert first.kv_cache_spec_kind is None and {e.group_idx for e in cpu} == {0, 1}
    # a GPU removal comes before the CPU store of the same block
    i = next(i for i, e in enumerate(pool.events) if isinstance(e, BlockRemoved) and e.medium == "GPU")
    j = next(i for i, e in enumerate(pool.events) if e is first)
    assert i < j and first.block_hashes[0] in pool.events[i].block_hashes
    # the 100-byte tier holds 10 blocks of 10: the oldest go, reported per group with medium CPU
    removed = [e for e in cpu if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    assert all(e.group_idx in (0, 1) for e in removed) and pool.lower.used_bytes() == {"CPU": 100}


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "radix", "session"])
def test_random_operations_with_a_cpu_tier_and_each_policy_keep_the_invariants(policy):
    rng = random.Random(5)
    specs = [("full", 10), ("sliding", 7, 9), ("chunked", 5, 16), ("state", 40)]
    pool = pool_with_cpu(specs, capacity=900, cpu_bytes=1500, policy=policy)
    below = 0
    for i in range(250):
        sess, n_blocks = rng.randrange(5), rng.randrange(2, 14)
        r = PoolRequest(f"r{i}", [sess * 100 + j for j in range(n_blocks)], session_id=sess)
        pool.session_resumed(sess, float(i))
        below += run(pool, r, n_blocks * BS + rng.randrange(1, BS + 1), chunk=rng.choice((BS, 2 * BS, None)))[
            1
        ]
        pool.session_paused(sess, float(i) + 0.5, "tool_use")
    assert below > 0 and pool.stats.evicted > 0
    assert pool.available_bytes == pool.capacity


def test_lfu_keeps_a_reused_prefix_that_lru_evicts():
    """Constructed: a hot prefix hit three times, then a stream of one-off prompts."""
    hits = {}
    for policy in ("lru", "lfu"):
        pool = HybridPool([GroupSpec("full", 10), GroupSpec("sliding", 10, 8)], 300, BS, policy=policy)
        hot = PoolRequest("h", [1 + i for i in range(6)])
        for k in range(3):
            c = pool.get_computed_blocks(hot.block_hashes, 25)
            assert pool.allocate_slots(PoolRequest(f"h{k}", hot.block_hashes), 25 - c.hit * BS, c.hit * BS, c)
            pool.free(f"h{k}")
        for k in range(4):
            cold = PoolRequest(f"c{k}", [1000 * (k + 1) + i for i in range(6)])
            assert pool.allocate_slots(cold, 25)
            pool.free(cold.request_id)
        pool.check_invariants()
        hits[policy] = pool.get_computed_blocks(hot.block_hashes, 25).hit
    assert hits == {"lru": 0, "lfu": 6}


def test_bad_combinations_are_refused_in_one_line():
    from agentkv.engine.config import EngineConfig
    from agentkv.engine.engine import Engine

    with pytest.raises(UserError, match="capacity holds no block") as e:
        Engine(EngineConfig(model="gpt-oss-120b", kv_offloading_size=1e-4))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="write_back"):
        TierStack([TierSpec("CPU", capacity_bytes=100)], 10, write_mode="write_through", group_bytes=[10])
    with pytest.raises(ValueError, match="group_bytes"):
        HybridPool(
            [GroupSpec("full", 10)], 100, BS, lower=TierStack([TierSpec("CPU", capacity_bytes=100)], 10)
        )


def simulate(shared_dir, capsys, *flags: str) -> dict:
    import json

    from agentkv.cli import main

    argv = ["simulate", str(shared_dir / "traces" / "claude-code"), "--traces-limit", "3", "--lanes", "3"]
    argv += [
        "--model",
        "DeepSeek-V4-Flash",
        "-tp",
        "2",
        "--num-gpu-blocks-override",
        "562",
    ]  # 256-token blocks
    assert main([*argv, "--max-requests", "20", "-q", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.shared
def test_a_cpu_tier_raises_a_hybrid_models_hit_rate_on_real_traces(shared_dir, capsys):
    """DeepSeek-V4-Flash (MLA + window + compressor states) on 3 Claude Code sessions, a pool too
    small for them: the CPU tier serves what the GPU evicted (recomputing a window or a state
    needs the whole prompt again; loading one needs its last blocks)."""
    gpu = simulate(shared_dir, capsys)
    cpu = simulate(shared_dir, capsys, "--cpu-offload", "64GB")
    assert "CPU" not in gpu["cache"]["by_tier"] and cpu["cache"]["by_tier"]["CPU"] > 0
    assert cpu["cache"]["reported"] > gpu["cache"]["reported"] + 0.1
    assert cpu["ttft"]["p50"] < gpu["ttft"]["p50"]
    assert cpu["valid"] and cpu["config"]["engine"]["kv_offloading_size"] == pytest.approx(64e9 / 2**30)


def test_a_state_models_prompt_whose_rest_after_cpu_hits_is_under_a_block_is_admitted():
    """A model with a state group (Qwen3-Next) cuts prefill chunks on block boundaries, counted from
    where the chunk starts: after the GPU hits AND the blocks loaded from the CPU tier. A prompt 24
    tokens short of 4 blocks whose first 3 come back from CPU leaves under one block to compute: a
    chunk counted from the GPU hits alone was cut to nothing, and the engine stalled with it queued."""
    from agentkv.engine.config import EngineConfig
    from agentkv.engine.engine import Engine

    e = Engine(  # 80 blocks on the GPU, 1 GiB of CPU tier
        EngineConfig(
            model="qwen3-next-80b-a3b",
            tensor_parallel_size=2,
            max_model_len=4096,
            num_gpu_blocks_override=80,
            kv_offloading_size=1.0,
        )
    )
    bs = e.config.block_size

    def serve(rid: str, toks: list[int]) -> None:
        e.add_request(rid, max_tokens=2, token_ids=toks)
        while e.has_work() and e.step() is not None:
            e.pool.check_invariants()
        assert not e.has_work(), f"{rid}: the engine stalled with {len(e.scheduler.waiting)} queued"

    prompt = list(range(1, 4 * bs - 23))
    serve("a", prompt)
    for k in range(1, 12):  # other prompts push its blocks out of the GPU (into the CPU tier)
        serve(f"fill{k}", list(range(10_000 * k, 10_000 * k + 3000)))
    loaded = e.pool.stats.lower_blocks
    serve("b", prompt)
    assert e.pool.stats.lower_blocks - loaded == 3  # 3 blocks back from CPU, bs - 24 tokens computed
