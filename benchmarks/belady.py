"""Belady's offline optimum on all 119 shared Claude Code traces at one capacity: seconds (target < 60 s).

The accesses are those of `agentkv cache analyze` (every session from t=0, chained keys of the
block size); the timed part is Belady's preparation (the next-use index over every access) plus
the replay through the pool. Prints wall and CPU seconds, since the machine may be shared.

Run: .venv/bin/python benchmarks/belady.py [--capacity 100GB] [--block-size 64] [--model llama3-8b]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from agentkv.cache.analyze import fitting
from agentkv.cache.grid import make_grid
from agentkv.cache.replay import replay
from agentkv.kv.eviction import make_policy
from agentkv.kv.pool import BlockPool
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.formats import load_paths

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared")) / "traces" / "claude-code"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument(
        "--capacity", default="100GB", help="GPU KV capacity (default 100GB: Llama-3.1-8B on one H200)"
    )
    ap.add_argument(
        "--block-size", type=int, default=64, help="tokens per block (default 64, the traces' own)"
    )
    ap.add_argument("--model", default="llama3-8b")
    args = ap.parse_args()
    grid = make_grid(args.capacity, str(args.block_size), "belady", args.model)
    (label, nbytes), bs = grid.capacities[0], args.block_size
    num_blocks = nbytes // (bs * grid.kv_bytes_per_token)

    t = time.perf_counter()
    traces = load_paths([args.traces])
    reqs = fitting(block_accesses(arrivals(traces), bs), num_blocks, bs)
    naccess = sum(len(r.hashes) for r in reqs)
    print(
        f"{len(traces)} traces, {len(reqs)} requests, {naccess / 1e6:.2f} M block accesses at block size {bs}; "
        f"loaded and keyed in {time.perf_counter() - t:.1f} s"
    )

    w0, c0 = time.perf_counter(), time.process_time()
    policy = make_policy("belady", accesses=[r.hashes for r in reqs])
    w1, c1 = time.perf_counter(), time.process_time()
    pool = BlockPool(num_blocks, bs, policy)
    res = replay(pool, reqs)
    w2, c2 = time.perf_counter(), time.process_time()
    print(
        f"Belady at {label} ({num_blocks:,} blocks of {grid.model} {grid.kv_dtype} KV): hit rate {res.hit_rate:.4f}, "
        f"{pool.stats.evicted:,} evictions"
    )
    print(
        f"  preparation {w1 - w0:.1f} s wall ({c1 - c0:.1f} s CPU), replay {w2 - w1:.1f} s wall "
        f"({c2 - c1:.1f} s CPU)"
    )
    print(
        f"Belady, {len(traces)} traces, one capacity: {w2 - w0:.1f} s wall, {c2 - c0:.1f} s CPU (target < 60 s)"
    )


if __name__ == "__main__":
    main()
