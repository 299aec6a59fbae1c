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
Its parts: routing_quality_cluster.py (the processes), routing_quality_rows.py (the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from router import PEER as PEER_PYTHON  # benchmarks/router.py (it puts tests/ on sys.path for cluster.py)
from routing_quality_cluster import PEER, predicted_hit, probe, prompt_mode, replay, started
from routing_quality_rows import Row, rows_json, run_line, steady, table

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "claude-code"
OURS = ("kv_aware", "round_robin", "least_loaded", "session")
DEFAULT = "kv_aware,round_robin,least_loaded,sglang"


def _needed_model_len(paths: list[str]) -> int:
    from agentkv.bench.embedded import needed_model_len
    from agentkv.trace.formats import load_paths

    return max(131072, needed_model_len(load_paths(paths, "auto")))


async def run_one(router: str, args: argparse.Namespace, model_len: int, out: Path) -> Row:
    """Fresh workers, one router in front, the replay through it, then the latency probe."""
    run_dir = out / router
    async with started(router, args, model_len, out) as (c, proc):
        wall, cpu, skipped = await replay(c, proc, router, args, run_dir)
        s = json.loads((run_dir / "summary.json").read_text())
        predicted = None if router == PEER else await predicted_hit(c.router_url(), s["input_tokens"])
        added = (None, None)
        if args.probe_seconds > 0:
            added = await probe(c.urls, c.router_url(), args.probe_rate, args.probe_seconds)
        row = Row.from_summary(
            router,
            prompt_mode(router),
            s,
            cpu_s=cpu,
            added=added,
            predicted=predicted,
            catchup=skipped,
            steady=steady(run_dir / "requests.jsonl", args.warmup),
        )
        print(run_line(row, wall, args.warmup), flush=True)
        return row


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


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def _known(router: str) -> bool:
    """One of our policies, kv_aware@W with a number W >= 0, or sglang."""
    policy, _, weight = router.partition("@")
    return policy in (*OURS, PEER) and (not weight or (policy == "kv_aware" and _is_number(weight)))


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _routers(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The routers to compare, checked (sglang-router dropped when not installed), after checking --traces."""
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if not _known(r)]
    if bad:
        ap.error(f"--routers: unknown {', '.join(bad)}")
    if PEER in routers and not PEER_PYTHON.exists():
        print(f"sglang-router: skipped ({PEER_PYTHON} not found; pip install sglang-router there)")
        routers.remove(PEER)
    for p in args.traces:
        if not Path(p).exists():
            ap.error(f"--traces: {p} does not exist")
    return routers


async def main() -> int:
    ap = _parser()
    args = ap.parse_args()
    routers = _routers(ap, args)
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
        print(table(rows))
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
        print(rows_json(rows))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
