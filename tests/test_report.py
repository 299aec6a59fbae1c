"""report.html: self-contained (no external resource), every panel present, readable at 8,000
requests and 119 session trees (aggregated, grouped, axes fitted), titled by model and target, the
configuration as a table. Rendering in Chromium: tests/test_report_render.py."""

from __future__ import annotations

from html.parser import HTMLParser

import numpy as np
import pytest
from reportutil import PANELS, check_axes_fit

from agentkv.metrics.records import RequestRecord
from agentkv.metrics.report import render_report
from agentkv.metrics.summary import Sample, summarize
from agentkv.metrics.svg import log_ticks, nice_ticks


def _records() -> list[RequestRecord]:
    out = []
    for i in range(60):
        tree = f"t{i % 4}#0"
        start = i * 0.5
        inp = 1000 + 400 * (i // 4)
        ok = i % 17 != 5
        out.append(
            RequestRecord(
                id=i,
                trace=f"t{i % 4}",
                session=tree if i % 5 else f"sub{i}#0",
                tree=tree,
                depth=0 if i % 5 else 1,
                index=i // 4,
                scheduled=start,
                sent=start + 0.001,
                first_token=start + 0.05 + 0.001 * (i % 7),
                end=start + 0.4,
                ttft=0.05 + 0.001 * (i % 7),
                e2e=0.4,
                tpot=0.01 + 0.0005 * (i % 9),
                itl_max=0.03,
                input_tokens=inp,
                output_tokens=30 if ok else 3,
                expected_output_tokens=30,
                cached_tokens=inp - 400 if i >= 4 else 0,
                ceiling_tokens=inp - 400 if i >= 4 else 0,
                ok=ok,
                error="" if ok else "http_500",
            )
        )
    return out


def _summary(records):
    tl = [Sample(t, t % 5, 0.1 + 0.01 * t, t % 3, 0, 100.0 * t, 150.0 * t) for t in range(31)]
    return summarize(
        records,
        kind="bench",
        target="http://127.0.0.1:8000",
        timeline=tl,
        slo={"ttft": 0.053},
        metrics_hit_rate=0.66,
        notes=[
            "prompts: token ids (exact prompt lengths)",
            "GPU monitoring absent: the target is not on this host",
        ],
    )


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_report_is_self_contained_with_every_plot():
    recs = _records()
    html = render_report(_summary(recs), recs)
    p = _Collect()
    p.feed(html)
    tags = p.tags
    assert sum(1 for t, _ in tags if t == "svg") == len(PANELS)
    for title in PANELS:
        assert title in html
    # nothing loads from elsewhere: no src/href to a URL, no external stylesheet
    for t, a in tags:
        for key in ("src", "href"):
            assert not a.get(key, "").startswith(("http:", "https:", "//")), (t, a)
    assert not any(t == "link" for t, _ in tags)
    assert "http_500" in html and "goodput" in html and "GPU monitoring absent" in html
    assert html.count("<circle") > 40  # the TTFT and per-request hit scatters are drawn


def test_report_of_an_empty_run_still_renders():
    html = render_report(summarize([], kind="bench", target="x"), [])
    assert html.count("no data") == len(PANELS)


def test_report_and_terminal_say_which_clock_each_figure_is_on():
    from rich.console import Console

    from agentkv.metrics.view import print_summary

    recs = _records()
    s = _summary(recs)
    assert "engine clock" not in render_report(s, recs)  # no clocks recorded: nothing claimed
    s.clocks = {"ttft": "engine", "tpot": "engine", "itl": "engine", "e2e": "engine", "duration": "client"}
    html = render_report(s, recs)
    assert (
        "TTFT, TPOT, ITL and E2E on the target&#x27;s engine clock (its own timestamps); duration and "
        "throughput on the client&#x27;s clock (wall x time scale)"
    ) in html
    con = Console(record=True, width=200)
    print_summary(s, con)
    assert "latency (ms, engine clock)" in con.export_text()


def test_nice_ticks():
    assert nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(0.0, 0.9)[-1] >= 0.9
    t = nice_ticks(1234, 98765)
    assert t[0] <= 1234 and t[-1] >= 98765 and len(t) <= 7


def _big_run(n: int = 8000, trees: int = 119) -> list[RequestRecord]:
    """A long run: `n` requests over `trees` session trees (a fifth of them sub-agent requests),
    TTFT spanning four decades (1 ms to 10 s), contexts growing turn by turn."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        t = i % trees
        turn = i // trees
        start = float(i) * 0.4
        ttft = float(10 ** rng.uniform(-3, 1))
        sub = i % 5 == 0
        inp = 2000 + 900 * turn + 10 * t
        out.append(
            RequestRecord(
                id=i,
                trace=f"trace_{t:04d}",
                session=f"sub{t}-{turn}#0" if sub else f"trace_{t:04d}#0",
                tree=f"trace_{t:04d}#0",
                depth=1 if sub else 0,
                index=turn,
                scheduled=start,
                sent=start,
                first_token=start + ttft,
                end=start + ttft + 2.0,
                ttft=ttft,
                e2e=ttft + 2.0,
                tpot=0.02 + 0.001 * (i % 13),
                itl_max=0.05,
                input_tokens=inp,
                trace_input_tokens=inp,
                output_tokens=100,
                cached_tokens=inp // 2 if t % 7 else None,
                ceiling_tokens=inp - 900,
            )
        )
    return out


def test_report_of_8000_requests_and_119_trees_is_aggregated_grouped_and_fitted():
    recs = _big_run()
    s = summarize(recs, kind="simulate", target="simulated 1x H200 (tp=1) llama3-8b", config={"lanes": 16})
    html = render_report(s, recs)
    # no overplotting: percentiles per time slice and histograms, not a dot per request
    assert html.count("<circle") < 2000 and len(html) < 3_000_000
    assert "p99 per slice" in html and ">each request<" not in html
    # the 119 trees: 40 swim lanes, 30 hit-rate rows and one for the rest, 10 coloured growth lines
    assert "40 largest of 119 session trees; 79 not drawn" in html
    assert "other 89 trees" in html and "30 largest of 119 session trees; 89 grouped" in html
    assert "10 largest of 119 session trees; 109 in grey" in html
    assert check_axes_fit(html) >= 16
    # TTFT spans four decades: log scale on its time chart and its histogram
    p = _Collect()
    p.feed(html)
    svgs = {a["aria-label"]: a for t, a in p.tags if t == "svg"}
    assert svgs["TTFT over time"]["data-ylog"] == "1"
    assert svgs["TTFT distribution"]["data-xlog"] == "1"
    assert svgs["TPOT over time"]["data-ylog"] == "0"
    lo, hi = map(float, svgs["TPOT over time"]["data-ylim"].split(","))
    assert lo > 0  # TPOT 20-32 ms: the axis does not start at zero


def test_axis_check_catches_an_axis_that_does_not_fit():
    from agentkv.metrics.svg import Chart, Series

    ok = Chart("fits", "x", "y", ylog=None).add(Series("s", [1, 2, 3], [500, 510, 520], "line")).svg()
    assert check_axes_fit(ok) == 2
    squeezed = Chart("squeezed", "x", "y", ymin=0).add(Series("s", [1, 2, 3], [500, 510, 520], "line")).svg()
    with pytest.raises(AssertionError, match="squeezed"):
        check_axes_fit(squeezed)


def test_log_ticks_bound_the_data():
    assert log_ticks(3, 700) == [2, 5, 10, 20, 50, 100, 200, 500, 1000]  # 1-2-5 over a few decades
    assert log_ticks(0.3, 2000) == [0.1, 1, 10, 100, 1000, 10000]  # decades over many
    t = log_ticks(0.001, 50_000)
    assert (
        t[0] == 0.001
        and t[-1] == 100_000
        and all(b / a == pytest.approx(10) for a, b in zip(t, t[1:], strict=False))
    )


def test_title_names_model_and_target_and_configuration_is_a_table():
    recs = _records()
    s = _summary(recs)
    s.config = {"model": "llama3-8b", "time_scale": 10.0, "server": {"gpu": "h200", "tp_size": 1}, "lanes": 8}
    s.notes.append("target: the embedded server (http://127.0.0.1:39235  model=llama3-8b), started as: ...")
    html = render_report(s, recs)
    h1 = html[html.index("<h1>") + 4 : html.index("</h1>")]
    assert h1 == "agentkv bench: llama3-8b on the embedded agentkv serve (simulated H200, time scale 10)"
    assert "<td>server.gpu</td><td>h200</td>" in html and "<td>lanes</td><td>8</td>" in html
    assert '{"model"' not in html  # no one-line JSON blob
    s.notes.pop()
    assert "llama3-8b on http://127.0.0.1:8000" in render_report(s, recs)


def test_latency_table_shows_the_requested_percentiles():
    recs = _records()
    s = summarize(recs, kind="bench", target="x", percentiles=(50.0, 99.9))
    html = render_report(s, recs)
    assert "<th>p99.9</th>" in html and "<th>p95</th>" not in html
    assert "<th>p95</th>" in render_report(_summary(recs), recs)  # the default set
