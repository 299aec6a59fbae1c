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
    return {
        "device": "test",
        "torch": "-",
        "parts": {"deepseek-v3-moe": {"decode": moe}, "deepseek-v3-mla": {"decode": mla}},
    }


def test_points_and_predictions_follow_the_model():
    doc = _doc()
    assert doc["parts"]["deepseek-v3-moe"]["decode"][0]["model_ms"] == pytest.approx(0.1 * probe.MOE_LAYERS)
    mla = doc["parts"]["deepseek-v3-mla"]["decode"][0]  # batch 1 x 4096 latents of 1,152 bytes in 0.01 ms
    assert mla["layer_GBps"] == pytest.approx(4096 * 1152 / 0.01e-3 / 1e9)
    rows = probe.compare(doc)
    assert len(rows) == len(probe.MOE_BATCHES) + len(probe.MLA_GRID)
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
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "probe_moe_mla:" in r.stderr and "Traceback" not in r.stderr
