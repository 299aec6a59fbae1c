"""The Gated DeltaNet GPU probe's CPU parts: its comparison with the model, its errors, and the bundled
H200 points (held out of the fit) against the linear-attention state terms."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/probe_linear.py"
sys.path.insert(0, str(SCRIPT.parent))
spec = importlib.util.spec_from_file_location("probe_linear", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
BUNDLED = ROOT / "agentkv/data/calibration/h200-qwen3-next-gdn.json"


def _doc() -> dict:
    dec = [
        {"batch": b, "heads": h, "mode": "graph", "layer_ms": 0.002 * b} for b in (1, 64) for h in (32, 16)
    ]
    pre = [{"seqs": 1, "tokens": 8192, "heads": 32, "mode": "graph", "layer_ms": 0.6}]
    failed = {"seqs": 8, "tokens": 2048, "heads": 32, "mode": "graph", "error": "RuntimeError: capture"}
    return {"device": "test", "parts": {probe.PART: {"decode": dec, "prefill": [*pre, failed]}}}


def test_predictions_follow_heads_batch_and_tokens():
    """TP 2 holds half the value heads and half the state; decode grows with the batch, prefill with tokens."""
    rows = probe.compare(_doc())
    assert len(rows) == 5  # the failed point is left out
    pred = {(k, p.get("batch", p.get("tokens")), p["heads"]): v for k, p, _, v in rows}
    assert pred[("decode", 64, 16)] == pytest.approx(pred[("decode", 64, 32)] / 2, rel=0.01)
    assert pred[("decode", 64, 32)] == pytest.approx(64 * pred[("decode", 1, 32)], rel=0.01)
    one = probe.predict({"seqs": 1, "tokens": 1024, "heads": 32}, "prefill")
    assert pred[("prefill", 8192, 32)] > 7 * one
    assert probe.state_bytes(32) == 32 * 128 * 128 * 6  # bf16 read, float32 written


def test_compare_and_no_gpu_from_the_command_line(tmp_path):
    f = tmp_path / "probe.json"
    f.write_text(json.dumps(_doc()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = [sys.executable, str(SCRIPT), "--compare"]
    r = subprocess.run([*run, str(f)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.count("predicted") == 5, r.stderr
    (tmp_path / "bad.json").write_text('{"parts": {"qwen3-next-gdn": {"decode": [{"batch": 1}]}}}')
    (tmp_path / "other.json").write_text('{"parts": {"deepseek-v3-moe": {}}}')
    for bad in ("missing.json", "bad.json", "other.json"):
        r = subprocess.run([*run, str(tmp_path / bad)], capture_output=True, text=True, env=env)
        assert r.returncode == 2 and "not a probe file" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "probe_linear:" in r.stderr and "Traceback" not in r.stderr


def test_bundled_h200_points_scale_as_the_model_does():
    """Held out of the fit: graphed decode grows with the batch (past 32 sequences) and graphed prefill
    with tokens (past 8K) at the model's rates within 15%; the model stays below the GPU by at most 5x
    there (the state read + write at 2.3 TB/s, fla's Triton chunk kernels at ~75 ns a token a layer)."""
    doc = json.loads(BUNDLED.read_text())
    rows = probe.compare(doc)
    assert len(rows) == sum(len(v) for v in doc["parts"][probe.PART].values())  # no point failed
    dec = {p["batch"]: (m, v) for k, p, m, v in rows if k == "decode" and p["heads"] == 32}
    (m0, p0), (m1, p1) = dec[64], dec[512]
    assert p1 / p0 == pytest.approx(m1 / m0, rel=0.15)
    pre = {
        p["tokens"]: (m, v)
        for k, p, m, v in rows
        if k == "prefill" and p["mode"] == "graph" and p["seqs"] == 1
    }
    (m0, p0), (m1, p1) = pre[8192], pre[32768]
    assert p1 / p0 == pytest.approx(m1 / m0, rel=0.15)
    big = [
        (m, v)
        for k, p, m, v in rows
        if p["mode"] == "graph" and p.get("batch", 64) >= 32 and p.get("tokens", 8192) >= 8192
    ]
    assert big and all(1 / 5 < v / m < 1 for m, v in big)
