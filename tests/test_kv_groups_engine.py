"""The engine on hybrid models: a multi-turn session hits its previous turn in every group, window
blocks are released while it decodes (step by step and in decode bursts), a state model cuts
prefill chunks on block boundaries, and the published events name their group."""

from __future__ import annotations

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine


def run(engine: Engine, burst: bool) -> None:
    while engine.has_work():
        b = engine.plan_burst() if burst else None
        if b is not None:
            engine.commit_burst(b, len(b.ends))
        elif engine.step() is None:
            break
        engine.pool.check_invariants()


def session(engine: Engine, turns: int, prompt0: int, grow: int, out: int, burst: bool) -> list[int]:
    """Turn k's prompt extends turn k-1's prompt and output; returns each turn's cached tokens."""
    toks, cached = list(range(1, prompt0 + 1)), []
    for k in range(turns):
        req = engine.add_request(f"t{k}", max_tokens=out, token_ids=toks, session_id="s")
        run(engine, burst)
        cached.append(req.num_cached_tokens)
        toks = toks + [50_000 + k * 1000 + i for i in range(out + grow)]
    return cached


@pytest.mark.parametrize("burst", [False, True])
def test_gpt_oss_session_hits_every_turn_and_frees_its_window(burst):
    e = Engine(EngineConfig(model="gpt-oss-120b", max_model_len=65536, num_gpu_blocks_override=4000))
    cached = session(e, 3, 3000, 500, 200, burst)
    assert cached[0] == 0
    # each turn reuses the previous prompt's full blocks (its output was never hashed)
    assert cached[1] == 3000 // 16 * 16 and cached[2] == (3000 + 700) // 16 * 16
    full, window = e.pool.cached_maps
    assert len(full) == (3000 + 700 + 700) // 16
    assert e.pool.stats.hits == cached[1] + cached[2]


def test_window_blocks_go_back_to_the_pool_during_a_long_decode():
    e = Engine(EngineConfig(model="gpt-oss-120b", max_model_len=65536, num_gpu_blocks_override=4000))
    e.add_request("r", max_tokens=4000, prompt_len=64, block_hashes=[1, 2, 3, 4])
    for _ in range(200):
        e.step()
    full, window = e.pool.tables["r"]
    assert len(full) == len(window) and sum(b >= 0 for b in window) <= 9  # 128 tokens + the open block
    e.pool.check_invariants()


def test_a_state_model_cuts_prefill_chunks_on_block_boundaries():
    cfg = EngineConfig(
        model="qwen3-next", tensor_parallel_size=2, max_model_len=65536, max_num_batched_tokens=1200
    )
    assert cfg.block_size == 544  # vLLM's page alignment for Qwen3-Next (tests/test_block_size.py)
    e = Engine(cfg)
    toks = list(range(1, 2501))
    req = e.add_request("a", max_tokens=2, token_ids=toks, session_id="s")
    seen = []
    while e.has_work():
        e.step()
        seen.append(req.num_computed)
    # chunks end at 1088 (1200 cut to blocks), 2176 (the prompt's last full block), then 2500
    assert seen[:3] == [1088, 2176, 2500]
    state = e.pool.cached_maps[1]
    assert len(state) == 1  # states saved at 2 and 4 blocks; only the replay boundary's (4) cached
    b = e.add_request("b", max_tokens=1, token_ids=toks + [9] * 100, session_id="s")
    while e.has_work():
        e.step()
    assert b.num_cached_tokens == 2176


def test_a_block_aligned_prompt_stops_its_chunk_a_block_short_of_its_end():
    """vLLM stops the last chunk at `(num_tokens - 1) // block` blocks: the state a resend of the same
    prompt resumes at (its last token is recomputed), so the resend hits all but the last block."""
    cfg = EngineConfig(model="qwen3-next", tensor_parallel_size=2, max_model_len=65536)
    e = Engine(cfg)
    toks = list(range(1, 3 * 544 + 1))  # three whole blocks
    req = e.add_request("a", max_tokens=2, token_ids=toks, session_id="s")
    seen = []
    while e.has_work():
        e.step()
        seen.append(req.num_computed)
    assert seen[:2] == [2 * 544, 3 * 544]
    again = e.add_request("b", max_tokens=1, token_ids=toks, session_id="s")
    while e.has_work():
        e.step()
    assert again.num_cached_tokens == 2 * 544


def test_events_name_the_group_and_its_kind():
    events = []
    e = Engine(EngineConfig(model="gemma-3-27b", max_model_len=32768), on_event=events.append)
    e.add_request("r", max_tokens=1, token_ids=list(range(1, 2001)))
    while e.has_work():
        e.step()
    kinds = {(ev.group_idx, ev.kv_cache_spec_kind) for ev in events}
    assert kinds == {(0, "full_attention"), (1, "sliding_window")}
    assert all(len(ev.token_ids) == 16 * len(ev.block_hashes) for ev in events)


def trace_of(model: str, quiet: bool, blocks: int = 1400) -> tuple[list[tuple], int]:
    """Each step's (prefill tokens, decodes, preempted) and each request's (cached tokens, first
    token, finish) for sessions sharing prefixes on a small pool; and allocate_slots' call count.
    `quiet=False` hides the pool's quiet ranges: every decode asks allocate_slots."""
    e = Engine(EngineConfig(model=model, max_model_len=8192, num_gpu_blocks_override=blocks))
    if not quiet:
        e.pool.quiet_ranges = lambda: None
    calls, alloc = [0], e.pool.allocate_slots

    def counted(*a, **k):
        calls[0] += 1
        return alloc(*a, **k)

    e.pool.allocate_slots = counted
    steps, reqs = [], []
    for i in range(12):  # three sessions share prefixes; varied output lengths cross block boundaries
        s = i % 3
        toks = [s * 100_000 + j for j in range(1, 2000 + 400 * s)] + [90_000 + i] * (40 + 7 * i)
        reqs.append(e.add_request(f"r{i}", max_tokens=200 + 61 * i, token_ids=toks, session_id=s))
    while e.has_work():
        r = e.step()
        if r is None:
            break
        steps.append((r.num_prefill_tokens, r.num_decode, r.preempted))
        if len(steps) % 8 == 0:
            e.pool.check_invariants()
    e.pool.check_invariants()
    steps += [(q.num_cached_tokens, q.first_token, q.finished_at, q.num_output) for q in reqs]
    return steps, calls[0]


@pytest.mark.parametrize("model,blocks", [("gpt-oss-120b", 1200), ("gemma-3-27b", 3620)])
def test_the_decode_loops_quiet_shortcut_schedules_as_allocate_slots_does(model, blocks):
    """The scheduler answers a quiet decode (no block freed, taken or cached) from the pool's quiet
    ranges without calling allocate_slots: the same steps, preemptions and requests either way."""
    with_shortcut, n_short = trace_of(model, True, blocks)
    without, n_all = trace_of(model, False, blocks)
    assert with_shortcut == without
    assert n_short < n_all / 2  # most decodes took the shortcut
    if model == "gpt-oss-120b":  # (the pool runs out: requests are preempted and come back)
        assert sum(step[2] for step in with_shortcut[:-12]) > 0


def test_a_pool_with_an_eviction_policy_hears_every_allocation():
    e = Engine(EngineConfig(model="gpt-oss-120b", max_model_len=65536, eviction_policy="lfu"))
    assert e.pool.quiet_ranges() is None
    assert Engine(EngineConfig(model="gpt-oss-120b", max_model_len=65536)).pool.quiet_ranges() == {}
