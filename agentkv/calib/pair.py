"""The cached-past setup from the pair of probes that differ by it alone, not from the joint fit.

A cold 16-token prompt and 16 new tokens after one cached block differ in engine time by the per-layer
setup of a cached-past kernel (a fifth of that step on a 7B model) and in host time by one block's
parsing; every other cached probe carries the host's per-token time of its whole past (0.5-1.6 us a
token on a busy host, drifting with its load), which the joint fit's one linear term cannot follow and
which took the setup's share with it (-12% to -22% at time scale 0.25). So the setup is solved from
the pair's least samples with the rest fitted, then held while the rest is refitted; its standard
error is the spread of the same estimate over the pair's samples in `CHUNKS` consecutive parts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from agentkv.calib.fit import WIDE, Fit, Target, fit, predict
from agentkv.calib.plan import Probe, tiny_pair

SETUP = "past_setup_s"
CHUNKS = 3  # the pair's samples in this many consecutive parts (one per repeat by default)
# above this standard error the pair does not pin the setup: a coefficient called pinned must be
# within 10% of the truth, two standard errors
PAIR_LIMIT_PCT = 5.0


def pair_of(probes: list[Probe]) -> tuple[Probe, Probe] | None:
    """The measured probes' `plan.tiny_pair`: the cold prompt and the fewest-past cached one."""
    return tiny_pair([p for p in probes if p.measured_s])


def solve_setup(t: Target, f: Fit, cold: Probe, cached: Probe, gap_s: float) -> float | None:
    """The setup at which the model's (cached - cold) time equals `gap_s`, the other coefficients and
    the overheads at `f`'s; None where no setup within WIDE's bounds does."""
    from scipy.optimize import brentq

    def excess(log_s: float) -> float:
        cm = t.cost(replace(f.coeffs, **{SETUP: math.exp(log_s)}))
        return predict(cm, t, cached, f.overhead) - predict(cm, t, cold, f.overhead) - gap_s

    lo, hi = math.log(WIDE[SETUP][0]), math.log(WIDE[SETUP][1])
    if excess(lo) > 0 or excess(hi) < 0:
        return None
    return math.exp(brentq(excess, lo, hi, xtol=1e-6))


def _spread_pct(t: Target, f: Fit, cold: Probe, cached: Probe, s: float) -> float | None:
    """Standard error (% of `s`) of the pair's estimate: the spread of it over `CHUNKS` consecutive
    parts of both probes' samples, over sqrt(CHUNKS); inf where a part has no solution, None
    without two samples a part."""
    n = min(len(cold.samples_s), len(cached.samples_s)) // CHUNKS
    if n < 2:
        return None
    parts = []
    for i in range(CHUNKS):
        gap = min(cached.samples_s[i * n : (i + 1) * n]) - min(cold.samples_s[i * n : (i + 1) * n])
        parts.append(solve_setup(t, f, cold, cached, gap))
    if None in parts:  # a part's gap is less than the rest of the model puts between the two
        return math.inf
    return statistics.stdev(parts) / math.sqrt(CHUNKS) / s * 100


def _least(p: Probe) -> float:
    """The least of the probe's samples (its measured time without samples): host delay only adds,
    and the medians of a busy host's 16-token prompts differ by twice the setup (+112% in one run)."""
    return min(p.samples_s) if p.samples_s else p.measured_s


def setup_from_pair(t: Target, probes: list[Probe], f: Fit) -> Fit:
    """`f` with the setup solved from the pair (`pair_of`) and held, the rest refitted around it
    (twice: the overheads move), its standard error from the pair's samples, and the setup named
    not identifiable where that error exceeds `PAIR_LIMIT_PCT` or the pair has no solution; `f`
    itself without the pair."""
    pair = pair_of(probes)
    if pair is None:
        return f
    cold, cached = pair
    gap, names, cur = _least(cached) - _least(cold), tuple(n for n in f.free if n != SETUP), f
    s = None
    for _ in range(2):
        s = solve_setup(t, cur, cold, cached, gap)
        if s is None:
            break
        held = replace(cur.coeffs, **{SETUP: s})
        cur = fit(t, probes, start=held, fixed=held, names=names)
    label = f"{cold.label()} against {cached.label()}"
    if s is None:
        why = (
            f"the pair {label} differs by {gap * 1e3:.3g} ms, less than the rest of the model has them apart"
        )
        return replace(f, not_identifiable={SETUP: why})
    se = _spread_pct(t, cur, cold, cached, s)
    finite = se if se is not None and math.isfinite(se) else None
    cur = replace(cur, stderr_pct=cur.stderr_pct | {SETUP: finite}, held=(SETUP,), free=f.free)
    if se is None or se > PAIR_LIMIT_PCT:
        if se is None:  # the budget ended its rounds early
            known = "has too few samples to tell it"
        elif math.isinf(se):
            known = "leaves no room for it in a part of its samples"
        else:
            known = f"pins it to +-{se:.0f}% in this run's samples"
        why = f"the pair {label} (the setup alone apart) {known}"
        cur = replace(cur, not_identifiable={SETUP: why})
    return cur
