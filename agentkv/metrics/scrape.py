"""Read an engine's Prometheus `/metrics` text: prefix-cache counters, KV usage, running and waiting.

vLLM's names first (v1, then the older `gpu_` ones), SGLang's as a fallback. Counters and
request counts are summed over label sets (engines, ranks); KV usage is averaged over them.
The text comes from servers agentkv does not control (the router's workers), so each line is
parsed on its own by prometheus_client's parser: a malformed line is skipped, not the page.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

import msgspec
from prometheus_client.parser import text_string_to_metric_families

QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
CATCHUP = ("agentkv:engine_catchup_seconds_total",)  # agentkv serve: engine time skipped behind real time
KNOWN = frozenset(QUERIES + HITS + KV_USAGE + RUNNING + WAITING + CATCHUP)

# Bounds on hostile text (the router parses pages from workers it does not trust): a longer line
# is skipped unparsed (vLLM's longest, `vllm:cache_config_info`, is about 1.3 KB), and so are a
# name's lines past MAX_SAMPLES (a server exports one gauge or counter per engine or rank).
MAX_LINE = 64 << 10
MAX_SAMPLES = 1024

_NAME = re.compile(r"[ \t]*([^ \t{]*)")


class MetricsSnapshot(msgspec.Struct, omit_defaults=True):
    """One scrape; a field is None when the target does not export it."""

    prefix_queries: float | None = None
    prefix_hits: float | None = None
    kv_usage: float | None = None  # fraction 0..1
    running: float | None = None
    waiting: float | None = None
    catchup_s: float | None = None  # agentkv serve's engine seconds skipped (a host that fell behind)

    def requests(self) -> float:
        """Running + waiting requests (0 for what is not exported): the router's load signal."""
        return (self.running or 0.0) + (self.waiting or 0.0)


def parse_prometheus(text: str, names: Collection[str] | None = None) -> dict[str, list[float]]:
    """Sample name -> the finite values of its label sets; comments, malformed and over-long lines
    are skipped. With `names`, only those samples are parsed (other lines cost a prefix check)."""
    prefixes = tuple(names) if names is not None else ("",)
    seen: dict[str, int] = {}  # lines parsed per name
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes) or not line or line[0] == "#" or len(line) > MAX_LINE:
            continue
        name = _NAME.match(line).group(1)
        n = seen.get(name, 0)
        if n >= MAX_SAMPLES or (names is not None and name not in names):
            continue
        seen[name] = n + 1
        try:
            samples = [s for f in text_string_to_metric_families(line) for s in f.samples]
        except Exception:  # whatever a hostile line makes the parser raise, the line is skipped
            continue
        for s in samples:
            v = float(s.value)
            if math.isfinite(v):
                out.setdefault(s.name, []).append(v)
    return out


def _pick(m: dict[str, list[float]], names: tuple[str, ...], mean: bool = False) -> float | None:
    for n in names:
        vs = m.get(n)
        if vs:
            return sum(vs) / len(vs) if mean else sum(vs)
    return None


def snapshot(text: str) -> MetricsSnapshot:
    """The cache and queue metrics of one /metrics page (vLLM's or SGLang's names)."""
    m = parse_prometheus(text, KNOWN)
    return MetricsSnapshot(
        _pick(m, QUERIES),
        _pick(m, HITS),
        _pick(m, KV_USAGE, mean=True),
        _pick(m, RUNNING),
        _pick(m, WAITING),
        _pick(m, CATCHUP),
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
