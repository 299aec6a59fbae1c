"""Fit the cost model's coefficients to probe measurements, with the cost model's own formula."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from agentkv.calib.plan import DECODING, Probe
from agentkv.engine.calibrate import FREE
from agentkv.engine.cost import CostCoefficients, CostModel, load_coefficients

# outside the engine steps, in wall time: per request (HTTP, queueing) and per prompt token (parsing,
# hashing); a time scale multiplies both into engine seconds
OVERHEAD = {"request_ms": (1.0, 0.0, 1000.0), "token_us": (0.1, 0.0, 100.0)}
# interference is reported, not fitted: its measurement is a maximum of gaps, which any hiccup of a
# busy host inflates
FITTED = ("prefill_cold", "prefill_cached", "decode", "floor")  # floor: calib.floor's long decodes
# FREE's coefficients, fitted as logarithms within bounds far wider than fit_cost.py's H200 ones: a
# black box may be a CPU (GEMMs 10^4 x slower than the catalogue part, milliseconds of step overhead)
WIDE = {
    "gemm_eff": (1e-7, 1.0),
    "overlap_k": (1.0, 20.0),
    "attn_self_eff": (1e-7, 1.0),
    "attn_past_eff": (1e-7, 1.0),
    "stream_gbps": (1e-3, 4000.0),
    "past_setup_s": (1e-9, 1.0),
    "launch_floor_s": (1e-9, 1.0),
    "floor_k": (1.0, 40.0),
    "copy_gbps": (1e-2, 1e5),
}
# and the copy roof, which FREE leaves at the catalogue GPU's: it is the rate a batch's KV is read at
# (the sum of its contexts), where `stream_gbps` reads one sequence's (the longest context). vLLM's CPU
# build reads the sum ~1,000x slower than an H200 (decode 32 x 1,024 -> 32 x 4,096 tokens: +5.9 ms a
# step, one stream 1,024 -> 4,096: +0.8 ms); with the roof held, only the longest context could pay for
# it, and the fit missed one-stream decode steps by +50-90% (decode MAPE 31-53%)
NAMES = (*FREE, "copy_gbps")
# the first fit starts from the bundled coefficients and again with the copy roof at a CPU's (GB/s),
# keeping the better: from the catalogue's rate the KV term is too small for the roof's gradient to
# move it, and one live run's fit stayed there (decode MAPE 33% against 15% from a CPU's start)
CPU_COPY_GBPS = 10.0
STEP = 0.01  # relative change for the numerical derivatives (`jacobian`)


@dataclass(frozen=True, slots=True)
class Target:
    """What the engine is modelled as: catalogue GPU and model, TP, KV dtype, prefill chunk, time scale."""

    gpu: str
    model: str
    tp: int = 1
    kv_dtype: str = "bf16"
    chunk: int = 8192
    time_scale: float = 1.0

    def cost(self, coeffs: CostCoefficients | None = None) -> CostModel:
        return CostModel(self.gpu, self.model, tp=self.tp, kv_dtype=self.kv_dtype, coeffs=coeffs)


def host_delay(overhead: tuple[float, ...], prompt_tokens: int, others: int = 0) -> float:
    """Wall seconds before the engine sees a request: per request, per prompt token and (a third
    overhead, 0 when absent) per other request in flight, which a busy host serving them adds."""
    per_other = overhead[2] if len(overhead) > 2 else 0.0
    return overhead[0] + overhead[1] * prompt_tokens + per_other * others


def predict(cm: CostModel, t: Target, p: Probe, overhead: tuple[float, ...] = (0.0, 0.0)) -> float:
    """Engine seconds the probe measures: chunked prefill steps to the first token (plus the host
    delay of `overhead`), one decode step, for interference the longest step that batches a prefill
    chunk (the token budget less the decodes) with the decodes, and for loaded_ttft half a decode
    step (the one under way), the step batching the prompt with the decodes, and the host delay."""
    if p.family in DECODING:
        return cm.step_time([], [p.ctx + p.out // 2] * p.n)
    if p.family == "loaded_ttft":
        dec = [p.ctx + p.out // 2] * p.n
        eng = 0.5 * cm.step_time([], dec) + cm.step_time([(p.new, 0)], dec)
        return eng + host_delay(overhead, p.new, p.n) * t.time_scale
    if p.family == "interference":
        dec, worst, done, left = [p.ctx + p.out // 2] * p.n, 0.0, 0, p.new
        while left > 0:
            n = min(t.chunk - p.n, left)
            worst = max(worst, cm.step_time([(n, done)], dec))
            done, left = done + n, left - n
        return worst
    total, done, left = 0.0, p.past, p.new
    while left > 0:
        n = min(t.chunk, left)
        total += cm.step_time([(n, done)], [])
        done, left = done + n, left - n
    return total + host_delay(overhead, p.past + p.new) * t.time_scale


def _coeffs(x, base: CostCoefficients, names: tuple[str, ...] = tuple(FREE)) -> CostCoefficients:
    """The coefficients of the optimiser's vector (the logarithms of `names`, then the overheads)."""
    vals = {n: float(np.exp(v)) for n, v in zip(names, x, strict=False)}
    return replace(base, **vals)


# a probe's samples that agree to this (the standard error of their median, in log) weigh fully; one
# whose samples scatter more weighs in proportion less: on a busy host a 16-token prefill's samples
# spread 100-1,000% (host delay as large as the step) while a decode step's agree to 1-2%, and the
# former must not outvote the latter (docs/cost-model.md: the fit that put `stream_gbps` at +1,259%)
SPREAD_REF = 0.02


def weight(p: Probe) -> float:
    """The probe's weight in the fit: min(1, SPREAD_REF / the standard error of its median in log),
    from the spread (median absolute deviation) of its samples; 1 with a single sample. Two samples
    are spread enough to tell: the dearest probes are the ones a budget cuts to two, and a live run's
    32-stream decode probe, 10.0 and 54.0 ms (a busy moment), weighed fully at their mean, 32 ms."""
    if len(p.samples_s) < 2 or min(p.samples_s) <= 0:
        return 1.0
    logs = np.log(p.samples_s)
    mad = float(np.median(np.abs(logs - np.median(logs)))) * 1.4826
    se = 1.253 * mad / np.sqrt(len(logs))
    return min(1.0, SPREAD_REF / se) if se > 0 else 1.0


def weights(probes: list[Probe]) -> dict[str, float]:
    """label: weight of each fitted probe the fit weighed less than fully (`weight`), for the profile."""
    out = {p.label(): round(float(weight(p)), 3) for p in probes if p.measured_s and p.family in FITTED}
    return {k: v for k, v in out.items() if v < 1.0}


# a host hiccup (a late wake-up, a GC pause) can add tens of ms to one probe even after the least of
# its samples: residuals beyond ~5% (in log) weigh linearly, not quadratically (soft L1)
ROBUST_SCALE = 0.05


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted coefficients, the overheads (wall s per request, per prompt token), each free
    coefficient's standard error in % of its value (from the Jacobian; large or None: the probes do
    not pin it), and those the probes cannot pin on this target at all (name: why; see identify.py)."""

    coeffs: CostCoefficients
    overhead: tuple[float, float]
    stderr_pct: dict[str, float | None]
    not_identifiable: dict[str, str] = field(default_factory=dict)
    rms: float = 0.0  # root mean square of log(predicted / measured) over the fitted probes
    loss: float = 0.0  # the minimised soft-L1 sum over the fitted probes (~ the sum of squares, in log)
    points: int = 0  # fitted probes
    held: tuple[str, ...] = ()  # coefficients an earlier stage fixed (calib.pair): later refits keep them
    free: tuple[str, ...] = tuple(FREE)  # the coefficients the first fit freed: later stages judge these


def fit(
    t: Target,
    probes: list[Probe],
    start: CostCoefficients | None = None,
    fixed: CostCoefficients | None = None,
    names: tuple[str, ...] = tuple(FREE),
) -> Fit:
    """Bounded least squares (soft L1) on log(predicted / measured) over the logarithms of `names`
    (WIDE bounds; calibrate's `NAMES` frees the copy roof too) and the two overheads; the other
    coefficients stay `fixed`'s (default: the bundled ones). Without `start`, from the bundled
    coefficients, and with the copy roof free also from `CPU_COPY_GBPS`: the better fit."""
    base = fixed or load_coefficients()
    pts = [p for p in probes if p.measured_s and p.family in FITTED]
    if start is not None:
        return _fit_from(t, pts, start.to_dict(), base, names)
    src = base.to_dict() | {n: v[0] for n, v in FREE.items()}
    starts = [src] + ([src | {"copy_gbps": CPU_COPY_GBPS}] if "copy_gbps" in names else [])
    return min((_fit_from(t, pts, s, base, names) for s in starts), key=lambda f: f.loss)


def _fit_from(t: Target, pts: list[Probe], src: dict, base: CostCoefficients, names: tuple[str, ...]) -> Fit:
    """`fit` of the fitted probes `pts` from the coefficients `src` (a dict by name)."""
    from scipy.optimize import least_squares

    meas = np.array([p.measured_s for p in pts])
    w = np.array([weight(p) for p in pts])

    def residuals(x):
        cm = t.cost(_coeffs(x, base, names))
        ov = (x[-2] / 1e3, x[-1] / 1e6)
        return w * np.log(np.array([predict(cm, t, p, ov) for p in pts]) / meas)

    oh = list(OVERHEAD.values())
    lo = [np.log(WIDE[n][0]) for n in names] + [v[1] for v in oh]
    hi = [np.log(WIDE[n][1]) for n in names] + [v[2] for v in oh]
    x0 = [
        float(np.clip(np.log(max(src[n], WIDE[n][0])), a, b)) for n, a, b in zip(names, lo, hi, strict=False)
    ]
    x0 += [v[0] for v in oh]
    res = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac", loss="soft_l1", f_scale=ROBUST_SCALE)
    rms = float(np.sqrt(np.mean(res.fun**2)))
    ov = (float(res.x[-2]) / 1e3, float(res.x[-1]) / 1e6)
    fitted = _coeffs(res.x, base, names)
    return Fit(
        fitted, ov, _stderr(res, names), rms=rms, loss=2 * float(res.cost), points=len(pts), free=names
    )


def fit_loaded(
    t: Target, probes: list[Probe], coeffs: CostCoefficients, overhead: tuple[float, ...]
) -> float:
    """Wall seconds per other request in flight (>= 0): the least-squares slope, through zero, of
    what loaded_ttft probes measured beyond their prediction without it, against their streams (the
    intercept is the fitted per-request overhead); 0 without such probes."""
    cm, base = t.cost(coeffs), (overhead[0], overhead[1], 0.0)
    pts = [p for p in probes if p.measured_s and p.family == "loaded_ttft" and p.n > 0]
    extra = [(p.measured_s - predict(cm, t, p, base)) / t.time_scale for p in pts]
    den = sum(p.n * p.n for p in pts)
    return max(0.0, sum(p.n * e for p, e in zip(pts, extra, strict=True)) / den) if den else 0.0


def _stderr(res, names: tuple[str, ...]) -> dict[str, float | None]:
    """Relative standard errors (%) of the free coefficients: sqrt(diag((J'J)^-1) x residual variance)
    of their logarithms (a log's standard error is the value's relative one); None where the probes do
    not move the coefficient at all (a flat Jacobian column, e.g. pinned at a bound)."""
    j, r = res.jac, res.fun
    dof = max(len(r) - len(res.x), 1)
    cov = np.linalg.pinv(j.T @ j) * float(r @ r) / dof
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    col = np.linalg.norm(j, axis=0)
    flat = col < 1e-6 * max(float(col.max()), 1e-300)
    return {n: None if flat[i] else round(float(se[i] * 100), 2) for i, n in enumerate(names)}


def errors(
    t: Target, probes: list[Probe], coeffs: CostCoefficients, overhead: tuple[float, ...]
) -> dict[str, float]:
    """Mean absolute percentage error per probe family (and 'all' over the fitted families)."""
    cm = t.cost(coeffs)
    by: dict[str, list[float]] = {}
    for p in probes:
        if p.measured_s:
            e = abs(predict(cm, t, p, overhead) / p.measured_s - 1.0) * 100
            by.setdefault(p.family, []).append(e)
            if p.family in FITTED:
                by.setdefault("all", []).append(e)
    return {k: round(sum(v) / len(v), 3) for k, v in by.items()}


def jacobian(
    t: Target,
    probes: list[Probe],
    c: CostCoefficients,
    overhead: tuple[float, float],
    names: tuple[str, ...] = tuple(FREE),
) -> np.ndarray:
    """d log(predicted) / d log(coefficient) for `names`, then d log(predicted) / d overhead (per
    request and per token, in units of 1 ms and 1 us), one row per fitted probe."""
    pts = [p for p in probes if p.measured_s and p.family in FITTED]
    base = np.log([predict(t.cost(c), t, p, overhead) for p in pts])
    cols = []
    for n in names:
        up = t.cost(replace(c, **{n: getattr(c, n) * (1 + STEP)}))
        cols.append((np.log([predict(up, t, p, overhead) for p in pts]) - base) / np.log1p(STEP))
    for d in ((1e-3, 0.0), (0.0, 1e-6)):
        ov = (overhead[0] + d[0], overhead[1] + d[1])
        cols.append(np.log([predict(t.cost(c), t, p, ov) for p in pts]) - base)
    return np.array(cols).T
