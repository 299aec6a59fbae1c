"""report.html: self-contained (no external resource), every plot present, and it opens in headless
Chromium without a console message (screenshot test; Debian's chromium is installed when absent)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agentkv.metrics.report import render_report, write_report
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import Sample, summarize
from agentkv.metrics.svg import nice_ticks

CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
    "--window-size=1400,2400",
    "--hide-scrollbars",
]


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
    assert sum(1 for t, _ in tags if t == "svg") == 5
    for title in (
        "TTFT vs input length",
        "TPOT distribution",
        "Cache hit over time",
        "In-flight requests and KV usage over time",
        "Per-session context growth",
    ):
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
    assert html.count("no data") == 5


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


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    if shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and apt-get is not available to install it")
    try:
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600, check=True)
        subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, timeout=900, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"could not install Debian's chromium with apt-get ({e})")
    exe = shutil.which("chromium")
    if not exe:
        pytest.skip("apt-get install chromium gave no chromium executable")
    return exe


def _open(exe: str, page: Path, tmp: Path) -> tuple[list[str], Path]:
    """Load `page` headless, screenshot it; return the console lines Chromium logged."""
    shot = tmp / f"{page.stem}.png"
    p = subprocess.run(
        [
            exe,
            *CHROME_FLAGS,
            f"--user-data-dir={tmp / ('profile-' + page.stem)}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [ln for ln in p.stderr.splitlines() if re.search(r":CONSOLE[:(]", ln)], shot


def test_report_opens_in_headless_chromium_without_console_errors(tmp_path):
    exe = _chromium()
    # the check itself must see errors: a page with one is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>x</p><script>undefinedFunction();</script></body></html>")
    console, _ = _open(exe, bad, tmp_path)
    assert any("undefinedFunction" in ln for ln in console), console
    recs = _records()
    page = write_report(_summary(recs), recs, tmp_path / "report.html")
    console, shot = _open(exe, page, tmp_path)
    assert console == []
    assert shot.exists() and shot.stat().st_size > 20_000  # a real rendering, not a blank page
