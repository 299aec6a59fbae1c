"""Routing quality's processes: fresh `agentkv serve` workers with one router in front, the `agentkv
bench` replay through it, and what benchmarks/routing_quality.py scrapes or probes around that."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cluster.py: the process scaffolding
import aiohttp
from cluster import CLI, Cluster, wait_http
from router import cpu_seconds, load, pct, start_peer  # benchmarks/router.py: its load and measures

from agentkv.metrics.scrape import parse_prometheus

PEER = "sglang"


def prompt_mode(router: str) -> str:
    """Text for sglang-router, which routes on text only; token ids for ours."""
    return "text" if router == PEER else "token-ids"


def _start_router(c: Cluster, router: str, args: argparse.Namespace) -> subprocess.Popen:
    """sglang-router, or `agentkv route --policy P [--kv-weight W]` for `P[@W]`, on the router port."""
    if router == PEER:
        return start_peer(c, "router", 0, ["--log-level", "warn"])
    policy, _, weight = router.partition("@")
    return c.start_router(
        [
            "--policy",
            policy,
            *(["--kv-weight", weight] if weight else []),
            "--tokenizer",
            "builtin",
            "--health-interval",
            str(args.health_interval),
            "--log-level",
            "warning",
        ],
        exe=CLI,
    )


@contextlib.asynccontextmanager
async def started(
    router: str, args: argparse.Namespace, model_len: int, out: Path
) -> AsyncIterator[tuple[Cluster, subprocess.Popen]]:
    """Fresh workers and `router` in front of them, all answering /health; every process stopped on exit."""
    # logs: OUT/logs/{router}-{serve,router,bench}.log
    c = Cluster(out / "logs", args.workers, one_process=True, prefix=f"{router}-", new_session=True)
    try:
        c.start_workers(
            time_scale=args.time_scale,
            log_level="error",
            extra=(
                "--max-model-len",
                str(model_len),
                "--kv-cache-dtype",
                args.kv_cache_dtype,
                *args.serve_args.split(),
            ),
        )
        await asyncio.to_thread(c.wait_workers, 120)
        proc = _start_router(c, router, args)
        await asyncio.to_thread(wait_http, c.router_url() + "/health", 120, proc)
        yield c, proc
    finally:
        c.close()


def _bench_args(router: str, args: argparse.Namespace, target: str, run_dir: Path) -> list[str]:
    """`agentkv bench` replaying the traces through `target` into `run_dir`."""
    return [
        "bench",
        *args.traces,
        "--target",
        target,
        "--lanes",
        str(args.lanes),
        "--max-requests",
        str(args.max_requests),
        "--duration",
        "none",
        "--time-scale",
        str(args.time_scale),
        "--prompt-mode",
        prompt_mode(router),
        "--seed",
        str(args.seed),
        "--out",
        str(run_dir),
        "--quiet",
        "--no-report",
    ]


async def replay(
    c: Cluster, proc: subprocess.Popen, router: str, args: argparse.Namespace, run_dir: Path
) -> tuple[float, float, float]:
    """The bench through the router: wall s, router CPU s, share of engine time the workers skipped."""
    urls = c.urls
    skipped0 = await _catchup(urls)
    cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
    bp = c.procs.start("bench", _bench_args(router, args, c.router_url(), run_dir))
    while bp.poll() is None:
        await asyncio.sleep(0.5)
    wall = time.monotonic() - t0
    cpu = cpu_seconds(proc.pid) - cpu0
    skipped = (await _catchup(urls) - skipped0) / (args.workers * wall * args.time_scale)
    if bp.returncode != 0:
        raise RuntimeError(
            f"agentkv bench failed for {router} (exit {bp.returncode}); see {c.procs.logs}/{router}-bench.log"
        )
    return wall, cpu, skipped


async def _router_metrics(url: str) -> dict[str, float]:
    """Our router's /metrics, each sample summed over its label sets (agentkv.metrics.scrape)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {k: sum(v) for k, v in parse_prometheus(text).items()}


async def predicted_hit(url: str, input_tokens: int) -> float | None:
    """Share of the replayed prompt tokens our router's index placed on the chosen worker."""
    m = await _router_metrics(url)
    if not input_tokens:
        return None
    return m.get("agentkv_router_predicted_hit_blocks_total", 0) * 16 / input_tokens


async def _catchup(urls: list[str]) -> float:
    """Engine seconds skipped so far, summed over the workers (agentkv:engine_catchup_seconds_total)."""
    total = 0.0
    name = "agentkv:engine_catchup_seconds_total"
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/metrics") as r:
                total += sum(parse_prometheus(await r.text(), [name]).get(name, []))
    return total


async def probe(urls: list[str], via: str, rate: float, seconds: float) -> tuple[float, float]:
    """Router-added time to first byte (p50, p99 in ms): the same open-loop load direct, then via."""
    base = await load(urls, rate, seconds, 64, seed=11)
    routed = await load([via], rate, seconds, 64, seed=12)
    if not base["ttfb"] or not routed["ttfb"]:
        return float("nan"), float("nan")
    p50 = (statistics.median(routed["ttfb"]) - statistics.median(base["ttfb"])) * 1e3
    p99 = (pct(routed["ttfb"], 0.99) - pct(base["ttfb"], 0.99)) * 1e3
    return p50, p99
