"""The router's own Prometheus metrics: requests, retries, auth failures, and per worker its mode,
health, load, indexed blocks and event-stream health (`agentkv_router_*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.route.proxy import Router


@dataclass(slots=True)
class RouterStats:
    """Counters the proxy bumps as it routes."""

    requests: int = 0
    failed: int = 0
    retries: int = 0
    unauthorized: int = 0
    throttled: int = 0  # 429: a tenant over its concurrent-request limit
    broken_streams: int = 0
    exact: int = 0  # requests hashed exactly (token ids or a matching tokenizer)
    prompt_blocks: int = 0
    predicted_hit_blocks: int = 0  # blocks the index said the chosen worker caches
    route_seconds: float = 0.0


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(router: Router) -> str:
    """Prometheus text exposition of the router's counters and per-worker gauges."""
    st = router.stats
    out = [
        "# HELP agentkv_router_requests_total Generation requests accepted (authenticated, valid JSON).",
        "# TYPE agentkv_router_requests_total counter",
        f"agentkv_router_requests_total {st.requests}",
        "# TYPE agentkv_router_failed_total counter",
        f"agentkv_router_failed_total {st.failed}",
        "# HELP agentkv_router_retries_total Requests re-sent to another worker after failing before their first byte.",
        "# TYPE agentkv_router_retries_total counter",
        f"agentkv_router_retries_total {st.retries}",
        "# TYPE agentkv_router_unauthorized_total counter",
        f"agentkv_router_unauthorized_total {st.unauthorized}",
        "# HELP agentkv_router_throttled_total Requests refused with 429: their tenant was at its concurrency limit.",
        "# TYPE agentkv_router_throttled_total counter",
        f"agentkv_router_throttled_total {st.throttled}",
        "# HELP agentkv_router_index_overflow_blocks_total Stored blocks not indexed: the worker was at --max-index-blocks.",
        "# TYPE agentkv_router_index_overflow_blocks_total counter",
        f"agentkv_router_index_overflow_blocks_total {router.index.overflow}",
        "# TYPE agentkv_router_broken_streams_total counter",
        f"agentkv_router_broken_streams_total {st.broken_streams}",
        "# HELP agentkv_router_exact_hash_requests_total Requests hashed exactly as the engine does.",
        "# TYPE agentkv_router_exact_hash_requests_total counter",
        f"agentkv_router_exact_hash_requests_total {st.exact}",
        "# TYPE agentkv_router_prompt_blocks_total counter",
        f"agentkv_router_prompt_blocks_total {st.prompt_blocks}",
        "# HELP agentkv_router_predicted_hit_blocks_total Prompt blocks the index placed on the chosen worker.",
        "# TYPE agentkv_router_predicted_hit_blocks_total counter",
        f"agentkv_router_predicted_hit_blocks_total {st.predicted_hit_blocks}",
        "# TYPE agentkv_router_route_seconds_total counter",
        f"agentkv_router_route_seconds_total {st.route_seconds:.6f}",
    ]
    per = [
        ("worker_up", "gauge", "1 while the worker is in rotation.", lambda w: int(w.healthy)),
        ("worker_requests_total", "counter", "Requests sent to the worker.", lambda w: w.requests),
        (
            "worker_failures_total",
            "counter",
            "Requests that failed there before their first byte.",
            lambda w: w.failures,
        ),
        (
            "worker_first_byte_timeouts_total",
            "counter",
            "Requests retried elsewhere after --first-byte-timeout.",
            lambda w: w.first_byte_timeouts,
        ),
        ("worker_in_flight", "gauge", "Requests in flight (router accounting).", lambda w: w.in_flight),
        (
            "worker_in_flight_tokens",
            "gauge",
            "Prompt + max output tokens of requests streaming (the kv_aware load term).",
            lambda w: w.in_flight_tokens,
        ),
        (
            "worker_scraped_active",
            "gauge",
            "Running + waiting from the worker's /metrics.",
            lambda w: w.scraped_active,
        ),
        (
            "worker_indexed_blocks",
            "gauge",
            "Blocks the router believes the worker caches.",
            lambda w: router.index.blocks(w.slot) if w.mode == "event" else router.approx.blocks(w.slot),
        ),
        ("worker_events_total", "counter", "KV events applied.", lambda w: w.events_applied),
        (
            "worker_event_resyncs_total",
            "counter",
            "Sequence gaps and publisher restarts handled.",
            lambda w: w.resyncs,
        ),
    ]
    for name, kind, doc, get in per:
        out.append(f"# HELP agentkv_router_{name} {doc}")
        out.append(f"# TYPE agentkv_router_{name} {kind}")
        for w in router.pool.workers:
            out.append(f'agentkv_router_{name}{{worker="{w.slot}",url="{_esc(w.spec.url)}"}} {get(w)}')
    out.append(
        "# HELP agentkv_router_worker_mode How the router knows the worker's cache: event or approximate."
    )
    out.append("# TYPE agentkv_router_worker_mode gauge")
    for w in router.pool.workers:
        out.append(
            f'agentkv_router_worker_mode{{worker="{w.slot}",url="{_esc(w.spec.url)}",mode="{w.mode}"}} 1'
        )
    for w in router.pool.workers:
        sub = w.subscriber
        if sub is not None:
            s = sub.stats
            lbl = f'worker="{w.slot}"'
            out.append(f"agentkv_router_worker_event_malformed_total{{{lbl}}} {s.malformed}")
            out.append(f"agentkv_router_worker_event_lost_total{{{lbl}}} {s.lost}")
    return "\n".join(out) + "\n"
