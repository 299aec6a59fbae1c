"""Integration: `agentkv bench` against a real `agentkv serve` (a simulated H200 running 20x real time)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkv.bench.embedded import EmbeddedServer
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.metrics.records import read_records
from agentkv.metrics.summary import read_summary, write_summary
from agentkv.trace.model import Request, Session, Trace

pytestmark = pytest.mark.slow
SCALE = 20.0


def turns(n: int, *, base: int = 0, gap: float = 0.0, start_blocks: int = 8, grow: int = 4) -> list[Request]:
    """`n` turns, each extending the previous turn's blocks by `grow` blocks of 16 tokens."""
    return [
        Request(
            t=0.001 * i,
            input_tokens=(start_blocks + grow * i) * 16,
            output_tokens=4,
            hash_ids=list(range(base, base + start_blocks + grow * i)),
            think_time=gap if i else 0.0,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def serve():
    with EmbeddedServer(time_scale=SCALE) as srv:
        yield srv


def _run(url: str, traces, **kw):
    cfg = BenchConfig(target=url, duration=None, idle_gap_cap=None, time_scale=SCALE, sample_every=0.1, **kw)
    return asyncio.run(BenchRun(cfg, traces).run())


def test_cached_tokens_grow_across_turns(serve):
    t = Trace(id="grow", block_size=16, session=Session(id="grow", requests=turns(5)))
    res = _run(serve.url, [t], lanes=1)
    recs = sorted(res.records, key=lambda r: r.index)
    assert all(r.ok for r in recs), [r.error for r in recs]
    cached = [r.cached_tokens for r in recs]
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
    assert all(
        c >= prev.input_tokens - 16 for c, prev in zip(cached[1:], recs, strict=False)
    )  # the whole prior turn
    assert [r.input_tokens for r in recs] == [r.input_tokens for r in sorted(recs, key=lambda r: r.id)]
    s = res.summary
    assert s.cache.metrics is not None and s.cache.reported is not None
    assert s.cache.metrics == pytest.approx(s.cache.reported, abs=0.05)
    assert s.timeline and all(p.kv_usage is not None for p in s.timeline)  # vllm:kv_cache_usage_perc scraped


def test_subagents_overlap_their_parent(serve):
    # the sub-agent spawns after turn 0 and runs 5 s; the parent's turns 1-3 are not gated on it
    sub = Session(id="p/sub", t=0.0005, requests=turns(3, base=5000), duration=5.0)
    root = Session(id="p", requests=[*turns(4)], subagents=[sub])
    for r in root.requests:
        r.output_tokens = 40  # long enough to be in flight together
    res = _run(serve.url, [Trace(id="p", block_size=16, session=root)], lanes=1)
    assert all(r.ok for r in res.records)
    main = [r for r in res.records if r.depth == 0]
    subs = [r for r in res.records if r.depth == 1]
    assert len(main) == 4 and len(subs) == 3
    assert any(s.sent < m.end and m.sent < s.end for s in subs for m in main)
    assert min(s.scheduled for s in subs) < max(m.scheduled for m in main)  # spawned before the parent ended


def test_server_killed_mid_run_leaves_a_valid_summary(tmp_path):
    t = Trace(id="k", block_size=16, session=Session(id="k", requests=turns(30, gap=0.5)))
    with EmbeddedServer(time_scale=SCALE) as srv:
        cfg = BenchConfig(
            target=srv.url,
            duration=None,
            idle_gap_cap=None,
            time_scale=SCALE,
            lanes=1,
            sample_every=0.1,
            timeout=5.0,
        )
        run = BenchRun(cfg, [t], out=tmp_path)

        async def go():
            task = asyncio.create_task(run.run())
            while len(run.records) < 3:
                await asyncio.sleep(0.01)
            os.kill(srv.proc.pid, signal.SIGKILL)  # the server we started, by its pid
            return await task

        res = asyncio.run(go())
    s = res.summary
    assert s.requests == 30 and s.succeeded >= 3 and s.failed >= 1
    assert set(s.errors) <= {"connect_error", "reset"} and sum(s.errors.values()) == s.failed
    write_summary(s, tmp_path / "summary.json")
    back = read_summary(tmp_path / "summary.json")
    assert back.failed == s.failed and back.kind == "bench"
    assert len(read_records(tmp_path / "requests.jsonl")) == 30


def test_compare_simulate_and_bench_of_the_same_traces(tmp_path):
    cli = [sys.executable, "-m", "agentkv.cli"]
    traces = tmp_path / "traces"
    subprocess.run(
        [*cli, "trace", "synth", "--sessions", "2", "--seed", "3", "-o", str(traces)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    common = [str(traces), "--lanes", "2", "--max-requests", "10", "--idle-gap-cap", "2s"]
    subprocess.run(
        [*cli, "simulate", *common, "--out", str(tmp_path / "sim"), "-q"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    b = subprocess.run(
        [
            *cli,
            "bench",
            *common,
            "--out",
            str(tmp_path / "bench"),
            "--time-scale",
            str(SCALE),
            "--duration",
            "none",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert b.returncode == 0, b.stderr
    assert {p.name for p in (tmp_path / "bench").iterdir()} == {
        "requests.jsonl",
        "summary.json",
        "records.csv",
        "vllm_result.json",
        "report.html",
    }
    p = subprocess.run(
        [*cli, "compare", str(tmp_path / "sim"), str(tmp_path / "bench")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "simulate" in out and "bench" in out
    req = next(ln for ln in out.splitlines() if ln.lstrip("│ ").startswith("requests "))
    assert req.count("10") >= 2  # both ran the same 10 requests
    sim, bench = (
        read_summary(tmp_path / "sim" / "summary.json"),
        read_summary(tmp_path / "bench" / "summary.json"),
    )
    assert sim.input_tokens == bench.input_tokens and sim.cache.ceiling == pytest.approx(bench.cache.ceiling)
    assert bench.cache.reported == pytest.approx(sim.cache.reported, abs=0.05)
    assert Path(tmp_path / "bench" / "report.html").stat().st_size > 5000


def test_embedded_server_dies_with_a_killed_bench(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-m", "agentkv.cli", "bench", "--duration", "60s", "-q", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server = None
        for _ in range(1200):  # until bench has started its server (exec'd: its command line says serve)
            for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
                if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes():
                    server = int(c)
            if server:
                break
            time.sleep(0.05)
        assert server, "bench started no server"
        time.sleep(1.0)
    finally:
        p.kill()  # bench, by its pid: no chance to stop its server
        p.wait(10)
    for _ in range(100):
        if not Path(f"/proc/{server}").exists() or "Z" in Path(f"/proc/{server}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(server, signal.SIGKILL)
        pytest.fail("the embedded server outlived its bench")
