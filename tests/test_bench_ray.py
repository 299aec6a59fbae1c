"""`agentkv bench --clients N --ray`: on a real local Ray cluster (opt-in, see rayutil) two shard actors
replay the one-shard request set with clock offsets recorded, and a killed actor's finished records are
kept with the run invalid; without Ray, a one-line install hint before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rayutil import AUTH, ROOT, cli, cli_without_ray, free_port, ray_cluster

from agentkv.bench.ray_shards import RayLink, check_reachable
from agentkv.errors import UserError
from agentkv.metrics.records import read_records
from agentkv.metrics.summary import read_summary
from agentkv.trace.formats.agentx import write_agentx
from tests.serveutil import stream_server_process
from tests.test_bench_runner import trace

__all__ = ["ray_cluster"]  # the fixture, used by name

BENCH = ["bench", "--duration", "none", "--quiet", "--time-scale", "100", "--lanes", "4"]
HINT = "agentkv: error: --ray needs Ray: pip install 'agentkv[ray]'"


def _traces(folder: Path, turns: int = 4, out: int = 3) -> str:
    """Six small session trees as AgentX files (3 to 3 + turns requests each)."""
    folder.mkdir()
    for i in range(6):
        write_agentx(trace(f"t{i}", turns + i % 3, base=1000 * i, out=out), folder / f"t{i}.json")
    return str(folder)


def _keys(path: Path) -> list[tuple[str, str, int]]:
    return sorted((r.trace, r.session, r.index) for r in read_records(path / "requests.jsonl"))


def test_without_ray_installed_ray_says_how_to_install_it(tmp_path):
    missing = str(tmp_path / "no-such-traces")  # the hint comes before the traces load
    p = cli_without_ray(*BENCH, "--clients", "2", "--ray", missing, "--out", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == HINT


def test_bad_clients_and_an_address_where_nothing_listens_fail_before_anything_starts(tmp_path, capsys):
    from agentkv.cli import main

    missing = str(tmp_path / "no-such-traces")  # neither traces nor the embedded server are reached
    assert main([*BENCH, "--clients", "0", "--ray", missing]) == 2
    assert capsys.readouterr().err.strip() == "agentkv: error: --clients must be >= 1, got 0"
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    assert main([*BENCH, missing, "--clients", "2", "--ray", address]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agentkv: error: --ray {address}: cannot join"), lines


def test_a_loopback_target_is_refused_when_a_shard_runs_on_another_host():
    here = RayLink(None, 0, None, "10.0.0.4", os.uname().nodename, 11)
    there = RayLink(None, 1, None, "10.0.0.5", "gpu-node-7", 12)
    check_reachable("http://10.0.0.9:8000", [here, there])  # a routable target: anywhere is fine
    check_reachable("http://127.0.0.1:8000", [here])  # every shard on this host: loopback is fine
    for target in ("http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:9"):
        with pytest.raises(UserError, match=r"client shard 1 runs on node 10\.0\.0\.5 \(gpu-node-7\)"):
            check_reachable(target, [here, there])


def test_two_ray_shards_replay_the_one_shard_request_set(ray_cluster, tmp_path):
    gcs, _ = ray_cluster
    paths = _traces(tmp_path / "traces")
    with stream_server_process("--itl", "0.001") as url:
        one = cli(*BENCH, paths, "--target", url, "--out", str(tmp_path / "one"))
        on = [*BENCH, paths, "--target", url, "--ray", gcs, "--out"]
        two = cli(*on, str(tmp_path / "two"), "--clients", "2")
        three = cli(*on, str(tmp_path / "three"), "--clients", "3")
    assert three.returncode == 2 and three.stderr.strip().splitlines()[-1] == (
        "agentkv: error: --clients 3 --ray: a shard actor takes one CPU and the Ray cluster has 2"
    ), three.stderr  # the test cluster has 2 CPUs
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    want = _keys(tmp_path / "one")
    assert len(want) == sum(4 + i % 3 for i in range(6)) and _keys(tmp_path / "two") == want
    recs = read_records(tmp_path / "two" / "requests.jsonl")
    assert len({r.id for r in recs}) == len(recs) and all(r.ok for r in recs)
    s = read_summary(tmp_path / "two" / "summary.json")
    assert s.valid and s.requests == len(want)
    clients = s.config["clients"]
    assert [c["shard"] for c in clients] == [0, 1] and sum(c["records"] for c in clients) == len(recs)
    for c in clients:
        assert c["transport"] == "ray" and c["ended"] == "done" and c["node"] and c["pid"] != os.getpid()
        assert 0 < c["clock_rtt_s"] < 1.0
        assert abs(c["clock_offset_s"]) < c["clock_rtt_s"] + 0.01  # one host: one monotonic clock
        assert f"client shard {c['shard']}: Ray actor on {c['node']}, pid {c['pid']}" in two.stderr
    assert any("2 Ray actors on 1 node(s)" in n for n in s.notes)


def _lines_until(stream, pattern: str, seen: list[str]) -> re.Match:
    """Read `stream` line by line (kept in `seen`) until one matches `pattern`."""
    for line in stream:
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    pytest.fail("".join(seen))


def _records_of(path: Path, shard: int) -> int:
    """Complete lines of requests.jsonl from `shard` (ids are id * 2 + shard)."""
    if not path.exists():
        return 0
    text = path.read_text()
    return sum(1 for ln in text[: text.rfind("\n") + 1].splitlines() if json.loads(ln)["id"] % 2 == shard)


def test_a_killed_shard_actor_keeps_its_records_and_fails_the_run(ray_cluster, tmp_path):
    _, client = ray_cluster  # through the Ray client (ray://) this time
    paths, out = _traces(tmp_path / "traces", turns=10, out=12), tmp_path / "run"
    argv = [*BENCH, paths, "--out", str(out), "--clients", "2", "--lanes", "2", "--ray", client]
    with stream_server_process("--itl", "0.02") as url:  # ~0.25 s a request: the run takes seconds
        p = subprocess.Popen(
            [sys.executable, "-m", "agentkv.cli", *argv, "--target", url],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, **AUTH},
        )
        seen: list[str] = []
        try:
            m = _lines_until(p.stderr, r"client shard 0: (Ray actor on \S+, pid (\d+)),", seen)
            rest = threading.Thread(target=lambda: seen.extend(p.stderr), daemon=True)
            rest.start()
            deadline = 600
            while _records_of(out / "requests.jsonl", 0) < 2 and deadline and p.poll() is None:
                deadline -= 1
                threading.Event().wait(0.1)
            kept = _records_of(out / "requests.jsonl", 0)
            os.kill(int(m.group(2)), signal.SIGKILL)  # the actor's worker process, on our test cluster
            p.wait(timeout=120)
            rest.join(10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = "".join(seen)
    assert p.returncode == 3 and "Traceback" not in err, err[-3000:]
    s = read_summary(out / "summary.json")
    recs = read_records(out / "requests.jsonl")
    assert s.requests == len(recs) and sum(1 for r in recs if r.id % 2 == 0) >= kept >= 2
    dead, alive = s.config["clients"]
    assert dead["ended"] == "died" and alive["ended"] == "done"
    assert not s.valid and any(f"client shard 0 ({m.group(1)}) died" in r for r in s.invalid_reasons)
    assert f"its {dead['records']} finished requests are kept" in s.invalid_reason
    assert dead["records"] < sum(10 + i % 3 for i in range(6)) - alive["records"]  # killed mid-run
    other = {r.trace for r in recs if r.id % 2 == 1}
    assert len(other) == alive["traces"] and alive["records"] == sum(1 for r in recs if r.id % 2 == 1)
