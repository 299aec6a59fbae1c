"""A bench run's prediction errors (`agentkv predict RUN_DIR`'s prediction.json) in its report.html
and in `agentkv compare`; an unreadable prediction.json is a warning, not a failed compare."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.engine.cost import load_coefficients
from agentkv.metrics.report_prediction import prediction_summary

CLI = [sys.executable, "-m", "agentkv.cli"]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def predicted(tmp_path_factory) -> dict:
    """A six-request embedded bench run, predicted with the bundled coefficients into its folder."""
    tmp = tmp_path_factory.mktemp("pred")
    prof = tmp / "prof.json"
    modelled = {"gpu": "h200", "model": "llama-3.1-8b", "tp": 1}
    prof.write_text(
        json.dumps(
            {"name": "bundled", "modelled_as": modelled, "coefficients": load_coefficients().to_dict()}
        )
    )
    run = tmp / "run"
    b = _cli(
        "bench",
        "--max-requests",
        "6",
        "--duration",
        "none",
        "--lanes",
        "2",
        "--traces-limit",
        "2",
        "--out",
        str(run),
        "-q",
        "--json",
    )
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["config"]["selection"]["traces_limit"] == 2  # compare warns on it
    plain = tmp / "plain"
    shutil.copytree(run, plain)  # the same run, no prediction
    before = (run / "report.html").read_text()
    p = _cli("predict", str(run), "--profile", str(prof))
    assert p.returncode == 0, p.stderr
    assert "added the prediction errors to" in p.stdout
    return {"tmp": tmp, "run": run, "plain": plain, "prof": prof, "before": before}


def test_report_gains_the_prediction_panel(predicted: dict) -> None:
    run = predicted["run"]
    doc = json.loads((run / "prediction.json").read_text())
    html = (run / "report.html").read_text()
    assert "Prediction (agentkv predict)" not in predicted["before"]
    assert "Prediction (agentkv predict)" in html and "profile bundled" in html
    ttft = doc["overall"]["ttft"]
    assert (
        f"<td>TTFT</td><td>{ttft['n']}</td><td>{ttft['mape_pct']:.1f}</td><td>{ttft['bias_pct']:+.1f}</td>"
        in html
    )
    assert "ITL distribution (every token gap)" in html  # re-rendered from the records' token gaps
    assert html.count("<svg") == predicted["before"].count("<svg")
    # --out elsewhere: the run's report is left alone
    again = _cli(
        "predict", str(run), "--profile", str(predicted["prof"]), "--out", str(predicted["tmp"] / "o")
    )
    assert again.returncode == 0 and "added the prediction" not in again.stdout
    assert not (predicted["tmp"] / "o" / "report.html").exists()


def test_compare_shows_and_survives_predictions(predicted: dict, tmp_path: Path) -> None:
    run, plain = str(predicted["run"]), str(predicted["plain"])
    doc = json.loads(Path(run, "prediction.json").read_text())
    res = _cli("compare", plain, run, "--json", "--out", str(tmp_path / "c.html"))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert list(out["predictions"]) == [run] and out["predictions"][run]["overall"] == doc["overall"]
    cells = prediction_summary(doc)
    html = (tmp_path / "c.html").read_text()
    assert "prediction errors (agentkv predict)" in html and f"<td>{cells[1]}</td>" in html
    text = _cli("compare", plain, run)
    assert text.returncode == 0 and "prediction errors" in text.stdout
    hostile = tmp_path / "hostile"
    shutil.copytree(plain, hostile)
    (hostile / "prediction.json").write_text('{"overall": [')
    bad = _cli("compare", plain, str(hostile), "--json")
    assert bad.returncode == 0, bad.stderr
    warn = json.loads(bad.stdout)["warnings"]
    assert any("prediction.json: cannot read" in w and "not shown" in w for w in warn), warn
    (hostile / "prediction.json").write_text('{"overall": {"ttft": {"mape_pct": "x"}}}')
    odd = _cli("compare", plain, str(hostile))
    assert odd.returncode == 0 and "Traceback" not in odd.stderr
