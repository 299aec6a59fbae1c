"""Block-pool speed and eviction-policy hit rates on the 119 shared Claude Code traces.

Every request of every trace (all starting at t=0, interleaved by arrival) is replayed through
a `BlockPool`: lookup, allocate prompt + output, free. Prints, per capacity and policy, the
prefix-cache hit rate and the speed in block-ops/s (hashes probed + blocks shared or allocated +
blocks freed) and in request-blocks/s (one lookup+allocate+free cycle of one block of a
request's hash list), on one core, in CPU time of the replay loop; then LRU best-of-N with plain
lookups and with lookups hinted by the session's previous blocks (as the engine does), and
Belady's total time (preparation + replay). "session-noend": the session policy without
end-of-session hints. About 6 minutes on an idle core.

Run: .venv/bin/python benchmarks/kv_pool.py [--capacity 16384 65536] [--policies lru belady]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from agentkv.cache.replay import replay
from agentkv.kv.eviction import POLICIES, make_policy
from agentkv.kv.eviction.belady import Belady
from agentkv.kv.eviction.session import SessionAware
from agentkv.kv.pool import BlockPool, num_blocks_for
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.formats import load_paths

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared")) / "traces" / "claude-code"


def run_one(reqs, capacity: int, block_size: int, name: str, lookup_hints: bool = False):
    """One replay; returns (result, evictions, preparation CPU s, wall s in all)."""
    w0 = time.perf_counter()
    t0 = time.process_time()
    if name == "belady":
        policy = Belady([r.hashes for r in reqs])
    elif name == "session-noend":
        policy = SessionAware(use_end_hints=False)
        policy.name = "session-noend"
    else:
        policy = make_policy(name)
    prep = time.process_time() - t0
    pool = BlockPool(capacity, block_size, policy)
    res = replay(pool, reqs, lookup_hints=lookup_hints)
    return res, pool.stats.evicted, prep, time.perf_counter() - w0


def rates(res) -> str:
    """M block-ops/s and M request-blocks/s over the replay loop's CPU time."""
    return f"{res.block_ops / res.cpu_seconds / 1e6:13.2f} {res.request_blocks / res.cpu_seconds / 1e6:14.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument(
        "--capacity",
        type=int,
        nargs="+",
        default=[16384, 65536],
        help="GPU blocks (default: 16384, about one H200 of Llama-3.1-8B KV at 64 tokens/block, and 65536)",
    )
    ap.add_argument("--policies", nargs="+", default=[*POLICIES[:5], "session-noend", "belady"])
    ap.add_argument("--repeat", type=int, default=3, help="LRU speed: best of this many replays")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    t = time.perf_counter()
    traces = load_paths([args.traces])
    reqs = block_accesses(arrivals(traces), traces[0].block_size)
    bs = traces[0].block_size
    nblk = sum(len(r.hashes) for r in reqs)
    print(
        f"{len(traces)} traces, {len(reqs)} requests, {nblk / 1e6:.2f} M block accesses "
        f"({len({h for r in reqs for h in r.hashes})} distinct), block size {bs}; "
        f"loaded in {time.perf_counter() - t:.1f} s"
    )
    h200 = num_blocks_for(int(0.9 * 141e9) - 16 * 10**9, bs, 32, 8, 128, "bf16")
    print(f"(one H200 holds about {h200} blocks of Llama-3.1-8B bf16 KV after weights)")
    print(
        f"{'capacity':>8} {'policy':>14} {'hit rate':>8} {'evicted':>10} {'cpu s':>7} "
        f"{'M block-ops/s':>13} {'M req-blocks/s':>14}"
    )
    for cap in args.capacity:
        for name in args.policies:
            res, ev, prep, wall = run_one(reqs, cap, bs, name)
            cpu = res.cpu_seconds
            extra = (
                f"   Belady in all: {prep + cpu:.1f} s CPU ({prep:.1f} s preparation), {wall:.1f} s wall"
                if name == "belady"
                else ""
            )
            print(
                f"{cap:>8} {name:>14} {res.hit_rate:8.4f} {ev:>10} {cpu:7.2f} {rates(res)}{extra}", flush=True
            )

    cap = args.capacity[-1]
    for hinted in (False, True):
        runs = [run_one(reqs, cap, bs, "lru", lookup_hints=hinted)[0] for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r.cpu_seconds)
        how = "lookups hinted with the session's previous blocks" if hinted else "plain lookups"
        print(
            f"LRU, {cap} blocks, one core, best of {args.repeat}, {how}: "
            f"{best.block_ops / best.cpu_seconds / 1e6:.2f} M block-ops/s "
            f"({best.request_blocks / best.cpu_seconds / 1e6:.2f} M request-blocks/s, "
            f"{best.cpu_seconds:.2f} s CPU, {best.seconds:.2f} s wall)",
            flush=True,
        )


if __name__ == "__main__":
    main()
