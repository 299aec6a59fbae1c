"""`agentkv bench --target` against a live vLLM: a trimmed real trace, every hit accounted for three ways.

On a cache too big to evict, each request's `usage.prompt_tokens_details.cached_tokens`, the
`vllm:prefix_cache_hits_total` delta and the replay's theoretical hits (an unbounded prefix cache
over the trace's hash ids) must agree: the counters exactly with the usage, the usage within one
block of the theory per request (vLLM caches only full blocks and recomputes the last prompt token).
"""

from __future__ import annotations

import pytest
from vllm_runs import bench
from vllm_server import BLOCK_SIZE

from agentkv.trace.formats import load_paths

pytestmark = pytest.mark.vllm


def test_bench_hits_match_usage_metrics_and_theory(main_server, trimmed_trace, tmp_path, figures):
    (trace,) = load_paths([trimmed_trace])
    cfg = main_server.cache_config()
    assert (cfg["block_size"], cfg["enable_prefix_caching"], cfg["prefix_caching_hash_algo"]) == (
        str(BLOCK_SIZE),
        "True",
        "sha256",
    )
    run = bench(main_server, trimmed_trace, tmp_path / "bench")
    recs = run.records
    assert len(recs) == trace.num_requests == 57
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    assert all(r.output_tokens == r.expected_output_tokens for r in recs)
    assert all(r.cached_tokens is not None for r in recs), "usage.prompt_tokens_details missing"

    # the server's counters and the per-request usage are the same numbers
    assert run.queries_delta == run.prompt_tokens
    assert run.hits_delta == run.cached_tokens
    cache = run.summary["cache"]
    assert abs(cache["metrics"] - cache["reported"]) < 1e-9

    # each request within one block of the theoretical hits; in total, below them by under a block each
    for r in recs:
        assert abs(r.ceiling_tokens - r.cached_tokens) <= BLOCK_SIZE, r
        assert r.cached_tokens % BLOCK_SIZE == 0
    ceiling = sum(r.ceiling_tokens for r in recs)
    assert 0 <= ceiling - run.cached_tokens <= BLOCK_SIZE * len(recs)
    assert run.hit_rate > 0.85  # the trace's sessions reuse their prefix turn after turn

    figures["bench (no eviction)"] = (
        f"{int(cfg['num_gpu_blocks']):,} blocks, {len(recs)} requests, {run.prompt_tokens:,} prompt tokens; cached (usage) {run.cached_tokens:,} = "
        f"prefix_cache_hits delta {run.hits_delta:,.0f}; theoretical {ceiling:,} "
        f"(hit rate {run.hit_rate:.2%} vs {ceiling / run.prompt_tokens:.2%}); "
        f"TTFT p50 {run.summary['ttft']['p50'] * 1000:.0f} ms"
    )
