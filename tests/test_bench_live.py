"""`agentkv bench`'s live panel: open-loop arrivals (trees arrived, waiting for a lane) and the
warm-up's state, read from a real replay plan driven forward in time."""

from __future__ import annotations

from rich.console import Console

from agentkv.bench.live import load_lines, progress_panel
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.trace.formats import bundled_sample, load_paths


def _text(renderable) -> str:
    con = Console(record=True, width=200)
    con.print(renderable)
    return con.export_text()


def test_arrivals_and_warmup_lines_follow_the_plan():
    traces = load_paths(bundled_sample())
    cfg = BenchConfig(
        target="http://127.0.0.1:1", lanes=1, session_rate=2.0, arrivals="constant", warmup_requests=3
    )
    run = BenchRun(cfg, traces)
    run.plan.start(0.0)
    sent = run.plan.pop_due(1.01)  # arrivals at 0, 0.5 and 1.0 s; one lane: the later two wait
    a = run.plan.arrivals
    assert (a.arrived, a.backlog) == (3, 2)
    lines = load_lines(cfg, len(sent), a, 1.0)
    assert (
        "3 session trees arrived (constant, --session-rate 2/s, at most 1 at once), 2 waiting for a lane"
        in lines[0]
    )
    assert lines[1] == f"warming up: {len(sent)} of 3 requests sent (left out of every statistic)"
    assert load_lines(cfg, 3, a, 1.0)[1].startswith("warm-up done: the first 3 requests")
    run.stats.released = len(sent)
    panel = _text(progress_panel(run))
    assert "2 waiting for a lane" in panel and "warming up:" in panel


def test_closed_loop_without_warmup_adds_nothing_and_duration_warmup_counts_seconds():
    traces = load_paths(bundled_sample())
    closed = BenchConfig(target="http://127.0.0.1:1", lanes=2)
    assert load_lines(closed, 10, BenchRun(closed, traces).plan.arrivals, 5.0) == []
    timed = BenchConfig(target="http://127.0.0.1:1", lanes=2, warmup_s=30.0)
    assert load_lines(timed, 10, None, 12.4) == ["warming up: 12s of 30s (left out of every statistic)"]
    assert load_lines(timed, 10, None, 31.0)[0].startswith("warm-up done: requests due in the first 30s")


def _rec(i: int, out: int, ok: bool = True):
    from agentkv.metrics.records import RequestRecord, encode_record

    r = RequestRecord(id=i, trace="t", session="t", lane=0, end=1.0, e2e=1.0, output_tokens=out, ok=ok)
    return ("rec", encode_record(r))


def test_sharded_panel_shows_a_line_per_shard_under_the_total():
    """--clients 2: the shards' own counts, fed through the driver's message handler, each on a line
    (done, failed, output tok/s, in flight, state) below the run's totals."""
    from agentkv.bench.live import shard_table
    from agentkv.bench.shards import Shard, ShardedRun

    traces = load_paths(bundled_sample())
    run = ShardedRun(BenchConfig(target="http://127.0.0.1:1", lanes=4), traces, 2, out=None)
    run.shards = [Shard(0, link=None, lanes=2, traces=2), Shard(1, link=None, lanes=2, traces=1)]
    a, b = run.shards
    for i, (out, ok) in enumerate([(100, True), (300, True), (0, False)]):
        run._on_msg(a, _rec(i, out, ok))
    run._on_msg(b, _rec(0, 50))
    run._on_msg(a, ("tick", 3, 6, None))
    run._on_msg(b, ("tick", 1, 2, None))
    run._on_msg(b, ("done", b"", False, "", None))
    lines = [ln.split() for ln in _text(shard_table(run.shards, 10.0)).splitlines() if ln.strip()]
    assert lines[0] == ["shard", "runs", "as", "done", "failed", "output", "tok/s", "in", "flight", "state"]
    assert lines[1] == ["0", "3", "1", "40", "3", "running"]  # 400 tokens in 10 s
    assert lines[2] == ["1", "1", "0", "5", "0", "done"]  # done: nothing in flight
    run.stats.started = 1.0
    panel = _text(progress_panel(run)).splitlines()  # a ShardedRun renders as a BenchRun does
    total = next(i for i, ln in enumerate(panel) if "finished" in ln)
    assert (
        "4 (1 failed)" in panel[total] and "in flight" in panel[total] and panel[total].endswith("3")
    )  # 3 + 0
    assert total < next(i for i, ln in enumerate(panel) if ln.split()[:1] == ["shard"])
    run._on_msg(a, ("error", "bad"))
    assert "error" in _text(shard_table(run.shards, 10.0)).splitlines()[1]


def test_one_client_panel_has_no_shard_lines():
    traces = load_paths(bundled_sample())
    run = BenchRun(BenchConfig(target="http://127.0.0.1:1", lanes=2), traces)
    assert "output tok/s" in _text(progress_panel(run)) and "runs as" not in _text(progress_panel(run))
