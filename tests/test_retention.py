"""vLLM 0.32's `--prefix-cache-retention-interval`: which window blocks and Mamba-style states a hybrid
pool caches (`group_rules.segment_tails`, `state_kept`), against vLLM's mask written out block by
block, and the flag's checks. Live vLLM agrees on a Gemma 3 and a Qwen3-Next (tests/vllm)."""

from __future__ import annotations

import re

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.errors import UserError
from agentkv.kv import group_rules as R
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.interface import PoolRequest


def _vllm_window_mask(start: int, end: int, window: int, bs: int, interval: int) -> set[int]:
    """`SlidingWindowManager.reachable_block_mask`'s segment part (no EAGLE), block by block."""
    need, per = -(-(window - 1) // bs), interval // bs
    if need >= per:
        return set(range(start, end))
    return {i for i in range(start, end) if i % per >= per - need}


@pytest.mark.parametrize(
    ("window", "bs", "interval"),
    [(512, 32, 1024), (128, 16, 4096), (100, 16, 64), (8, 256, 512), (512, 32, 512)],
)
def test_segment_tails_are_vllms_mask(window, bs, interval):
    for lo, hi in ((0, 200), (5, 6), (31, 97), (64, 64), (3, 1000)):
        got = {b for a, e in R.segment_tails(window, bs, interval, lo, hi) for b in range(a, e)}
        assert got == _vllm_window_mask(lo, hi, window, bs, interval), (lo, hi)


def test_a_state_is_kept_at_each_segments_end_with_an_interval():
    # a 41-token prompt in 4-token blocks (replay boundary at 10 blocks); 8-token segments: every 2nd block
    assert [k for k in range(1, 12) if R.state_kept(k, 41, 4, 0, 8)] == [2, 4, 6, 8, 10]
    assert [k for k in range(1, 12) if R.state_kept(k, 41, 4, 3, 0)] == [3, 10]  # the junction, the boundary
    assert all(R.state_kept(k, 41, 4, 0, 4) for k in range(1, 9))  # a segment of one block: every state


def test_the_pool_caches_a_window_tail_at_each_segment():
    """Window 8 tokens in 4-token blocks (2 blocks a hit needs), 16-token segments: blocks 2-3, 6-7
    and the replay boundary's window (blocks 7-8 of a 37-token prompt) are cached, no others."""
    specs = [GroupSpec("full", 10), GroupSpec("sliding", 10, 8)]
    for interval, want in ((0, {7, 8}), (16, {2, 3, 6, 7, 8})):
        pool = HybridPool(specs, 10_000, 4, retention_interval=interval)
        r = PoolRequest("r", list(range(100, 109)), prompt_len=37)  # 9 full blocks
        assert pool.allocate_slots(r, 37)
        assert {h - 100 for h in pool.cached_maps[1]} == want, interval
        pool.check_invariants()


def test_the_flag_reaches_the_engine():
    e = Engine(EngineConfig(model="gemma-3-27b", max_model_len=32768, prefix_cache_retention_interval=1024))
    assert e.pool.retention_interval == 1024
    assert Engine(EngineConfig(model="gemma-3-27b", max_model_len=32768)).pool.retention_interval == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"model": "gemma-3-27b", "prefix_cache_retention_interval": -16}, "-16 must be non-negative"),
        (
            {"model": "gemma-3-27b", "prefix_cache_retention_interval": 1000},
            "a multiple of the block size (16)",
        ),
    ],
)
def test_a_bad_interval_is_refused(kw, message):
    with pytest.raises(UserError, match=re.escape(message)):
        EngineConfig(**kw)


def test_a_model_without_a_window_or_state_refuses_an_interval(capsys):
    with pytest.raises(UserError, match="has no sliding-window or Mamba KV cache group"):
        Engine(EngineConfig(model="llama3-8b", prefix_cache_retention_interval=1024))
    Engine(EngineConfig(model="llama3-8b", prefix_cache_retention_interval=0))  # 0: vLLM's default, fine
    rc = main(["simulate", "--model", "llama3-8b", "--prefix-cache-retention-interval", "1024", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "--prefix-cache-retention-interval 1024: Llama-3.1-8B has no sliding-window" in err
