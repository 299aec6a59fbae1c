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
