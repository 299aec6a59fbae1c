"""The host's own noise floor beside the model's error (issue #17): live runs of one plan predict one
another through `accuracy.repeatability`, and `scripts/live_repeat.py` prints it or ends bad input
in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.calib.accuracy import repeatability

ROOT = Path(__file__).resolve().parents[1]


def _run(ttfts: list[float], pred: float = 1.0) -> list[dict]:
    """One run's rows: each request's measured TTFT (TPOT and E2E fixed), the model saying `pred`."""
    return [
        {"id": i, "ttft": t, "ttft_pred": pred, "tpot": 0.01, "tpot_pred": 0.01, "e2e": 2.0, "e2e_pred": 2.0}
        for i, t in enumerate(ttfts)
    ]


def test_runs_that_repeat_have_no_floor_and_noisy_runs_set_one() -> None:
    same = repeatability([_run([1.0, 2.0]), _run([1.0, 2.0])])
    assert same["ttft"]["pair_mape_pct"] == {"median": 0.0, "min": 0.0, "max": 0.0}
    assert same["ttft"]["floor_mape_pct"] == [0.0, 0.0]
    assert same["ttft"]["model_mape_pct"] == [25.0, 25.0]  # |1-1|/1 and |1-2|/2, averaged
    rep = repeatability([_run([1.0]), _run([1.2]), _run([0.8])])
    # run 0 predicted by the mean of 1.2 and 0.8 is exact; run 1 by 0.9: 25%; run 2 by 1.1: 37.5%
    assert rep["ttft"]["floor_mape_pct"] == [0.0, 25.0, 37.5]
    assert rep["ttft"]["pair_mape_pct"]["max"] == 50.0  # 1.2 taken as the prediction of 0.8
    assert rep["tpot"]["floor_mape_pct"] == [0.0, 0.0, 0.0]


def test_requests_match_by_id_and_one_run_is_refused() -> None:
    a, b = _run([1.0, 3.0]), list(reversed(_run([1.0, 3.0])))
    assert repeatability([a, b])["ttft"]["floor_mape_pct"] == [0.0, 0.0]
    assert repeatability([a, b[:1]])["ttft"]["pair_mape_pct"]["max"] == 0.0  # only the common request
    with pytest.raises(ValueError, match="two runs"):
        repeatability([a])


def _script(*args: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/live_repeat.py"), *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_script_prints_the_floor_and_ends_bad_input_in_one_line(tmp_path: Path) -> None:
    dirs = []
    for k, ttfts in enumerate(([1.0, 2.0], [1.1, 1.8], [0.9, 2.2])):
        d = tmp_path / f"r{k}"
        d.mkdir()
        (d / "predictions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in _run(ttfts)))
        dirs.append(d)
    ok = _script(*dirs)
    assert ok.returncode == 0, ok.stderr
    assert "3 runs of one plan" in ok.stdout and "TTFT  run-vs-run" in ok.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "predictions.jsonl").write_text('{"id": 0, "ttft": 1}\nnot json\n')
    for args, want in (
        (
            (dirs[0], bad),
            "bad/predictions.jsonl:1: not a predictions.jsonl row (missing tpot, e2e, ttft_pred",
        ),
        ((dirs[0], tmp_path / "nowhere"), "No such file"),
        ((dirs[0],), "two runs"),
    ):
        r = _script(*args)
        assert r.returncode == 1 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
