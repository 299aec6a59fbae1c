"""Per-engine load of a finished run: requests, prompt and prefill (uncached) tokens, TTFT p90, trees.

Why: a router's spread shows per engine, not in the run's totals (issue #16: kv_aware over 9 or 72
engines). Reads the `requests.jsonl` of `agentkv simulate|bench --out DIR`; warm-up requests are left out.

Run: .venv/bin/python benchmarks/engine_balance.py RUN_DIR [RUN_DIR ...] [--rows]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def p90(xs: list[float]) -> float:
    """The 90th percentile (nearest rank), NaN for none."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def load(run: Path) -> tuple[dict[str, list[dict]], dict[str, set[str]]]:
    """The run's measured records by worker, and the workers each session tree touched."""
    by: dict[str, list[dict]] = defaultdict(list)
    trees: dict[str, set[str]] = defaultdict(set)
    path = run / "requests.jsonl" if run.is_dir() else run
    if not path.is_file():
        sys.exit(f"{path}: not found (give a simulate or bench --out folder)")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                if r.get("warmup") or not r.get("ok", True):
                    continue
                by[str(r["worker"])].append(r)
                trees[str(r.get("tree", r["session"]))].add(str(r["worker"]))
            except (ValueError, KeyError) as e:
                sys.exit(f"{path}:{n}: bad record ({e})")
    if not by:
        sys.exit(f"{path}: no measured requests")
    return by, trees


def rows(by: dict[str, list[dict]], trees: dict[str, set[str]]) -> list[tuple]:
    """(worker, requests, prompt Mtok, prefill Mtok, TTFT p90 s, trees) per worker."""
    touched: dict[str, int] = defaultdict(int)
    for ws in trees.values():
        for w in ws:
            touched[w] += 1
    out = []
    for w in sorted(by, key=lambda k: (len(k), k)):
        rs = by[w]
        prompt = sum(r["input_tokens"] for r in rs) / 1e6
        prefill = sum(r["input_tokens"] - r.get("cached_tokens", 0) for r in rs) / 1e6
        out.append((w, len(rs), prompt, prefill, p90([r["ttft"] for r in rs]), touched[w]))
    return out


def report(run: Path, show_rows: bool) -> None:
    """Print one run's spread: min / median / max and max over mean of each per-engine figure."""
    by, trees = load(run)
    table = rows(by, trees)
    every = [r for rs in by.values() for r in rs]
    hit = sum(r.get("cached_tokens", 0) for r in every) / max(1, sum(r["input_tokens"] for r in every))
    print(
        f"{run}: {len(table)} engines, {len(every)} requests, TTFT p90 {p90([r['ttft'] for r in every]):.2f} s, "
        f"hit {hit:.1%}, engines per tree {sum(len(s) for s in trees.values()) / len(trees):.2f}"
    )
    if show_rows:
        print(
            f"  {'worker':>6} {'requests':>8} {'prompt Mtok':>11} {'prefill Mtok':>12} {'TTFT p90 s':>10} {'trees':>5}"
        )
        for w, n, pr, pf, t, k in table:
            print(f"  {w:>6} {n:8d} {pr:11.1f} {pf:12.2f} {t:10.1f} {k:5d}")
    for col, name in ((1, "requests"), (2, "prompt Mtok"), (3, "prefill Mtok"), (4, "TTFT p90 s")):
        v = sorted(r[col] for r in table)
        print(
            f"  {name:>12}: min {v[0]:.2f}  median {v[len(v) // 2]:.2f}  max {v[-1]:.2f}  "
            f"max/mean {v[-1] / statistics.mean(v):.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (or requests.jsonl files)")
    ap.add_argument("--rows", action="store_true", help="also print one row per engine")
    a = ap.parse_args()
    for run in a.runs:
        report(run, a.rows)


if __name__ == "__main__":
    main()
