"""Calibrate the live vLLM (CPU build, tiny model) within a small budget, bench shared traces the
calibration never saw, and predict that run with the profile: `agentkv predict` beside what vLLM did.

The probes are synthetic prompts; the traces are four Claude Code sessions (8 turns each, lengths / 8,
16 output tokens, think times capped at 1 s) on four lanes. The bounds are what holds on a busy
2-core machine shared with other work (docs/cost-model.md has the figures); each still fails a
predictor that ignores the profile (the bundled H200 coefficients run this model ~100x too fast).
The suite's summary also prints vLLM's own means over the bench (its `/metrics` histograms: queue,
prefill, TTFT, TPOT) beside the client's and the prediction's: host time against engine time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_runs import agentkv
from vllm_server import BLOCK_SIZE

from agentkv.engine.cost import load_coefficients
from agentkv.trace.formats import load_paths
from agentkv.trace.formats.agentx import write_agentx
from tests.test_predict import trimmed

pytestmark = pytest.mark.vllm

SOURCES = ("trace_0119", "trace_0137", "trace_0167", "trace_0229")  # not in the suite's other traces
# the prefill chunk the server runs: vLLM's CPU default for the API server (max_num_batched_tokens
# 2048, vllm/engine/arg_utils.py), which calibrate cannot read from vLLM (no /server_info)
CHUNK = ("--max-num-batched-tokens", "2048")


def _figures(doc: dict) -> str:
    o, h, tp = doc["overall"], doc["hit_rate"], doc["throughput"]
    lat = ", ".join(
        f"{f.upper()} MAPE {o[f]['mape_pct']:.1f}% (bias {o[f]['bias_pct']:+.1f}%)" for f in o if o[f]
    )
    rest = doc["by_delivery"].get("one token a chunk") or {}
    merged = doc["merged_requests"]
    lat += f"; without the {merged} merged-chunk streams ({rest.get('requests', 0)}): " + ", ".join(
        f"{f.upper()} {rest[f]['mape_pct']:.1f}%" for f in ("ttft", "tpot", "e2e") if rest.get(f)
    )
    return (
        f"{doc['requests']} requests: {lat}; hit rate {h['measured']:.2%} vs {h['predicted']:.2%}; "
        f"throughput {tp['diff_pct']:+.2f}%"
    )


ENGINE_VIEW = {  # vLLM's own per-request histograms: API-server receipt to first token, engine steps
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "tokens_per_step": "vllm:iteration_tokens_total",
}


def engine_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Means over the bench (ms; tokens for a step) of vLLM's histograms, from /metrics scraped
    around it, and its step count: what the engine saw, beside what the client measured."""
    out: dict[str, float | None] = {}
    for key, name in ENGINE_VIEW.items():
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        s = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[key] = round(s / n * (1 if key == "tokens_per_step" else 1e3), 2) if n else None
        if key == "tokens_per_step":
            out["steps"] = n
    return out


def _means(rows: list[dict]) -> dict[str, float]:
    """Mean measured and predicted TTFT, TPOT, E2E over predictions.jsonl rows (ms)."""
    out = {}
    for f in ("ttft", "tpot", "e2e"):
        for k in (f, f"{f}_pred"):
            v = [x[k] for x in rows if x[k] is not None]
            out[k] = round(sum(v) / len(v) * 1e3, 2)
    return out


def _traces(shared_dir: Path, out: Path) -> Path:
    out.mkdir()
    for n in SOURCES:
        src = load_paths([shared_dir / "traces" / "claude-code" / f"{n}.json.gz"])[0]
        write_agentx(trimmed(src, turns=8, max_output=16), out / f"{n}.json")
    return out


def _predict(run: Path, prof: Path, traces: Path, out: Path, *extra: str) -> dict:
    bs = str(BLOCK_SIZE)
    agentkv(
        "predict",
        str(run),
        "--profile",
        str(prof),
        "--traces",
        str(traces),
        "--block-size",
        bs,
        "--out",
        str(out),
        *extra,
    )
    return json.loads((out / "prediction.json").read_text())


def test_calibrated_profile_predicts_shared_traces(main_server, vllm_env, shared_dir, tmp_path, figures):
    traces = _traces(shared_dir, tmp_path / "traces")
    prof, run, url = tmp_path / "profile.json", tmp_path / "run", main_server.url
    shape = ["--model", str(vllm_env.model_dir), "--block-size", str(BLOCK_SIZE), *CHUNK]
    agentkv("calibrate", "--target", url, "--out", str(prof), "--budget", "45s", *shape, "-q", timeout=180)
    fit = json.loads(prof.read_text())["fit"]
    loaded = [p for p in json.loads(prof.read_text())["probes"] if p["family"] == "loaded_ttft"]
    lanes = ["--lanes", "4", "--duration", "none"]
    before = main_server.metrics()
    agentkv("bench", str(traces), "--target", url, *lanes, "--out", str(run), "-q", "--no-report", "--json")
    view = engine_view(before, main_server.metrics())
    doc = _predict(run, prof, traces, tmp_path / "p")
    rows = [json.loads(x) for x in (tmp_path / "p" / "predictions.jsonl").read_text().splitlines()]
    (tmp_path / "engine_view.json").write_text(json.dumps({"engine": view, "client": _means(rows)}))
    wrong = tmp_path / "bundled.json"  # the profile ignored: bundled H200 coefficients, no host overheads
    wrong.write_text(
        json.dumps(json.loads(prof.read_text()) | {"coefficients": load_coefficients().to_dict()})
    )
    bad = _predict(run, wrong, traces, tmp_path / "w", "--no-overhead")
    lag, ov = fit["overhead"]["first_token_s"] * 1e3, fit["overhead"]
    front = f"{ov.get('front_end_token_s', 0) * 1e6:.2f} us/token, {ov.get('front_end_before_engine', 0):.0%} before"
    figures["predict (calibrated)"] = (
        f"fit MAPE {fit['mape_pct']}; first-token delay {lag:.1f} ms; front end {front}; " + _figures(doc)
    )
    figures["predict (bundled H200 coefficients)"] = _figures(bad)
    figures["vLLM's own means (ms)"] = f"{view}; client and predicted: {_means(rows)}"

    assert loaded and fit["overhead"]["per_other_request_s"] >= 0.0  # host time under traffic, measured
    assert ov["front_end_token_s"] >= 0.0  # the front end under concurrency, measured
    assert doc["requests"] == 32 and doc["failed_requests_skipped"] == 0
    assert abs(doc["hit_rate"]["diff_points"]) < 1.0  # one prefix-cache model: the same hits
    assert abs(doc["throughput"]["diff_pct"]) < 10.0
    o, b = doc["overall"], bad["overall"]
    # Absolute errors move with the host's load between calibration and bench (quiet: E2E MAPE 13.5%,
    # TTFT 22%; with other work on the 2 cores: 61% and 70%), so the bounds are loose; the 15%
    # target is reported in docs/cost-model.md as missed. Per-request TPOT here measures how the
    # one-process server flushes tokens (bursts: TPOT near 0, so one burst of 0.3 ms against a
    # predicted 5 ms is +1,500%: a CI run had MAPE 291% with mean TPOT 6.8 ms predicted, 3.7 ms
    # measured, 4.9 ms by vLLM's own metrics), so TPOT is judged on its mean over the requests:
    # within 0.4-2.5x of the measured mean, which the control (0.08x in that run) fails.
    assert o["e2e"]["mape_pct"] < 80.0 and o["ttft"]["mape_pct"] < 85.0, o
    mean = _means(rows)
    bad_mean = _means(
        [json.loads(x) for x in (tmp_path / "w" / "predictions.jsonl").read_text().splitlines()]
    )
    assert 0.4 < mean["tpot_pred"] / mean["tpot"] < 2.5, mean
    assert bad_mean["tpot_pred"] / bad_mean["tpot"] < 0.3, bad_mean
    # the control (bundled H200 coefficients) is far off, and the calibrated profile inside it
    assert b["e2e"]["bias_pct"] < -60.0 and b["ttft"]["bias_pct"] < -60.0, b
    for fig in ("ttft", "e2e"):  # TPOT here is the server's token flushing (above), not its steps
        assert o[fig]["mape_pct"] < b[fig]["mape_pct"], (fig, o, b)
