"""The H200 calibration points and how well the cost model reproduces them.

Each point of `data/calibration/h200-llama3-shapes.json` is one decoder layer (attention + MLP,
no embedding, lm_head or norms) timed eagerly in PyTorch and multiplied by the layer count
(`model_ms`). A prefill point is `new` tokens attending `past` cached tokens plus themselves
(lower-right causal); a decode point is `batch` sequences of `ctx` cached tokens each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from agentkv.engine.cost import CostCoefficients, CostModel
from agentkv.engine.hardware import ModelShape, get_gpu

CALIBRATION = "data/calibration/h200-llama3-shapes.json"
# held out of the fit: longer contexts (to 524K), measured later by scripts/gpu_long_context.py
LONG_CONTEXT = "data/calibration/h200-llama3-long-context.json"
PROBE_MODELS = ("llama3-8b", "llama3-70b")
# the coefficients a fit frees (scripts/fit_cost.py, agentkv calibrate): name: (start, lower, upper);
# times in seconds, rates in GB/s or fractions of the measured GEMM peak
FREE = {
    "gemm_eff": (0.9, 0.1, 1.0),
    "overlap_k": (1.3, 1.0, 20.0),
    "attn_self_eff": (0.45, 0.05, 1.0),
    "attn_past_eff": (0.4, 0.05, 1.0),
    "stream_gbps": (44.0, 1.0, 4000.0),
    "past_setup_s": (100e-6, 0.0, 1e-3),
    "launch_floor_s": (140e-6, 0.0, 1e-3),
    "floor_k": (1.7, 1.0, 40.0),
}
SCALE = {"past_setup_s": 1e-6, "launch_floor_s": 1e-6}  # optimise in microseconds


@dataclass(frozen=True, slots=True)
class CalPoint:
    """One measured step: `kind` 'prefill' (a=new, b=past) or 'decode' (a=batch, b=ctx); seconds for all layers."""

    model: str
    kind: str
    a: int
    b: int
    measured_s: float


@cache
def calibration(name: str = CALIBRATION) -> dict:
    """A bundled probe output, parsed (default: the points the cost model is fitted to)."""
    return json.loads(resources.files("agentkv").joinpath(name).read_text())


def probe_shape(name: str) -> ModelShape:
    """The exact shape the probe built for `name` (its vocab is only used by the lm_head, which it did not time)."""
    s = calibration()["parts"][name]["shape"]
    return ModelShape(name, s["layers"], s["h"], s["nh"], s["nkv"], s["hd"], s["inter"], s["vocab"])


def points(name: str = CALIBRATION) -> list[CalPoint]:
    """Every successful prefill and decode point of a probe file, both shapes."""
    out = []
    for model in PROBE_MODELS:
        part = calibration(name)["parts"][model]
        out += [
            CalPoint(model, "prefill", r["new"], r["past"], r["model_ms"] / 1e3)
            for r in part["prefill"]
            if "model_ms" in r
        ]
        out += [
            CalPoint(model, "decode", r["batch"], r["ctx"], r["model_ms"] / 1e3)
            for r in part["decode"]
            if "model_ms" in r
        ]
    return out


def predict(cm: CostModel, p: CalPoint) -> float:
    """The model's time for what the probe timed: all layers, no lm_head."""
    if p.kind == "prefill":
        n, past = p.a, p.b
        layer = cm.layer_time_agg(n, past, n * (n + 1) * 0.5, float(n * past), past > 0, 0, 0, 0)
    else:
        layer = cm.layer_time_agg(0, 0, 0.0, 0.0, False, p.a, p.a * p.b, p.b)
    return cm.model.layers * layer


def errors(
    coeffs: CostCoefficients | None = None, name: str = CALIBRATION
) -> list[tuple[CalPoint, float, float]]:
    """(point, predicted seconds, relative error) for every point of a probe file on an H200, bf16, tp=1."""
    h200 = get_gpu("h200")
    models = {n: CostModel(h200, probe_shape(n), coeffs=coeffs) for n in PROBE_MODELS}
    out = []
    for p in points(name):
        pred = predict(models[p.model], p)
        out.append((p, pred, pred / p.measured_s - 1.0))
    return out


def summary(errs: list[tuple[CalPoint, float, float]]) -> tuple[float, float]:
    """(mean absolute percentage error, worst absolute percentage error)."""
    abs_pct = [abs(e) * 100 for _, _, e in errs]
    return sum(abs_pct) / len(abs_pct), max(abs_pct)


def table_markdown(coeffs: CostCoefficients | None = None, name: str = CALIBRATION) -> str:
    """The per-point fit table (Markdown) with the MAPE and worst-error line under it."""
    errs = errors(coeffs, name)
    lines = [
        "| model | kind | grid point | measured ms | predicted ms | error % |",
        "|---|---|---|---:|---:|---:|",
    ]
    for p, pred, e in errs:
        grid = f"new={p.a}, past={p.b}" if p.kind == "prefill" else f"batch={p.a}, ctx={p.b}"
        lines.append(
            f"| {p.model} | {p.kind} | {grid} | {p.measured_s * 1e3:.2f} | {pred * 1e3:.2f} | {e * 100:+.1f} |"
        )
    mape, worst = summary(errs)
    lines.append("")
    lines.append(f"{len(errs)} points: MAPE {mape:.2f}%, worst {worst:.1f}%.")
    return "\n".join(lines)
