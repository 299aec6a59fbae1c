"""The hybrid pool's hinted prefix lookup (`HybridPool._full_prefix`), as it is and as it was before
recomputed copies were resolved through their originals (every hint block that failed the check was
looked up in the hash map), timed in lockstep on the same calls of one `simulate` run (the order
alternates per call; the two answers are asserted equal on every call).

Prints each variant's CPU seconds, the hint blocks that failed the check, and the hash map lookups
each variant made (`get` calls, the blocks past the hint included: the same in both).

Run: .venv/bin/python benchmarks/kv_hint.py [--model DeepSeek-V4-Flash --tp 2 --traces 30]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from agentkv.engine.config import EngineConfig
from agentkv.kv.groups import HybridPool
from agentkv.kv.hashmap import gallop
from agentkv.sim.cluster import SimConfig, make_cluster
from agentkv.trace.formats import load_paths

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared"))
NOW = HybridPool._full_prefix
COUNT = {"calls": 0, "failed": 0, "map_before": 0, "map_now": 0}  # map lookups: `get` calls


def before(pool: HybridPool, block_hashes, limit: int, hint, hash_array):
    """The lookup as it was: the four-array check, then the map for every hint block that failed it."""
    get = pool.cached_maps[0].get
    if hint is None or hash_array is None or not pool.mirror or not len(hint):
        return gallop(get, block_hashes, limit)
    m = min(len(hint), limit, len(hash_array))
    hb = hint[:m]
    ok = (hb >= 0) & pool.hashed_blk[hb] & (pool.bgroup[hb] == 0) & (pool.bh64[hb] == hash_array[:m])
    if not ok.all():
        bad = np.flatnonzero(~ok)
        COUNT["failed"] += len(bad) if isinstance(pool.cached_maps[0], _Counting) else 0  # counted once
        found = gallop(get, [block_hashes[i] for i in bad.tolist()], len(bad))
        end = int(bad[len(found)]) if len(found) < len(bad) else len(hb)
        hb = hb[:end].copy()
        hb[bad[: len(found)]] = found
        if end < m:
            return hb
    rest = gallop(get, block_hashes, limit, m)
    return hb if not rest else np.concatenate((hb, np.asarray(rest, dtype=np.int64)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="DeepSeek-V4-Flash", help="a hybrid model (full attention first)")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel size; replicas = 8 / tp")
    ap.add_argument("--traces", type=int, default=30, help="the first N Claude Code traces")
    args = ap.parse_args()
    src = SHARED / "traces" / "claude-code"
    if not src.is_dir():
        raise SystemExit(f"{src} not found (set AGENTKV_SHARED)")
    cpu = {"before": 0.0, "now": 0.0}

    def both(pool, block_hashes, limit, hint, hash_array):
        COUNT["calls"] += 1
        pairs = [("before", before), ("now", NOW)]
        out = {}
        for name, f in pairs if COUNT["calls"] % 2 else pairs[::-1]:
            t0 = time.process_time()
            out[name] = f(pool, block_hashes, limit, hint, hash_array)
            cpu[name] += time.process_time() - t0
        assert np.array_equal(np.asarray(out["before"]), np.asarray(out["now"])), "answers differ"
        plain = pool.cached_maps[0]
        for name, f in pairs:  # again, untimed, counting each one's map lookups
            pool.cached_maps[0] = seen = _Counting(plain)
            f(pool, block_hashes, limit, hint, hash_array)
            COUNT["map_" + name] += seen.n
        pool.cached_maps[0] = plain
        return out["now"]

    HybridPool._full_prefix = both
    traces = load_paths([src])[: args.traces]
    eng = EngineConfig(gpu="h200", model=args.model, tensor_parallel_size=args.tp, kv_cache_dtype="fp8")
    res = make_cluster(traces, SimConfig(engine=eng, workers=8 // args.tp, lanes=64, router="kv_aware")).run()
    print(
        f"{args.model} (tp {args.tp} x {8 // args.tp}), {len(res.records):,} requests, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  {COUNT['calls']:,} lookups, {COUNT['failed']:,} hint blocks failed the check; hash map lookups "
        f"(the blocks past the hint too): before {COUNT['map_before']:,}, now {COUNT['map_now']:,}"
    )
    print(
        f"  CPU s in the lookup (answers equal in every call): before {cpu['before']:.3f}, now {cpu['now']:.3f}"
    )


class _Counting:
    """Group 0's map, counting `get` calls (the hint's own lookups)."""

    def __init__(self, d: dict) -> None:
        self.d, self.n = d, 0

    def get(self, key, default=None):
        self.n += 1
        return self.d.get(key, default)

    def __getattr__(self, name):
        return getattr(self.d, name)


if __name__ == "__main__":
    main()
