"""The engine behaves like vLLM step by step: prefix hits skip prefill, pressure preempts, tiers restore."""

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.errors import UserError


def run(engine: Engine) -> list:
    steps = []
    while engine.has_work():
        s = engine.step()
        assert s is not None, "engine has work but scheduled nothing"
        engine.clock.advance_to(s.end)
        steps.append(s)
    return steps


def test_second_turn_hits_prefix_and_ttft_drops():
    e = Engine(EngineConfig(block_size=16))
    first = e.add_request("t1", max_tokens=4, token_ids=list(range(1, 20001)))
    run(e)
    ttft1 = first.first_token - first.arrival
    second = e.add_request("t2", max_tokens=4, token_ids=list(range(1, 20001)) + list(range(5, 2005)))
    run(e)
    ttft2 = second.first_token - second.arrival
    assert second.num_cached_tokens == 20000 // 16 * 16
    assert ttft2 < ttft1 / 3
    assert e.prefix_cache_hits == second.num_cached_tokens


def test_salt_isolates_identical_prompts():
    e = Engine(EngineConfig())
    e.add_request("a", max_tokens=1, token_ids=list(range(1, 1025)), cache_salt="tenant-a")
    run(e)
    b = e.add_request("b", max_tokens=1, token_ids=list(range(1, 1025)), cache_salt="tenant-b")
    run(e)
    assert b.num_cached_tokens == 0
    a2 = e.add_request("a2", max_tokens=1, token_ids=list(range(1, 1025)), cache_salt="tenant-a")
    run(e)
    assert a2.num_cached_tokens == 1024 - 16


def test_chunked_prefill_respects_token_budget():
    e = Engine(EngineConfig(max_num_batched_tokens=2048))
    r = e.add_request("long", max_tokens=2, prompt_len=10000, block_hashes=list(range(625)))
    steps = run(e)
    assert all(s.num_prefill_tokens <= 2048 for s in steps)
    assert sum(s.num_prefill_tokens for s in steps) == 10000
    assert r.first_token == steps[4].end  # 5 chunks of <= 2048, the token comes with the last


def test_memory_pressure_preempts_and_all_finish():
    e = Engine(EngineConfig(num_gpu_blocks_override=600, max_model_len=8192, max_num_batched_tokens=8192))
    reqs = [
        e.add_request(
            f"r{i}", max_tokens=400, prompt_len=2000, block_hashes=[i * 1000 + j for j in range(125)]
        )
        for i in range(8)
    ]
    run(e)
    assert e.num_preemptions > 0
    assert all(r.num_output == 400 for r in reqs)
    e.pool.check_invariants()  # the pool's internals, on purpose
    assert e.kv_usage == 0.0 and e.active_blocks == 0


def test_cpu_offload_restores_hits_at_a_transfer_cost():
    def trial(offload: float):
        e = Engine(EngineConfig(num_gpu_blocks_override=700, max_model_len=8192, kv_offloading_size=offload))
        first = e.add_request("s0", max_tokens=1, prompt_len=8000, block_hashes=list(range(500)))
        run(e)
        for i in range(1, 4):  # other sessions push s0's blocks out of HBM
            e.add_request(
                f"s{i}", max_tokens=1, prompt_len=8000, block_hashes=[i * 10_000 + j for j in range(500)]
            )
            run(e)
        again = e.add_request("s0b", max_tokens=1, prompt_len=8000, block_hashes=list(range(500)))
        run(e)
        return first, again, e

    _, again, e = trial(0.0)
    assert again.num_cached_tokens == 0 and again.num_lower_tokens == 0
    _, again_off, e_off = trial(64.0)
    assert again_off.lower_tier_tokens.get("CPU", 0) > 7000
    assert e_off.stats.promote_s > 0
    assert (again_off.first_token - again_off.arrival) < (again.first_token - again.arrival)


def test_engine_answers_what_routers_and_the_server_ask():
    e = Engine(EngineConfig(num_gpu_blocks_override=700, max_model_len=8192, kv_offloading_size=64.0))
    a = list(range(500))
    e.add_request("a", max_tokens=1, prompt_len=8000, block_hashes=a)
    run(e)
    assert e.cached_prefix(a + [-1]) == (500, 0) and set(e.cached_block_hashes()) == set(a)
    assert (e.num_cached_blocks, e.active_blocks, e.num_free_blocks) == (500, 0, 699)
    e.add_request("b", max_tokens=1, prompt_len=8000, block_hashes=[10_000 + j for j in range(500)])
    run(e)  # b takes the 199 empty blocks, then 301 of a's, tail first: they go down to CPU
    assert e.cached_prefix(a) == (199, 301)
    again = e.add_request("a2", max_tokens=1, prompt_len=8000, block_hashes=a)
    run(e)
    # the last prompt block is always recomputed (as vLLM): 300 of the 301 come from CPU
    assert again.num_cached_tokens == 199 * 16 and e.lower_tier_tokens == {"CPU": 300 * 16}
    assert e.num_preemptions == 0


def test_abort_frees_blocks():
    e = Engine(EngineConfig())
    e.add_request("x", max_tokens=1000, prompt_len=5000, block_hashes=list(range(312)))
    s = e.step()
    e.clock.advance_to(s.end)
    assert e.kv_usage > 0 and e.active_blocks > 0
    assert e.abort("x")
    assert e.kv_usage == 0.0 and e.active_blocks == 0 and not e.has_work()
    assert not e.abort("x")


def test_bad_config_and_requests():
    with pytest.raises(UserError, match="--block-size"):
        EngineConfig(block_size=17)
    with pytest.raises(UserError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    for bad in (-1.0, float("nan"), float("inf")):  # inf used to crash sizing the tier, nan meant none
        with pytest.raises(UserError, match="--kv-offloading-size"):
            EngineConfig(kv_offloading_size=bad)
        with pytest.raises(UserError, match="--disk-offload"):
            EngineConfig(kv_disk_size=bad)
    e = Engine(EngineConfig(max_model_len=4096))
    with pytest.raises(ValueError, match="max_model_len"):
        e.add_request("big", max_tokens=10, prompt_len=5000)
    with pytest.raises(UserError, match="KV cache holds"):
        Engine(EngineConfig(num_gpu_blocks_override=10))


def test_deterministic():
    def once():
        e = Engine(EngineConfig(num_gpu_blocks_override=900, max_model_len=8192))
        for i in range(6):
            e.add_request(
                f"r{i}",
                max_tokens=50 + i,
                prompt_len=3000 + 100 * i,
                block_hashes=[j + (i % 2) * 7 for j in range(180)],
            )
        return [(s.start, s.end, s.num_prefill_tokens) for s in run(e)]

    assert once() == once()


def test_block_stored_events_carry_token_ids():
    events = []
    e = Engine(EngineConfig(block_size=16), on_event=events.append)
    ids = list(range(100, 150))
    e.add_request("t", max_tokens=1, token_ids=ids)
    run(e)
    stored = [ev for ev in events if type(ev).__name__ == "BlockStored"]
    assert stored and [t for ev in stored for t in ev.token_ids] == ids[:48]


def test_prefix_cache_counters_count_each_request_once_as_vllm():
    """vLLM counts a request's queries and hits once, at admission (re-admissions apart): four
    1,000-token prompts preempted over and over on 200 blocks move the counters by their prompts once."""
    e = Engine(EngineConfig(num_gpu_blocks_override=200, max_model_len=2560, max_num_batched_tokens=2048))
    shared = list(range(1, 513))  # 32 blocks, cached by a first request
    e.add_request("warm", max_tokens=1, token_ids=shared)
    run(e)
    reqs = [
        e.add_request(
            f"r{i}", max_tokens=1500, token_ids=shared + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 488))
        )
        for i in range(4)
    ]
    run(e)
    assert e.num_preemptions >= 4 and sum(r.num_preemptions > 0 for r in reqs) >= 2
    assert e.prefix_cache_queries == 512 + 4 * 1000
    assert e.prefix_cache_hits == 4 * 512
    # usage's cached_tokens: what the first admission found, as vLLM's prefill stats (set only before
    # any preemption), although a re-admission finds the request's own blocks too
    assert [r.num_cached_tokens for r in reqs] == [512] * 4
    st = e.pool.stats
    assert st.requests == 5 and st.preempted_requests == e.num_preemptions
    assert st.preempted_hits > 0


def test_prefix_cache_hits_are_counted_at_admission_not_at_the_first_try():
    """A request that waits for room while its cached prefix is evicted is counted with the hits it
    had when admitted (none), as vLLM ("Record at admission so unscheduled lookups are not counted")."""
    e = Engine(EngineConfig(num_gpu_blocks_override=101, max_model_len=1600, max_num_batched_tokens=1600))
    prefix = list(range(1, 161))  # 10 blocks, cached and free once this request ends
    e.add_request("p", max_tokens=1, token_ids=prefix)
    run(e)
    e.add_request("a", max_tokens=150, token_ids=list(range(5000, 5000 + 1440)))  # the 90 empty blocks
    s = e.step()
    e.clock.advance_to(s.end)
    b = e.add_request("b", max_tokens=1, token_ids=prefix + list(range(9000, 9200)))
    s = e.step()  # b finds the prefix but there is no room; a's decoding then evicts the prefix
    e.clock.advance_to(s.end)
    assert b.first_scheduled is None and b.computed.num_blocks >= 8  # most of the prefix, then
    run(e)
    assert b.num_cached_tokens == 0
    assert e.prefix_cache_queries == 160 + 1440 + 360 and e.prefix_cache_hits == 0
