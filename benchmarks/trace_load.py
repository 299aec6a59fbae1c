"""How long reading real traces takes, and what they hold: all 119 Claude Code traces, each Mooncake file.

Usage: python benchmarks/trace_load.py [SHARED_DIR]   (default: ../shared beside the repository)
Prints the best and median of a few runs, the bytes read and the requests found, then the memory the
decoded Claude Code traces keep (tracemalloc: MiB and allocated blocks, ~ Python objects).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from agentkv.trace.formats import load_paths, read_bytes

RUNS = 3


def _time(paths: list[Path]) -> tuple[float, float, list]:
    times, traces = [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        traces = load_paths(paths)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), traces


def _report(label: str, paths: list[Path]) -> None:
    files = [f for p in paths for f in (sorted(p.rglob("*.gz")) if p.is_dir() else [p])]
    packed = sum(f.stat().st_size for f in files) / 1e6
    raw = sum(len(read_bytes(f)) for f in files) / 1e6
    best, median, traces = _time(paths)
    reqs = sum(t.num_requests for t in traces)
    subs = sum(t.num_subagents for t in traces)
    print(
        f"{label:<28} {len(traces):>4} traces {reqs:>7} requests {subs:>3} sub-agents "
        f"{packed:6.1f} MB gz {raw:6.1f} MB json   best {best:6.3f} s  median {median:6.3f} s  "
        f"({raw / best:5.1f} MB/s)"
    )


def _decoded(paths: list[Path]) -> None:
    """Print the memory the decoded traces of `paths` keep, read once under tracemalloc."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    traces = load_paths(paths)
    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(base, "filename")
    tracemalloc.stop()
    size, count = sum(s.size_diff for s in stats), sum(s.count_diff for s in stats)
    print(
        f"claude-code decoded: {len(traces)} traces keep {size / 2**20:.0f} MiB in {count / 1e6:.2f} M blocks"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1].parent / "shared"
    ap.add_argument(
        "shared", nargs="?", type=Path, default=default, help="the shared directory (default: %(default)s)"
    )
    shared = ap.parse_args().shared
    traces = shared / "traces"
    if not traces.is_dir():
        sys.exit(f"trace_load: no traces under {shared} (pass the shared directory as the argument)")
    print(f"reading traces under {traces} ({RUNS} runs each)")
    _report("claude-code (all files)", [traces / "claude-code"])
    _decoded([traces / "claude-code"])
    for f in sorted((traces / "mooncake").glob("*.jsonl*")):
        _report(f"mooncake {f.name.split('.')[0]}", [f])


if __name__ == "__main__":
    main()
