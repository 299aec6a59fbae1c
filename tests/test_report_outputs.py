"""A run's output files: --percentiles, records.csv, vllm_result.json (vLLM's `bench serve
--save-result` field names) and simulate --out writing what bench writes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from agentkv.errors import UserError
from agentkv.metrics.dist import Dist, parse_percentiles, pct_key
from agentkv.metrics.export import peak_concurrency, peak_output_rate, vllm_result
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.summary import summarize

# what `vllm bench serve --save-result --save-detailed` writes for a generation run
VLLM_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
}


def test_percentile_keys_and_flag_values():
    assert [pct_key(p) for p in (50, 99.0, 99.9, 99.99)] == ["p50", "p99", "p99.9", "p99.99"]
    assert parse_percentiles("99, p50,50,99.9") == (50.0, 99.0, 99.9)
    assert parse_percentiles(None) == (50.0, 90.0, 95.0, 99.0, 99.9)
    for bad in ("0", "100.5", "fifty", "50,,90"):
        with pytest.raises(UserError, match="--percentiles"):
            parse_percentiles(bad)
    v = np.random.default_rng(3).exponential(size=1001)
    d = Dist.of(v, (50.0, 99.9))
    assert d.percentiles == {
        "p50": pytest.approx(np.percentile(v, 50)),
        "p99.9": pytest.approx(np.percentile(v, 99.9)),
    }
    assert d.std == pytest.approx(v.std()) and d.p90 == pytest.approx(np.percentile(v, 90))


@pytest.mark.parametrize("cmd", ["bench", "simulate"])
def test_a_bad_percentiles_flag_is_a_usage_error_before_any_run(cmd):
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", cmd, "--percentiles", "50,abc", "--out", "/nonexistent/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "argument --percentiles: expected numbers" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def _rec(i: int, sent: float, first: float, end: float, out: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        id=i,
        trace="t",
        session="t#0",
        scheduled=sent,
        sent=sent,
        first_token=first if ok else None,
        end=end,
        ttft=first - sent if ok else None,
        e2e=end - sent,
        tpot=(end - first) / (out - 1) if ok else None,
        input_tokens=1000,
        output_tokens=out if ok else 0,
        ok=ok,
        error="" if ok else "http_500",
        http_status=0 if ok else 500,
        error_detail="" if ok else "boom",
    )


def test_peaks_count_overlaps_and_token_arrivals():
    # two requests decode 100 tokens each over the same 10 s: 20 tok/s; a third overlaps neither
    recs = [_rec(0, 0.0, 0.0, 10.0, 101), _rec(1, 0.0, 0.0, 10.0, 101), _rec(2, 20.0, 20.0, 21.0, 11)]
    assert peak_output_rate(recs) == pytest.approx(20.2, rel=0.02)
    assert peak_concurrency(recs) == 2
    assert peak_output_rate([]) == 0.0 and peak_concurrency([]) == 0


def test_vllm_result_has_vllms_fields_and_agrees_with_the_summary():
    recs = [_rec(i, i * 1.0, i + 0.1 + 0.01 * i, i + 3.0, 50) for i in range(20)] + [
        _rec(20, 5.0, 0, 6.0, 0, ok=False)
    ]
    s = summarize(recs, kind="bench", target="http://x", config={"model": "m", "api": "chat", "lanes": 4})
    v = vllm_result(s, recs)
    assert set(v) >= VLLM_KEYS
    assert (v["completed"], v["failed"], v["num_prompts"]) == (20, 1, 21)
    assert v["backend"] == "openai-chat" and v["model_id"] == "m" and v["max_concurrency"] == 4
    assert (
        v["total_input_tokens"] == s.input_tokens and v["request_throughput"] == s.throughput.requests_per_s
    )
    ttfts = [r.ttft for r in recs if r.ok]
    assert v["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert v["median_ttft_ms"] == pytest.approx(1000 * np.median(ttfts))
    assert v["std_ttft_ms"] == pytest.approx(1000 * np.std(ttfts))
    assert v["p99.9_ttft_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99.9))
    for name in ("tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p95_{name}_ms"} <= set(v)
    assert len(v["ttfts"]) == len(v["latencies"]) == len(v["errors"]) == 21
    assert v["ttfts"][20] == 0.0 and v["errors"][20] == "http_500 boom" and v["errors"][0] == ""
    assert v["generated_texts"] == [""] * 21  # agentkv never keeps completion text
    json.dumps(v)  # plain JSON


def test_simulate_out_writes_what_bench_writes(tmp_path):
    out = tmp_path / "sim"
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "simulate", "--max-requests", "30", "--percentiles", "50,99.9"]
        + ["--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["ttft"]["percentiles"]) == ["p50", "p99.9"]
    assert list(summary["itl"]["percentiles"]) == ["p50", "p99.9"]
    assert "p90" in p.stdout  # the terminal keeps its compact set
    lines = [json.loads(ln) for ln in (out / "requests.jsonl").read_text().splitlines()]
    with open(out / "records.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines) == 30
    for row, rec in zip(rows, lines, strict=True):
        assert int(row["id"]) == rec["id"] and row["session"] == rec["session"]
        assert (
            float(row["ttft"]) == pytest.approx(rec["ttft"])
            and int(row["cached_tokens"]) == rec["cached_tokens"]
        )
    v = json.loads((out / "vllm_result.json").read_text())
    assert v["completed"] == summary["succeeded"] and v["label"] == "agentkv-simulate"
    assert "itls" not in v  # simulate pools its token gaps: no per-request lists to write
    assert v["p99.9_ttft_ms"] == pytest.approx(summary["ttft"]["percentiles"]["p99.9"] * 1000)
    html = (out / "report.html").read_text()
    assert "<h1>agentkv simulate: simulated 1x" in html and "ITL distribution (every token gap)" in html
