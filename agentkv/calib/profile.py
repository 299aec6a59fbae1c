"""The profile JSON `agentkv calibrate` writes: where it was measured, the raw probes, the fit, the errors.

Its `coefficients` object is what `load_coefficients` reads, so a profile is a cost coefficient file."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from agentkv.calib.fit import Target
from agentkv.calib.plan import Probe

FIT_KEYS = (
    "overhead",
    "mape_pct",
    "stderr_pct",
    "not_identifiable",
    "weights",
    "first_token_ttft_s",
    "front_end_ttft_s",
    "front_end",
    "front_end_split",
)


def profile_doc(
    name: str,
    target_url: str,
    t: Target,
    server: dict,
    probes: list[Probe],
    fitted: dict | None,
    error: str | None,
    skipped: dict[str, str] | None = None,
) -> dict:
    """The profile as a JSON-ready dict; `fitted`: {'coefficients', 'overhead', 'mape_pct', 'stderr_pct',
    'not_identifiable', 'weights' (probes weighed less, their samples scattering), 'first_token_ttft_s'
    (the first-token delay's samples, optional), 'front_end_ttft_s' (the front end's curve, optional)} or None; `skipped`: label: why, for probes the target cannot run
    (`calib.floor`), kept as the profile's `skipped_probes`."""
    done = [asdict(p) for p in probes if p.measured_s is not None]
    doc = {
        "about": "agentkv calibrate: black-box probes of an OpenAI-compatible engine, fitted to the "
        "step-time cost model (docs/cost-model.md)",
        "name": name,
        "target": target_url,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "modelled_as": asdict(t),
        "server": server,
        "probes": done,
        "error": error,
        "skipped_probes": skipped or {},
    }
    if fitted is not None:
        c = {k: (float(f"{v:.6g}") if math.isfinite(v) else v) for k, v in fitted["coefficients"].items()}
        doc |= {
            "coefficients": c,
            "fit": {k: fitted[k] for k in FIT_KEYS if k in fitted} | {"points": len(done)},
        }
    return doc


def write_profile(path: str | Path, doc: dict) -> None:
    """Write `doc` as indented JSON (parent folders made)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
