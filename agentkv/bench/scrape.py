"""Scrape a target's Prometheus `/metrics`: prefix-cache counters, KV usage, running and waiting.

vLLM's names first (v1, then the older `gpu_` ones), SGLang's as a fallback. Counters and
request counts are summed over label sets (engines); KV usage is averaged over them.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import msgspec

QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


class MetricsSnapshot(msgspec.Struct, omit_defaults=True):
    """One scrape; a field is None when the target does not export it."""

    prefix_queries: float | None = None
    prefix_hits: float | None = None
    kv_usage: float | None = None  # fraction 0..1
    running: float | None = None
    waiting: float | None = None


def parse_prometheus(text: str) -> dict[str, list[float]]:
    """Metric name -> the values of its label sets (comments and malformed lines skipped)."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            close = line.rfind("}")
            rest = line[close + 1 :] if close > brace else ""
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            v = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(v):
            out.setdefault(name.strip(), []).append(v)
    return out


def _pick(m: dict[str, list[float]], names: tuple[str, ...], mean: bool = False) -> float | None:
    for n in names:
        vs = m.get(n)
        if vs:
            return sum(vs) / len(vs) if mean else sum(vs)
    return None


def snapshot(text: str) -> MetricsSnapshot:
    m = parse_prometheus(text)
    return MetricsSnapshot(
        _pick(m, QUERIES), _pick(m, HITS), _pick(m, KV_USAGE, mean=True), _pick(m, RUNNING), _pick(m, WAITING)
    )


def hit_rate(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> float | None:
    """Prefix-cache token hit rate over the run from the counters' deltas; None when not exported."""
    if before is None or after is None:
        return None
    if None in (before.prefix_queries, before.prefix_hits, after.prefix_queries, after.prefix_hits):
        return None
    dq = after.prefix_queries - before.prefix_queries  # type: ignore[operator]
    dh = after.prefix_hits - before.prefix_hits  # type: ignore[operator]
    return dh / dq if dq > 0 else None


class Scraper:
    """Reads `<base>/metrics` on the client's session; remembers why it could not when it cannot."""

    def __init__(self, session: aiohttp.ClientSession, base: str, timeout: float = 2.0):
        self.session, self.url, self.timeout = session, f"{base}/metrics", timeout
        self.absent_reason: str | None = None

    async def scrape(self) -> MetricsSnapshot | None:
        try:
            async with asyncio.timeout(self.timeout), self.session.get(self.url) as resp:
                if resp.status != 200:
                    self.absent_reason = f"GET /metrics answered HTTP {resp.status}"
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.absent_reason = f"GET /metrics failed ({type(e).__name__})"
            return None
        snap = snapshot(text)
        if snap == MetricsSnapshot():
            self.absent_reason = "/metrics has none of vLLM's or SGLang's cache and queue metrics"
            return None
        self.absent_reason = None
        return snap
