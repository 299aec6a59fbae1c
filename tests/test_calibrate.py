"""`agentkv calibrate`: the plan, the fit on exact data, and real runs against `agentkv serve` subprocesses
(one started with known coefficients, which the probes must recover) and against targets that fail."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from agentkv.calib import fit as F
from agentkv.calib.plan import Probe, make_plan, within_budget
from agentkv.calib.run import est_wall_s, plan_for, slowdown, target_of
from agentkv.engine.config import EngineConfig
from agentkv.engine.cost import CostCoefficients, load_coefficients
from agentkv.engine.engine import Engine
from agentkv.errors import UserError
from tests.cluster import CLI, HOST, Procs, free_ports, wait_http

# a different software stack than the bundled H200 fit: what the server under test is started with
TRUE = replace(
    load_coefficients(),
    gemm_eff=0.7,
    overlap_k=1.6,
    attn_self_eff=0.6,
    attn_past_eff=0.3,
    stream_gbps=80.0,
    past_setup_s=50e-6,
    launch_floor_s=60e-6,
    floor_k=2.5,
)
SHAPE = ["--gpu", "h100", "--model", "llama3-70b", "-tp", "4"]


def _args(**kw) -> argparse.Namespace:
    base = dict.fromkeys(
        ("gpu", "model", "tensor_parallel_size", "kv_cache_dtype", "max_model_len", "block_size"), None
    )
    return argparse.Namespace(**(base | {"max_num_batched_tokens": None, "time_scale": None} | kw))


def test_plan_fits_the_model_length_and_the_kv_cache() -> None:
    plan = make_plan(4096, 16, 8192, kv_tokens=100_000)
    assert plan and all(p.past + p.new + p.ctx + p.out <= 4096 for p in plan)
    assert {p.family for p in plan} == {
        "prefill_cold",
        "prefill_cached",
        "decode",
        "interference",
        "loaded_ttft",
    }
    small_kv = make_plan(131072, 16, 8192, kv_tokens=20_000)
    assert all(p.past + p.new + p.ctx <= 18_000 and p.n * p.ctx <= 10_000 for p in small_kv)
    busy = [p for p in small_kv if p.family == "interference"]  # prefill + the streams beside it fit
    assert busy and all(p.new + p.n * (p.ctx + p.out) <= 18_000 for p in busy)
    costs = [float(i) for i in range(len(plan))]
    assert within_budget(plan, costs, 3.5) == plan[:3]


def test_the_plan_gives_attention_to_a_cached_past_leverage() -> None:
    """On a 32K-context model some cached probe spends over 40% of its time attending the past (a
    1% error there moves the fitted attn_past_eff by under 2.5%), and cold probes span two chunks."""
    t = F.Target("h100", "qwen2.5-7b")
    plan = make_plan(32768, 16, 8192, kv_tokens=400_000)

    def share(p: Probe) -> float:  # -d log(time) / d log(attn_past_eff)
        slow = replace(TRUE, attn_past_eff=TRUE.attn_past_eff / 1.01)
        return (F.predict(t.cost(slow), t, p) / F.predict(t.cost(TRUE), t, p) - 1) * 100

    cached = [share(p) for p in plan if p.family == "prefill_cached"]
    assert max(cached) > 0.4 and sum(s > 0.25 for s in cached) >= 3, cached
    assert max(p.new for p in plan if p.family == "prefill_cold") >= 16384


def test_a_slower_target_gets_fewer_probes_cheapest_first() -> None:
    t = F.Target("h100", "llama3-70b", tp=4)
    args = argparse.Namespace(repeats=2, budget="60s")
    cm = t.cost()
    speed = (
        F.predict(cm, t, Probe("prefill_cold", new=512)),
        F.predict(cm, t, Probe("decode", n=1, ctx=512, out=16)),
    )
    quick = plan_for(t, make_plan(131072, 16, 8192, kv_tokens=489_824), speed, args, 60.0)
    slow = plan_for(
        t, make_plan(131072, 16, 8192, kv_tokens=489_824), (speed[0] * 100, speed[1] * 100), args, 60.0
    )
    assert slowdown(t, speed) == pytest.approx((1.0, 1.0)) and 0 < len(slow) < len(quick)
    est = [est_wall_s(t, p, 2) for p in quick]
    assert est == sorted(est) and sum(est) <= 60.0
    tight = plan_for(t, make_plan(131072, 16, 8192, kv_tokens=489_824), speed, args, 15.0)
    assert [p.n for p in tight if p.family == "loaded_ttft"] == [1]  # chosen before cheaper probes
    assert sum(est_wall_s(t, p, 2) for p in tight) <= 15.0 and len(tight) > 5
    with pytest.raises(UserError, match="too short"):
        plan_for(t, make_plan(131072, 16, 8192), speed, argparse.Namespace(repeats=2, budget="1ms"), 0.001)
    # a slow host stretches the streams (they must outlast the prompt sent beside them), but never past
    # the model length: a CI run's loaded probe asked 512 + 13,572 tokens of an 8,192-token model
    fast_decode = (speed[0] * 10, speed[1] * 0.01)  # a decode step 1,000x cheaper than prefill, relatively
    short = plan_for(t, make_plan(8192, 16, 2048), fast_decode, args, 600.0, max_len=8192)
    assert short and all(p.past + p.ctx + p.out <= 8192 for p in short), short
    longer = plan_for(t, make_plan(8192, 16, 2048), fast_decode, args, 600.0)
    assert any(p.ctx + p.out > 8192 for p in longer)  # what the cap prevents


def test_a_tiny_or_unknown_model_length_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="too small to calibrate"):
        target_of(_args(), {"id": "m", "root": "llama3-8b", "max_model_len": 512}, {})
    with pytest.raises(UserError, match="--max-model-len"):
        target_of(_args(), {"id": "m", "root": "llama3-8b"}, {})
    t, n, bs, kv = target_of(_args(max_model_len=8192), {"id": "m", "root": "llama3-8b"}, {"gpu": "h100"})
    assert (t.gpu, t.model, n, bs, kv) == ("h100", "llama3-8b", 8192, 16, None)


def test_the_fit_recovers_exact_measurements() -> None:
    t = F.Target("h100", "llama3-70b", tp=4, time_scale=3.0)
    cm = t.cost(TRUE)
    probes = make_plan(131072, 16, 8192, kv_tokens=489_824)
    for p in probes:
        p.measured_s = F.predict(cm, t, p, (1e-3, 3e-7))
    f = F.fit(t, probes)
    assert max(F.errors(t, probes, f.coeffs, f.overhead).values()) < 0.5
    for name in ("gemm_eff", "attn_past_eff", "stream_gbps"):  # the coefficients these probes pin
        assert getattr(f.coeffs, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name


def test_calibrate_recovers_what_serve_was_started_with(tmp_path: Path) -> None:
    truth = tmp_path / "true.json"
    truth.write_text(json.dumps({"name": "true", "coefficients": TRUE.to_dict()}))
    port = free_ports(1)[0]
    procs = Procs(tmp_path / "logs")
    serve = ["serve", "--port", str(port), "--time-scale", "3", *SHAPE, "--profile", str(truth)]
    try:
        wait_http(f"http://{HOST}:{port}/health", proc=procs.start("serve", serve))
        out = tmp_path / "profile.json"
        run = subprocess.run(
            [
                *CLI,
                "calibrate",
                "--target",
                f"http://{HOST}:{port}",
                "--out",
                str(out),
                "--budget",
                "90s",
                "--repeats",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        procs.stop_all()
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["modelled_as"]["gpu"] == "h100" and doc["modelled_as"]["tp"] == 4
    assert doc["server"]["server_info"]["engine"] == "agentkv" and doc["error"] is None
    fams = {"prefill_cold", "prefill_cached", "decode", "floor", "interference", "loaded_ttft", "all"}
    assert set(doc["fit"]["mape_pct"]) == fams
    mape = _tight_mape(doc)  # measured vs fitted where the samples agree (a busy host scatters the rest)
    assert mape["decode"] < 5.0 and mape["prefill_cold"] < 15.0 and mape["prefill_cached"] < 15.0, mape
    _check_stalls(doc)
    _check_unpinned(doc, run.stdout)
    fitted = CostCoefficients(**doc["coefficients"])
    for name, se in doc["fit"]["stderr_pct"].items():  # what the probes pin, they recover
        if se is not None and se < 5.0 and name not in doc["fit"]["not_identifiable"]:
            assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.1), (
                name,
                se,
                doc["fit"],
            )
    t = F.Target(**doc["modelled_as"])
    probes = [Probe(**p) for p in doc["probes"]]
    assert F.errors(t, probes, fitted, (0.0, 0.0))["decode"] < 5.0
    true_cm, fit_cm = t.cost(TRUE), t.cost(fitted)
    off: dict[str, list[float]] = {}  # the fitted model against the steps the server ran
    for p in probes:
        off.setdefault(p.family, []).append(abs(F.predict(fit_cm, t, p) / F.predict(true_cm, t, p) - 1))
    mean = {k: sum(v) / len(v) for k, v in off.items()}
    assert mean["decode"] < 0.02 and mean["prefill_cold"] < 0.05, mean
    # 128 new tokens after a cached past: ~25 ms of work under up to 60 ms of timing noise (serve's
    # 20 ms wall of slack x 3), the hardest family to pin
    assert mean["prefill_cached"] < 0.12 and max(max(v) for v in off.values()) < 0.3, off
    eng = Engine(EngineConfig(gpu="h100", model="llama3-70b", tensor_parallel_size=4, cost_profile=str(out)))
    assert eng.cost.coeffs == load_coefficients(out)


def _tight_mape(doc: dict) -> dict[str, float]:
    """The fitted model's MAPE against the measurements per family, over the probes the fit weighed
    at least half (`fit.weight`: their samples agree) as the profile lists them."""
    t, low = F.Target(**doc["modelled_as"]), doc["fit"]["weights"]
    cm, ov = t.cost(CostCoefficients(**doc["coefficients"])), doc["fit"]["overhead"]
    out: dict[str, list[float]] = {}
    for p in [Probe(**x) for x in doc["probes"]]:
        if low.get(p.label(), 1.0) >= 0.5:
            e = abs(F.predict(cm, t, p, (ov["request_s"], ov["prompt_token_s"])) / p.measured_s - 1)
            out.setdefault(p.family, []).append(e * 100)
    return {k: sum(v) / len(v) for k, v in out.items()}


def _check_unpinned(doc: dict, stdout: str) -> None:
    """Each coefficient calibrate names not identifiable is said, with the reason and what was kept."""
    for name, why in doc["fit"]["not_identifiable"].items():
        # structural, the floor's profile, the floor's pair, the cached-past setup's pair (calib.pair)
        said = ("10% change", "do not tell it apart", "pinned only with", "the pair prefill_cold")
        assert any(x in why for x in said) and ("default" in why or "estimate" in why), (name, why)
        assert f"not identifiable on this target: {name}: " in stdout


def _check_stalls(doc: dict) -> None:
    """A long prefill beside decoding streams stalls them for one mixed step, as long as the model the
    server ran says, and far longer than a plain decode step."""
    t = F.Target(**doc["modelled_as"])
    stalls = [Probe(**p) for p in doc["probes"] if p["family"] == "interference"]
    assert {p.new for p in stalls} == {2048, 8192}, doc["probes"]
    for p in stalls:
        plain = F.predict(t.cost(TRUE), t, Probe("decode", n=p.n, ctx=p.ctx, out=p.out))
        assert p.measured_s > 3 * plain, (p, plain)
        assert p.measured_s == pytest.approx(F.predict(t.cost(TRUE), t, p), rel=0.25), p


def test_simulate_records_the_profile(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"name": "m@http://x", "coefficients": TRUE.to_dict()}))
    run = subprocess.run(
        [*CLI, "simulate", "--profile", str(prof), "--max-requests", "3", "--json", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    engine = json.loads(run.stdout)["config"]["engine"]
    assert engine["cost_profile_name"] == "m@http://x" and engine["cost_profile"] == str(prof)


class _Bare:
    """A real HTTP target that lacks a feature: `mode` 'no_stream' answers one JSON, 'no_usage' streams
    without a usage chunk, 'tiny' says its max model length is 512."""

    def __init__(self, mode: str) -> None:
        self.mode, self.port = mode, free_ports(1)[0]
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, HOST, self.port).start()

    async def _models(self, request: web.Request) -> web.Response:
        n = 512 if self.mode == "tiny" else 8192
        return web.json_response({"data": [{"id": "llama3-8b", "max_model_len": n}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "no_stream":
            return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
        return resp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize(
    ("mode", "says"),
    [("no_stream", "does not stream"), ("no_usage", "no usage"), ("tiny", "too small to calibrate")],
)
def test_a_target_without_streaming_or_usage_is_one_line(tmp_path: Path, mode: str, says: str) -> None:
    target = _Bare(mode)
    out = tmp_path / "p.json"
    try:
        run = subprocess.run(
            [*CLI, "calibrate", "--target", f"http://{HOST}:{target.port}", "--out", str(out), "-q"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        target.close()
    assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1
    if mode == "tiny":  # refused before any probe: nothing to keep
        assert not out.exists()
    else:
        assert json.loads(out.read_text())["error"]


def test_a_target_that_dies_mid_run_keeps_the_finished_probes(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    procs = Procs(tmp_path / "logs")
    out = tmp_path / "p.json"
    try:
        serve = procs.start("serve", ["serve", "--port", str(port), *SHAPE])  # time scale 1: slow probes
        wait_http(f"http://{HOST}:{port}/health", proc=serve)
        cal = subprocess.Popen(
            [*CLI, "calibrate", "--target", f"http://{HOST}:{port}", "--out", str(out), "-q"],
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(6.0)  # the short cold prefills are done; a 32K one is running
        procs.stop("serve")
        _, err = cal.communicate(timeout=60)
    finally:
        procs.stop_all()
    assert cal.returncode == 2 and "finished probes written" in err, err
    assert len(err.strip().splitlines()) == 1
    doc = json.loads(out.read_text())
    assert doc["error"] and len(doc["probes"]) >= 2
