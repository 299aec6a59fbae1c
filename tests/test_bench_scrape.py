"""The bench's view of /metrics: vLLM's names (and the older and SGLang ones), hit rate from counter
deltas, and its GPU monitor (the shared parser itself is tested in test_metrics_scrape.py)."""

from __future__ import annotations

import asyncio

import aiohttp
from test_metrics_scrape import VLLM_PAGE, MetricsServer

from agentkv.bench.gpu import GpuMonitor, is_local
from agentkv.bench.scrape import MetricsSnapshot, Scraper, hit_rate
from agentkv.metrics.scrape import parse_prometheus, snapshot

VLLM = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="sha256"} 1.0
http_requests_total{handler="/v1/completions",method="POST"} NaN
garbage line
"""


def test_parse_and_snapshot():
    m = parse_prometheus(VLLM)
    assert m["vllm:prefix_cache_queries_total"] == [1000.0, 500.0]
    assert "http_requests_total" not in m  # NaN dropped
    s = snapshot(VLLM)
    assert s == MetricsSnapshot(
        prefix_queries=1500.0, prefix_hits=750.0, kv_usage=0.375, running=3.0, waiting=1.0
    )


def test_older_and_sglang_names():
    old = "vllm:gpu_prefix_cache_queries_total 10\nvllm:gpu_prefix_cache_hits_total 4\nvllm:gpu_cache_usage_perc 0.1\n"
    assert snapshot(old) == MetricsSnapshot(prefix_queries=10.0, prefix_hits=4.0, kv_usage=0.1)
    sg = 'sglang:token_usage{tp_rank="0"} 0.2\nsglang:num_running_reqs 5\nsglang:num_queue_reqs 7\n'
    assert snapshot(sg) == MetricsSnapshot(kv_usage=0.2, running=5.0, waiting=7.0)


def test_hit_rate_from_deltas():
    a = MetricsSnapshot(prefix_queries=100.0, prefix_hits=10.0)
    b = MetricsSnapshot(prefix_queries=300.0, prefix_hits=160.0)
    assert hit_rate(a, b) == 0.75
    assert hit_rate(a, a) is None  # no queries in between
    assert hit_rate(None, b) is None
    assert hit_rate(MetricsSnapshot(kv_usage=0.1), b) is None


def test_gpu_monitor_is_absent_for_remote_targets():
    assert is_local("http://127.0.0.1:8000") and is_local("http://localhost:1")
    assert not is_local("http://192.0.2.10:8000")  # TEST-NET-1: never this host
    g = GpuMonitor("http://192.0.2.10:8000")
    assert not g.active and g.absent_reason == "the target is not on this host"
    assert g.summary() is None
    local = GpuMonitor("http://127.0.0.1:8000")
    if not local.active:  # no NVML here: the reason says why
        assert local.absent_reason
    local.sample()
    local.close()


def test_scraper_says_why_metrics_are_absent():
    async def main() -> None:
        srv = MetricsServer()
        await srv.start()
        try:
            async with aiohttp.ClientSession() as session:
                scraper = Scraper(session, srv.url)
                srv.body = VLLM_PAGE.encode()
                snap = await scraper.scrape()
                assert snap is not None and snap.running == 2.0 and scraper.absent_reason is None
                srv.body = b"\xff\xfe not text \x80"
                assert await scraper.scrape() is None and "does not decode" in scraper.absent_reason
                srv.body = b"garbage line\nhttp_requests_total 3\n"
                assert await scraper.scrape() is None and "none of vLLM's" in scraper.absent_reason
                srv.status = 404
                assert (
                    await scraper.scrape() is None
                    and scraper.absent_reason == "GET /metrics answered HTTP 404"
                )
        finally:
            await srv.runner.cleanup()

    asyncio.run(main())


def test_agentkv_catchup_counter_becomes_a_note():
    from agentkv.bench.clocks import catchup_note

    page = 'agentkv:engine_catchup_seconds_total{engine="0",model_name="m"} 1.5\n'
    before, after = snapshot(page), snapshot(page.replace("1.5", "4.0"))
    assert before.catchup_s == 1.5 and snapshot(VLLM).catchup_s is None
    assert "skipped 2.500 engine seconds" in catchup_note(before, after)
    assert catchup_note(before, before) is None and catchup_note(snapshot(VLLM), after) is None
