"""Timing shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so importable as `timing`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_s(fn: Callable[[], object], repeat: int = 5) -> float:
    """Best of `repeat` runs of `fn`, in seconds (the least disturbed by other work on the machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    """`best_s` in milliseconds."""
    return best_s(fn, repeat) * 1e3
