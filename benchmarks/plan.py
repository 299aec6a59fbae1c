"""Replay-plan throughput: items per second through `simulate_schedule` and the bare driver loop.

Uses the shared Claude Code traces when present (../shared/traces/claude-code or $AGENTKV_SHARED),
else 119 synthetic traces of the same size. Prints figures; asserts nothing.
Run: .venv/bin/python benchmarks/plan.py
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared"))


def load() -> tuple[str, list[Trace]]:
    src = SHARED / "traces" / "claude-code"
    if src.is_dir():
        from agentkv.trace.formats import load_paths

        return str(src), load_paths([src])
    reqs = [
        Request(t=i * 10.0, input_tokens=1000 + i, output_tokens=100, api_time=3.0, think_time=7.0)
        for i in range(68)
    ]
    return "synthetic", [
        Trace(id=f"s{i}", block_size=64, session=Session(id=f"s{i}", requests=reqs)) for i in range(119)
    ]


def best(fn, reps: int = 5) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - t0)
    return min(times), n


def simulate(traces: list[Trace], **kw) -> int:
    return len(simulate_schedule(ReplayPlan(traces, lanes=64, **kw), lambda it: it.request.api_time or 1.0))


def bare(traces: list[Trace]) -> int:
    """The driver loop alone: release everything due, complete it at once, repeat."""
    plan = ReplayPlan(traces, lanes=64)
    plan.start(0.0)
    n = 0
    while (due := plan.next_due()) is not None:
        for d in plan.pop_due(due):
            plan.complete(d.item.id, due)
            n += 1
    return n


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    src, traces = load()
    print(f"traces: {len(traces)} from {src}, {sum(t.num_requests for t in traces)} requests, 64 lanes")
    for name, fn in [
        ("simulate_schedule, one pass", lambda: simulate(traces)),
        ("simulate_schedule, warm start + shuffle", lambda: simulate(traces, warm_start=True, shuffle=True)),
        (
            "simulate_schedule, cycling to 100k items",
            lambda: simulate(traces, cycle=True, max_requests=100_000),
        ),
        ("bare pop_due/complete loop", lambda: bare(traces)),
    ]:
        dt, n = best(fn, reps=1 if "100k" in name else 5)
        print(f"{name:44s} {n:7d} items  {dt * 1e3:8.1f} ms  {n / dt / 1e3:7.0f} k items/s")


if __name__ == "__main__":
    main()
