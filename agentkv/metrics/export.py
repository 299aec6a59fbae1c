"""A run's files besides requests.jsonl: summary.json, records.csv, vllm_result.json (read by
`vllm bench serve --save-result` consumers) and report.html. Written alike by bench and simulate.

vllm_result.json uses vLLM's field names and units (lists in seconds, statistics in ms); the
mapping is in docs/bench.md ("Outputs").
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import msgspec
import numpy as np

from agentkv.metrics.dist import Dist
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.report import write_report
from agentkv.metrics.summary import Summary, write_summary
from agentkv.trace.warmup import measured

CSV_FIELDS = tuple(f for f in RequestRecord.__struct_fields__ if f != "itls")  # a list per row: jsonl only
OUTPUT_FILES = ("requests.jsonl", "summary.json", "records.csv", "vllm_result.json")


def _cell(v) -> str | int | float:
    if v is None:
        return ""
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":")) if v else ""
    return v


def write_records_csv(records: list[RequestRecord], path: str | Path) -> Path:
    """One row per request, one column per requests.jsonl field but `itls` (empty: unknown/absent)."""
    p = Path(path)
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in records:
            w.writerow([_cell(getattr(r, k)) for k in CSV_FIELDS])
    return p


def _stats(d: Dist, name: str, keys: list[str]) -> dict[str, float | None]:
    """vLLM's mean_/median_/std_/pN_{name}_ms keys from one distribution (seconds -> ms; None when
    nothing was measured)."""

    def ms(v):
        return None if v is None else v * 1000

    out = {f"mean_{name}_ms": ms(d.mean), f"median_{name}_ms": ms(d.p50), f"std_{name}_ms": ms(d.std)}
    ps = d.percentiles or {"p50": d.p50, "p90": d.p90, "p99": d.p99}
    for key in keys:
        out[f"{key}_{name}_ms"] = ms(ps.get(key))
    return out


def peak_output_rate(records: list[RequestRecord]) -> float:
    """The most output tokens in any one-second bin, each request's tokens spread evenly from its
    first token to its end (vLLM's max_output_tokens_per_s counts token arrivals per second)."""
    ok = [r for r in records if r.ok and r.output_tokens and r.first_token is not None]
    if not ok:
        return 0.0
    horizon = int(np.ceil(max(r.end for r in ok))) + 1
    rate = np.zeros(horizon + 1)
    for r in ok:
        a, b = r.first_token, max(r.end, r.first_token + 1e-9)  # type: ignore[operator]
        per_s = r.output_tokens / (b - a)
        for s in range(int(a), int(np.ceil(b))):
            rate[s] += per_s * (min(b, s + 1) - max(a, s))
    return float(rate.max())


def peak_concurrency(records: list[RequestRecord]) -> int:
    """The most requests in flight at once (sent to end)."""
    ev = sorted([(r.sent, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def vllm_result(s: Summary, records: list[RequestRecord]) -> dict:
    """The run as `vllm bench serve --save-result --save-detailed` writes it (see docs/bench.md)."""
    cfg = s.config or {}
    model = cfg.get("model") or (cfg.get("engine") or {}).get("model") or ""
    tp = s.throughput
    stamp = time.strptime(s.created, "%Y-%m-%dT%H:%M:%SZ") if s.created else time.gmtime()
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S", stamp),
        "endpoint_type": "openai-chat" if cfg.get("api") == "chat" else "openai",
        "backend": "openai-chat" if cfg.get("api") == "chat" else "openai",
        "label": f"agentkv-{s.kind}",
        "model_id": model,
        "tokenizer_id": cfg.get("tokenizer") or model,
        "num_prompts": s.requests,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": cfg.get("lanes"),
        "duration": s.duration_s,
        "completed": s.succeeded,
        "failed": s.failed,
        "total_input_tokens": s.input_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": tp.requests_per_s if tp else 0.0,
        "request_goodput": s.goodput.requests_per_s if s.goodput else None,
        "output_throughput": tp.output_tokens_per_s if tp else 0.0,
        "total_token_throughput": tp.total_tokens_per_s if tp else 0.0,
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft if r.ok and r.ttft is not None else 0.0 for r in records],
        "latencies": [r.e2e if r.ok else 0.0 for r in records],
        "start_times": [r.sent for r in records],
        "generated_texts": ["" for _ in records],
        "errors": ["" if r.ok else f"{r.error} {r.error_detail}".strip() for r in records],
        "max_output_tokens_per_s": peak_output_rate(records),
        "max_concurrent_requests": peak_concurrency(records),
    }
    if any(r.itls for r in records):  # bench records each request's token gaps; simulate pools them
        out["itls"] = [r.itls for r in records]
    dists = ((s.ttft, "ttft"), (s.tpot, "tpot"), (s.itl, "itl"), (s.e2e, "e2el"))
    keys = next((list(d.percentiles) for d, _ in dists if d.percentiles), ["p50", "p90", "p99"])
    for d, name in dists:
        out.update(_stats(d, name, keys))
    return out


def write_outputs(
    out: Path, s: Summary, records: list[RequestRecord], *, report: bool = True, itl_values=None
) -> list[str]:
    """summary.json, records.csv, vllm_result.json and (unless `report` is False) report.html into
    `out`; returns the names written. requests.jsonl is the caller's (bench appends it live).
    records.csv has every record (warm-up ones marked); vllm_result.json and the report the measured."""
    out.mkdir(parents=True, exist_ok=True)
    write_summary(s, out / "summary.json")
    write_records_csv(records, out / "records.csv")
    kept = measured(records)
    (out / "vllm_result.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(vllm_result(s, kept)), indent=2)
    )
    names = ["summary.json", "records.csv", "vllm_result.json"]
    if report:
        write_report(s, kept, out / "report.html", itl_values)
        names.append("report.html")
    return names
