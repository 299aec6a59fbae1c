"""`cache analyze --ray`'s shared object: lists of Python ints (the old form) vs packed arrays.

Prints, for the block accesses of synthetic sessions (or --traces) at each block size: the pickle's
size and its dump and load times in both forms, and the packed form's pack (driver) and unpack (once
per worker process) times. With --ray, the grid's cells also run on one new local Ray cluster of 2
CPUs through `raytasks.stream` (what `cache analyze --ray` uses), the packed arrays shared, then the
lists, each timed from `ray.put` to the last result, with the workers' peak RSS; results must be equal.
Prints figures only.

Run: .venv/bin/python benchmarks/cache_ray_shared.py [--sessions 40] [--block-size 16] [--ray [--pairs 2]]
"""

from __future__ import annotations

import argparse
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

from agentkv.cache.analyze import run_cell
from agentkv.cache.grid import make_grid
from agentkv.cache.packed import PackedRequests
from agentkv.cli import main as cli
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.formats import load_paths


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def _row(label: str, obj) -> None:
    blob, dump = _timed(pickle.dumps, obj, 5)
    _, load = _timed(pickle.loads, blob)
    print(f"  {label:<7} pickle {len(blob) / 1e6:8.1f} MB, dump {dump:7.3f} s, load {load:7.3f} s")


def _rss_mb() -> float:
    """This worker's peak RSS so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _lists_cell(shared, bs, cap, pol):
    """A cell from the old shared form (lists of ints), with its worker's peak RSS."""
    grid, requests = shared
    return run_cell(grid, requests[bs], bs, cap, pol), _rss_mb()


def _packed_cell(shared, bs, cap, pol):
    """A cell as `cache analyze --ray` runs it (`ray_cells._cell`), with its worker's peak RSS."""
    grid, packed = shared
    return run_cell(grid, packed[bs].requests(), bs, cap, pol), _rss_mb()


def _warm(shared, seconds: float) -> int:
    """A warm-up task: both worker processes started and the replay imported before timing."""
    time.sleep(seconds)
    return id(shared)


def on_ray(grid, requests: dict, packed: dict, pairs: int) -> None:
    """The grid's cells on a local 2-CPU cluster (workers warm), the packed arrays shared and then
    the lists, `pairs` times (packed first: a worker's peak RSS only grows)."""
    from agentkv.scaleout.raytasks import connect, import_ray, stream

    ray = import_ray("local")
    connect(ray, "local", 2)
    cells = [(bs, cap, pol) for bs in grid.block_sizes for cap in grid.capacities for pol in grid.policies]
    forms = (("packed", _packed_cell, (grid, packed)), ("lists", _lists_cell, (grid, requests)))
    try:
        list(stream(ray, _warm, None, [(1.0,), (1.0,)]))
        got = {}
        for _ in range(pairs):
            for label, fn, shared in forms:
                res, wall = _timed(lambda f=fn, s=shared: list(stream(ray, f, s, cells)))
                got[label] = sorted(
                    (r.block_size, r.capacity, r.policy, r.hit_tokens, r.evicted) for r, _ in res
                )
                rss = max(m for _, m in res)
                print(
                    f"  {label:<7} {len(cells)} cells on Ray, ray.put to the last: {wall:6.1f} s; worker peak RSS {rss:,.0f} MB"
                )
        print(f"  results equal: {got['lists'] == got['packed']}")
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=40, help="synthetic sessions (default 40)")
    ap.add_argument("--traces", help="trace files or a directory instead of synthetic sessions")
    ap.add_argument("--block-size", default="16", help="comma list (default 16)")
    ap.add_argument("--capacity", default="8GB,16GB", help="the --ray grid's capacities")
    ap.add_argument("--policy", default="lru,lfu", help="the --ray grid's policies")
    ap.add_argument("--ray", action="store_true", help="also run the grid on a local Ray cluster")
    ap.add_argument("--pairs", type=int, default=2, help="--ray: lists-then-packed runs (default 2)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [args.traces] if args.traces else [str(Path(tmp) / "synth")]
        if not args.traces and cli(["trace", "synth", "--sessions", str(args.sessions), "-o", paths[0]]):
            sys.exit("trace synth failed")
        traces = load_paths(paths)
    grid = make_grid(args.capacity, args.block_size, args.policy)
    arrived = arrivals(traces)
    requests, packed = {}, {}
    for bs in grid.block_sizes:
        reqs = requests[bs] = block_accesses(arrived, bs)
        packed[bs], pack = _timed(PackedRequests.pack, reqs)
        n = sum(len(r.hashes) for r in reqs)
        print(
            f"block size {bs}: {len(reqs)} requests, {n / 1e6:.1f} M accesses, {len(packed[bs].keys) / 1e6:.2f} M stored keys"
        )
        _row("lists", reqs)
        _row("packed", packed[bs])
        copy = pickle.loads(pickle.dumps(packed[bs], 5))
        unpacked, unpack = _timed(copy.requests)
        same = unpacked == reqs
        print(f"  packed  pack {pack:.2f} s (driver), unpack {unpack:.2f} s (once a worker), equal: {same}")
    if args.ray:
        on_ray(grid, requests, packed, args.pairs)


if __name__ == "__main__":
    main()
