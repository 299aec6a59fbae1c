"""Routing quality: cache-hit rate of each router on the Claude Code traces, against an oracle.

For every router in turn, starts fresh `agentkv serve --workers 4` (simulated H200s with
Llama-3.1-8B: ~900K tokens of KV each, LRU, sped up by --time-scale), puts the router in front
(`agentkv route --policy kv_aware|round_robin|least_loaded`, or sglang-router `--policy
cache_aware` from .venv-peers/sglang), and replays the same requests with `agentkv bench --lanes
32 --max-requests N --duration none` through it. Then a short probe (the open-loop load of
benchmarks/router.py) measures the router's added latency: short streamed completions straight
to the workers, then through the router.

Oracle: the bench's `cache.ceiling`, the hit rate of an unbounded prefix cache over the requests
replayed. The traces' hash ids are local to each trace, so no two sessions share a block, and the
ceiling is exactly "every session on one fixed worker with unlimited KV".

Prompts: token ids for our router (it hashes them as the engine does); text rendered by the
built-in tokenizer for sglang-router, which routes on text only (agentkv serve tokenizes that text
back to the very same ids, so the workers see identical prompts either way).

The workers cannot always keep up with --time-scale on a small host; the engine time they skip
is printed per run (a skipping worker is a slower GPU: more queueing, more evictions), so compare
routers at similar figures. docs/route.md, "Routing quality", has the numbers and a simulator
cross-check at exact H200 timing.

Run: .venv/bin/python benchmarks/routing_quality.py [--max-requests 300] [--time-scale 25]
     [--routers kv_aware,round_robin,least_loaded,sglang] [--out DIR] [--json]
(about 3-4 minutes per router on a busy 2-core machine; `kv_aware@W` runs `agentkv route --kv-weight W`)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cluster.py: the process scaffolding
import aiohttp
from cluster import CLI, Cluster, wait_http

from agentkv.metrics.scrape import parse_prometheus

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "claude-code"
OURS = ("kv_aware", "round_robin", "least_loaded", "session")
PEER = "sglang"
DEFAULT = "kv_aware,round_robin,least_loaded,sglang"


def _router_bench():
    """benchmarks/router.py as a module: its load, percentile and CPU-time helpers are reused here."""
    spec = importlib.util.spec_from_file_location("bench_router", Path(__file__).with_name("router.py"))
    mod = sys.modules["bench_router"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rb = _router_bench()


@dataclass(slots=True)
class Row:
    """One router's figures: hits against the oracle, latency, throughput and its own cost."""

    router: str
    prompts: str
    requests: int
    failed: int
    hit_rate: float
    oracle: float
    ttft_p50: float
    ttft_p99: float
    out_tok_s: float
    router_cpu_ms: float  # router CPU per replayed request
    added_p50_ms: float | None = None  # probe: time to first byte, via router - direct
    added_p99_ms: float | None = None
    predicted_hit: float | None = None  # our router: prompt tokens its index placed on the chosen worker
    catchup: float = 0.0  # engine time the workers skipped because the host fell behind --time-scale
    steady_hit: float = 0.0  # hit rate and oracle over the requests after the first --warmup (cold start)
    steady_oracle: float = 0.0

    @property
    def of_oracle(self) -> float:
        return self.hit_rate / self.oracle if self.oracle else 0.0

    @property
    def steady_of_oracle(self) -> float:
        return self.steady_hit / self.steady_oracle if self.steady_oracle else 0.0


def _steady(records: Path, warmup: int) -> tuple[float, float]:
    """(hit rate, oracle) over the requests after the first `warmup` by due time, when all lanes are warm."""
    recs = sorted((json.loads(line) for line in records.open()), key=lambda r: r["scheduled"])[warmup:]
    total = sum(r["input_tokens"] for r in recs if r.get("ok", True))
    if not total:
        return 0.0, 0.0
    hit = sum(r.get("cached_tokens") or 0 for r in recs if r.get("ok", True))
    return hit / total, sum(r.get("ceiling_tokens", 0) for r in recs if r.get("ok", True)) / total


def _needed_model_len(paths: list[str]) -> int:
    from agentkv.bench.embedded import needed_model_len
    from agentkv.trace.formats import load_paths

    return max(131072, needed_model_len(load_paths(paths, "auto")))


async def _router_metrics(url: str) -> dict[str, float]:
    """Our router's /metrics, each sample summed over its label sets (agentkv.metrics.scrape)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {k: sum(v) for k, v in parse_prometheus(text).items()}


async def _catchup(urls: list[str]) -> float:
    """Engine seconds skipped so far, summed over the workers (agentkv:engine_catchup_seconds_total)."""
    total = 0.0
    name = "agentkv:engine_catchup_seconds_total"
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/metrics") as r:
                total += sum(parse_prometheus(await r.text(), [name]).get(name, []))
    return total


async def _probe(urls: list[str], via: str, rate: float, seconds: float) -> tuple[float, float]:
    """Router-added time to first byte (p50, p99 in ms): the same open-loop load direct, then via."""
    base = await rb.load(urls, rate, seconds, 64, seed=11)
    routed = await rb.load([via], rate, seconds, 64, seed=12)
    if not base["ttfb"] or not routed["ttfb"]:
        return float("nan"), float("nan")
    p50 = (statistics.median(routed["ttfb"]) - statistics.median(base["ttfb"])) * 1e3
    p99 = (rb.pct(routed["ttfb"], 0.99) - rb.pct(base["ttfb"], 0.99)) * 1e3
    return p50, p99


async def run_one(router: str, args: argparse.Namespace, model_len: int, out: Path) -> Row:
    """Fresh workers, one router in front, the replay through it, then the latency probe."""
    w = args.workers
    # logs: OUT/logs/{router}-{serve,router,bench}.log
    c = Cluster(out / "logs", w, one_process=True, prefix=f"{router}-", new_session=True)
    logs, urls, target = c.procs.logs, c.urls, c.router_url()
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
        if router == PEER:
            proc = rb.start_peer(c, "router", 0, ["--log-level", "warn"])
        else:
            policy, _, weight = router.partition("@")
            proc = c.start_router(
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
        await asyncio.to_thread(wait_http, target + "/health", 120, proc)
        mode = "text" if router == PEER else "token-ids"
        run_dir = out / router
        bench = [
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
            mode,
            "--seed",
            str(args.seed),
            "--out",
            str(run_dir),
            "--quiet",
            "--no-report",
        ]
        skipped0 = await _catchup(urls)
        cpu0, t0 = rb.cpu_seconds(proc.pid), time.monotonic()
        bp = c.procs.start("bench", bench)
        while bp.poll() is None:
            await asyncio.sleep(0.5)
        wall = time.monotonic() - t0
        cpu = rb.cpu_seconds(proc.pid) - cpu0
        skipped = (await _catchup(urls) - skipped0) / (w * wall * args.time_scale)
        if bp.returncode != 0:
            raise RuntimeError(
                f"agentkv bench failed for {router} (exit {bp.returncode}); see {logs}/{router}-bench.log"
            )
        s = json.loads((run_dir / "summary.json").read_text())
        predicted = None
        if router != PEER:
            m = await _router_metrics(target)
            if s["input_tokens"]:
                predicted = m.get("agentkv_router_predicted_hit_blocks_total", 0) * 16 / s["input_tokens"]
        p50 = p99 = None
        if args.probe_seconds > 0:
            p50, p99 = await _probe(urls, target, args.probe_rate, args.probe_seconds)
        tp = s.get("throughput") or {}
        steady = _steady(run_dir / "requests.jsonl", args.warmup)
        row = Row(
            router,
            mode,
            s["requests"],
            s["failed"],
            s["cache"].get("reported") or 0.0,
            s["cache"].get("ceiling") or 0.0,
            s["ttft"].get("p50") or 0.0,
            s["ttft"].get("p99") or 0.0,
            tp.get("output_tokens_per_s", 0.0),
            cpu / max(1, s["requests"]) * 1e3,
            p50,
            p99,
            predicted,
            skipped,
            *steady,
        )
        print(
            f"  {router}: {s['requests']} requests in {wall:.0f} s wall, hit {row.hit_rate:.4f} of oracle "
            f"{row.oracle:.4f} ({row.of_oracle:.1%}); after the first {args.warmup}: {row.steady_hit:.4f} of "
            f"{row.steady_oracle:.4f} ({row.steady_of_oracle:.1%}); workers skipped {skipped:.0%} of engine time "
            f"(host behind)" + (f"; index predicted {predicted:.1%} hits" if predicted is not None else ""),
            flush=True,
        )
        return row
    finally:
        c.close()


def simulate_rows(routers: list[str], args: argparse.Namespace) -> list[str]:
    """The same comparison in `agentkv simulate` (virtual clock: exact H200 timing), as table lines."""
    from agentkv.engine.config import EngineConfig
    from agentkv.placement.policy import KV_WEIGHT
    from agentkv.sim.cluster import SimConfig, simulate
    from agentkv.trace.formats import load_paths

    traces = load_paths(args.traces, "auto")
    lines = [
        "| router | hit rate | oracle | % of oracle | TTFT p50 s | TTFT p99 s |",
        "|---|---|---|---|---|---|",
    ]
    for router in routers:
        policy, _, weight = router.partition("@")
        s = simulate(
            traces,
            SimConfig(
                engine=EngineConfig(kv_cache_dtype=args.kv_cache_dtype),
                workers=args.workers,
                lanes=args.lanes,
                router=policy,
                kv_weight=float(weight) if weight else KV_WEIGHT,
                seed=args.seed,
                max_requests=args.sim_requests,
            ),
        ).summary
        c = s.cache
        lines.append(
            f"| {router} | {c.reported:.1%} | {c.ceiling:.1%} | {c.reported / c.ceiling:.1%} | "
            f"{s.ttft.p50:.2f} | {s.ttft.p99:.1f} |"
        )
        print(f"  simulated {router}: hit {c.reported:.4f} of oracle {c.ceiling:.4f}", flush=True)
    return lines


def _table(rows: list[Row]) -> str:
    head = (
        "router",
        "prompts",
        "requests",
        "failed",
        "hit rate",
        "oracle",
        "% of oracle",
        "after warm-up",
        "engine time skipped",
        "TTFT p50 s",
        "TTFT p99 s",
        "out tok/s",
        "router CPU ms/req",
        "added TTFB p50 / p99 ms",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        added = "-" if r.added_p50_ms is None else f"{r.added_p50_ms:+.1f} / {r.added_p99_ms:+.1f}"
        lines.append(
            f"| {r.router} | {r.prompts} | {r.requests} | {r.failed} | {r.hit_rate:.1%} | {r.oracle:.1%} | "
            f"{r.of_oracle:.1%} | {r.steady_hit:.1%} / {r.steady_oracle:.1%} = {r.steady_of_oracle:.1%} | "
            f"{r.catchup:.0%} | {r.ttft_p50:.2f} | {r.ttft_p99:.1f} | {r.out_tok_s:,.0f} | "
            f"{r.router_cpu_ms:.1f} | {added} |"
        )
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=[str(TRACES)])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lanes", type=int, default=32)
    ap.add_argument("--max-requests", type=int, default=300, help="requests per router (0: simulator only)")
    ap.add_argument(
        "--time-scale", type=float, default=25.0, help="engine speed-up of the workers and the bench"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=100,
        help="requests (by due time) left out of the after-warm-up columns (default 100)",
    )
    ap.add_argument(
        "--routers",
        default=DEFAULT,
        help=f"comma list of {', '.join(OURS)}, {PEER} (default {DEFAULT}); kv_aware@W sets KvAware's "
        "weight to W (--kv-weight W)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="the workers' KV dtype, in the HTTP runs and the simulator (fp8 doubles their KV)",
    )
    ap.add_argument(
        "--serve-args", default="", help="extra flags for agentkv serve, e.g. '--cpu-offload 256GB'"
    )
    ap.add_argument(
        "--health-interval",
        type=float,
        default=60.0,
        help="our router's health-check period (default 60 s, sglang-router's default; see docs/route.md)",
    )
    ap.add_argument("--probe-rate", type=float, default=50.0, help="requests/s of the latency probe")
    ap.add_argument("--probe-seconds", type=float, default=4.0, help="0 skips the latency probe")
    ap.add_argument(
        "--sim-requests",
        type=int,
        default=0,
        metavar="N",
        help="also run our policies in agentkv simulate for N requests (0: skip; ~1 min each at 1000)",
    )
    ap.add_argument("--out", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "routing-quality"))
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args()
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [
        r
        for r in routers
        if r.partition("@")[0] not in (*OURS, PEER)
        or (
            r.partition("@")[2] and (r.partition("@")[0] != "kv_aware" or not _is_number(r.partition("@")[2]))
        )
    ]
    if bad:
        ap.error(f"--routers: unknown {', '.join(bad)}")
    if PEER in routers and not rb.PEER.exists():
        print(f"sglang-router: skipped ({rb.PEER} not found; pip install sglang-router there)")
        routers.remove(PEER)
    for p in args.traces:
        if not Path(p).exists():
            ap.error(f"--traces: {p} does not exist")
    out = Path(args.out)
    model_len = _needed_model_len(args.traces)
    print(
        f"{len(routers)} routers x {args.max_requests} requests, {args.lanes} lanes, {args.workers} agentkv serve "
        f"workers (H200, Llama-3.1-8B, time-scale {args.time_scale:g}{', ' + args.serve_args if args.serve_args else ''}),"
        f", KV {args.kv_cache_dtype}; {os.cpu_count()} CPUs shared by client, router and workers",
        flush=True,
    )
    t0 = time.monotonic()
    rows = [await run_one(r, args, model_len, out) for r in routers] if args.max_requests > 0 else []
    if rows:
        print(
            f"\nall runs: {time.monotonic() - t0:.0f} s wall; times in engine seconds; oracle = unbounded prefix "
            "cache over the replayed requests (each session on one worker, unlimited KV)\n"
        )
        print(_table(rows))
    for r in rows:
        if r.predicted_hit is not None:
            print(
                f"{r.router}: index predicted {r.predicted_hit:.1%} of prompt tokens cached on the chosen worker, "
                f"workers reported {r.hit_rate:.1%}"
            )
    if args.sim_requests > 0:
        ours = [r for r in routers if r != PEER]
        print(f"\nagentkv simulate, same plan and policies, {args.sim_requests} requests (virtual clock):")
        print("\n".join(simulate_rows(ours, args)))
    if args.json:
        print(
            json.dumps(
                [
                    {**asdict(r), "of_oracle": r.of_oracle, "steady_of_oracle": r.steady_of_oracle}
                    for r in rows
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
