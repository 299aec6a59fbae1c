"""Run `agentkv` as a user would in a shell and press Ctrl-C once: the shared piece of the
interrupt tests (local simulate/analyze, and their Ray runs)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def interrupt(
    args: list[str], marker: str, delay: float = 0.3, env: dict | None = None, cwd=None
) -> tuple[subprocess.CompletedProcess, float]:
    """Start `agentkv ARGS` (stderr piped), wait for `marker` on its stderr, `delay` s later send one
    SIGINT; its result (stderr: all it wrote) and the seconds from the SIGINT to its exit."""
    p = subprocess.Popen(
        [sys.executable, "-m", "agentkv.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    try:
        seen = ""
        while marker not in seen:
            line = p.stderr.readline()
            assert line, f"exited before {marker!r}: {seen}"
            seen += line
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        t = time.monotonic()
        out, err = p.communicate(timeout=60)
        stopped_in = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(args, p.returncode, out, seen + err), stopped_in
