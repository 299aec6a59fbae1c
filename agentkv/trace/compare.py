"""Real vs synthetic trace statistics side by side, each with the tolerance the synthesiser promises.

`python -m agentkv.trace.compare PATH...` prints the Markdown table in docs/traces.md; the tests
assert every row is within tolerance against the shared real traces.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from agentkv.trace.stats import Totals


class Row(msgspec.Struct, frozen=True):
    """One figure: real, synthetic, and how far apart they may be (relative or absolute)."""

    name: str
    real: float
    synth: float
    rel_tol: float | None = None
    abs_tol: float | None = None

    @property
    def ok(self) -> bool:
        if self.abs_tol is not None:
            return abs(self.synth - self.real) <= self.abs_tol
        return abs(self.synth - self.real) <= (self.rel_tol or 0.0) * abs(self.real)

    @property
    def tolerance(self) -> str:
        return f"± {self.abs_tol:g}" if self.abs_tol is not None else f"± {100 * (self.rel_tol or 0):.0f}%"


def _per_1k(count: int, t: Totals) -> float:
    return 1000.0 * count / t.requests if t.requests else 0.0


def rows(real: Totals, synth: Totals) -> list[Row]:
    """The compared figures. Rare events (compactions, sub-agents) get wide relative tolerances."""
    pairs = [
        ("requests / trace, p50", lambda t: t.requests_per_trace.p50, 0.25, None),
        ("requests / trace, p90", lambda t: t.requests_per_trace.p90, 0.35, None),
        ("first input tokens, p50", lambda t: t.first_input.p50, 0.25, None),
        ("first input tokens, p90", lambda t: t.first_input.p90, 0.35, None),
        ("input tokens / request, p50", lambda t: t.input.p50, 0.25, None),
        ("input tokens / request, p90", lambda t: t.input.p90, 0.35, None),
        ("context growth / turn, p50", lambda t: t.growth.p50, 0.15, None),
        ("context growth / turn, p90", lambda t: t.growth.p90, 0.3, None),
        ("output tokens / request, p50", lambda t: t.output.p50, 0.15, None),
        ("output tokens / request, p90", lambda t: t.output.p90, 0.3, None),
        ("think/tool gap s, p50", lambda t: t.gap.p50, 0.3, None),
        ("think/tool gap s, p90", lambda t: t.gap.p90, 0.5, None),
        ("side-call share", lambda t: t.side_calls / t.requests if t.requests else 0.0, None, 0.06),
        ("compactions / 1k requests", lambda t: _per_1k(t.compactions, t), 0.6, None),
        ("sub-agents / 1k requests", lambda t: _per_1k(t.subagents, t), 0.7, None),
        ("prefix-cache hit ceiling", lambda t: t.ceiling, None, 0.01),
    ]
    return [Row(name, float(f(real)), float(f(synth)), rel, ab) for name, f, rel, ab in pairs]


def markdown(table: list[Row]) -> str:
    """The rows as a Markdown table."""

    def fmt(x: float) -> str:
        return f"{x:.4f}" if abs(x) < 1 else f"{x:,.1f}" if abs(x) < 100 else f"{x:,.0f}"

    lines = ["| statistic | real | synthetic | tolerance | within |", "|---|---:|---:|---:|:---:|"]
    lines += [
        f"| {r.name} | {fmt(r.real)} | {fmt(r.synth)} | {r.tolerance} | {'yes' if r.ok else 'NO'} |"
        for r in table
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from agentkv.trace.formats import load_paths
    from agentkv.trace.stats import compute
    from agentkv.trace.synth import synthesize

    ap = argparse.ArgumentParser(prog="python -m agentkv.trace.compare", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", metavar="PATH", help="real traces (files or directories)")
    ap.add_argument("--sessions", type=int, default=120, help="synthetic sessions (default 120)")
    ap.add_argument("--seed", type=int, default=0, help="synthesis seed (default 0)")
    args = ap.parse_args(argv)
    real = compute(load_paths(args.paths)).total
    synth = compute(synthesize(args.sessions, args.seed)).total
    table = rows(real, synth)
    print(
        f"real: {real.traces} traces, {real.requests} requests; synthetic: {synth.traces} sessions "
        f"(seed {args.seed}), {synth.requests} requests\n"
    )
    print(markdown(table))
    return 0 if all(r.ok for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
