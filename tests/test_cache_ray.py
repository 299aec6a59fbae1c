"""`agentkv cache analyze --ray`: on a real local Ray cluster (opt-in, see rayutil) the cells give the
local results, tables and progress; without Ray, a one-line install hint before any trace loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from cliutil import interrupt
from rayutil import AUTH, ROOT, cli, cli_without_ray, free_port, need_cluster, ray_cluster, stop_group

from agentkv.cli import main

__all__ = ["ray_cluster"]  # the fixture, used by name

LONG_SESSIONS = 40  # synthetic sessions (19 M accesses at 16 tokens): ARC at 30GB takes ~10 s
GRID = ["cache", "analyze", "--capacity", "8GB,16GB", "--block-size", "16,64", "--policy", "lru,arc,belady"]


def _timeless(obj):
    """The analysis without its wall-clock fields (`seconds`), which differ between two runs."""
    if isinstance(obj, dict):
        return {k: _timeless(v) for k, v in obj.items() if k != "seconds"}
    if isinstance(obj, list):
        return [_timeless(v) for v in obj]
    return obj


def test_without_ray_installed_ray_says_how_to_install_it(tmp_path):
    missing = tmp_path / "no-such-traces"  # the hint comes before the traces are read
    for argv in ((*GRID, "--ray"), (*GRID, "--ray=127.0.0.1:6379", str(missing))):
        p = cli_without_ray(*argv)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip() == "agentkv: error: --ray needs Ray: pip install 'agentkv[ray]'"


def test_an_address_where_nothing_listens_is_one_line():
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    p = cli(*GRID, "-q", "--ray", address)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"agentkv: error: --ray {address}: cannot join")


def test_cells_on_ray_give_the_local_analysis(ray_cluster):
    gcs, client = ray_cluster
    local = cli(*GRID, "--json")
    assert local.returncode == 0, local.stderr
    want = _timeless(json.loads(local.stdout))
    assert len(want["results"]) == 12 and want["policies"] == ["lru", "arc", "belady"]
    for address in (gcs, client):
        on_ray = cli(*GRID, "--json", "--ray", address)
        assert on_ray.returncode == 0, (address, on_ray.stderr[-3000:])
        assert _timeless(json.loads(on_ray.stdout)) == want, address


def _on_a_new_local_cluster(argv: list[str], env: dict) -> tuple[int, str, str]:
    """The CLI with `--ray` (a cluster of its own) in its own session, stopped by process group."""
    need_cluster()
    short = tempfile.mkdtemp(prefix="akvray")  # Ray's socket paths must stay short
    env = {**env, "RAY_TMPDIR": short, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    argv = [sys.executable, "-m", "agentkv.cli", *argv, "--ray"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, start_new_session=True, stdout=-1, stderr=-1)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        stop_group(proc.pid)  # the cluster's processes too, should the run not stop them
        shutil.rmtree(short, ignore_errors=True)
    return proc.returncode, out, err


def test_a_new_local_cluster_keeps_token_auth_on_without_rays_line_about_it(tmp_path):
    """`--ray` with no address starts a cluster here: token auth on (Ray makes the token under $HOME)
    but not Ray's "Token authentication is enabled" line on stderr; the local run's analysis."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    rc, out, err = _on_a_new_local_cluster([*GRID, "--json"], {**env, "HOME": str(tmp_path)})
    assert rc == 0, err[-3000:]
    assert "Token authentication" not in err and "Traceback" not in err, err
    assert (tmp_path / ".ray" / "auth_token").stat().st_size > 0
    local = cli(*GRID, "--json")
    assert _timeless(json.loads(out)) == _timeless(json.loads(local.stdout))


def test_a_worker_killed_for_memory_fails_the_run_in_one_line():
    """Ray's memory monitor (its threshold set to 1% of the node's memory) kills the task's worker:
    the run fails with exit 2 and one line saying so, not a traceback."""
    env = {**os.environ, **AUTH, "RAY_memory_usage_threshold": "0.01", "RAY_memory_monitor_refresh_ms": "50"}
    rc, _, err = _on_a_new_local_cluster([*GRID[:-2], "--policy", "belady", "-q"], env)
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("agentkv: error: --ray: Ray's memory monitor killed"), err


def test_a_hybrid_models_cells_on_ray_give_the_local_analysis(ray_cluster):
    gcs, _ = ray_cluster
    grid = ["cache", "analyze", "--model", "gpt-oss-120b", "--capacity", "4GB,16GB", "--block-size", "16,64"]
    local, on_ray = cli(*grid, "--json"), cli(*grid, "--json", "--ray", gcs)
    assert local.returncode == on_ray.returncode == 0, on_ray.stderr[-3000:]
    want = _timeless(json.loads(local.stdout))
    assert len(want["results"]) == 4 and all(len(r["groups"]) == 2 for r in want["results"])
    assert _timeless(json.loads(on_ray.stdout)) == want


def test_the_table_on_ray_is_the_local_table(ray_cluster):
    gcs, _ = ray_cluster
    local, on_ray = cli(*GRID), cli(*GRID, "--ray", gcs)
    assert on_ray.returncode == local.returncode == 0, on_ray.stderr
    drop_time = lambda out: [ln for ln in out.splitlines() if " replays in " not in ln]  # noqa: E731
    assert drop_time(on_ray.stdout) == drop_time(local.stdout) and "belady" in local.stdout


PROGRESS = """
import json, sys
from agentkv.cache.analyze import analyze
from agentkv.cache.grid import make_grid
from agentkv.trace.formats import bundled_sample, load_paths
steps = []
res = analyze(load_paths(bundled_sample()), make_grid("8GB,16GB", "64", "lru,lfu"), ray=sys.argv[1],
              progress=lambda *a: steps.append(a))
print(json.dumps({"steps": steps, "cells": [[r.capacity, r.policy] for r in res.results]}))
"""


def test_progress_on_ray_counts_every_cell(ray_cluster):
    gcs, _ = ray_cluster
    p = subprocess.run(
        [sys.executable, "-c", PROGRESS, gcs],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **AUTH, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    steps, cells = out["steps"], [tuple(c) for c in out["cells"]]
    assert [d for d, _, _ in steps] == list(range(1, 6)) and {t for _, t, _ in steps} == {5}
    assert sorted(w for _, _, w in steps[1:]) == sorted(
        f"{pol} at {cap}, block size 64" for cap, pol in cells
    )
    assert cells == [("8GB", "lru"), ("8GB", "lfu"), ("16GB", "lru"), ("16GB", "lfu")]


def test_ctrl_c_on_ray_keeps_the_finished_replays_and_drops_the_rest(ray_cluster, tmp_path):
    """The driver looks at the stop request while cells run (the long cell is not waited for): one
    SIGINT after the short cell (one block: every request too big) shows it, drops the long one and
    exits 130 with the local run's message. Piped, stderr names each cell as it finishes."""
    gcs, _ = ray_cluster
    synth = tmp_path / "synth"
    assert main(["trace", "synth", "--sessions", str(LONG_SESSIONS), "-o", str(synth)]) == 0
    argv = ["cache", "analyze", str(synth), "--capacity", "4MB,30GB", "--block-size", "16"]
    argv += ["--policy", "arc", "--json"]
    short = "arc at 4MB, block size 16"  # the step line once the short cell is in (piped stderr)
    res, stopped_in = interrupt([*argv, "--ray", gcs], short, 1.0, env={**os.environ, **AUTH}, cwd=ROOT)
    out, err = res.stdout, res.stderr
    assert res.returncode == 130, err[-3000:]
    assert stopped_in < 20, stopped_in  # not the long cell's minutes
    assert "agentkv: interrupted: 1 of 2 replays done (shown)" in err and "Traceback" not in err, err
    res = json.loads(out)
    assert res["interrupted"] and [(r["capacity"], r["policy"]) for r in res["results"]] == [("4MB", "arc")]
