"""`agentkv compare RUN...`: N runs against the first, better/worse beyond a noise band, warnings
for different request sets or settings, aligned bench/simulate setting names, JSON and HTML."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from agentkv.bench.compare import Run, compare, config_diff, warnings
from agentkv.metrics.records import RequestRecord, encode_record
from agentkv.metrics.summary import summarize, write_summary

SIM_CFG = {"lanes": 16, "seed": 0, "engine": {"gpu": "h200", "block_size": 16, "tensor_parallel_size": 1}}
BENCH_CFG = {
    "lanes": 16,
    "seed": 0,
    "api": "completions",
    "server": {"gpu": "h200", "page_size": 16, "tp_size": 1},
}


def _records(ttfts, cached: int, sessions: int = 4, start: int = 0) -> list[RequestRecord]:
    return [
        RequestRecord(
            id=i,
            trace="t",
            session=f"t#{(start + i) % sessions}",
            index=(start + i) // sessions,
            scheduled=float(i),
            first_token=i + t,
            end=i + 1.0,
            ttft=t,
            e2e=1.0,
            tpot=0.01,
            input_tokens=1000,
            output_tokens=10,
            cached_tokens=cached,
            ceiling_tokens=950,
        )
        for i, t in enumerate(map(float, ttfts))
    ]


def _run(name: str, recs, kind="simulate", config=SIM_CFG) -> Run:
    s = summarize(recs, kind=kind, target=kind, config=config, duration_s=float(len(recs)))
    return Run(name=name, summary=s, records=recs)


def _rows(runs):
    return {r.name: r for r in compare(runs)}


def test_better_worse_and_noise_band():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.08, 0.12, 400)
    a = _run("a", _records(base, 800))
    slower = _run("slower", _records(base * 1.25, 900))  # same requests, 25% slower, more hits
    jitter = _run("jitter", _records(base * 1.01, 800))  # 1%: inside the 2% floor
    rows = _rows([a, slower, jitter])
    t = rows["TTFT p50"]
    assert t.better == "lower" and t.cells[1].verdict == "worse" and t.cells[2].verdict == "same"
    assert t.cells[1].rel == pytest.approx(0.25, rel=1e-6)
    hit = rows["cache hit: reported"]
    assert hit.cells[1].diff == pytest.approx(0.1) and hit.cells[1].verdict == "better"
    assert rows["requests"].cells[1].verdict == "same" and rows["goodput"].cells[1].verdict == ""
    assert rows["cache hit: ceiling"].better is None


def test_band_widens_with_per_request_spread():
    """A 10% shift of the median over 12 widely spread, unrelated requests is within the noise;
    the same shift over 400 paired requests is not."""
    rng = np.random.default_rng(2)
    wide = rng.lognormal(0.0, 1.0, 12)
    small = _rows([_run("a", _records(wide, 0)), _run("b", _records(rng.lognormal(0.0, 1.0, 12) * 1.1, 0))])
    assert small["TTFT p50"].cells[1].verdict == "same" and small["TTFT p50"].cells[1].band > 0.1
    many = rng.lognormal(0.0, 1.0, 400)
    big = _rows([_run("a", _records(many, 0)), _run("b", _records(many * 1.1, 0))])
    assert big["TTFT p50"].cells[1].verdict == "worse" and big["TTFT p50"].cells[1].band == pytest.approx(
        0.02
    )


def test_different_request_sets_and_workload_warn():
    a = _run("a", _records([0.1] * 20, 0))
    b = _run("b", _records([0.1] * 20, 0, start=5))  # shifted: 5 requests only in b, 5 only in a
    c = _run("c", _records([0.1] * 20, 0), config={**SIM_CFG, "lanes": 64})
    warn = warnings([a, b, c], config_diff([a, b, c]))
    assert any(
        "b replayed a different request set than a: 5 requests only in b, 5 only in a" in w for w in warn
    )
    assert not any("c replayed" in w for w in warn)
    assert any("workload setting lanes differs (16, 16, 64)" in w for w in warn)
    # without requests.jsonl, the summaries' sessions decide
    a2, b2 = (Run(name=r.name, summary=r.summary) for r in (a, _run("b", _records([0.1] * 12, 0))))
    assert any("b replayed a different request set" in w for w in warnings([a2, b2], {}))


def test_bench_and_simulate_settings_align():
    sim = _run("sim", _records([0.1] * 8, 0))
    bench = _run("bench", _records([0.1] * 8, 0), kind="bench", config=BENCH_CFG)
    diff = config_diff([sim, bench])
    assert "engine.block_size" not in diff and "server.page_size" not in diff and "engine.gpu" not in diff
    assert diff["api"] == [None, "completions"]
    other = _run(
        "bench64", _records([0.1] * 8, 0), kind="bench", config={**BENCH_CFG, "server": {"page_size": 64}}
    )
    assert config_diff([sim, other])["engine.block_size"] == [16, 64]


def _write(tmp_path, name, run: Run, records=True):
    d = tmp_path / name
    d.mkdir()
    write_summary(run.summary, d / "summary.json")
    if records:
        (d / "requests.jsonl").write_bytes(b"".join(encode_record(r) + b"\n" for r in run.records))
    return str(d)


def _cli(*args, columns="80"):
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "compare", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": columns},
    )


def test_cli_three_runs_table_json_html(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.uniform(0.5, 1.5, 200) * 1000  # TTFTs near 1,000 s: wide numbers at 80 columns
    a = _write(tmp_path, "base", _run("a", _records(base, 800)))
    b = _write(tmp_path, "slow", _run("b", _records(base * 1.3, 800), kind="bench", config=BENCH_CFG))
    c = _write(tmp_path, "fast", _run("c", _records(base * 0.7, 900)), records=False)
    p = _cli(a, b, c + "/summary.json", "--out", str(tmp_path / "cmp.html"))
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "TTFT p50" in ln)
    assert "+30.0% worse" in line and "-30.0% better" in line
    assert "…" not in p.stdout  # nothing cut at 80 columns, piped
    assert "fast replayed" not in p.stdout  # no records: compared by sessions, which match
    html = (tmp_path / "cmp.html").read_text()
    assert html.count("<svg") >= 5 and 'class="worse"' in html and "slow" in html and "api" in html
    data = json.loads(_cli(a, b, "--json").stdout)
    ttft = next(f for f in data["figures"] if f["name"] == "TTFT p50")
    assert ttft["cells"][1]["verdict"] == "worse" and data["settings_diff"]["api"] == [None, "completions"]


def test_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "junk.json").write_text("{}")
    good = _write(tmp_path, "good", _run("g", _records([0.1] * 4, 0)))
    for args, needle in (
        ((str(tmp_path / "missing"), good), "no summary.json"),
        ((str(tmp_path / "junk.json"), good), "not an agentkv summary"),
        ((good,), "at least two runs"),
        ((good, good, "--out", str(tmp_path / "junk.json" / "x.html")), "cannot write"),
    ):
        p = _cli(*args)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def _bars(html: str, title: str) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """(y, height) of each bar and (top, height) of the plot frame, in the chart titled `title`."""
    svg = next(s for s in html.split("<svg")[1:] if f'aria-label="{title}"' in s)
    frame = re.search(r'<rect x="[\d.]+" y="([\d.]+)" width="[\d.]+" height="([\d.]+)" class="plot"', svg)
    bars = re.findall(r'<rect x="[\d.]+" y="([\d.]+)" width="[\d.]+" height="([\d.]+)"><title>', svg)
    return [(float(y), float(h)) for y, h in bars], (float(frame[1]), float(frame[2]))


def test_html_bars_fit_their_axes_and_render(tmp_path):
    rng = np.random.default_rng(4)
    base = rng.uniform(0.1, 0.2, 100)
    runs = [
        _run("a", _records(base, 800)),
        _run("b", _records(base * 2, 800)),
        _run("c", _records(base * 3, 900)),
    ]
    from agentkv.bench.compare_view import write_html

    rows = compare(runs)
    page = tmp_path / "compare.html"
    write_html(runs, rows, config_diff(runs), warnings(runs, config_diff(runs)), page)
    html = page.read_text()
    bars, (top, height) = _bars(html, "TTFT p50")
    values = [c.value for c in next(r for r in rows if r.name == "TTFT p50").cells]
    assert len(bars) == 3
    for (y, h), v in zip(bars, values, strict=True):
        assert top <= y and y + h == pytest.approx(top + height, abs=0.2)  # inside the frame, on zero
        assert h / bars[-1][1] == pytest.approx(v / values[-1], rel=0.02)  # heights follow the values
    assert bars[-1][1] > 0.5 * height  # the axis is fitted to the data, not far above it
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium to render the page (the SVG was checked above)")
    shot = tmp_path / "compare.png"
    args = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    subprocess.run(
        [exe, *args, f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists() and shot.stat().st_size > 20_000  # a rendering, not a blank page


def test_load_and_selection_settings_warn():
    """Runs at other load (session rate, warm-up, clients) or over another trace selection warn;
    a setting only one kind of run records (bench's think_scale against simulate) does not."""
    base = {**BENCH_CFG, "session_rate": None, "warmup": None, "think_scale": 1.0}
    sel = {"sample": None, "traces_limit": None, "max_context": None, "over_context": "drop"}
    a = _run("a", _records([0.1] * 8, 0), kind="bench", config={**base, "selection": sel})
    b_cfg = {**base, "session_rate": 0.5, "warmup": "100 requests", "selection": {**sel, "sample": 40}}
    b_cfg["clients"] = [{"shard": 0, "pid": 11}, {"shard": 1, "pid": 12}]
    b = _run("b", _records([0.1] * 8, 0), kind="bench", config=b_cfg)
    warn = "\n".join(warnings([a, b], config_diff([a, b])))
    assert "workload setting session_rate differs (None, 0.5)" in warn
    assert "workload setting warmup differs (None, '100 requests')" in warn
    assert "workload setting clients differs (1, 2)" in warn
    assert "workload setting selection.sample differs (None, 40)" in warn
    assert "think_scale" not in warn and "over_context" not in warn
    sim = _run("sim", _records([0.1] * 8, 0))
    c = _run("c", _records([0.1] * 8, 0), kind="bench", config={**base, "think_scale": 2.0})
    assert not any("think_scale" in w for w in warnings([sim, c], config_diff([sim, c])))


def test_simulate_records_trace_selection(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentkv.cli", "simulate", "--sample", "2", "--max-requests", "20"]
    r = subprocess.run([*cmd, "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sel = json.loads((out / "summary.json").read_text())["config"]["selection"]
    assert sel["sample"] == 2 and sel["traces_limit"] is None and sel["over_context"] == "drop"


def test_sweep_points_record_the_selection_and_compare_warns(tmp_path, capsys):
    """A simulate --sweep point records the trace selection as a single run does (--trace-block-size
    and --cycle too), so comparing it with a run over another selection warns."""
    from agentkv.cli import main

    sim = ["simulate", "--max-requests", "20", "--quiet", "--trace-block-size", "64"]
    assert main([*sim, "--sample", "2", "--sweep", "lanes=1,2", "--out", str(tmp_path / "sw"), "--json"]) == 0
    assert main([*sim, "--traces-limit", "3", "--cycle", "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    points = sorted((tmp_path / "sw").glob("summary-*.json"))
    assert len(points) == 2
    for p in points:
        sel = json.loads(p.read_text())["config"]["selection"]
        assert (sel["sample"], sel["traces_limit"], sel["trace_block_size"]) == (2, None, "64")
    one = json.loads((tmp_path / "one" / "summary.json").read_text())["config"]
    assert one["cycle"] is True and one["selection"]["traces_limit"] == 3
    assert main(["compare", str(points[0]), str(tmp_path / "one"), "--json"]) == 0
    warn = "\n".join(json.loads(capsys.readouterr().out)["warnings"])
    assert "selection.sample differs (2, None)" in warn and "selection.traces_limit differs (None, 3)" in warn
    assert "workload setting cycle differs (False, True)" in warn
    assert main(["compare", str(points[0]), str(points[1]), "--json"]) == 0
    assert "selection" not in "\n".join(json.loads(capsys.readouterr().out)["warnings"])
