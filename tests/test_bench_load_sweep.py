"""`agentkv bench --sweep lanes=...` against a test server of known capacity (at most 2 requests
stream at once, 5 ms a token): the sweep's knee under a TTFT SLO is that capacity, throughput
stops growing there, and every point leaves its usual outputs plus sweep.json and sweep.html."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkv.bench.sweep import between
from agentkv.bench.sweep_view import knee
from agentkv.cli import main
from agentkv.metrics.summary import read_summary
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace
from tests.serveutil import stream_server_process

CAPACITY, ITL, OUT_TOKENS = 2, 0.005, 25  # one request streams for ~125 ms; 2 at once


@pytest.fixture
def capped_server():
    with stream_server_process("--itl", str(ITL), "--max-running", str(CAPACITY)) as url:
        yield url


def write_traces(folder: Path, n: int = 6, turns: int = 40) -> Path:
    """Sessions with no think time: each lane keeps one request in flight all the time."""
    folder.mkdir()
    for s in range(n):
        reqs = [
            Request(
                t=i * 0.001,
                input_tokens=64 + 32 * i,
                output_tokens=OUT_TOKENS,
                hash_ids=list(range(s * 1000, s * 1000 + 4 + 2 * i)),
            )
            for i in range(turns)
        ]
        write_agentx(
            Trace(id=f"s{s}", block_size=16, session=Session(id=f"s{s}", requests=reqs)),
            folder / f"s{s}.json",
        )
    return folder


def test_sweep_finds_the_known_capacity_as_the_slo_knee(capped_server, tmp_path, capsys):
    traces, out = write_traces(tmp_path / "traces"), tmp_path / "sweep"
    argv = [
        "bench",
        str(traces),
        "--target",
        capped_server,
        "--duration",
        "1.2s",
        "--quiet",
        "--out",
        str(out),
    ]
    # a grid of 1 and 4 lanes (any order: lowest load first), then the SLO search halves the gap
    # between the knee and the first point past it: 2 (meets), 3 (misses), then nothing is left
    argv += ["--sweep", "lanes=4,1", "--slo", "ttft=60ms", "--slo-search", "3"]
    assert main(argv) == 0
    doc = json.loads((out / "sweep.json").read_text())
    pts = doc["points"]
    assert [p["lanes"] for p in pts] == [1, 2, 3, 4] and doc["key"] == "lanes"
    assert [p["k"] for p in pts] == [0, 2, 3, 1]  # run order: the grid, then the search
    # up to the capacity nothing waits; above it a third (lanes 3) or half (lanes 4) of requests
    # queue for a whole ~125 ms stream, so fewer than 90% meet TTFT <= 60 ms
    assert [p["meets_slo"] for p in pts] == [True, True, False, False], [p["slo_share"] for p in pts]
    assert doc["knee"] == 1 and pts[doc["knee"]]["lanes"] == CAPACITY
    tps = [p["output_tokens_per_s"] for p in pts]
    assert tps[1] > 1.6 * tps[0]  # below capacity throughput grows with the load
    assert max(tps[2:]) < 1.35 * tps[1]  # at capacity it stops growing
    for p in pts:  # a TPOT of ~5 ms: ~200 tok/s per user whatever the load (the server's own pace)
        assert 80 < p["interactivity_tokens_per_s_per_user"] < 1 / ITL * 1.1
        assert p["output_tokens_per_s_per_gpu"] is None and p["gpus"] is None  # unknown: per server
        assert p["slo_share"]["ttft"] == pytest.approx(p["goodput_fraction"])
        run = out / p["dir"]
        assert p["dir"] == f"point-{p['k']}"
        s = read_summary(run / "summary.json")
        assert s.config["lanes"] == p["lanes"] and s.requests == p["requests"] > 0
        assert (run / "requests.jsonl").stat().st_size > 0 and (run / "report.html").exists()
    assert doc["throughput_per"] == "server"
    html = (out / "sweep.html").read_text()
    assert "<svg" in html and "knee: lanes=2" in html and "output tok/s per server" in html
    assert html.count("<circle") == 9  # four points, the knee marker and a ring per point meeting the tier
    assert "tier: 20 tok/s per user" in html and html.count('stroke="#7c3aed" stroke-width="1.5"') == 1
    for n in (1, 2, 3, 4):  # each dot labelled with its load
        assert re.search(rf'<text x="[\d.]+" y="[\d.]+">{n}</text>', html)
    printed = capsys.readouterr().out
    assert "knee: lanes=2" in printed
    # every point streams ~200 tok/s per user: all meet the default tier, so its knee is the top
    # load; the test server reports no GPUs, so agents per GPU and per MW stay unknown
    assert [p["meets_tier"] for p in pts] == [True] * 4 and doc["tier_knee"] == 3
    assert all(p["agents_per_mw"] is None and 0 < p["agents"] <= p["lanes"] for p in pts)
    assert "tier knee (tps>=20, TTFT p90<=10s): at least" in doc["tier_knee_note"]
    assert "unknown per GPU, unknown per MW" in doc["tier_knee_note"] and "tier knee" in printed


def test_sweep_over_session_rate_without_an_slo(capped_server, tmp_path):
    traces, out = write_traces(tmp_path / "traces", n=30, turns=2), tmp_path / "sweep"
    argv = ["bench", str(traces), "--target", capped_server, "--duration", "1s", "--quiet", "--out", str(out)]
    argv += ["--sample", "25"]  # each point records the selection, as a single run does
    assert main([*argv, "--sweep", "session_rate=12,3", "--arrivals", "constant", "--json"]) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["key"] == "session_rate" and [p["session_rate"] for p in doc["points"]] == [3.0, 12.0]
    assert doc["knee"] is None and doc["knee_note"] == "no --slo: no knee"
    trees = []
    for p in doc["points"]:
        assert p["meets_slo"] is None and p["slo_share"] == {}
        s = read_summary(out / p["dir"] / "summary.json")
        assert s.config["session_rate"] == p["session_rate"] and s.config["lanes"] is None
        assert s.config["selection"]["sample"] == 25 and "trace_block_size" in s.config["selection"]
        trees.append(len({x.session for x in s.sessions}))
    assert trees[0] in (3, 4) and trees[1] in (12, 13)  # 1 s at 3/s and 12/s, the first at once


def test_ctrl_c_mid_sweep_keeps_the_points_done(capped_server, tmp_path):
    traces, out = write_traces(tmp_path / "traces"), tmp_path / "sweep"
    argv = [sys.executable, "-m", "agentkv.cli", "bench", str(traces), "--target", capped_server]
    argv += ["--duration", "1s", "--quiet", "--out", str(out), "--sweep", "lanes=1,2,3"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "point-1" / "requests.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    doc = json.loads((out / "sweep.json").read_text())
    assert [(x["lanes"], x["valid"], x["invalid_reason"]) for x in doc["points"]] == [
        (1, True, ""),
        (2, False, "interrupted"),
    ]
    assert not (out / "point-2").exists() and "Traceback" not in err


def row(k: int, meets: bool | None) -> dict:
    return {"k": k, "lanes": k + 1, "meets_slo": meets}


def test_the_knee_is_the_end_of_the_first_run_of_points_meeting_the_slo():
    assert knee([row(0, True), row(1, False), row(2, True)])[0]["k"] == 0  # a noisy later pass is no knee
    best, why = knee([row(0, True), row(1, True)])
    assert best["k"] == 1 and "at or above the highest load" in why
    assert knee([row(0, False), row(1, True)])[0] is None
    assert knee([row(0, None)]) == (None, "no --slo: no knee")


def test_the_slo_search_halves_the_gap_past_the_knee():
    rates = [
        {"k": 0, "session_rate": 1.0, "meets_slo": True},
        {"k": 1, "session_rate": 4.0, "meets_slo": False},
    ]
    assert between("session_rate", rates) == 2.5
    lanes = [{"k": 0, "lanes": 4, "meets_slo": True}, {"k": 1, "lanes": 5, "meets_slo": False}]
    assert between("lanes", lanes) is None  # no whole number of lanes in between
    assert between("lanes", [row(0, True), row(1, True)]) is None  # no point past the knee
    assert between("lanes", [row(0, False), row(1, False)]) is None  # no knee
