"""`agentkv bench --clients N`: real shard processes against the real streaming test server; one merged
request set, clock offsets recorded, a killed shard's finished records kept and reported."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.shards import ShardedRun, clamp_clients, split
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.errors import UserError
from agentkv.metrics.records import read_records
from tests.test_bench_runner import cfg, trace

TRACES = [trace(f"t{i}", 3 + i % 3, base=1000 * i) for i in range(6)]


def _keys(records) -> list[tuple[str, str, int]]:
    return sorted((r.trace, r.session, r.index) for r in records)


def _run(c: BenchConfig, out, clients: int, **server_kw):
    async def go():
        async with StreamTestServer(**server_kw) as srv:
            c.target = srv.url
            run = ShardedRun(c, TRACES, clients, out=out) if clients > 1 else BenchRun(c, TRACES, out=out)
            return await run.run()

    return asyncio.run(go())


def test_two_shards_replay_the_same_requests_as_one(tmp_path, capsys):
    one = _run(cfg(lanes=4), tmp_path / "one", 1)
    capsys.readouterr()
    two = _run(cfg(lanes=4), tmp_path / "two", 2)
    starts = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("client shard")]
    assert [ln.split(":")[0] for ln in starts] == ["client shard 0", "client shard 1"], starts
    assert len(one.records) == sum(len(t.session.requests) for t in TRACES)
    assert _keys(two.records) == _keys(one.records)
    assert all(r.ok for r in two.records)
    # one requests.jsonl with every merged record, ids unique, times on the driver's timeline
    on_disk = read_records(tmp_path / "two" / "requests.jsonl")
    assert _keys(on_disk) == _keys(one.records)
    assert len({r.id for r in on_disk}) == len(on_disk)
    assert all(0 <= r.scheduled <= r.sent <= r.end for r in on_disk)
    # each session tree came from one shard only (a record's id modulo 2 names its shard)
    assert all(len({r.id % 2 for r in on_disk if r.trace == t.id}) == 1 for t in TRACES)
    s = two.summary
    assert s.requests == len(one.records) and s.valid
    clients = s.config["clients"]
    assert [c["shard"] for c in clients] == [0, 1]
    assert sum(c["records"] for c in clients) == len(on_disk)
    for c in clients:
        assert c["ended"] == "done" and 0 < c["clock_rtt_s"] < 1.0
        assert abs(c["clock_offset_s"]) < c["clock_rtt_s"] + 0.01  # one host: one monotonic clock
    assert any("2 client processes" in n for n in s.notes)
    written = json.loads((tmp_path / "two" / "requests.jsonl").read_text().splitlines()[0])
    assert {"trace", "session", "scheduled", "end"} <= written.keys()


def test_split_keeps_session_trees_whole_and_divides_the_load():
    parts = split(cfg(lanes=5, max_requests=7, warmup_requests=3), TRACES, 2)
    ids = [sorted(t.id for t in p) for _, p in parts]
    assert sorted(ids[0] + ids[1]) == sorted(t.id for t in TRACES) and not set(ids[0]) & set(ids[1])
    assert [c.lanes for c, _ in parts] == [3, 2]
    assert [c.max_requests for c, _ in parts] == [4, 3]
    assert [c.warmup_requests for c, _ in parts] == [2, 1]
    sizes = [sum(t.num_requests for t in p) for _, p in parts]
    assert abs(sizes[0] - sizes[1]) <= 2  # balanced by requests


def test_bad_client_counts():
    with pytest.raises(UserError, match="--clients must be >= 1, got 0"):
        clamp_clients(0, TRACES, cfg(lanes=4))
    n, notes = clamp_clients(9, TRACES, cfg(lanes=16))
    assert n == len(TRACES) and "lowered to 6" in notes[0]
    n, notes = clamp_clients(4, TRACES, cfg(lanes=3))
    assert n == 3 and "--lanes 3" in notes[0]
    for bad in ("0", "-2", "two"):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "agentkv.cli",
                "bench",
                "--target",
                "http://127.0.0.1:9",
                "--clients",
                bad,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and "--clients" in lines[-1] and "Traceback" not in p.stderr
        if bad != "two":  # argparse prints its usage above a type error
            assert lines == [f"agentkv: error: --clients must be >= 1, got {bad}"], p.stderr


def test_killed_shard_keeps_its_records_and_fails_the_run(tmp_path):
    async def go():
        # tokens 20 ms apart: each request takes ~60 ms, the run over a second
        async with StreamTestServer(behave=lambda body, n: Behaviour(itl=0.02)) as srv:
            c = cfg(lanes=2)
            c.target = srv.url
            run = ShardedRun(c, TRACES, 2, out=tmp_path)
            task = asyncio.create_task(run.run())
            while not run.shards or run.shards[0].records < 2:
                await asyncio.sleep(0.01)
                assert not task.done()
            victim = run.shards[0]
            kept = victim.records
            os.kill(victim.link.pid, signal.SIGKILL)
            return await task, victim, kept

    res, victim, kept = asyncio.run(go())
    mine = [r for r in res.records if r.id % 2 == 0]
    assert len(mine) >= kept >= 2  # every record it streamed before dying survives
    assert victim.ended == "died"
    s = res.summary
    assert not s.valid and any(f"client shard 0 (pid {victim.link.pid}) died" in r for r in s.invalid_reasons)
    assert len(read_records(tmp_path / "requests.jsonl")) == len(res.records)
    other = [r for r in res.records if r.id % 2 == 1]
    other_traces = {t.id for t in split(cfg(lanes=2), TRACES, 2)[1][1]}
    assert {r.trace for r in other} == other_traces  # the other shard ran its trees out


def test_clock_offset_moves_every_timestamp_onto_the_drivers_timeline():
    """A shard whose clock runs 5 s ahead and which started 2 s after the driver: its record's times
    move by 2 s (x the time scale), its latencies stay as measured."""
    from agentkv.bench.shards import Shard
    from agentkv.metrics.records import RequestRecord, encode_record

    for scale in (1.0, 10.0):
        run = ShardedRun(cfg(lanes=4, time_scale=scale), TRACES, 2, out=None)
        run.base._t0 = 100.0
        shard = Shard(1, link=None, lanes=2, traces=3, offset=5.0)
        run.shards = [Shard(0, link=None, lanes=2, traces=3), shard]
        run._on_msg(shard, ("start", 107.0))  # 102 on the driver's clock
        rec = RequestRecord(
            id=3,
            trace="t1",
            session="t1",
            lane=1,
            scheduled=0.5,
            sent=0.6,
            first_token=0.7,
            end=0.9,
            ttft=0.2,
            e2e=0.4,
        )
        run._on_msg(shard, ("rec", encode_record(rec)))
        (got,) = run.base.records
        d = 2.0 * scale
        assert (got.scheduled, got.sent, got.first_token, got.end) == pytest.approx(
            (0.5 + d, 0.6 + d, 0.7 + d, 0.9 + d)
        )
        assert (got.ttft, got.e2e) == (0.2, 0.4)
        assert got.id == 3 * 2 + 1 and got.lane == 2 + 1  # unique id; lanes after shard 0's


def test_open_loop_splits_the_session_rate_and_counts_every_arrival(tmp_path):
    res = _run(cfg(lanes=None, session_rate=40.0, arrivals="constant"), tmp_path, 2)
    assert _keys(res.records) == _keys(_run(cfg(lanes=2), tmp_path / "one", 1).records)
    assert any(
        n.startswith(f"load: {len(TRACES)} session trees arrived (constant, 40/s") for n in res.summary.notes
    )


def test_ctrl_c_stops_every_shard_and_writes_the_merged_summary(tmp_path):
    from agentkv.metrics.summary import read_summary
    from tests.serveutil import stream_server_process
    from tests.test_bench_cli import _wait_lines

    with stream_server_process("--itl", "0.002") as url:
        p = subprocess.Popen(
            [sys.executable, "-m", "agentkv.cli", "bench", "--target", url, "--out", str(tmp_path)]
            + ["--duration", "none", "--quiet", "--time-scale", "200", "--lanes", "4", "--clients", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_lines(tmp_path / "requests.jsonl", 4, p)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "Traceback" not in err, err
    s = read_summary(tmp_path / "summary.json")
    assert s.requests == len(read_records(tmp_path / "requests.jsonl")) >= 4
    pids = [c["pid"] for c in s.config["clients"]]
    assert len(pids) == 2 and all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def test_a_sweeps_points_do_not_print_shard_start_lines(tmp_path, capfd):
    """A sweep prints its own progress, one line a point: its --clients points do not add a line
    per shard as a single run does (test_two_shards_replay_the_same_requests_as_one)."""
    from agentkv.cli import main
    from tests.serveutil import stream_server_process

    argv = ["--clients", "2", "--max-requests", "4", "--duration", "none", "-q", "--time-scale", "50"]
    with stream_server_process("--itl", "0", "--ttft", "0") as url:
        rc = main(["bench", "--target", url, *argv, "--out", str(tmp_path), "--sweep", "lanes=2"])
    err = capfd.readouterr().err
    assert rc == 0 and "lanes" in err and "client shard" not in err, err
    assert len(read_records(tmp_path / "point-0" / "requests.jsonl")) == 4
