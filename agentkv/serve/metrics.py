"""Prometheus metrics under vLLM's names (labels `model_name`, `engine`), plus agentkv's per-tier hits.

Counters and gauges are read from the engine at scrape time (one source of truth); latency
histograms are observed as tokens are delivered, in engine seconds (wall seconds times
`--time-scale`; equal at the default scale of 1), as vLLM measures them inside its engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from agentkv.engine.engine import StepResult
from agentkv.engine.request import EngineRequest
from agentkv.serve.runner import EngineRunner

disable_created_metrics()  # no `_created` series, as vLLM's exposition
CONTENT_TYPE = CONTENT_TYPE_LATEST
GIB = 1 << 30
# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """One server's registry: hook `on_step` / `on_finish` into the runner, serve `render()` at /metrics."""

    def __init__(self, runner: EngineRunner, model_name: str, engine_index: str = "0") -> None:
        self.runner = runner
        self.labels = {"model_name": model_name, "engine": engine_index}
        self.registry = CollectorRegistry(auto_describe=False)
        names = ["model_name", "engine"]
        vals = (model_name, engine_index)

        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(*vals)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token (engine seconds).", TTFT_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Inter-token latency (engine seconds).", ITL_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency (engine seconds).", E2E_BUCKETS
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.registry.register(_EngineCollector(self))

    def on_step(self, result: StepResult, itl_gaps: list[float]) -> None:
        """Count a step's tokens; observe first-token and inter-token times."""
        for out in result.outputs:
            req = out.request
            if req.num_output == 1:
                self.prompt_tokens += req.prompt_len
                self.ttft.observe(req.first_token - req.arrival)
        self.generation_tokens += len(result.outputs)
        observe = self.itl.observe
        for gap in itl_gaps:
            observe(gap)

    def on_finish(self, req: EngineRequest, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason != "abort" and req.finished_at is not None:
            self.e2e.observe(req.finished_at - req.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Counters and gauges read from the engine, pool, tiers and event publisher at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.names = list(metrics.labels)
        self.vals = list(metrics.labels.values())

    def collect(self) -> Iterator[Metric]:
        yield from self._engine()
        yield self._cache_config()
        yield from self._agentkv()

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.names)
        c.add_metric(self.vals, value)
        return c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.names)
        g.add_metric(self.vals, value)
        return g

    def _engine(self) -> Iterator[Metric]:
        """vLLM's prefix-cache, queue, token and finished-request metrics."""
        m, counter, gauge = self.m, self._counter, self._gauge
        eng = m.runner.engine
        yield counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", eng.prefix_cache_queries
        )
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", eng.prefix_cache_hits)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).", eng.kv_usage)
        yield gauge("vllm:num_requests_running", "Requests in model execution batches.", eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", eng.num_waiting)
        yield counter("vllm:num_preemptions", "Cumulative preemptions.", eng.num_preemptions)
        yield counter(
            "vllm:prompt_tokens",
            "Prefill tokens processed (whole prompts, cached included).",
            m.prompt_tokens,
        )
        yield counter("vllm:generation_tokens", "Generation tokens processed.", m.generation_tokens)

        ok = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            labels=[*self.names, "finished_reason"],
        )
        for reason, n in m.finished.items():
            ok.add_metric([*self.vals, reason], n)
        yield ok

    def _cache_config(self) -> GaugeMetricFamily:
        """vLLM's `cache_config_info`: the cache's configuration as labels of a constant 1."""
        eng = self.m.runner.engine
        cfg = eng.config
        cpu_blocks = int(cfg.kv_offloading_size * GIB // eng.block_bytes) if cfg.kv_offloading_size else 0
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": cfg.kv_cache_dtype,
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "num_gpu_blocks": str(eng.num_gpu_blocks),
            "num_cpu_blocks": str(cpu_blocks),
            "prefix_caching_hash_algo": cfg.hash_algo,
            "prefix_cache_retention_interval": str(cfg.prefix_cache_retention_interval),
        }
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the cache config.", labels=[*info, "engine"]
        )
        g.add_metric([*info.values(), self.m.labels["engine"]], 1.0)
        return g

    def _agentkv(self) -> Iterator[Metric]:
        """agentkv's own: hits by tier, engine catch-up and wake-ups, KV event batches."""
        runner, names, vals = self.m.runner, self.names, self.vals
        eng = runner.engine
        tiers = CounterMetricFamily(
            "agentkv:prefix_cache_hits_by_tier",
            "Prefix cache hits by the tier that held them, in tokens.",
            labels=[*names, "medium"],
        )
        tiers.add_metric([*vals, "GPU"], eng.prefix_cache_hits)
        for medium in ("CPU", "DISK"):
            tiers.add_metric([*vals, medium], eng.lower_tier_tokens.get(medium, 0))
        yield tiers
        yield self._counter(
            "agentkv:engine_catchup_seconds",
            "Engine seconds skipped because the server fell behind --time-scale.",
            runner.jumped_s,
        )
        wake = SummaryMetricFamily(
            "agentkv:engine_wake_seconds",
            "Wall seconds from an idle engine's first arrival to its loop waking (host time, not engine time).",
            labels=self.names,
        )
        wake.add_metric(self.vals, runner.wakes, runner.wake_s)
        yield wake
        pub = runner.publisher
        if pub is not None:
            ev = CounterMetricFamily(
                "agentkv:kv_event_batches", "KV event batches, by outcome.", labels=[*names, "outcome"]
            )
            ev.add_metric([*vals, "sent"], pub.stats.sent)
            ev.add_metric([*vals, "dropped"], pub.stats.dropped)
            yield ev
