"""`agentkv simulate --sweep ... --ray`: a real local Ray cluster (2 CPUs, started and stopped here)
gives the same results as the local processes; without Ray, a one-line install hint."""

from __future__ import annotations

import json
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
SWEEP = ["simulate", "--max-requests", "40", "--workers", "2", "-q"]
SWEEP += ["--sweep", "lanes=2,4", "--sweep", "router=round_robin,kv_aware"]
TIMING = {"created"}  # the summary fields that differ between two identical runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **AUTH, **(env or {})},
    )


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on this machine (2 CPUs, its own temp dir and ports), stopped by its process group.

    Opt-in (AGENTKV_RAY_CLUSTER_TESTS=1): Ray 2.60 advertises and listens on the host's own address
    even when told 127.0.0.1, and this project's tests keep their traffic on loopback."""
    pytest.importorskip("ray")
    if os.environ.get("AGENTKV_RAY_CLUSTER_TESTS") != "1":
        pytest.skip("a Ray cluster listens beyond loopback; set AGENTKV_RAY_CLUSTER_TESTS=1 to run it")
    gcs, client = _free_port(), _free_port()
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
        _stop_group(proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop_group(pgid: int) -> None:
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


def _comparable(rows: list[dict]) -> list[dict]:
    return [{**r, "summary": {k: v for k, v in r["summary"].items() if k not in TIMING}} for r in rows]


def _summaries(folder: Path) -> dict[str, dict]:
    return {
        p.name: {k: v for k, v in json.loads(p.read_text()).items() if k not in TIMING}
        for p in sorted(folder.glob("summary-*.json"))
    }


def test_a_sweep_on_ray_gives_the_local_results(ray_cluster, tmp_path):
    gcs, client = ray_cluster
    local = _cli(*SWEEP, "--json", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    rows = json.loads(local.stdout)
    assert len(rows) == 4
    for name, address in (("gcs", gcs), ("client", client)):
        on_ray = _cli(*SWEEP, "--json", "--out", str(tmp_path / name), "--ray", address)
        assert on_ray.returncode == 0, (name, on_ray.stderr[-3000:])
        assert _comparable(json.loads(on_ray.stdout)) == _comparable(rows), name
        assert _summaries(tmp_path / name) == _summaries(tmp_path / "local")
        assert on_ray.stderr.count("done: {") == 4, on_ray.stderr


def test_the_table_on_ray_is_the_local_table(ray_cluster):
    gcs, _ = ray_cluster
    local, on_ray = _cli(*SWEEP), _cli(*SWEEP, "--ray", gcs)
    assert on_ray.returncode == local.returncode == 0, on_ray.stderr
    assert on_ray.stdout == local.stdout and "simulate sweep" in local.stdout


def test_without_ray_installed_ray_says_how_to_install_it():
    blocked = (
        "import sys; sys.modules['ray'] = None; from agentkv.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    p = subprocess.run(
        [sys.executable, "-c", blocked, *SWEEP, "--ray"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == "agentkv: error: --ray needs Ray: pip install 'agentkv[ray]'"


def test_ray_without_a_sweep_is_an_error(capsys):
    from agentkv.cli import main

    assert main(["simulate", "--max-requests", "5", "-q", "--ray"]) == 2
    assert "--ray runs a --sweep" in capsys.readouterr().err


def test_a_local_sweep_never_imports_ray():
    check = (
        "import sys; from agentkv.cli import main; rc = main(sys.argv[1:]); "
        "sys.exit(rc or ('ray' in sys.modules and 9))"
    )
    p = subprocess.run(
        [sys.executable, "-c", check, *SWEEP], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr


def test_a_point_that_fails_on_ray_fails_as_it_does_locally(ray_cluster):
    gcs, _ = ray_cluster
    bad = ["simulate", "--max-requests", "5", "-q", "--sweep", "gpu=h200,h999"]
    local, on_ray = _cli(*bad), _cli(*bad, "--ray", gcs)
    assert local.returncode == on_ray.returncode == 2, on_ray.stderr
    last = on_ray.stderr.strip().splitlines()[-1]
    assert last == local.stderr.strip().splitlines()[-1] and "h999" in last, on_ray.stderr
    assert "Traceback" not in on_ray.stderr, on_ray.stderr


def test_an_address_where_nothing_listens_is_one_line():
    pytest.importorskip("ray")
    for address in (f"127.0.0.1:{_free_port()}", f"ray://127.0.0.1:{_free_port()}"):
        p = _cli(*SWEEP, "--ray", address)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith(f"agentkv: error: --ray {address}: cannot join")
