"""Agents per megawatt: does a run meet an interactivity tier, and the most concurrent session trees
that do (the knee of a lanes sweep), per GPU and per provisioned MW. Pure arithmetic on summaries,
shared by simulate and bench (on summaries and, for bench, its records)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import Interactivity, Summary
from agentkv.units import parse_duration

DEFAULT_TIER = "tps=20,ttft_p90=10s"  # AA-AgentPerf's: >= 20 output tok/s per user, TTFT <= 10 s


def parse_tier(spec: str) -> tuple[float, float]:
    """`tps=20,ttft_p90=10s` -> (output tok/s per user, TTFT p90 seconds); one-line errors."""
    out = {"tps": 20.0, "ttft_p90": 10.0}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, sep, val = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in out:
            raise UserError(f"--tier: expected tps=N,ttft_p90=DURATION, got {part!r}")
        if key == "tps":
            if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", val.strip()):
                raise UserError(f"--tier tps: expected a number >= 0, got {val!r}")
            out[key] = float(val)
        else:
            out[key] = parse_duration(val.strip(), "--tier ttft_p90")
            if not out[key] > 0:
                raise UserError(f"--tier ttft_p90: must be > 0, got {val!r}")
    return out["tps"], out["ttft_p90"]


def power_mw(gpus: int, power_w_per_gpu: float) -> float:
    """Provisioned megawatts of `gpus` GPUs at `power_w_per_gpu` each (system share or board power)."""
    return gpus * power_w_per_gpu / 1e6


def interactivity(
    s: Summary,
    sessions: int | None,
    gpus: int | None,
    power_w_per_gpu: float | None,
    tier: tuple[float, float],
    basis: str = "",
    mean_trees: float | None = None,
) -> Interactivity:
    """The run `s` (with `sessions` lanes of session trees on `gpus` GPUs) against `tier`.

    Per-user speed is 1 / TPOT p50 (requests with one output token have no TPOT); a run with no
    TPOT, no TTFT or marked invalid does not meet the tier. Its agents are the session trees in
    progress on average (`mean_trees`, when known: lanes run dry once the traces are used up),
    else `sessions`. `sessions` None: no lane cap (open loop), so the trees in progress, rounded
    up, are what it offered. GPU count or power unknown (None): no per-GPU or per-MW figure."""
    tps_min, ttft_max = tier
    tps = 1.0 / s.tpot.p50 if s.tpot.p50 else None
    ttft = s.ttft.p90
    met = bool(s.valid and tps is not None and ttft is not None and tps >= tps_min and ttft <= ttft_max)
    if sessions is None:
        sessions = max(1, math.ceil(mean_trees or 0))
    mw = power_mw(gpus, power_w_per_gpu) if gpus and power_w_per_gpu else 0.0
    agents = min(float(sessions), mean_trees) if mean_trees is not None else float(sessions)
    return Interactivity(
        tier_tps=tps_min,
        tier_ttft_p90=ttft_max,
        tps_per_user_p50=tps,
        ttft_p90=ttft,
        met=met,
        sessions=sessions,
        agents=agents if met else None,
        agents_per_gpu=agents / gpus if met and gpus else None,
        agents_per_mw=agents / mw if met and mw > 0 else None,
        power_basis=basis,
        mean_trees=mean_trees,
    )


def knee(points: Sequence[Interactivity]) -> Interactivity | None:
    """The point with the most concurrent sessions that meets its tier (None: none does)."""
    met = [p for p in points if p.met]
    return max(met, key=lambda p: p.sessions) if met else None


def trees_in_progress(records: Sequence[RequestRecord]) -> float | None:
    """Session trees in progress, time-averaged over the records' span (first due to last end): a
    tree counts from its first request's due time to its last request's end, think gaps included
    (what simulate samples from its replay plan); None without records or span."""
    span: dict[str, tuple[float, float]] = {}
    for r in records:
        a, b = span.get(r.tree or r.session, (math.inf, -math.inf))
        span[r.tree or r.session] = (min(a, r.scheduled), max(b, r.end))
    if not span:
        return None
    lo, hi = min(a for a, _ in span.values()), max(b for _, b in span.values())
    return sum(b - a for a, b in span.values()) / (hi - lo) if hi > lo else None


def reached_text(i: Interactivity) -> str:
    """`met: 25.0 tok/s per user, TTFT p90 3.00 s` (or missed): the run against its tier."""
    got = f"{_num(i.tps_per_user_p50, ',.1f')} tok/s per user, TTFT p90 {_num(i.ttft_p90, ',.2f')} s"
    return f"{'met' if i.met else 'missed'}: {got}"


def agents_text(i: Interactivity) -> str:
    """`12.0 agents, 1.50 per GPU, 1,176 per MW` (a figure whose GPU count or power is unknown says
    so); `-` when the run missed its tier."""
    if not i.met:
        return "-"
    per_gpu = "unknown per GPU" if i.agents_per_gpu is None else f"{i.agents_per_gpu:,.2f} per GPU"
    per_mw = "unknown per MW" if i.agents_per_mw is None else f"{i.agents_per_mw:,.0f} per MW"
    return f"{_num(i.agents, ',.1f')} agents, {per_gpu}, {per_mw}"


def tier_text(i: Interactivity) -> str:
    return f"tier >= {i.tier_tps:g} tok/s, TTFT p90 <= {i.tier_ttft_p90:g} s"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)
