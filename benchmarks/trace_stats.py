"""`agentkv trace stats` speed on the 119 shared Claude Code traces (16M hash ids), and synth speed.

Run: .venv/bin/python benchmarks/trace_stats.py [TRACE_DIR]   (default ../shared/traces/claude-code;
prints best-of-3 wall times: reading, statistics with the ceiling, and synthesising 120 sessions)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from timing import best_s

from agentkv.trace.formats import load_paths
from agentkv.trace.stats import compute
from agentkv.trace.synth import synthesize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared/traces/claude-code"
    ap.add_argument(
        "root", nargs="?", type=Path, default=default, help="a trace directory (default: %(default)s)"
    )
    root = ap.parse_args().root
    if not root.is_dir():
        print(f"skipped: {root} not found (pass a trace directory)")
        return 0
    traces = load_paths([root])
    report = compute(traces)
    blocks = sum(len(x.request.hash_ids) for t in traces for x in t.timeline())
    print(
        f"{len(traces)} traces, {report.total.requests} requests, {blocks:,} hash ids, "
        f"ceiling {report.total.ceiling:.5f}"
    )
    print(f"read:      {best_s(lambda: load_paths([root]), 3):.2f} s")
    print(f"stats:     {best_s(lambda: compute(traces), 3):.2f} s  (all figures, ceiling included)")
    print(f"synth 120: {best_s(lambda: synthesize(120, 0), 3):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
