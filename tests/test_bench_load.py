"""`--warmup` and `--think-scale` against the real streaming test server, and the load flags'
one-line errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.cli import main
from agentkv.metrics.records import read_records
from agentkv.metrics.summary import read_summary
from agentkv.trace.model import Request, Session, Trace


def session(tid: str, n: int, think: float = 0.0, out: int = 5) -> Trace:
    reqs = [
        Request(
            t=i * 0.001,
            input_tokens=64 + 32 * i,
            output_tokens=out,
            hash_ids=list(range(4 + 2 * i)),
            think_time=think if i else 0.0,
        )
        for i in range(n)
    ]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs))


def run(traces, itl: float = 0.0, out=None, **kw):
    async def go():
        async with StreamTestServer(behave=lambda b, n: Behaviour(itl=itl)) as srv:
            cfg = BenchConfig(srv.url, duration=None, idle_gap_cap=None, monitor_gpu=False, **kw)
            return await BenchRun(cfg, traces, out=out).run()

    return asyncio.run(go())


def test_warmup_requests_are_sent_marked_and_left_out(tmp_path):
    traces = [session("a", 4), session("b", 4)]
    res = run(traces, lanes=2, warmup_requests=3, out=tmp_path)
    recs = read_records(tmp_path / "requests.jsonl")
    assert len(recs) == 8  # every request was sent and recorded
    assert sorted(r.id for r in recs if r.warmup) == [0, 1, 2]
    s = res.summary
    assert s.requests == 5 and s.succeeded == 5 and s.warmup_requests == 3
    assert s.output_tokens == 5 * 5 and sum(x.turns for x in s.sessions) == 5
    assert s.config["warmup"] == "3 requests"
    assert any(n.startswith("warm-up: 3 requests sent and left out") for n in s.notes)
    # the duration form: requests due in the first 0.25 s (turns 0.2 s apart on one lane)
    res = run([session("c", 5, think=0.2)], lanes=1, warmup_s=0.25)
    warm = [r for r in res.records if r.warmup]
    assert [r.index for r in warm] == [0, 1] and res.summary.requests == 3
    assert res.summary.ttft.count == 3


def test_think_scale_shortens_gaps_but_not_latencies():
    """--think-scale 0.2 replays 0.5 s gaps as 0.1 s and keeps the server's 10 ms TPOT; --time-scale 5
    (for a target 5x faster than real time) gives the same gaps but reports TPOT 5x larger."""
    tr = [session("a", 3, think=0.5, out=6)]
    thin = run(tr, itl=0.01, lanes=1, think_scale=0.2)
    fast = run(tr, itl=0.01, lanes=1, time_scale=5.0)
    for res, x in ((thin, 1.0), (fast, 5.0)):
        recs = sorted(res.records, key=lambda r: r.index)
        gaps = [(b.scheduled - a.end) / x for a, b in zip(recs, recs[1:], strict=False)]
        assert all(0.09 < g < 0.13 for g in gaps), gaps  # 0.5 s x 0.2 on the wall clock
    assert 0.009 < thin.summary.tpot.p50 < 0.03  # the server's own 10 ms
    assert fast.summary.tpot.p50 > 4 * thin.summary.tpot.p50  # target seconds: wall x 5
    assert thin.summary.config["think_scale"] == 0.2
    assert any(n.startswith("think scale 0.2") for n in thin.summary.notes)
    none = run(tr, itl=0.01, lanes=1, think_scale=0.0)
    recs = sorted(none.records, key=lambda r: r.index)
    assert all(b.scheduled - a.end < 0.05 for a, b in zip(recs, recs[1:], strict=False))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--session-rate", "0"], "--session-rate must be > 0"),
        (["--session-rate", "-2"], "--session-rate must be > 0"),
        (["--think-scale", "-1"], "--think-scale must be >= 0"),
        (["--think-scale", "abc"], "--think-scale: expected a number >= 0"),
        (["--warmup", "abc"], "--warmup: expected a request count"),
        (["--warmup=-5s"], "--warmup: expected"),
        (["--warmup", "2.5"], "--warmup: expected"),
        (["--lanes", "0"], "--lanes must be >= 1"),
        (["--sweep", "gpus=1,2"], "--sweep: expected KEY=V1,V2"),
        (["--sweep", "lanes=1,x"], "--sweep lanes: 'x' is not a whole number"),
        (["--sweep", "lanes=0,2"], "--sweep lanes: values must be > 0"),
        (["--sweep", "lanes=2,2"], "repeated"),
        (["--sweep", "lanes="], "no values"),
        (["--sweep", "lanes=1,2", "--slo", "ttft=1s", "--slo-attainment", "150%"], "--slo-attainment"),
        (["--sweep", "lanes=1,2", "--slo-search", "2"], "--slo-search needs --sweep and --slo"),
        (["--sweep", "lanes=1,2", "--slo", "ttft=1s", "--slo-search", "-1"], "--slo-search must be >= 0"),
    ],
)
def test_bad_load_flags_are_one_line_errors_before_any_server_starts(flags, message, capsys, tmp_path):
    # no --target: a bad flag must fail before the embedded server would start
    assert main(["bench", "--quiet", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentkv: error:") and message in err and "Traceback" not in err
    assert "\n" not in err and not (tmp_path / "o").exists()


def test_summary_config_records_the_load(tmp_path):
    res = run([session("a", 2)], lanes=3, out=tmp_path)
    cfg = json.loads((tmp_path / "requests.jsonl").read_text().splitlines()[0])
    assert "warmup" not in cfg  # unmarked records stay as before
    c = res.summary.config
    assert (c["lanes"], c["session_rate"], c["arrivals"], c["warmup"], c["think_scale"]) == (
        3,
        None,
        None,
        None,
        1.0,
    )
    assert res.summary.warmup_requests == 0 and read_summary is not None
