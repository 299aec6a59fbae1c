"""`simulate --sweep lanes=LO..HI`: search for the knee, the most lanes that still meet the
interactivity tier, by bisection (met at LO, missed at HI, assumed monotone in between)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable

from rich.console import Console

from agentkv.errors import UserError
from agentkv.metrics.summary import Interactivity, Summary
from agentkv.sim.cluster import SimConfig

RANGE = re.compile(r"\s*(\d+)\s*\.\.\s*(\d+)\s*")
REL_TOLERANCE = 0.1  # stop when the bracket is within 10% of its lower end (at least 1 lane)


def split_range(specs: list[str]) -> tuple[list[str], tuple[int, int] | None]:
    """The sweep specs without a `lanes=LO..HI` one, and that range (None: a plain grid)."""
    rest, found = [], None
    for spec in specs:
        key, _, vals = spec.partition("=")
        if key.strip().lstrip("-").replace("-", "_") == "lanes" and ".." in vals:
            m = RANGE.fullmatch(vals)
            if m is None or not 1 <= int(m[1]) < int(m[2]):
                raise UserError(f"--sweep lanes: expected LO..HI with 1 <= LO < HI, got {vals!r}")
            found = (int(m[1]), int(m[2]))
        else:
            rest.append(spec)
    return rest, found


def bisect_lanes(run: Callable[[int], Summary], lo: int, hi: int) -> list[tuple[int, Summary]]:
    """Every point run while bracketing the knee between `lo` and `hi` (geometric midpoints)."""
    seen = [(lo, run(lo))]
    if not _met(seen[-1][1]):
        return seen
    seen.append((hi, run(hi)))
    if _met(seen[-1][1]):
        return seen
    while hi - lo > max(1, REL_TOLERANCE * lo):
        mid = min(hi - 1, max(lo + 1, round(math.sqrt(lo * hi))))
        s = run(mid)
        seen.append((mid, s))
        lo, hi = (mid, hi) if _met(s) else (lo, mid)
    return sorted(seen, key=lambda p: p[0])


def _met(s: Summary) -> bool:
    return s.interactivity is not None and s.interactivity.met


def search_results(
    args: argparse.Namespace, base: SimConfig, console: Console
) -> tuple[list[str], list[tuple[dict, Summary]]]:
    """(sweep keys, (overrides, summary) per point run) of a lanes search, for each setting of the
    other swept keys; the points run one after another in this process."""
    from agentkv.sim.cluster import simulate
    from agentkv.sim.command import load_traces
    from agentkv.sim.sweep import apply, parse_sweep

    rest, (lo, hi) = split_range(args.sweep)
    grid = parse_sweep(rest) if rest else [{}]
    configs = [apply(base, g) for g in grid]
    traces = load_traces(args)[0]
    results: list[tuple[dict, Summary]] = []
    for g, cfg in zip(grid, configs, strict=True):

        def run(lanes: int, g=g, cfg=cfg) -> Summary:
            res = simulate(traces, dataclasses.replace(cfg, lanes=lanes))
            console.print(f"[dim]done: { ({**g, 'lanes': lanes}) } ({res.wall_s:.1f} s)[/dim]")
            return res.summary

        results += [({**g, "lanes": str(n)}, s) for n, s in bisect_lanes(run, lo, hi)]
    return [*grid[0], "lanes"], results


def knees(results: list[tuple[dict, Summary]]) -> list[tuple[str, Interactivity | None, bool]]:
    """Per setting of the keys other than lanes ("k=v, ..."): its knee (None: no point meets the
    tier) and whether the knee is the most lanes run (the top still met)."""
    from agentkv.metrics.tier import knee

    groups: dict[tuple, list[Interactivity]] = {}
    for overrides, s in results:
        rest = tuple((k, v) for k, v in overrides.items() if k != "lanes")
        if s.interactivity is not None:
            groups.setdefault(rest, []).append(s.interactivity)
    out = []
    for rest, points in groups.items():
        k = knee(points)
        top = k is not None and k.sessions == max(p.sessions for p in points)
        out.append((", ".join(f"{key}={v}" for key, v in rest) or "all points", k, top))
    return out


def best_line(found: list[tuple[str, Interactivity | None, bool]]) -> str:
    """The setting whose knee gives the most agents per MW (e.g. the prefill:decode split of a
    `--sweep disagg=...` search), with agents per GPU and GPUs."""
    met = [(where, k) for where, k, _ in found if k is not None and k.agents_per_mw is not None]
    if not met:
        return "best: no setting meets the tier"
    where, k = max(met, key=lambda m: (m[1].agents_per_mw, m[1].agents_per_gpu or 0.0))
    gpus = round(k.agents / k.agents_per_gpu) if k.agents and k.agents_per_gpu else 0
    tied = [w for w, o in met if w != where and o.agents_per_mw == k.agents_per_mw]
    return (
        f"best ({len(met)} of {len(found)} settings meet the tier): {where}: {k.agents_per_mw:,.0f} agents/MW, "
        f"{k.agents_per_gpu:,.2f} agents/GPU on {gpus} GPUs"
        + (f" (tied with {'; '.join(tied)})" if tied else "")
    )
