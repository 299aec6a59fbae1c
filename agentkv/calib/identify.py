"""Which coefficients the probes can pin on this target, and what the profile keeps for the others.

A coefficient is identifiable when, with every probe timed to 1% (`SIGMA_REF`), the probes would
know it to `LIMIT_PCT`: its term must be a large enough share of some probed step, and not one
another coefficient can mimic (the launch floor and its exponent trade off freely where the floor
stays under a layer's weight read). This depends on the target's shapes, not on the noise of one run.
The launch floor is a threshold, which a linearised error cannot judge: its profile likelihood (the
fit redone with it fixed 25% higher, and 25% to 10x lower) must also rise by two standard errors of this
run's noise at every point (`floor_profile`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from agentkv.calib.fit import NAMES, WIDE, Fit, Target, fit, jacobian
from agentkv.calib.floor import floor_from_ladder
from agentkv.calib.pair import setup_from_pair
from agentkv.calib.plan import DECODING, Probe
from agentkv.engine.cost import CostCoefficients, load_coefficients

SIGMA_REF = 0.01  # the timing error per probe the test assumes (1%)
# on a target's own clock (agentkv serve's stamps, to the nanosecond, no host delay) the test assumes
# the fit's own RMS error instead, at least this: a coefficient pinned there is pinned by the engine
SIGMA_ENGINE_MIN = 1e-4
LIMIT_PCT = 25.0  # a coefficient known only to worse than this is not identifiable
# keep the defaults when the fit with them is at most this much worse (root mean square of log errors)
RMS_SLACK = (1.05, 0.001)
FLOOR = ("launch_floor_s", "floor_k")
ROOF = "copy_gbps"  # the copy roof, which calibrate frees too (fit.NAMES; `catalogue_roof`)
# the launch floor's profile: refitted fixed at these multiples of its fitted value (`floor_profile`);
# the whole lower range, as a floor under every probed layer's time leaves no trace the others cannot take
PROFILE = (1 + LIMIT_PCT / 100, 1 / (1 + LIMIT_PCT / 100), 0.5, 0.25, 0.1)
# the profile must rise by this many noise variances at each point (two standard errors, ~95%)
RISE = 4.0


def structural_se(j: np.ndarray, sigma: float = SIGMA_REF) -> np.ndarray:
    """Relative standard errors (%) of each column's parameter at `sigma` timing error per row
    (infinite for a column the rows do not move, or one others can reproduce exactly)."""
    norm = np.linalg.norm(j, axis=0)
    ok = norm > 1e-12
    u, s, vt = np.linalg.svd(j[:, ok] / norm[ok], full_matrices=False)
    # the floor squared must stay a normal float (1e-300 squared underflowed to 0: a divide-by-zero warning)
    inv = np.where(s > 1e-9 * s.max(), 1.0 / np.maximum(s, 1e-150) ** 2, 1e30)
    var = (vt.T**2) @ inv
    out = np.full(j.shape[1], np.inf)
    out[ok] = np.sqrt(var) / norm[ok] * sigma * 100
    return out


def _off_bounds(c: CostCoefficients) -> CostCoefficients:
    """`c` with each coefficient the fit left at a bound of its range (where a log-space derivative
    vanishes: noise pushed it there) back at its bundled default, so identifiability is judged at a
    plausible value of every term."""
    default = load_coefficients()
    edge = {
        n: getattr(default, n) for n, (lo, hi) in WIDE.items() if not lo * 1.01 < getattr(c, n) < hi / 1.01
    }
    return replace(c, **edge)


def floor_profile(t: Target, probes: list[Probe], f: Fit, sigma: float = SIGMA_REF) -> float:
    """The profile likelihood of the launch floor: refit the rest with the floor fixed at each
    `PROFILE` multiple of its fitted value; the smallest rise of the fit's loss, in units of one
    probe's noise variance (this run's residual variance, at least `sigma` squared). Under
    `RISE`, the probes do not know the floor to +-`LIMIT_PCT`%: it is not pinned, however well the
    linearised standard error says it is (the floor is a threshold: host delay on the smallest steps
    can fit one where the engine has none, and a floor under every probed step leaves no trace)."""
    var = max(f.loss / max(f.points - len(f.free) - 2, 1), sigma**2)
    names = tuple(n for n in f.free if n != "launch_floor_s" and n not in f.held)
    rises = []
    for k in PROFILE:
        fixed = replace(f.coeffs, launch_floor_s=f.coeffs.launch_floor_s * k)
        rises.append((fit(t, probes, start=f.coeffs, fixed=fixed, names=names).loss - f.loss) / var)
    return min(rises)


def unpinned(t: Target, probes: list[Probe], f: Fit, sigma: float = SIGMA_REF) -> dict[str, str]:
    """name: why, for the free coefficients these probes cannot pin on this target at the fit: those
    the probes would know only to worse than +-`LIMIT_PCT`% with `sigma` timing error (`structural_se`),
    the single-stream KV rate where the decode probes have one context (the budget cut the rest),
    and the launch floor where its profile (`floor_profile`) stays within this run's noise."""
    c, names = _off_bounds(f.coeffs), f.free
    j = jacobian(t, probes, c, f.overhead, names)
    se = structural_se(j, sigma)
    out = {}
    for i, n in enumerate(names):
        if se[i] > LIMIT_PCT:
            share = float(np.abs(j[:, i]).max()) * 10
            known = "not at all" if not np.isfinite(se[i]) or se[i] > 1e5 else f"to +-{se[i]:.0f}%"
            out[n] = (
                f"a 10% change moves no probed step by more than {share:.2g}%; with {sigma * 100:.2g}% timing error "
                f"the probes would know it {known}"
            )
    ctxs = {p.ctx for p in probes if p.measured_s and p.family in DECODING}
    if len(ctxs) < 2 and "stream_gbps" not in out:  # collinear with the floor at one context
        out["stream_gbps"] = (
            f"the decode probes have {len(ctxs) or 'no'} context{'s' * (len(ctxs) != 1)}: a step's fixed "
            "time and its reading of the context trade off freely"
        )
    if "launch_floor_s" not in out and (rise := floor_profile(t, probes, f, sigma)) < RISE:
        out["launch_floor_s"] = (
            f"fixed {LIMIT_PCT:.0f}% higher or {LIMIT_PCT:.0f}% to 10x lower ({f.coeffs.launch_floor_s * 1e6:.3g} "
            f"us fitted), the rest refitted, the fit's loss rises by as little as {max(rise, 0.0):.2f} of one "
            f"probe's noise variance (under {RISE:g}): the probes do not tell it apart"
        )
    return out


def _groups(bad: dict[str, str]) -> list[tuple[str, ...]]:
    """The unpinned coefficients as they are tried at their defaults: the launch floor and its
    exponent together (one without the other makes an odd pair), the others one at a time."""
    out = [g for g in (FLOOR,) if set(g) & set(bad)]
    return out + [(n,) for n in bad if n not in FLOOR]


def resolve(t: Target, probes: list[Probe], f: Fit, sigma: float = SIGMA_REF) -> Fit:
    """`f` with its unpinned coefficients marked (those `unpinned` names and those `f` already names,
    e.g. the cached-past setup its pair does not pin). Group by group, they take their bundled defaults
    (the rest refitted, `f.held` kept) unless the probes contradict the defaults (the fit's RMS error
    grows by more than `RMS_SLACK`); then they keep the fitted values, which reproduce the probed steps.
    The cached-past setup its pair solved keeps the pair's estimate: with the probes weighted by their
    spread (`fit.weight`) the default (another device's) barely changed the RMS error and replaced
    estimates within 20% by one 2.7x the truth."""
    # a coefficient an earlier stage solved and held is judged by that stage (pair, ladder)
    bad = {n: w for n, w in unpinned(t, probes, f, sigma).items() if n not in f.held} | f.not_identifiable
    default, cur, notes, held = load_coefficients(), f, {}, set(f.held)
    for g in _groups(bad):
        if set(g) <= set(f.held):
            notes |= {n: f"{bad[n]}; its estimate {getattr(cur.coeffs, n):.4g} is kept" for n in g}
            continue
        names = tuple(m for m in f.free if m not in held and m not in g)
        fixed = replace(cur.coeffs, **{n: getattr(default, n) for n in g})
        alt = fit(t, probes, start=cur.coeffs, fixed=fixed, names=names)
        ok = alt.rms <= f.rms * RMS_SLACK[0] + RMS_SLACK[1]
        for n in g:
            why = bad.get(n, "pinned only with the launch floor's other coefficient, which is not")
            if ok:
                notes[n] = f"{why}; the default {getattr(default, n):.4g} is kept"
            else:
                notes[n] = (
                    f"{why}; the default {getattr(default, n):.4g} fits the probes worse (RMS error "
                    f"{f.rms * 100:.1f}% -> {alt.rms * 100:.1f}%), so the fitted value stays"
                )
        if ok:
            cur = alt
            held |= set(g)
    se = dict.fromkeys(f.free) | {n: f.stderr_pct.get(n) for n in f.held} | cur.stderr_pct
    return replace(cur, stderr_pct=se, not_identifiable=notes, held=f.held, free=f.free)


def catalogue_roof(t: Target, probes: list[Probe], f: Fit) -> Fit:
    """`f` refitted with the copy roof back at the catalogue GPU's, and held there, unless the probes
    contradict it (the fit's RMS error grows by more than `RMS_SLACK`): on a GPU the catalogue's rate
    is known better than probes can tell it from the single-stream KV rate and the launch floor, which
    trade off with it; a CPU's (vLLM's CPU build) is ~1,000x slower, and the fitted one stays."""
    if ROOF not in f.free:
        return f
    free = tuple(n for n in f.free if n != ROOF)
    fixed = replace(f.coeffs, **{ROOF: getattr(load_coefficients(), ROOF)})
    alt = fit(t, probes, start=fixed, fixed=fixed, names=tuple(n for n in free if n not in f.held))
    if alt.rms > f.rms * RMS_SLACK[0] + RMS_SLACK[1]:
        return f
    se = alt.stderr_pct | {n: f.stderr_pct.get(n) for n in f.held}
    return replace(alt, stderr_pct=se, not_identifiable=f.not_identifiable, held=f.held, free=free)


def fit_all(t: Target, probes: list[Probe], engine_clock: bool = False) -> Fit:
    """What calibrate fits: the joint fit, the cached-past setup from its pair (`calib.pair`), the copy
    roof at the catalogue's where the probes allow (`catalogue_roof`), the launch floor, its exponent
    and the stream KV rate from the floor ladder (`calib.floor`), then each coefficient these probes
    cannot pin named (`resolve`): at `SIGMA_REF` timing error, or on the target's own clock at the
    fit's RMS error (at least `SIGMA_ENGINE_MIN`)."""
    paired = setup_from_pair(t, probes, fit(t, probes, names=NAMES))
    f = floor_from_ladder(t, probes, catalogue_roof(t, probes, paired), engine_clock)
    return resolve(t, probes, f, max(f.rms, SIGMA_ENGINE_MIN) if engine_clock else SIGMA_REF)
