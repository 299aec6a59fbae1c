"""A real Ray head node for the opt-in cluster tests (AGENTKV_RAY_CLUSTER_TESTS=1), the CLI run in a
subprocess with that cluster's token, and a CLI run with Ray made unimportable."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# the test cluster's own token (Ray >= 2.5x asks one of every client), never ~/.ray/auth_token
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **AUTH, **(env or {})},
    )


def need_cluster() -> None:
    """Skip unless Ray is installed and AGENTKV_RAY_CLUSTER_TESTS=1 (a cluster listens beyond loopback)."""
    pytest.importorskip("ray")
    if os.environ.get("AGENTKV_RAY_CLUSTER_TESTS") != "1":
        pytest.skip("a Ray cluster listens beyond loopback; set AGENTKV_RAY_CLUSTER_TESTS=1 to run it")


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on this machine (2 CPUs, its own temp dir and ports), stopped by its process group.

    Opt-in (AGENTKV_RAY_CLUSTER_TESTS=1): Ray 2.60 advertises and listens on the host's own address
    even when told 127.0.0.1, and this project's tests keep their traffic on loopback."""
    need_cluster()
    gcs, client = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="akvray")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **AUTH}
    env["RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S"] = "150"  # a ray:// session's server, on a loaded box
    ray_bin = Path(sys.executable).parent / "ray"
    cmd = [str(ray_bin), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs)]
    cmd += ["--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", tmp]
    cmd += ["--ray-client-server-port", str(client), "--disable-usage-stats"]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
        yield f"127.0.0.1:{gcs}", f"ray://127.0.0.1:{client}"
    finally:
        stop_group(proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)


def stop_group(pgid: int) -> None:
    """SIGTERM to the cluster's process group (ours alone), SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def cli_without_ray(*argv: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess where `import ray` fails, as on a machine without the extra."""
    blocked = (
        "import sys; sys.modules['ray'] = None; from agentkv.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", blocked, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
