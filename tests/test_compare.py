"""`agentkv compare A B`: two summaries side by side with absolute and relative differences."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentkv.bench.compare import compare, config_diff
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import summarize, write_summary


def _summary(kind: str, ttft: float, cached: int, config: dict):
    recs = [
        RequestRecord(
            id=i,
            trace="t",
            session="t#0",
            tree="t#0",
            index=i,
            scheduled=float(i),
            first_token=i + ttft,
            end=i + 0.5,
            ttft=ttft,
            e2e=0.5,
            tpot=0.01,
            input_tokens=1000,
            output_tokens=10,
            cached_tokens=cached,
            ceiling_tokens=900,
        )
        for i in range(10)
    ]
    return summarize(recs, kind=kind, target=kind, config=config, duration_s=10.0)


@pytest.fixture
def runs(tmp_path):
    a = _summary("simulate", 0.1, 800, {"lanes": 16, "engine": {"gpu": "h200"}})
    b = _summary("bench", 0.125, 900, {"lanes": 16, "api": "completions"})
    (tmp_path / "a").mkdir()
    write_summary(a, tmp_path / "a" / "summary.json")
    write_summary(b, tmp_path / "b.json")
    return a, b, tmp_path


def test_differences_absolute_and_relative(runs):
    a, b, _ = runs
    rows = {r.name: r for r in compare(a, b)}
    t = rows["TTFT p50"]
    assert t.a == pytest.approx(100.0) and t.b == pytest.approx(125.0)
    assert t.diff == pytest.approx(25.0) and t.rel == pytest.approx(0.25)
    hit = rows["cache hit: reported"]
    assert hit.a == pytest.approx(0.8) and hit.diff == pytest.approx(0.1)
    assert rows["requests"].diff == 0 and rows["requests"].rel == 0
    assert rows["goodput"].a is None and rows["goodput"].diff is None
    assert config_diff(a, b) == {"api": (None, "completions"), "engine.gpu": ("h200", None)}


def test_cli_prints_both_side_by_side(runs):
    _, _, tmp = runs
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "compare", str(tmp / "a"), str(tmp / "b.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "140"},
    )
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "TTFT p50" in ln)
    for cell in ("100.0", "125.0", "+25.0", "+25.0%"):
        assert cell in line
    hit = next(ln for ln in p.stdout.splitlines() if "cache hit: reported" in ln)
    assert "80.0%" in hit and "90.0%" in hit and "+10.0 pp" in hit
    assert "simulate" in p.stdout and "bench" in p.stdout


def test_cli_json(runs):
    _, _, tmp = runs
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "compare", str(tmp / "a"), str(tmp / "b.json"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    data = json.loads(p.stdout)
    ttft = next(f for f in data["figures"] if f["name"] == "TTFT mean")
    assert ttft["rel"] == pytest.approx(0.25)
    assert data["config_diff"]["api"] == [None, "completions"]


def test_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "junk.json").write_text("{}")
    for arg, needle in (
        (tmp_path / "missing", "no summary.json"),
        (tmp_path / "junk.json", "not an agentkv summary"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "agentkv.cli", "compare", str(arg), str(arg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
