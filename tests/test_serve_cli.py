"""`agentkv serve` as a real subprocess: start, answer, stop by pid; multi-worker launch; bad flags."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import free_port_range, stop_process

from agentkv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def agentkv_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "agentkv"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agentkv.cli"]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*agentkv_cmd(), "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def read_lines(proc: subprocess.Popen, pattern: str, n: int, timeout: float = 60.0) -> list[str]:
    """Lines of stdout matching `pattern` until n have come (fails if the process dies first)."""
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < n:
        assert time.monotonic() < deadline, f"timed out; got {found}"
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"server exited ({proc.wait()}): {proc.stderr.read()}")
        if re.search(pattern, line):
            found.append(line)
    return found


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_serve_subprocess_answers_and_stops_on_sigterm():
    proc = start(
        "--port", "0", "--time-scale", "1000", "--max-model-len", "2048", "--served-model-name", "m1"
    )
    try:
        (line,) = read_lines(proc, r"http://", 1)
        url = re.search(r"http://[\d.]+:\d+", line).group(0)
        body = post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "model": "m1"})
        assert body["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert b"vllm:generation_tokens_total" in r.read()
    finally:
        rc = stop_process(proc, 20)
    assert rc == 0
    assert "Traceback" not in proc.stderr.read()


def test_multi_worker_launch_and_clean_shutdown():
    base = free_port_range(4)
    events = base + 2
    proc = start(
        "--workers",
        "2",
        "--port",
        str(base),
        "--time-scale",
        "1000",
        "--max-model-len",
        "2048",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{events}",
    )
    pids = []
    try:
        lines = read_lines(proc, r"^agentkv serve: worker \d", 2, timeout=120)
        for line in lines:
            pids.append(int(re.search(r"pid=(\d+)", line).group(1)))
            i = int(re.search(r"worker (\d+)", line).group(1))
            assert f"http://127.0.0.1:{base + i} " in line
            assert f"kv-events=tcp://127.0.0.1:{events + i}" in line
        for i in range(2):
            body = post(f"http://127.0.0.1:{base + i}/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert body["usage"]["completion_tokens"] == 2
    finally:
        rc = stop_process(proc, 30)
    assert rc == 0, proc.stderr.read()
    for pid in pids:  # the children were stopped and reaped by the parent
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--time-scale", "0"], "--time-scale"),
        (["--time-scale", "nan"], "--time-scale"),
        (["--kv-offloading-size", "inf"], "--kv-offloading-size"),
        (["--workers", "2", "--port", "0"], "--workers"),
        (["--kv-events-config", "{nope"], "--kv-events-config"),
        (["--max-body-size", "lots"], "--max-body-size"),
        (["--block-size", "7"], "--block-size"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port), "--max-model-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1
