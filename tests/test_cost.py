"""Step-time cost model: fit quality on every H200 point, the HBM roofline, scaling and invariants."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine import calibrate
from agentkv.engine.cost import CostModel, load_coefficients
from agentkv.engine.hardware import GPUS, get_gpu, get_model, ring_allreduce_s
from agentkv.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
MEASURED_H200_BW = calibrate.calibration()["parts"]["ceilings"]["d2d_GBps"] * 1e9


def test_fit_error_on_every_calibration_point():
    errs = calibrate.errors()
    assert len(errs) == 72  # 19 prefill + 17 decode points for each of the two shapes
    for p, pred, e in errs:
        assert abs(e) <= 0.25, (
            f"{p.model} {p.kind} ({p.a}, {p.b}): measured {p.measured_s:.4f}s, predicted {pred:.4f}s"
        )
    mape, worst = calibrate.summary(errs)
    assert mape <= 10.0 and worst <= 25.0


def test_long_context_points_held_out_of_the_fit():
    """Points to 524K tokens, measured on a later H200 lease and never fitted, stay close."""
    errs = calibrate.errors(name=calibrate.LONG_CONTEXT)
    assert len(errs) == 19 and max(p.b for p, _, _ in errs) == 524288
    for p, pred, e in errs:
        assert abs(e) <= 0.15, (
            f"{p.model} {p.kind} ({p.a}, {p.b}): measured {p.measured_s:.4f}s, predicted {pred:.4f}s"
        )
    assert calibrate.summary(errs)[0] <= 8.0
    docs = (ROOT / "docs/cost-model.md").read_text()
    assert calibrate.table_markdown(name=calibrate.LONG_CONTEXT) in docs, (
        "docs/cost-model.md: long-context table stale"
    )


def test_bundled_fit_figures_and_docs_table_are_current():
    doc = json.loads((ROOT / "agentkv/data/calibration/cost-h200.json").read_text())
    mape, worst = calibrate.summary(calibrate.errors())
    assert doc["fit"]["mape_pct"] == pytest.approx(mape, abs=0.01)
    assert doc["fit"]["max_abs_pct"] == pytest.approx(worst, abs=0.01)
    docs = (ROOT / "docs/cost-model.md").read_text()
    assert calibrate.table_markdown() in docs, (
        "docs/cost-model.md is stale: paste `python scripts/fit_cost.py` output"
    )


def test_refit_reproduces_the_bundled_coefficients():
    pytest.importorskip("scipy")
    spec = importlib.util.spec_from_file_location("fit_cost", ROOT / "scripts/fit_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    refit, bundled = mod.fit().to_dict(), load_coefficients().to_dict()
    for k, v in bundled.items():
        assert refit[k] == pytest.approx(v, rel=0.02), k


def _weights_read(cm: CostModel) -> float:
    """Bytes a decode step must read: every layer's shard plus the lm_head shard (embedding rows are gathered)."""
    r = cm.model.shard(cm.tp)
    wb = {"bf16": 2, "fp8": 1, "fp4": 0.5}[cm.weight_dtype]
    return cm.model.layers * r.layer_params * wb + r.lm_head_params * 2


@pytest.mark.parametrize("gpu", [g.name for g in GPUS])
def test_decode_never_beats_the_hbm_roofline(gpu):
    g = get_gpu(gpu)
    bw = MEASURED_H200_BW * g.hbm_tbps / 4.8
    for model, tp in (("llama3-8b", 1), ("llama3-70b", 4), ("qwen3-32b", 2), ("llama3-70b", 16)):
        for kv in ("bf16", "fp8"):
            cm = CostModel(g, model, tp=tp, kv_dtype=kv)
            for batch in (1, 4, 16, 64, 256, 1024):
                for ctx in (1, 128, 1024, 8192, 32768, 131072):
                    roof = (_weights_read(cm) + batch * ctx * cm.kv_bytes_per_token) / bw
                    assert cm.decode_roofline(batch, ctx) == pytest.approx(roof, rel=1e-5)
                    t = cm.step_time((), [ctx] * batch)
                    assert t >= roof * (1 - 1e-9), (gpu, model, tp, kv, batch, ctx)


def test_long_single_sequence_decode_is_bound_by_one_stream_not_hbm():
    # the calibration shows batch 1 and 4 at 128K context take the same time: the measured kernel
    # streams each (sequence, KV head) on one program, so time follows the longest context
    cm = CostModel("h200", "llama3-8b")
    assert cm.step_time((), [131072]) == pytest.approx(cm.step_time((), [131072] * 4), rel=0.01)
    assert cm.step_time((), [131072] * 64) > 2 * cm.step_time((), [131072])


def test_faster_parts_are_faster_and_memory_bound_decode_scales_with_bandwidth():
    batch = [32768] * 64
    t = {g: CostModel(g, "llama3-8b").step_time((), batch) for g in ("h100", "h200", "b200")}
    assert t["h100"] > t["h200"] > t["b200"]
    assert 1.0 < t["h100"] / t["h200"] <= 4.8 / 3.35 + 1e-9
    pf = {g: CostModel(g, "llama3-70b", tp=8).step_time([(8192, 0)], ()) for g in ("h200", "b200")}
    assert pf["h200"] / pf["b200"] > 1.5  # compute-bound prefill gains from 2.3x the TFLOP/s


def test_fp8_kv_and_weights():
    bf, f8 = CostModel("h200", "llama3-70b", tp=2), CostModel("h200", "llama3-70b", tp=2, kv_dtype="fp8")
    assert f8.kv_bytes_per_token == bf.kv_bytes_per_token / 2
    assert f8.step_time((), [32768] * 64) < 0.75 * bf.step_time((), [32768] * 64)
    w8 = CostModel("h200", "llama3-70b", tp=2, weight_dtype="fp8")
    assert w8.weights_bytes < 0.55 * bf.weights_bytes
    assert w8.step_time((), [1024] * 8) < bf.step_time((), [1024] * 8)
    assert w8.kv_capacity_bytes() > bf.kv_capacity_bytes()
    with pytest.raises(UserError, match="fp4"):
        CostModel("h200", "llama3-8b", weight_dtype="fp4")
    assert CostModel("b200", "llama3-8b", weight_dtype="fp4").weights_bytes < w8.weights_bytes
    with pytest.raises(UserError, match="KV dtype 'int8'"):
        CostModel("h200", "llama3-8b", kv_dtype="int8")


def test_tensor_parallel_adds_all_reduces():
    m = get_model("llama3-70b")
    cm = CostModel("h200", m, tp=8)
    tokens = 4096
    comm = m.layers * 2 * ring_allreduce_s(tokens * m.hidden * 2, 8, 450)
    assert cm.step_time([(tokens, 0)], ()) > comm
    one = CostModel("h200", "llama3-8b", tp=1).step_time([(4096, 0)], ())
    two = CostModel("h200", "llama3-8b", tp=2).step_time([(4096, 0)], ())
    assert one / 2 < two < one  # faster, but not twice: the all-reduces cost time


def test_kv_capacity():
    cm = CostModel("h200", "llama3-8b")
    expected = 141 * 2**30 * 0.9 - cm.weights_bytes - cm.activation_reserve_bytes()
    assert cm.kv_capacity_bytes() == pytest.approx(expected)
    assert 95 * 2**30 < cm.kv_capacity_bytes() < 115 * 2**30
    assert cm.kv_capacity_bytes(0.5) < cm.kv_capacity_bytes(0.9)
    assert CostModel("h200", "llama3-70b", tp=4).kv_capacity_bytes() > 80 * 2**30
    with pytest.raises(UserError, match="does not fit on H100 SXM"):
        CostModel("h100", "llama3-70b").kv_capacity_bytes()
    with pytest.raises(UserError, match="gpu_memory_utilization"):
        cm.kv_capacity_bytes(1.5)


def test_empty_step_and_repr():
    cm = CostModel("mi300x", "qwen3-32b")
    assert cm.step_time((), ()) == 0.0
    assert "MI300X" in repr(cm) and "Qwen3-32B" in repr(cm)


def test_bad_coefficient_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"coefficients": {"gemm_eff": 1.0}}))
    with pytest.raises(UserError, match="not a cost coefficient file"):
        load_coefficients(f)
    good = json.loads((ROOT / "agentkv/data/calibration/cost-h200.json").read_text())
    good["coefficients"]["overlap_k"] = 0.5
    f.write_text(json.dumps(good))
    with pytest.raises(UserError, match="overlap_k"):
        load_coefficients(f)


prefill = st.tuples(st.integers(1, 16384), st.integers(0, 131072))
decodes = st.lists(st.integers(1, 131072), max_size=64)


@settings(max_examples=150, deadline=None)
@given(st.lists(prefill, max_size=4), decodes, st.sampled_from(["h100", "b200", "mi355x"]))
def test_step_time_invariants(prefills, decs, gpu):
    cm = CostModel(gpu, "llama3-8b")
    t = cm.step_time(prefills, decs)
    # aggregates give the same answer; order does not matter
    new, past = sum(n for n, _ in prefills), sum(p for _, p in prefills)
    agg = cm.step_time_agg(
        new,
        past,
        sum(n * (n + 1) / 2 for n, _ in prefills),
        float(sum(n * p for n, p in prefills)),
        past > 0,
        len(prefills),
        len(decs),
        sum(decs),
        max(decs, default=0),
    )
    assert agg == pytest.approx(t, rel=1e-12)
    assert cm.step_time(prefills[::-1], decs[::-1]) == pytest.approx(t, rel=1e-12)
    # more work never takes less time
    assert cm.step_time(prefills, [*decs, 4096]) >= t
    assert cm.step_time([*prefills, (512, 1000)], decs) >= t
    # one step serving both is never slower than two steps serving each (weights are read once)
    if prefills and decs:
        assert t <= cm.step_time(prefills, ()) + cm.step_time((), decs)
        assert t >= max(cm.step_time(prefills, ()), cm.step_time((), decs)) * (1 - 1e-12)
