"""Memory the decoded traces hold: all shared Claude Code traces read once under tracemalloc.

Usage: python benchmarks/trace_memory.py [TRACES_DIR]   (default: ../shared/traces/claude-code)
Prints the traced MiB and allocated blocks (~ Python objects) kept by the loaded traces, and the
best load wall time of three runs without tracemalloc. Measured 2026-12-04 (load 1.3): 144 MiB,
0.66 M blocks, 0.46 s; before prefix-shared hash_ids (main d767860) 564 MiB, 14.19 M, 0.77 s.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from pathlib import Path

from agentkv.trace.formats import load_paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared" / "traces" / "claude-code"
    ap.add_argument("traces", nargs="?", type=Path, default=default, help="default: %(default)s")
    path = ap.parse_args().traces
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        traces = load_paths([path])
        times.append(time.perf_counter() - t0)
        del traces
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    traces = load_paths([path])
    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(base, "filename")
    tracemalloc.stop()
    size, count = sum(s.size_diff for s in stats), sum(s.count_diff for s in stats)
    reqs = sum(t.num_requests for t in traces)
    print(
        f"{len(traces)} traces {reqs} requests: decoded {size / 2**20:.0f} MiB, "
        f"{count / 1e6:.2f} M blocks, load best {min(times):.2f} s (of 3)"
    )


if __name__ == "__main__":
    main()
