"""benchmarks/simulate.py's block-work line: the KV blocks a run's pools allocated and evicted per
simulated request, which tells simulated churn (a pool too small for its sessions) from pool cost."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.sim.cluster import SimConfig, make_cluster
from agentkv.trace.synth import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulate import block_work  # noqa: E402


def _run(blocks: int, model: str = "Llama-3.1-8B"):
    eng = EngineConfig(model=model, num_gpu_blocks_override=blocks, max_model_len=200_000)
    cluster = make_cluster(
        synthesize(6, seed=3), SimConfig(engine=eng, workers=2, lanes=6, router="round_robin")
    )
    res = cluster.run()
    return cluster, len(res.records)


def _figures(line: str) -> tuple[float, float, float]:
    m = re.fullmatch(
        r"blocks per request: ([\d,]+) allocated, ([\d,]+) evicted; ([\d.]+) us CPU per allocated block", line
    )
    assert m, line
    return tuple(float(x.replace(",", "")) for x in m.groups())


def test_block_work_sums_every_replica_pool_and_shows_a_small_pool_churning():
    big, n_big = _run(60_000)
    small, n_small = _run(20_000)
    assert n_big == n_small > 0
    alloc = sum(w.engine.pool.stats.allocated for w in small.workers)
    evicted = sum(w.engine.pool.stats.evicted for w in small.workers)
    a, e, us = _figures(block_work(small, n_small, 2.0))
    assert round(a) == round(alloc / n_small) and round(e) == round(evicted / n_small)
    assert us == round(2.0 / alloc * 1e6, 2)
    a_big, e_big, _ = _figures(block_work(big, n_big, 2.0))
    assert e_big < e  # the same traces evict more, and recompute more, in a pool too small for them
    assert a_big <= a


def test_block_work_reads_a_hybrid_pool_per_group_blocks():
    cluster, n = _run(8_000, model="gpt-oss-120b")  # full attention and a sliding window: two groups
    assert cluster.workers[0].engine.hybrid
    a, e, _ = _figures(block_work(cluster, n, 1.0))
    alloc = sum(w.engine.pool.stats.allocated for w in cluster.workers)
    assert a == round(alloc / n) > 0 and e >= 0
