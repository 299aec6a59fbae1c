"""The MoE/MLA GPU probe's CPU parts: routing, the JSON it writes, and its comparison with the model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/probe_moe_mla.py"
spec = importlib.util.spec_from_file_location("probe_moe_mla", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_routing_sends_each_token_to_k_experts():
    one = probe.route(1, seed=3)
    assert len(one) == 32 and sum(one) <= 8
    many = probe.route(4096, seed=1)
    assert all(c > 0 for c in many)  # 4,096 tokens touch every expert on the GPU
    assert sum(many) == pytest.approx(4096 * 8 / 8, rel=0.1)  # 1/8 of the 8 picks land here


def _doc() -> dict:
    moe = [probe.point("moe", 0.1 * b**0.5, batch=b) for b in probe.MOE_BATCHES]
    mla = [probe.point("mla", 0.01 * b * c / 4096, batch=b, ctx=c) for b, c in probe.MLA_GRID]
    sparse = [probe.point("sparse", 0.02 * b, "graph", batch=b, ctx=c) for b, c in probe.SPARSE_GRID]
    failed = {"batch": 8, "mode": "grouped", "error": "RuntimeError: no grouped GEMM on this torch"}
    return {
        "device": "test",
        "torch": "-",
        "parts": {
            "deepseek-v3-moe": {"decode": [*moe, failed]},
            "deepseek-v3-mla": {"decode": mla},
            "deepseek-v32-sparse": {"decode": sparse},
        },
    }


def test_points_and_predictions_follow_the_model():
    doc = _doc()
    assert doc["parts"]["deepseek-v3-moe"]["decode"][0]["model_ms"] == pytest.approx(0.1 * probe.MOE_LAYERS)
    mla = doc["parts"]["deepseek-v3-mla"]["decode"][0]  # batch 1 x 4096 latents of 1,152 bytes in 0.01 ms
    assert mla["layer_GBps"] == pytest.approx(4096 * 1152 / 0.01e-3 / 1e9)
    rows = probe.compare(doc)
    assert len(rows) == len(probe.MOE_BATCHES) + len(probe.MLA_GRID) + len(probe.SPARSE_GRID)  # not the error
    moe = [pred for kind, _, _, pred in rows if kind == "moe"]
    assert moe == sorted(moe) and moe[-1] < 1.5 * moe[-2]  # expert bytes flatten once all are touched
    mla = {(p["batch"], p["ctx"]): pred for kind, p, _, pred in rows if kind == "mla"}
    assert mla[(64, 32768)] > 3 * mla[(64, 8192)]


def test_compare_and_no_gpu_from_the_command_line(tmp_path):
    f = tmp_path / "probe.json"
    f.write_text(json.dumps(_doc()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--compare", str(f)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and r.stdout.count("predicted") == len(probe.compare(_doc()))
    for bad in (tmp_path / "missing.json", tmp_path / "bad.json"):
        (tmp_path / "bad.json").write_text('{"parts": {"deepseek-v3-moe": {"decode": [{"batch": 1}]}}}')
        r = subprocess.run(
            [sys.executable, str(SCRIPT), "--compare", str(bad)], capture_output=True, text=True, env=env
        )
        assert r.returncode == 2 and "not a probe file" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "probe_moe_mla:" in r.stderr and "Traceback" not in r.stderr


def test_sparse_reads_topk_latents_and_fp8_halves_expert_bytes():
    """V3.2 sparse decode's bytes and prediction stop growing with context past top-k but for the
    indexer keys; fp8 experts are half bf16's bytes, and the model predicts them faster."""
    assert probe.layer_bytes("sparse", 1, 4096) == 4096 * 128 * 2 + 2048 * 576 * 2
    assert probe.layer_bytes("moe", 256, mode="fp8") * 2 == probe.layer_bytes("moe", 256)
    short, long = (probe.predict("sparse", {"batch": 16, "ctx": c}) for c in (32768, 131072))
    mla_long = probe.predict("mla", {"batch": 16, "ctx": 131072})
    assert short < long < mla_long  # the indexer grows with context; the attention does not
    bf16, fp8 = (probe.predict("moe", {"batch": 1024, "mode": m}) for m in ("eager", "fp8"))
    assert fp8 < bf16


def test_bundled_h200_points_and_mla_decode_scaling():
    """The held-out H200 file: MLA decode of one sequence grows with context as the model's does (no
    single-stream bound: 32K latents in 0.07 ms, not 0.88), and graphed MoE/MLA points predict within 8x."""
    doc = json.loads((ROOT / "agentkv/data/calibration/h200-deepseek-moe-mla.json").read_text())
    rows = probe.compare(doc)
    assert len(rows) == sum(len(p["decode"]) for p in doc["parts"].values())  # no point failed
    mla = [(p, meas, pred) for k, p, meas, pred in rows if k == "mla" and p["mode"] == "graph"]
    one = {p["ctx"]: (meas, pred) for p, meas, pred in mla if p["batch"] == 1 and p["ctx"] >= 32768}
    (m0, p0), (m1, p1) = one[32768], one[max(one)]
    assert p1 / p0 == pytest.approx(m1 / m0, rel=0.2)
    graphed = [(meas, pred) for k, p, meas, pred in rows if k != "sparse" and p["mode"] != "eager"]
    assert all(1 / 8 < pred / meas < 8 for meas, pred in graphed)  # eager adds the launches
