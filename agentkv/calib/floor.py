"""The launch-floor ladder: one stream decoding long from a tiny, a moderate and a long context.

A layer's time is ||(GPU time, launch floor)||_floor_k, and every step reads all weights, so a
layer's GPU time is never under its weight read: the floor shows most where the step is the weight
read alone, one stream at a tiny context (`FLOOR_CTX[0]`; Qwen2.5-7B on an H100 with a 60 us floor
under a 157 us read: 3.2% of the step), less as the step's KV read grows (4K: 1.9%, 16K: 0.8%); the
rungs give the floor's decay, which tells the floor from its exponent and both from the stream's KV
rate. A stream of `FLOOR_OUT` tokens averages its steps, so its inter-token time carries little of
the host's jitter (0.01-0.05% against agentkv serve at load 3-6, where a 16-token prefill carried
+19-25%), and no per-request host time: the three are solved from the ladder alone and held while
the rest is refitted (`floor_from_ladder`), as the cached-past setup from its pair.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from agentkv.calib.fit import WIDE, Fit, Target, fit, jacobian, predict
from agentkv.calib.plan import Probe
from agentkv.engine.calibrate import FREE
from agentkv.engine.cost import CostCoefficients

FAMILY = "floor"
FLOOR_CTX = (16, 4096, 16384)  # the weight read alone; then a KV read of ~1/4 and ~1 of it (7B, 80 GB/s)
FLOOR_OUT = 256
FLOOR_SHARE = 1 / 3  # of calibrate's budget, at most, for the rungs chosen before the rest (~17 s of 90)
LADDER = ("launch_floor_s", "floor_k", "stream_gbps")  # what the ladder solves, alone
LADDER_LIMIT_PCT = 5.0  # above this standard error the ladder does not pin its terms (2 SE: 10%)
SIGMA_MIN = 1e-4  # a rung's timing error is taken as at least this (the engine's own stamps: ~0)
# on the client clock at least this: one 256-token stream's mean gap was off agentkv serve's own by
# -0.06% to +0.08% (the first and last tokens' delivery, load ~1), so the median of 3 samples ~0.03%;
# 3 samples agreeing to 0.01% still sat 0.1% off in a run, and the ladder then held a +22% floor
SIGMA_CLIENT_MIN = 3e-4


def floor_probes(max_model_len: int, kv_tokens: int | None = None) -> tuple[list[Probe], dict[str, str]]:
    """(The floor probes that fit `max_model_len` and the KV cache, label: why for those that do not)."""
    out, skipped = [], {}
    room = min(max_model_len, int(kv_tokens * 0.9)) if kv_tokens else max_model_len
    for ctx in FLOOR_CTX:
        p = Probe(FAMILY, n=1, ctx=ctx, out=FLOOR_OUT)
        need = ctx + FLOOR_OUT + 1
        if need > room:
            what = "max model length" if room == max_model_len else "KV cache (90%)"
            skipped[p.label()] = (
                f"needs {need:,} tokens ({ctx:,} context + {FLOOR_OUT} output + 1), the target's {what} holds {room:,}"
            )
        else:
            out.append(p)
    return out, skipped


def floor_first(plan: list[Probe]) -> list[Probe]:
    """The plan's floor probes, which calibrate chooses before the cheapest-first rest (after the
    decode anchors, within `FLOOR_SHARE` of the budget), as their streams are long and a cheapest-first
    cut would drop them first; none where the plan lacks a rung (the ladder needs all three; the rest
    then compete as any probe)."""
    rungs = [p for p in plan if p.family == FAMILY]
    return rungs if len({p.ctx for p in rungs}) == len(FLOOR_CTX) else []


def _rung_sigma(p: Probe, least: float = SIGMA_MIN) -> float:
    """The standard error of a rung's median, in log (1.253 x the samples' standard deviation /
    sqrt(n): a MAD of 3 samples, the least deviation, understated it 2x); `least` at least, and 1%
    (the client clock's reference) with fewer than 3 samples."""
    if len(p.samples_s) < 3 or min(p.samples_s) <= 0:
        return 0.01
    logs = np.log(p.samples_s)
    return max(1.253 * float(np.std(logs, ddof=1)) / math.sqrt(len(logs)), least)


def solve_ladder(
    t: Target, rungs: list[Probe], c: CostCoefficients, least: float = SIGMA_MIN
) -> CostCoefficients:
    """`c` with `LADDER` fitted to the rungs alone (least squares on log(predicted / measured), each
    rung over its timing error), to a tight tolerance (the floor and its exponent lie along a long,
    flat valley, where the joint fit's default tolerance stopped 30% short of exact data), from `c`'s
    values and from the calibration's starting ones, the better kept."""
    from scipy.optimize import least_squares

    sig = np.array([_rung_sigma(p, least) for p in rungs])
    meas = np.log([p.measured_s for p in rungs])
    lo, hi = [math.log(WIDE[n][0]) for n in LADDER], [math.log(WIDE[n][1]) for n in LADDER]

    def coeffs(x) -> CostCoefficients:
        return replace(c, **{n: float(math.exp(v)) for n, v in zip(LADDER, x, strict=True)})

    def residuals(x):
        cm = t.cost(coeffs(x))
        return (np.log([predict(cm, t, p) for p in rungs]) - meas) / sig

    best = None
    for start in ({n: getattr(c, n) for n in LADDER}, {n: FREE[n][0] for n in LADDER}):
        x0 = np.clip([math.log(max(start[n], WIDE[n][0])) for n in LADDER], lo, hi)
        res = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac", ftol=1e-15, xtol=1e-15, gtol=1e-15)
        if best is None or res.cost < best.cost:
            best = res
    return coeffs(best.x)


def ladder_se(t: Target, rungs: list[Probe], f: Fit, least: float = SIGMA_MIN) -> dict[str, float]:
    """Relative standard errors (%) of `LADDER` from the rungs alone at `f`: the rungs' Jacobian,
    each row weighted by its own timing error (`_rung_sigma`)."""
    sig = np.array([_rung_sigma(p, least) for p in rungs])
    j = jacobian(t, rungs, f.coeffs, (0.0, 0.0), LADDER)[:, : len(LADDER)] / sig[:, None]
    cov = np.linalg.pinv(j.T @ j)
    return {n: float(np.sqrt(max(cov[i, i], 0.0)) * 100) for i, n in enumerate(LADDER)}


def floor_from_ladder(t: Target, probes: list[Probe], f: Fit, engine_clock: bool = False) -> Fit:
    """`f` with the launch floor, its exponent and the stream KV rate solved from the floor rungs
    alone (the rest at `f`'s) and held while the rest is refitted around them; where a term's
    standard error (`ladder_se`) exceeds `LADDER_LIMIT_PCT`, or the ladder has under 3 rungs (3
    unknowns), `f` itself (the joint fit and `calib.identify` judge them as before). A rung's timing
    error is at least `SIGMA_CLIENT_MIN` on the client clock, `SIGMA_MIN` on the engine's."""
    rungs = [p for p in probes if p.family == FAMILY and p.measured_s]
    if len({p.ctx for p in rungs}) < len(LADDER) or any(n in f.held for n in LADDER):
        return f
    least = SIGMA_MIN if engine_clock else SIGMA_CLIENT_MIN
    solo = replace(f, coeffs=solve_ladder(t, rungs, f.coeffs, least))
    se = ladder_se(t, rungs, solo, least)
    if max(se.values()) > LADDER_LIMIT_PCT:
        return f
    names = tuple(n for n in f.free if n not in LADDER and n not in f.held)
    cur = fit(t, probes, start=solo.coeffs, fixed=solo.coeffs, names=names)
    stderr = (
        cur.stderr_pct | {n: round(v, 2) for n, v in se.items()} | {n: f.stderr_pct.get(n) for n in f.held}
    )
    return replace(
        cur, stderr_pct=stderr, held=(*f.held, *LADDER), not_identifiable=f.not_identifiable, free=f.free
    )
