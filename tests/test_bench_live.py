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
