"""`agentkv bench` as a user runs it: a killed run keeps its records, Ctrl-C still writes the summary,
a down target is one clear line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkv.metrics.records import read_records
from agentkv.metrics.summary import read_summary
from tests.serveutil import stream_server_process

BENCH = [sys.executable, "-m", "agentkv.cli", "bench"]


@pytest.fixture
def server():
    """The test server in its own process (tokens 2 ms apart), so the bench can be killed on its own."""
    with stream_server_process("--itl", "0.002") as url:
        yield url


def _start(url: str, out: Path, preexec_fn=None) -> subprocess.Popen:
    # bundled sample, gaps 200x shorter: many requests of ~0.5 s each
    return subprocess.Popen(
        [
            *BENCH,
            "--target",
            url,
            "--out",
            str(out),
            "--duration",
            "none",
            "--quiet",
            "--time-scale",
            "200",
            "--lanes",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"bench exited early: {proc.communicate()}")
        time.sleep(0.05)
    pytest.fail(f"no {n} records in {path} within {limit} s")


def test_killed_run_keeps_every_finished_request(server, tmp_path):
    p = _start(server, tmp_path)
    _wait_lines(tmp_path / "requests.jsonl", 3, p)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=10)
    recs = read_records(tmp_path / "requests.jsonl")
    assert len(recs) >= 3
    assert all(r.ok and r.output_tokens == r.expected_output_tokens for r in recs)
    assert not (tmp_path / "summary.json").exists()  # nothing else got the chance to be written


def _ignore_sigint() -> None:
    """In the child: what a shell's background job (`agentkv bench ... &`) inherits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig, inherited",
    [(signal.SIGINT, None), (signal.SIGTERM, None), (signal.SIGINT, _ignore_sigint)],
    ids=["ctrl-c", "term", "ctrl-c-bg"],
)
def test_ctrl_c_still_writes_summary_and_report(server, tmp_path, sig, inherited):
    """Ctrl-C or SIGTERM stops the run and writes what finished, also for a bench started in the
    background, whose SIGINT the shell set to ignored."""
    p = _start(server, tmp_path, preexec_fn=inherited)
    _wait_lines(tmp_path / "requests.jsonl", 2, p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    s = read_summary(tmp_path / "summary.json")
    recs = read_records(tmp_path / "requests.jsonl")
    assert s.requests == len(recs) >= 2
    assert any(n.startswith("interrupted") for n in s.notes)
    assert (tmp_path / "report.html").stat().st_size > 1000
    assert "Traceback" not in err


def test_down_target_is_one_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run(
        [*BENCH, "--target", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o"), "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"target http://127.0.0.1:{port} is not reachable" in lines[0]
    assert not (tmp_path / "o").exists()


def test_bad_flags_are_one_line(tmp_path):
    for flags, needle in (
        (["--slo", "speed=3"], "--slo"),
        (["--duration", "soon"], "--duration"),
        (["--lanes", "0"], "--lanes"),
    ):
        p = subprocess.run(
            [*BENCH, "--target", "http://127.0.0.1:9", *flags], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
