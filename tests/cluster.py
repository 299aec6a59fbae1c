"""Helpers for the security, privacy and fault tests: real `agentkv serve` / `agentkv route`
subprocesses on free loopback ports, their output captured to files, stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "agentkv.cli"]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200 (the machine may be busy: start-up takes seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before {url} came up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


class Procs:
    """Subprocesses started by one test module; `stop_all` ends each by its pid (TERM, then KILL)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self._files: list = []

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        out = (self.tmp / f"{name}.out").open("ab")
        err = (self.tmp / f"{name}.err").open("ab")
        self._files += [out, err]
        p = subprocess.Popen([*CLI, *args], stdout=out, stderr=err, env={**os.environ, **(env or {})})
        self.procs[name] = p
        return p

    def output(self, name: str) -> str:
        """Everything the named process wrote so far (stdout and stderr)."""
        return "".join((self.tmp / f"{name}.{k}").read_text("utf-8", "replace") for k in ("out", "err")
                       if (self.tmp / f"{name}.{k}").exists())

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs[name]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)  # a stalled process must be able to act on TERM
            os.kill(p.pid, sig)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        for f in self._files:
            f.close()


def serve_args(port: int, *, time_scale: float = 1.0, events: int | None = None, replay: int | None = None,
               log_level: str = "warning", extra: tuple[str, ...] = ()) -> list[str]:
    args = ["serve", "--port", str(port), "--time-scale", str(time_scale), "--log-level", log_level]
    if events is not None:
        args += ["--kv-events-endpoint", f"tcp://*:{events}"]
    if replay is not None:
        args += ["--kv-events-replay-endpoint", f"tcp://*:{replay}"]
    return [*args, *extra]


def write_keys(tmp: Path, keys: dict[str, str]) -> Path:
    path = tmp / "keys.json"
    path.write_text(json.dumps(keys))
    return path


def post(url: str, body: dict | bytes, key: str | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body) of a POST; HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def get_json(url: str, timeout: float = 10.0):
    return json.loads(get_text(url, timeout))
