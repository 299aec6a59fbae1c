"""report.html as a person sees it: a short bench demo against the embedded server and a simulate
run over all 119 shared Claude Code traces (600 requests), rendered in headless Chromium. Every panel must show
something (pixel spread in its box), the page must log no console error, and every chart's axes
must fit the data it draws (read from the SVG)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from reportutil import PANELS, check_axes_fit, chromium, read_png, region_stats, screenshot


def _agentkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    _agentkv("bench", "--duration", "4s", "--lanes", "4", "--out", str(out), "-q")
    return out


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory, shared_dir) -> Path:
    traces = str(shared_dir / "traces" / "claude-code")
    out = tmp_path_factory.mktemp("sim") / "run"
    _agentkv("simulate", traces, "--lanes", "119", "--max-requests", "600", "--out", str(out), "-q")
    return out


def _check_page(page: Path, tmp: Path, rows: int) -> None:
    exe = chromium()
    shot = tmp / f"{page.parent.name}.png"
    rects, console = screenshot(exe, page, shot, height=rows)
    assert console == [], console
    labels = [r[0] for r in rects]
    for name in PANELS:
        assert any(lbl.startswith(name) for lbl in labels), (name, labels)
    bottom = max(int(y + h) for _, _, y, _, h in rects) + 1
    img = read_png(shot, rows=bottom)
    assert img.shape[1] == 1400 and img.shape[0] >= bottom - 1
    for label, x, y, w, h in rects:
        spread, inked = region_stats(img, x, y, w, h)
        # a blank or "no data" panel is one colour with a caption: under 2% of pixels differ
        assert spread > 10 and inked > 0.04, (label, spread, inked)


def test_bench_demo_writes_every_output(bench_run):
    for name in ("requests.jsonl", "summary.json", "records.csv", "vllm_result.json", "report.html"):
        assert (bench_run / name).stat().st_size > 0, name
    lines = (bench_run / "requests.jsonl").read_text().splitlines()
    with open(bench_run / "records.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines) > 0
    assert [int(r["id"]) for r in rows] == [json.loads(ln)["id"] for ln in lines]
    html = (bench_run / "report.html").read_text()
    h1 = html[html.index("<h1>") : html.index("</h1>")]
    assert "llama3-8b" in h1 and "embedded agentkv serve" in h1 and "127.0.0.1" not in h1
    assert check_axes_fit(html) >= 12


def test_bench_report_renders_every_panel(bench_run, tmp_path):
    _check_page(bench_run / "report.html", tmp_path, 4200)


def test_simulate_report_of_119_real_traces_renders(sim_run, tmp_path):
    html = (sim_run / "report.html").read_text()
    assert "agentkv simulate: simulated 1x" in html
    assert check_axes_fit(html) >= 16
    assert "10 largest of 119 session trees" in html  # context growth: the rest in grey
    assert "other 89 trees (grouped)" in html  # hit rate per tree: 30 rows, the rest as one
    _check_page(sim_run / "report.html", tmp_path, 5200)
