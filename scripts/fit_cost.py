"""Re-fit the step-time cost model to the bundled H200 calibration and print the coefficients and fit table.

Usage: python scripts/fit_cost.py [--write]
  --write  store the coefficients in agentkv/data/calibration/cost-h200.json (what the package loads).
Least squares on log(predicted / measured) over every prefill and decode point (scipy, bounded),
evaluating the package's own CostModel, so the fit and the runtime share one formula.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from agentkv.engine import calibrate
from agentkv.engine.calibrate import FREE, SCALE
from agentkv.engine.cost import COEFFICIENTS, CostCoefficients

OUT = Path(__file__).resolve().parents[1] / "agentkv" / COEFFICIENTS


def coeffs_from(x) -> CostCoefficients:
    """CostCoefficients from the optimiser's vector, with the measured ceilings fixed."""
    ceil = calibrate.calibration()["parts"]["ceilings"]
    vals = {n: float(v) * SCALE.get(n, 1.0) for n, v in zip(FREE, x, strict=True)}
    return CostCoefficients(copy_gbps=ceil["d2d_GBps"], gemm_tflops=ceil["bf16_gemm_TFLOPs"], **vals)


def fit() -> CostCoefficients:
    """Bounded least squares on log error over all calibration points."""
    meas = np.array([p.measured_s for p in calibrate.points()])

    def residuals(x):
        pred = np.array([pr for _, pr, _ in calibrate.errors(coeffs_from(x))])
        return np.log(pred / meas)

    x0 = [v[0] / SCALE.get(n, 1.0) for n, v in FREE.items()]
    lo = [v[1] / SCALE.get(n, 1.0) for n, v in FREE.items()]
    hi = [v[2] / SCALE.get(n, 1.0) for n, v in FREE.items()]
    res = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac")
    return coeffs_from(res.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {OUT}")
    args = ap.parse_args()
    c = fit()
    mape, worst = calibrate.summary(calibrate.errors(c))
    print("coefficient        value")
    for k, v in c.to_dict().items():
        print(f"{k:18s} {v:.6g}")
    print()
    print(calibrate.table_markdown(c))
    if args.write:
        src = calibrate.calibration()
        doc = {
            "about": "Step-time cost model coefficients fitted by scripts/fit_cost.py to "
            "h200-llama3-shapes.json (see docs/cost-model.md).",
            "device": src["device"],
            "fit": {
                "points": len(calibrate.points()),
                "mape_pct": round(mape, 3),
                "max_abs_pct": round(worst, 3),
            },
            "coefficients": {
                k: (float(f"{v:.6g}") if math.isfinite(v) else v) for k, v in c.to_dict().items()
            },
        }
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
