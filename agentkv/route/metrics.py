"""The router's own Prometheus metrics: requests, retries, auth failures, and per worker its mode,
health, load, indexed blocks and event-stream health (`agentkv_router_*`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from agentkv.route.proxy import Router
    from agentkv.route.workers import Worker


@dataclass(slots=True)
class RouterStats:
    """Counters the proxy bumps as it routes."""

    requests: int = 0
    failed: int = 0
    retries: int = 0
    unauthorized: int = 0
    throttled: int = 0  # 429: a tenant over its concurrent-request limit
    broken_streams: int = 0  # a worker cut a response after its first byte
    client_disconnects: int = 0  # a client left before its response ended (not a worker fault)
    exact: int = 0  # requests hashed exactly (token ids or a matching tokenizer)
    prompt_blocks: int = 0
    predicted_hit_blocks: int = 0  # blocks the index said the chosen worker caches
    route_seconds: float = 0.0


# the router's counters: name, HELP ("" where it never had one), value
_TOTALS: tuple[tuple[str, str, Callable[[Router], float]], ...] = (
    ("requests", "Generation requests accepted (authenticated, valid JSON).", lambda r: r.stats.requests),
    ("failed", "", lambda r: r.stats.failed),
    (
        "retries",
        "Requests re-sent to another worker after failing before their first byte.",
        lambda r: r.stats.retries,
    ),
    ("unauthorized", "", lambda r: r.stats.unauthorized),
    (
        "throttled",
        "Requests refused with 429: their tenant was at its concurrency limit.",
        lambda r: r.stats.throttled,
    ),
    (
        "index_overflow_blocks",
        "Stored blocks not indexed: the worker was at --max-index-blocks.",
        lambda r: r.index.overflow,
    ),
    (
        "index_skipped_group_blocks",
        "Blocks a hybrid model's window or state groups stored or removed: kept apart from the "
        "full-attention index, they cut a predicted hit to what their rules serve.",
        lambda r: r.index.groups.skipped_stores + r.index.groups.skipped_removals,
    ),
    ("broken_streams", "", lambda r: r.stats.broken_streams),
    (
        "event_thread_restarts",
        "Times the KV-event thread's loop failed (logged) and started over.",
        lambda r: r.pool.poller.restarts,
    ),
    (
        "client_disconnects",
        "Clients that left before their response ended (the worker's request is aborted).",
        lambda r: r.stats.client_disconnects,
    ),
    ("exact_hash_requests", "Requests hashed exactly as the engine does.", lambda r: r.stats.exact),
    ("prompt_blocks", "", lambda r: r.stats.prompt_blocks),
    (
        "predicted_hit_blocks",
        "Prompt blocks the index placed on the chosen worker.",
        lambda r: r.stats.predicted_hit_blocks,
    ),
    # microsecond resolution, as the hand-written exposition printed it
    ("route_seconds", "", lambda r: float(f"{r.stats.route_seconds:.6f}")),
)

_Family = type[CounterMetricFamily] | type[GaugeMetricFamily]
_Counter, _Gauge = CounterMetricFamily, GaugeMetricFamily

# per worker (labels worker, url): name, family, HELP, value
_PER_WORKER: tuple[tuple[str, _Family, str, Callable[[Router, Worker], float]], ...] = (
    ("up", _Gauge, "1 while the worker is in rotation.", lambda r, w: int(w.healthy)),
    ("requests_total", _Counter, "Requests sent to the worker.", lambda r, w: w.requests),
    (
        "failures_total",
        _Counter,
        "Requests that failed there before their first byte.",
        lambda r, w: w.failures,
    ),
    (
        "first_byte_timeouts_total",
        _Counter,
        "Requests retried elsewhere after --first-byte-timeout.",
        lambda r, w: w.first_byte_timeouts,
    ),
    ("in_flight", _Gauge, "Requests in flight (router accounting).", lambda r, w: w.in_flight),
    (
        "in_flight_tokens",
        _Gauge,
        "Prompt + max output tokens of requests streaming (the kv_aware load term).",
        lambda r, w: w.in_flight_tokens,
    ),
    (
        "scraped_active",
        _Gauge,
        "Running + waiting from the worker's /metrics.",
        lambda r, w: w.scraped_active,
    ),
    (
        "indexed_blocks",
        _Gauge,
        "Blocks the router believes the worker caches.",
        lambda r, w: r.index.blocks(w.slot) if w.mode == "event" else r.approx.blocks(w.slot),
    ),
    ("events_total", _Counter, "KV events applied.", lambda r, w: w.events_applied),
    (
        "event_resyncs_total",
        _Counter,
        "Sequence gaps and publisher restarts handled.",
        lambda r, w: w.resyncs,
    ),
)


class RouterCollector(Collector):
    """Reads the router's counters and per-worker state at scrape time (one source of truth)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        for name, doc, get in _TOTALS:
            yield CounterMetricFamily(f"agentkv_router_{name}_total", doc, value=get(r))
        workers = r.pool.workers
        keys = [[str(w.slot), w.spec.url] for w in workers]
        for name, family, doc, get in _PER_WORKER:
            m = family(f"agentkv_router_worker_{name}", doc, labels=["worker", "url"])
            for w, key in zip(workers, keys, strict=True):
                m.add_metric(key, get(r, w))
            yield m
        mode = GaugeMetricFamily(
            "agentkv_router_worker_mode",
            "How the router knows the worker's cache: event or approximate.",
            labels=["worker", "url", "mode"],
        )
        for w, key in zip(workers, keys, strict=True):
            mode.add_metric([*key, w.mode], 1)
        yield mode
        yield from _event_streams(workers)


def _event_streams(workers: list[Worker]) -> Iterator[Metric]:
    """Per subscribed worker, its malformed and lost event batches (untyped and without HELP, as
    they always were); nothing when no worker is subscribed."""
    subs = [(str(w.slot), sub.stats) for w in workers if (sub := w.subscriber) is not None]
    if not subs:
        return
    malformed = UnknownMetricFamily("agentkv_router_worker_event_malformed_total", "", labels=["worker"])
    lost = UnknownMetricFamily("agentkv_router_worker_event_lost_total", "", labels=["worker"])
    refused = CounterMetricFamily(
        "agentkv_router_worker_event_handshake_failures",
        "Event connections refused in the ZMQ handshake: a publisher without the worker's pinned CURVE "
        "key, or CURVE on one side only.",
        labels=["worker"],
    )
    for slot, s in subs:
        malformed.add_metric([slot], s.malformed)
        lost.add_metric([slot], s.lost)
        refused.add_metric([slot], s.handshake_failures)
    yield malformed
    yield lost
    yield refused


def render_metrics(router: Router) -> str:
    """Prometheus text exposition of the router's counters and per-worker gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return generate_latest(registry).decode()


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_processes(pages: dict[str, str]) -> str:
    """One exposition of several router processes' pages ({process index: page}), every sample
    labelled with its `process`: `route --processes N` answers a scrape with all N."""
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for process, page in pages.items():
        for fam in text_string_to_metric_families(page):
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            into.samples += [s._replace(labels={**s.labels, "process": process}) for s in fam.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))
    return generate_latest(registry).decode()


PAGE_INTERVAL_S = 1.0  # how often each of `--processes N` leaves its page for the others


async def publish_page(folder: str, process: str, render: Callable[[], str]) -> None:
    """Every PAGE_INTERVAL_S, this process's page as `folder/<process>.prom` (written whole, renamed)."""
    import asyncio

    path = Path(folder) / f"{process}.prom"
    while True:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(render(), encoding="utf-8")
        tmp.replace(path)
        await asyncio.sleep(PAGE_INTERVAL_S)


def sibling_pages(folder: str) -> dict[str, str]:
    """{process: page} of every page in `folder` (at most PAGE_INTERVAL_S old)."""
    out = {}
    for p in Path(folder).glob("*.prom"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            out[p.stem] = p.read_text(encoding="utf-8")
    return out
