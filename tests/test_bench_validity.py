"""A failed run never reads as a success: real servers that refuse the bench's requests in each common
way, with the run marked invalid and why, the server's message kept, a hint, and bounded rates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.bench.client import BenchClient
from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.testserver import NO_TEMPLATE, Behaviour, Quirks, StreamTestServer
from agentkv.metrics.records import read_records
from agentkv.metrics.validity import error_message, excess, invalid_reasons
from agentkv.trace.model import Request, Session, Trace


def trace(tid: str, n: int = 3, base: int = 0) -> Trace:
    """`n` turns, each extending the last by two 16-token blocks (4, 6, 8, ... blocks)."""
    reqs = [
        Request(
            t=i * 0.001,
            input_tokens=(4 + 2 * i) * 16,
            output_tokens=2,
            hash_ids=list(range(base, base + 4 + 2 * i)),
        )
        for i in range(n)
    ]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs))


TRACES = [trace("a"), trace("b", base=500)]


def cfg(**kw) -> BenchConfig:
    kw.setdefault("lanes", 2)
    return BenchConfig(target="", duration=None, idle_gap_cap=None, sample_every=0.05, **kw)


async def _runs(server: StreamTestServer, configs: list[BenchConfig], out: Path | None):
    async with server as srv:
        results = []
        for c in configs:
            c.target = srv.url
            results.append(await BenchRun(c, TRACES, out=out).run())
        return results


def run(c: BenchConfig, out: Path | None = None, **server_kw):
    """One run of TRACES against a fresh test server built with `server_kw`."""
    return asyncio.run(_runs(StreamTestServer(**server_kw), [c], out))[0]


def failing(res, error: str, status: int):
    """Every request failed with `error`/`status`; the run says so and shows no measured hit rate."""
    s = res.summary
    assert s.requests == 6 and s.failed == 6 and s.errors == {error: 6}
    assert not s.valid and s.invalid_reasons == ["no request succeeded (all 6 failed)"]
    assert s.cache.reported is None and s.cache.ceiling is None and s.throughput.output_tokens_per_s == 0
    assert all(r.http_status == status and r.error_detail for r in res.records)
    (g,) = s.top_errors
    assert (g.count, g.error, g.status) == (6, error, status)
    return g


def test_a_server_that_ignores_stream(tmp_path):
    res = run(cfg(), tmp_path, behave=lambda b, n: Behaviour(ignore_stream=True))
    g = failing(res, "not_streamed", 200)
    assert "ignores `stream: true`" in g.hint
    on_disk = read_records(tmp_path / "requests.jsonl")
    assert all('"text_completion"' in r.error_detail and r.http_status == 200 for r in on_disk)


@pytest.mark.parametrize("transport", ["http1", "aiohttp"])
def test_both_transports_see_a_json_answer_as_not_streamed(transport):
    async def go():
        srv = StreamTestServer(behave=lambda b, n: Behaviour(ignore_stream=True))
        async with srv, BenchClient(srv.url, transport=transport) as c:
            return await c.stream(c.body("test-model", [1, 2, 3], 4))

    res = asyncio.run(go())
    assert (res.ok, res.error, res.status) == (False, "not_streamed", 200)
    assert json.loads(res.detail)["usage"]["completion_tokens"] == 4


def test_a_chat_only_server_hints_api_chat():
    g = failing(run(cfg(), quirks=Quirks(completions=False)), "http_404", 404)
    assert g.message == "Not Found" and "--api chat" in g.hint


def test_a_server_refusing_token_ids_hints_text_prompts():
    g = failing(run(cfg(), quirks=Quirks(token_ids=False)), "http_400", 400)
    assert "Input should be a valid string" in g.message and "--prompt-mode text" in g.hint
    # the same server takes text prompts
    res = run(cfg(prompt_mode="text"), quirks=Quirks(token_ids=False))
    assert res.summary.valid and res.summary.failed == 0


def test_a_model_without_a_chat_template():
    g = failing(run(cfg(api="chat", prompt_mode="text"), quirks=Quirks(chat_template=False)), "http_400", 400)
    assert g.message == NO_TEMPLATE and "chat template" in g.hint and "--api completions" in g.hint


def test_failures_above_the_threshold_make_the_run_invalid():
    def behave(body, n):
        return Behaviour(status=500) if n == 0 else Behaviour()

    s = run(cfg(), behave=behave).summary
    assert s.failed == 1 and not s.valid
    assert s.invalid_reasons == ["1 of 6 requests failed (16.7% > the 1.0% allowed by --max-failure-rate)"]
    assert s.top_errors[0].message == "injected error 500" and s.top_errors[0].status == 500
    assert run(cfg(max_failure_rate=0.2), behave=behave).summary.valid


def test_any_context_overflow_makes_the_run_invalid():
    s = run(cfg(max_failure_rate=0.5), max_model_len=100).summary  # the third turns do not fit
    assert s.errors == {"context_overflow": 2} and not s.valid
    assert [r[:30] for r in s.invalid_reasons] == ["context overflow on 2 of 6 req"]
    assert "max-model-len" in s.top_errors[0].hint and "maximum context length" in s.top_errors[0].message


def test_a_second_run_without_cache_bust_is_flagged_contaminated():
    first, second, busted = asyncio.run(
        _runs(StreamTestServer(), [cfg(cache_bust=False), cfg(cache_bust=False), cfg()], None)
    )
    a, b, c = first.summary.cache, second.summary.cache, busted.summary.cache
    assert not a.contaminated and a.reported == pytest.approx(a.ceiling)
    assert b.ceiling == pytest.approx(a.ceiling) and b.reported == 1.0 and b.metrics == 1.0
    assert b.contaminated and b.reported_over_ceiling == pytest.approx(1.0 - b.ceiling)
    assert b.metrics_over_ceiling == pytest.approx(1.0 - b.ceiling)
    assert any(
        n.startswith("cache contaminated by an earlier run or other clients") for n in second.summary.notes
    )
    assert second.summary.valid  # contamination is flagged, not a failure
    assert not c.contaminated and c.reported == pytest.approx(c.ceiling)  # the default busts the cache


def test_server_metrics_above_the_ceiling_are_flagged_alone():
    first, second = asyncio.run(
        _runs(StreamTestServer(quirks=Quirks(usage_cached=False)), [cfg(cache_bust=False)] * 2, None)
    )
    c = second.summary.cache
    assert c.reported is None and c.metrics == 1.0 and c.contaminated
    assert c.reported_over_ceiling is None and c.metrics_over_ceiling == pytest.approx(1 - c.ceiling)


def test_cached_above_the_prompt_is_clipped_and_counted(tmp_path):
    res = run(cfg(), tmp_path, behave=lambda b, n: Behaviour(cached_bonus=10_000))
    recs = read_records(tmp_path / "requests.jsonl")
    assert all(r.cached_tokens == r.input_tokens and r.cached_reported > r.input_tokens for r in recs)
    c = res.summary.cache
    assert c.clipped == 6 and c.reported == 1.0
    assert any("6 requests reported cached tokens outside" in n for n in res.summary.notes)
    assert all(x.hit_rate <= 1.0 for x in res.summary.sessions)


def test_chat_template_tokens_count_on_the_server_side():
    plain = run(cfg()).summary
    res = run(cfg(api="chat", prompt_mode="text"), quirks=Quirks(template_tokens=7, chars_per_token=None))
    s = res.summary
    assert all(r.input_tokens == r.trace_input_tokens + 7 for r in res.records)
    assert s.cache.ceiling == pytest.approx(plain.cache.ceiling)  # on the trace's counts
    assert 0 <= s.cache.reported <= 1 and not s.cache.contaminated
    trace_in = sum(r.trace_input_tokens for r in res.records)
    assert any(f"where the trace has {trace_in:,} (+" in n for n in s.notes)


def test_a_server_counting_fewer_tokens_keeps_the_ceiling_bounded():
    s = run(cfg(prompt_mode="text"), quirks=Quirks(chars_per_token=64)).summary
    assert s.valid and 0 < s.cache.ceiling <= 1 and 0 <= s.cache.reported <= 1
    assert s.input_tokens < sum(t.session.requests[i].input_tokens for t in TRACES for i in range(3))


def test_validity_rules_and_messages():
    assert invalid_reasons(0, 0, 0) == ["no request finished"]
    assert invalid_reasons(100, 1, 0) == []  # 1% is within the default
    assert invalid_reasons(100, 2, 0)[0].startswith("2 of 100 requests failed")
    assert invalid_reasons(1000, 1, 1)[0].startswith("context overflow on 1 of 1000")
    assert invalid_reasons(10, 1, 0, max_failure_rate=0.0) != []
    assert excess(0.5, 0.49) is None and excess(0.9, 0.7) == pytest.approx(0.2) and excess(None, 0.5) is None
    assert error_message('{"error": {"message": "bad  prompt\\n"}}') == "bad prompt"
    assert error_message('{"detail": [{"msg": "Field required"}]}') == "Field required"
    assert error_message('{"object":"error","message":"cut sho') == "cut sho"  # a body cut at 512 bytes
    assert error_message("404: Not Found") == "404: Not Found"


# ---- as a user runs it: exit status, stderr, terminal, summary.json, report.html ----------------
BENCH = [sys.executable, "-m", "agentkv.cli", "bench", "--duration", "none", "-q", "--time-scale", "200"]


@contextlib.contextmanager
def server_process(*flags: str):
    """The test server in its own process, with the quirks `flags` name."""
    p = subprocess.Popen(
        [sys.executable, "-m", "agentkv.bench.testserver", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield p.stdout.readline().strip()
    finally:
        p.terminate()
        p.wait(10)


def bench(url: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    argv = [*BENCH, "--target", url, "--out", str(out), "--max-requests", "4", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_cli_an_invalid_run_exits_3_and_writes_everything(tmp_path):
    with server_process("--chat-only") as url:
        p = bench(url, tmp_path)
    assert p.returncode == 3, p.stderr
    assert "agentkv: invalid run: no request succeeded (all 4 failed) (outputs written; exit 3)" in p.stderr
    assert "Traceback" not in p.stderr
    assert "top errors" in p.stdout and "try --api chat" in p.stdout and "INVALID" in p.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["valid"] is False and s["invalid_reasons"] == ["no request succeeded (all 4 failed)"]
    assert s["top_errors"][0] == {
        "count": 4,
        "error": "http_404",
        "status": 404,
        "message": "Not Found",
        "hint": "the server has no /v1/completions (a chat-only server?): try --api chat",
    }
    assert "ceiling" not in s["cache"]
    html = (tmp_path / "report.html").read_text()
    assert "INVALID RUN" in html and "try --api chat" in html and "Not Found" in html
    assert '<div class="v">-</div><div class="k">cache hit: ceiling</div>' in html  # unknown, not 0%
    recs = read_records(tmp_path / "requests.jsonl")
    assert [(r.http_status, r.error_detail) for r in recs] == [(404, '{"detail": "Not Found"}')] * 4


def test_cli_cache_bust_by_default_and_contamination_without_it(tmp_path):
    with server_process() as url:
        runs = [
            bench(url, tmp_path / f"r{i}", *f)
            for i, f in enumerate([["--no-cache-bust"]] * 2 + [["--cache-bust"]])
        ]
    assert [p.returncode for p in runs] == [0, 0, 0], [p.stderr for p in runs]
    first, second, third = (json.loads((tmp_path / f"r{i}" / "summary.json").read_text()) for i in range(3))
    assert first["config"]["cache_bust"] is None and third["config"]["cache_bust"]
    assert "contaminated" not in first["cache"] and "contaminated" not in third["cache"]
    assert second["cache"]["contaminated"] is True and second["cache"]["reported_over_ceiling"] > 0.2
    assert "CACHE CONTAMINATED" in runs[1].stdout
    assert "CACHE CONTAMINATED" in (tmp_path / "r1" / "report.html").read_text()


@pytest.mark.parametrize("rate", ["101%", "-0.1", "lots"])
def test_cli_bad_max_failure_rate_is_one_line(rate):
    p = subprocess.run(
        [*BENCH, "--target", "http://127.0.0.1:9", "--max-failure-rate", rate],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--max-failure-rate" in p.stderr and "Traceback" not in p.stderr
