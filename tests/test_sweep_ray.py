"""`agentkv simulate --sweep ... --ray`: a real local Ray cluster (2 CPUs, started and stopped here)
gives the same results as the local processes; without Ray, a one-line install hint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cliutil import interrupt
from rayutil import AUTH, ROOT, cli_without_ray, free_port, ray_cluster
from rayutil import cli as _cli

__all__ = ["ray_cluster"]  # the fixture, used by name

SWEEP = ["simulate", "--max-requests", "40", "--workers", "2", "-q"]
SWEEP += ["--sweep", "lanes=2,4", "--sweep", "router=round_robin,kv_aware"]
TIMING = {"created"}  # the summary fields that differ between two identical runs


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
        assert len(re.findall(r"\d/4 points.*: done ", on_ray.stderr)) == 4, on_ray.stderr


def test_the_table_on_ray_is_the_local_table(ray_cluster):
    gcs, _ = ray_cluster
    local, on_ray = _cli(*SWEEP), _cli(*SWEEP, "--ray", gcs)
    assert on_ray.returncode == local.returncode == 0, on_ray.stderr
    assert on_ray.stdout == local.stdout and "simulate sweep" in local.stdout


def test_without_ray_installed_ray_says_how_to_install_it():
    p = cli_without_ray(*SWEEP, "--ray")
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
    for address in (f"127.0.0.1:{free_port()}", f"ray://127.0.0.1:{free_port()}"):
        p = _cli(*SWEEP, "--ray", address)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith(f"agentkv: error: --ray {address}: cannot join")


def test_ctrl_c_on_ray_keeps_the_finished_points_and_drops_the_rest(ray_cluster):
    """The driver looks at the stop request while points run (a minutes-long point is not waited
    for): one SIGINT after the short point writes it, drops the long one and exits 130."""
    gcs, _ = ray_cluster
    argv = ["simulate", "--cycle", "--max-requests", "20", "--workers", "2", "-q", "--json", "--ray", gcs]
    argv += ["--sweep", "max_requests=20,1000000"]  # the second: minutes
    short = "1/2 points"  # the short point's progress line
    res, stopped_in = interrupt(argv, short, 1.0, env={**os.environ, **AUTH}, cwd=ROOT)
    out, err = res.stdout, res.stderr
    assert res.returncode == 130, err
    assert stopped_in < 20, stopped_in  # not the long point's minutes
    rows = json.loads(out)
    assert [r["overrides"] for r in rows] == [{"max_requests": "20"}], rows
    assert "Traceback" not in err, err
