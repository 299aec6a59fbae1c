"""The router's /metrics exposition: the same names, types, labels, HELP texts and values as the
hand-written text it replaced (captured from it below), rendered through prometheus_client.

Compared as parsed samples, not bytes: prometheus_client writes 41 as `41.0`, sorts each sample's
labels (`url` before `worker`) and groups a family's samples together."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored
from agentkv.route.metrics import render_metrics
from agentkv.route.proxy import Router, RouterConfig
from agentkv.route.workers import WorkerSpec

# render_metrics' output for populated_router() before it moved to prometheus_client (commit 05e460a),
# plus agentkv_router_client_disconnects_total and _event_thread_restarts_total (added since: existing
# names are unchanged)
CAPTURED = r"""
# HELP agentkv_router_requests_total Generation requests accepted (authenticated, valid JSON).
# TYPE agentkv_router_requests_total counter
agentkv_router_requests_total 41
# TYPE agentkv_router_failed_total counter
agentkv_router_failed_total 2
# HELP agentkv_router_retries_total Requests re-sent to another worker after failing before their first byte.
# TYPE agentkv_router_retries_total counter
agentkv_router_retries_total 3
# TYPE agentkv_router_unauthorized_total counter
agentkv_router_unauthorized_total 5
# HELP agentkv_router_throttled_total Requests refused with 429: their tenant was at its concurrency limit.
# TYPE agentkv_router_throttled_total counter
agentkv_router_throttled_total 1
# HELP agentkv_router_index_overflow_blocks_total Stored blocks not indexed: the worker was at --max-index-blocks.
# TYPE agentkv_router_index_overflow_blocks_total counter
agentkv_router_index_overflow_blocks_total 7
# TYPE agentkv_router_broken_streams_total counter
agentkv_router_broken_streams_total 4
# HELP agentkv_router_event_thread_restarts_total Times the KV-event thread's loop failed (logged) and started over.
# TYPE agentkv_router_event_thread_restarts_total counter
agentkv_router_event_thread_restarts_total 0
# HELP agentkv_router_client_disconnects_total Clients that left before their response ended (the worker's request is aborted).
# TYPE agentkv_router_client_disconnects_total counter
agentkv_router_client_disconnects_total 6
# HELP agentkv_router_exact_hash_requests_total Requests hashed exactly as the engine does.
# TYPE agentkv_router_exact_hash_requests_total counter
agentkv_router_exact_hash_requests_total 40
# TYPE agentkv_router_prompt_blocks_total counter
agentkv_router_prompt_blocks_total 900
# HELP agentkv_router_predicted_hit_blocks_total Prompt blocks the index placed on the chosen worker.
# TYPE agentkv_router_predicted_hit_blocks_total counter
agentkv_router_predicted_hit_blocks_total 612
# TYPE agentkv_router_route_seconds_total counter
agentkv_router_route_seconds_total 0.123457
# HELP agentkv_router_worker_up 1 while the worker is in rotation.
# TYPE agentkv_router_worker_up gauge
agentkv_router_worker_up{worker="0",url="http://127.0.0.1:9"} 1
agentkv_router_worker_up{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_requests_total Requests sent to the worker.
# TYPE agentkv_router_worker_requests_total counter
agentkv_router_worker_requests_total{worker="0",url="http://127.0.0.1:9"} 30
agentkv_router_worker_requests_total{worker="1",url="http://h:2/a\"b\\c\nd"} 11
# HELP agentkv_router_worker_failures_total Requests that failed there before their first byte.
# TYPE agentkv_router_worker_failures_total counter
agentkv_router_worker_failures_total{worker="0",url="http://127.0.0.1:9"} 1
agentkv_router_worker_failures_total{worker="1",url="http://h:2/a\"b\\c\nd"} 1
# HELP agentkv_router_worker_first_byte_timeouts_total Requests retried elsewhere after --first-byte-timeout.
# TYPE agentkv_router_worker_first_byte_timeouts_total counter
agentkv_router_worker_first_byte_timeouts_total{worker="0",url="http://127.0.0.1:9"} 2
agentkv_router_worker_first_byte_timeouts_total{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_in_flight Requests in flight (router accounting).
# TYPE agentkv_router_worker_in_flight gauge
agentkv_router_worker_in_flight{worker="0",url="http://127.0.0.1:9"} 3
agentkv_router_worker_in_flight{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_in_flight_tokens Prompt + max output tokens of requests streaming (the kv_aware load term).
# TYPE agentkv_router_worker_in_flight_tokens gauge
agentkv_router_worker_in_flight_tokens{worker="0",url="http://127.0.0.1:9"} 4096
agentkv_router_worker_in_flight_tokens{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_scraped_active Running + waiting from the worker's /metrics.
# TYPE agentkv_router_worker_scraped_active gauge
agentkv_router_worker_scraped_active{worker="0",url="http://127.0.0.1:9"} 5
agentkv_router_worker_scraped_active{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_indexed_blocks Blocks the router believes the worker caches.
# TYPE agentkv_router_worker_indexed_blocks gauge
agentkv_router_worker_indexed_blocks{worker="0",url="http://127.0.0.1:9"} 3
agentkv_router_worker_indexed_blocks{worker="1",url="http://h:2/a\"b\\c\nd"} 2
# HELP agentkv_router_worker_events_total KV events applied.
# TYPE agentkv_router_worker_events_total counter
agentkv_router_worker_events_total{worker="0",url="http://127.0.0.1:9"} 9
agentkv_router_worker_events_total{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_event_resyncs_total Sequence gaps and publisher restarts handled.
# TYPE agentkv_router_worker_event_resyncs_total counter
agentkv_router_worker_event_resyncs_total{worker="0",url="http://127.0.0.1:9"} 1
agentkv_router_worker_event_resyncs_total{worker="1",url="http://h:2/a\"b\\c\nd"} 0
# HELP agentkv_router_worker_mode How the router knows the worker's cache: event or approximate.
# TYPE agentkv_router_worker_mode gauge
agentkv_router_worker_mode{worker="0",url="http://127.0.0.1:9",mode="event"} 1
agentkv_router_worker_mode{worker="1",url="http://h:2/a\"b\\c\nd",mode="approximate"} 1
agentkv_router_worker_event_malformed_total{worker="0"} 6
agentkv_router_worker_event_lost_total{worker="0"} 8
"""[1:]

# families added after the capture
ADDED = r"""
# HELP agentkv_router_worker_event_handshake_failures_total Event connections refused in the ZMQ handshake: a publisher without the worker's pinned CURVE key, or CURVE on one side only.
# TYPE agentkv_router_worker_event_handshake_failures_total counter
agentkv_router_worker_event_handshake_failures_total{worker="0"} 2
# HELP agentkv_router_index_skipped_group_blocks_total Blocks a hybrid model's window or state groups stored or removed: kept apart from the full-attention index, they cut a predicted hit to what their rules serve.
# TYPE agentkv_router_index_skipped_group_blocks_total counter
agentkv_router_index_skipped_group_blocks_total 2
"""[1:]


def populated_router() -> Router:
    """Two workers (one in event mode with a live subscriber, one approximate and down), every
    counter non-zero somewhere, and a URL that needs escaping."""
    odd_url = 'http://h:2/a"b\\c\nd'
    r = Router(
        RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9", "tcp://127.0.0.1:9"), WorkerSpec(odd_url)])
    )
    st = r.stats
    st.requests, st.failed, st.retries, st.unauthorized, st.throttled = 41, 2, 3, 5, 1
    st.broken_streams, st.exact, st.prompt_blocks, st.predicted_hit_blocks = 4, 40, 900, 612
    st.route_seconds = 0.123456789
    st.client_disconnects = 6
    r.index.overflow = 7
    r.index.apply(0, BlockStored(block_hashes=[11, 12, 13]))
    r.index.apply(0, BlockStored(block_hashes=[11, 12], group_idx=1, kv_cache_spec_kind="sliding_window"))
    r.approx.record(1, "default", [21, 22])
    w0, w1 = r.pool.workers
    w1.healthy = False
    w0.requests, w0.failures, w0.first_byte_timeouts = 30, 1, 2
    w0.in_flight, w0.in_flight_tokens, w0.scraped_active = 3, 4096, 5
    w1.requests, w1.failures = 11, 1
    w0.events_applied, w0.resyncs = 9, 1
    w0.subscriber = ZmqEventSubscriber("tcp://127.0.0.1:9")
    w0.subscriber.stats.malformed, w0.subscriber.stats.lost = 6, 8
    w0.subscriber.stats.handshake_failures = 2
    return r


def families(text: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, tuple, float]]]:
    """Family name -> (type, HELP), and every sample as (name, sorted labels, value), sorted."""
    fams: dict[str, tuple[str, str]] = {}
    samples = []
    for f in text_string_to_metric_families(text):
        assert fams.setdefault(f.name, (f.type, f.documentation)) == (f.type, f.documentation)
        samples += [(s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples]
    return fams, sorted(samples)


def test_exposition_matches_the_captured_text():
    r = populated_router()
    try:
        text = render_metrics(r)
    finally:
        r.pool.workers[0].subscriber.close()
    assert families(text) == families(CAPTURED + ADDED)
    assert "_created" not in text
    assert 'url="http://h:2/a\\"b\\\\c\\nd"' in text  # escaped as before


def test_no_subscriber_no_event_stream_series():
    r = Router(RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9")]))
    text = render_metrics(r)
    assert "event_malformed" not in text and "event_lost" not in text
    fams, samples = families(text)
    assert (
        "agentkv_router_worker_mode",
        (("mode", "approximate"), ("url", "http://127.0.0.1:9"), ("worker", "0")),
        1.0,
    ) in samples
