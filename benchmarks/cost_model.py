"""Cost-model call rate: the simulator asks for a step time at every engine step, millions of times.

Run: .venv/bin/python benchmarks/cost_model.py   (prints calls/s, best of 5, for typical batches)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from timing import best_s

from agentkv.engine.cost import CostModel


def calls_per_s(fn: Callable[[], object], n: int = 20_000, repeat: int = 5) -> float:
    """Best-of-`repeat` rate of `n` calls (the least disturbed by other work on the machine)."""

    def calls() -> None:
        for _ in range(n):
            fn()

    return n / best_s(calls, repeat)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    d64 = [4096 + 37 * i for i in range(64)]
    d256 = [2048 + 11 * i for i in range(256)]
    models = (
        CostModel("h200", "llama3-70b", tp=4),
        CostModel("h200", "deepseek-v3", tp=8),
        CostModel("h200", "deepseek-v4-pro", tp=8),
        CostModel("h200", "deepseek-v3", tp=1, dp=8, ep=True),
    )
    for cm in models:
        cases = {
            "decode only, 64 seqs": lambda cm=cm: cm.step_time((), d64),
            "decode only, 256 seqs": lambda cm=cm: cm.step_time((), d256),
            "1 prefill chunk + 64 decodes": lambda cm=cm: cm.step_time(((2048, 30_000),), d64),
            "step_time_agg (aggregates kept by the caller)": lambda cm=cm: cm.step_time_agg(
                2048, 30_000, 2048 * 2049 / 2, 2048 * 30_000.0, True, 1, 64, 300_000, 6427
            ),
            "decode_steps, 64 seqs x 32 steps (per call)": lambda cm=cm: cm.decode_steps(
                64, 300_000, 6427, 32
            ),
        }
        print(f"{cm!r}")
        for name, fn in cases.items():
            print(f"  {name:48s} {calls_per_s(fn, n=5_000) / 1e6:6.2f} M calls/s")


if __name__ == "__main__":
    main()
