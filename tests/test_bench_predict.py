"""`agentkv bench --predict PROFILE`: one command benches and predicts the run. Against the embedded
server with a profile of its own coefficients the prediction matches; a bad profile fails before
the run; a failed run is not predicted."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentkv.cli import main
from agentkv.engine.cost import load_coefficients
from tests.cluster import CLI
from tests.serveutil import stream_server_process

SHORT = ["--max-requests", "8", "--duration", "none", "--time-scale", "10", "-q"]


def _profile(path: Path, **over) -> Path:
    """A profile of the embedded server's own model: its GPU and model, the bundled coefficients."""
    doc = {
        "name": "embedded",
        "coefficients": load_coefficients().to_dict(),
        "modelled_as": {"gpu": "h200", "model": "llama3-8b"},
    }
    path.write_text(json.dumps(doc | over))
    return path


def _bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "bench", *argv], capture_output=True, text=True, timeout=timeout)


def test_bench_predict_against_the_embedded_server(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    res = _bench(*SHORT, "--out", str(out), "--predict", str(_profile(tmp_path / "p.json")))
    assert res.returncode == 0, res.stderr
    assert "prefix-cache hit rate" in res.stdout and "output throughput" in res.stdout
    doc = json.loads((out / "prediction.json").read_text())
    rows = (out / "predictions.jsonl").read_text().splitlines()
    summary = json.loads((out / "summary.json").read_text())
    assert doc["requests"] == len(rows) == summary["succeeded"] == 8
    # serve steps the same engine with these coefficients: hits equal, throughput within a few %
    assert doc["hit_rate"]["predicted"] == pytest.approx(doc["hit_rate"]["measured"], abs=1e-9)
    assert doc["hit_rate"]["measured"] > 0.1
    assert abs(doc["throughput"]["diff_pct"]) < 3.0, doc["throughput"]
    # engine-clock stamps: each request arrives as it did; a busy host's late steps are the rest
    assert doc["overall"]["e2e"]["mape_pct"] < 10.0, doc["overall"]
    assert "Prediction" in (out / "report.html").read_text()
    assert main(["compare", str(out), str(out), "--json"]) == 0
    assert str(out) in json.loads(capsys.readouterr().out)["predictions"]


def _main(capsys, *argv: str) -> tuple[int, str]:
    """`agentkv bench ARGV` in this process: (exit status, stderr)."""
    rc = main(["bench", *argv])
    return rc, capsys.readouterr().err


def test_a_bad_profile_fails_before_the_run(tmp_path: Path, capsys) -> None:
    coeffs = load_coefficients().to_dict() | {"gemm_eff": -1}
    cases = [
        (tmp_path / "none.json", "none.json: cannot read the profile"),
        (_profile(tmp_path / "c.json", coefficients=coeffs), "c.json: 'coefficients'"),
        (
            _profile(tmp_path / "m.json", modelled_as={"gpu": "h200", "model": "nope"}),
            "m.json: 'modelled_as'",
        ),
        (_profile(tmp_path / "t.json", modelled_as=[]), "t.json: 'modelled_as' must be an object"),
    ]
    for path, says in cases:
        # a target nobody listens on: the check must come before bench reads the traces or connects
        rc, err = _main(
            capsys, "--target", "http://127.0.0.1:9", "--out", str(tmp_path / "o"), "--predict", str(path)
        )
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, (path, err)
        assert not (tmp_path / "o").exists()
    rc, err = _main(capsys, "--sweep", "lanes=1,2", "--predict", str(_profile(tmp_path / "p.json")))
    assert rc == 2 and "--predict simulates one run" in err, err


def test_a_failed_run_is_not_predicted(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    with stream_server_process("--ignore-stream") as url:  # every request fails: the run is invalid
        rc, err = _main(
            capsys,
            *SHORT,
            "--target",
            url,
            "--out",
            str(out),
            "--predict",
            str(_profile(tmp_path / "p.json")),
        )
    assert rc == 3 and "no prediction: the run is invalid (exit 3)" in err, err
    assert (out / "summary.json").is_file() and not (out / "prediction.json").exists()


def test_an_interrupted_run_is_not_predicted(tmp_path: Path) -> None:
    out, prof = tmp_path / "run", _profile(tmp_path / "p.json")
    with stream_server_process("--itl", "0.02") as url:  # streams of a few hundred ms
        p = subprocess.Popen(
            [*CLI, "bench", "--target", url, "--out", str(out), "-q", "--predict", str(prof)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(600):  # until a request has finished
            if (out / "requests.jsonl").is_file() and (out / "requests.jsonl").read_text():
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "no prediction: the run was interrupted (exit 130)" in err, err
    assert (out / "summary.json").is_file() and not (out / "prediction.json").exists()


def test_bench_predict_runs_predict_with_every_predict_default() -> None:
    """bench --predict builds predict's arguments from predict's own flags: each flag `agentkv
    predict` has is there at its default, so a new one cannot be left out (even odd folder names)."""
    from agentkv.calib.command import predict_args
    from agentkv.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    predict = sub.choices["predict"]
    for run_dir, prof in (("runs/a", "p.json"), ("-odd dir", "-p.json")):
        got = vars(predict_args(run_dir, prof))
        assert got.pop("run_dir") == run_dir and got.pop("profile") == prof
        dests = {a.dest for a in predict._actions} - {"help", "run_dir", "profile"}
        assert dests and set(got) == dests, set(got) ^ dests
        for a in predict._actions:
            if a.dest in got:
                assert got[a.dest] == a.default, a.dest
        cli = vars(build_parser().parse_args(["predict", f"--profile={prof}", "--", run_dir]))
        assert {k: cli[k] for k in got} == got


@pytest.mark.slow
def test_bench_predict_through_a_router_keeps_each_workers_clock(tmp_path: Path) -> None:
    """bench --predict through `agentkv route` to two serve workers started a second apart: each
    engine clock starts at its own start, so the records name their engine and predict moves each
    engine's stamps by its own offset (one offset for both would put one worker's arrivals a second
    early), and prediction.json and the terminal say so."""
    from agentkv.calib.replay import clock_offsets
    from agentkv.metrics.records import read_records
    from tests.cluster import Cluster

    out = tmp_path / "run"
    with Cluster(tmp_path / "logs", 2, events=False, replay=False) as c:
        c.start_worker(0, time_scale=10.0)
        time.sleep(1.0)  # worker 1's engine clock starts about 10 engine seconds after worker 0's
        c.start_worker(1, time_scale=10.0)
        c.start_router(["--policy", "round_robin"])
        c.wait_ready()
        c.wait_taken_in()
        prof = str(_profile(tmp_path / "p.json"))
        res = _bench(*SHORT, "--target", c.router_url(), "--out", str(out), "--predict", prof)
    assert res.returncode == 0, res.stderr
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == 8 and all(r.clock == "engine" and len(r.engine_id) == 32 for r in recs)
    offsets = clock_offsets(recs, one_server=False).offsets
    assert len(offsets) == 2 and abs(offsets[max(offsets)] - offsets[min(offsets)]) > 5.0, offsets
    doc = json.loads((out / "prediction.json").read_text())
    says = "arrivals: 2 engines' stamps, each on its own clock and offset"
    assert doc["arrivals"] == says and says in res.stdout
    assert doc["requests"] == 8 and doc["overall"]["e2e"]["mape_pct"] < 50.0, doc["overall"]
