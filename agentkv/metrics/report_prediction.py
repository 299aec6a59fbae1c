"""The prediction errors of a bench run (prediction.json, written by `agentkv predict RUN_DIR`) as
rows for report.html's panel and `agentkv compare`: TTFT/TPOT/E2E MAPE and bias, hit-rate diff."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

import numpy as np

from agentkv.errors import UserError
from agentkv.metrics.records import read_records
from agentkv.metrics.summary import read_summary

FIGURES = ("ttft", "tpot", "e2e")
HEADERS = ["figure", "requests", "MAPE %", "bias %", "|err| p50 %", "|err| p90 %"]


def read_prediction(folder: str | Path) -> dict | None:
    """prediction.json of a run folder; None when there is none; a one-line error when it is not one."""
    p = Path(folder) / "prediction.json"
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{p}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("overall"), dict):
        raise UserError(f"{p}: not an `agentkv predict` prediction.json (no 'overall')")
    return doc


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def prediction_rows(doc: dict) -> list[list[str]]:
    """One row per figure: requests compared, MAPE, signed bias, |error| p50 and p90 (in %)."""
    rows = []
    for f in FIGURES:
        e = doc["overall"].get(f)
        if not isinstance(e, dict):
            continue
        keys = ("mape_pct", "bias_pct", "abs_p50_pct", "abs_p90_pct")
        rows.append(
            [f.upper(), _num(e.get("n"), ",")]
            + [_num(e.get(k), "+.1f" if k == "bias_pct" else ".1f") for k in keys]
        )
    return rows


SUMMARY_HEADERS = [
    *("profile", "TTFT MAPE %", "TTFT bias %", "TPOT MAPE %", "TPOT bias %"),
    *("E2E MAPE %", "E2E bias %", "hit rate diff (points)"),
]


def prediction_summary(doc: dict) -> list[str]:
    """One line of cells per run (SUMMARY_HEADERS): the figures' MAPE and bias, the hit-rate diff."""
    cells = [str(doc.get("profile_name") or doc.get("profile") or "-")]
    for f in FIGURES:
        e = doc["overall"].get(f)
        e = e if isinstance(e, dict) else {}
        cells += [_num(e.get("mape_pct"), ".1f"), _num(e.get("bias_pct"), "+.1f")]
    h = doc.get("hit_rate") if isinstance(doc.get("hit_rate"), dict) else {}
    return [*cells, _num(h.get("diff_points"), "+.2f")]


def prediction_line(doc: dict) -> str:
    """The profile and the hit-rate difference, one line."""
    h = doc.get("hit_rate") if isinstance(doc.get("hit_rate"), dict) else {}
    meas, pred = h.get("measured"), h.get("predicted")
    hits = f"hit rate measured {_num(meas, '.1%')}, predicted {_num(pred, '.1%')}"
    diff = h.get("diff_points")
    hits += f" ({_num(diff, '+.2f')} points)" if diff is not None else ""
    return f"profile {doc.get('profile_name') or doc.get('profile') or '-'}: {hits}"


def prediction_panel(doc: dict | None) -> str:
    """report.html's panel ("" without a prediction)."""
    if doc is None:
        return ""
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in prediction_rows(doc)
    )
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS)
    return (
        "<h2>Prediction (agentkv predict)</h2>"
        f'<div class="sub">{escape(prediction_line(doc))}; error = (predicted - measured) / measured</div>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def rerender_report(folder: str | Path, doc: dict) -> Path:
    """report.html of a run folder written again from its summary.json and requests.jsonl, with the
    prediction panel (the ITL histogram from the records' token gaps)."""
    from agentkv.metrics.report import write_report

    d = Path(folder)
    s = read_summary(d / "summary.json")
    records = read_records(d / "requests.jsonl")
    gaps = [g for r in records if r.ok for g in r.itls]
    itl = np.asarray(gaps, dtype=float) if gaps else None
    return write_report(s, records, d / "report.html", itl, prediction=doc)
