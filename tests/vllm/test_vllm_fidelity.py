"""Fidelity: `agentkv simulate` with vLLM's block count and block size predicts vLLM's cache-hit rate.

The same trimmed trace (two agents taking turns, one request at a time) goes through a live vLLM
whose cache is forced small (`--num-gpu-blocks-override 320`, so it evicts) and through the
simulator configured alike. The hit rates must be equal: the simulator keeps
vLLM's *null block* too (its BlockPool takes one block out of the free queue at start-up and never
hands it to a request, so 320 blocks leave 319 usable). Without it the simulator ran 0.14 points
high on this trace.
"""

from __future__ import annotations

import pytest
from vllm_runs import live_and_simulated
from vllm_server import EVICT_BLOCKS

pytestmark = pytest.mark.vllm


def test_simulator_hit_rate_matches_live_vllm(evict_server, trimmed_trace, tmp_path, figures):
    cfg = evict_server.cache_config()
    assert (cfg["num_gpu_blocks"], cfg["block_size"]) == (str(EVICT_BLOCKS), "32")
    live, sim = live_and_simulated(evict_server, trimmed_trace, tmp_path / "bench")
    n = len(live.records)
    sim_rate, live_rate = sim["cache"]["reported"], live.hit_rate
    ceiling = live.summary["cache"]["ceiling"]
    assert ceiling - live_rate > 0.02, "the forced-small cache should evict: no eviction, no fidelity test"
    assert sim_rate == live_rate, (sim_rate, live_rate)

    figures["fidelity (evicting)"] = (
        f"{n} requests, {EVICT_BLOCKS} blocks of 32 (one of them vLLM's null block): live vLLM hit rate "
        f"{live_rate:.4%}, agentkv simulate {sim_rate:.4%} (diff {100 * (sim_rate - live_rate):+.2f} pt); "
        f"unbounded ceiling {ceiling:.2%}"
    )
