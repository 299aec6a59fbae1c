"""The launch-floor probes (`calib.floor`) and calibrate's engine clock, against a real `agentkv serve`."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from agentkv.calib import fit as F
from agentkv.calib.floor import FLOOR_CTX, FLOOR_OUT, floor_probes
from agentkv.calib.identify import fit_all
from agentkv.calib.plan import Probe, make_plan, samples
from tests.cluster import CLI, HOST, Procs, free_ports, wait_http
from tests.test_calibrate import TRUE, _Bare

QWEN = F.Target("h100", "qwen2.5-7b")


def test_floor_probes_fit_the_model_length_or_say_why_not() -> None:
    both, none = floor_probes(32768)
    assert [p.ctx for p in both] == list(FLOOR_CTX) and none == {}
    assert all(p.family == "floor" and p.n == 1 and p.out == FLOOR_OUT for p in both)
    short, skipped = floor_probes(2048)  # the 4,096-token rung needs 4,096 + 256 + 1
    assert [p.ctx for p in short] == [16]
    assert list(skipped) == ["floor n=1 ctx=4096", "floor n=1 ctx=16384"]
    assert "4,353 tokens" in skipped["floor n=1 ctx=4096"]
    assert "max model length holds 2,048" in skipped["floor n=1 ctx=4096"]
    small_kv, why = floor_probes(32768, kv_tokens=250)  # hostile: a KV cache under any rung
    assert small_kv == [] and all("KV cache" in w for w in why.values()) and len(why) == 3


def test_the_whole_ladder_is_chosen_first_within_its_share_or_none_of_it() -> None:
    """A 90 s plan keeps all three rungs (chosen before the cheapest-first rest, within a third of
    the budget); a 20 s one cannot hold the ladder, so its rungs compete as any probe and the
    ladder's dearest go; a target lacking a rung gets none chosen first."""
    from agentkv.calib.floor import floor_first
    from agentkv.calib.run import plan_for

    speed = (F.predict(QWEN.cost(), QWEN, Probe("prefill_cold", new=512)), 0.005)

    def rungs(budget: float) -> list[int]:
        plan = make_plan(32768, 16, 8192, 400_000) + floor_probes(32768)[0]
        args = argparse.Namespace(repeats=3, budget=f"{budget}s")
        return [p.ctx for p in plan_for(QWEN, plan, speed, args, budget, 32768) if p.family == "floor"]

    assert rungs(54.0) == list(FLOOR_CTX)
    assert 16384 not in rungs(12.0)
    assert floor_first(make_plan(8192, 16) + floor_probes(8192)[0]) == []


def test_on_exact_times_the_floor_is_named_only_at_a_client_clocks_error() -> None:
    """The same exact measurements, without the ladder: at 1% timing error the floor and its
    exponent cannot be told apart (named not identifiable); at the fit's own error (an engine
    clock) they are pinned."""
    probes = make_plan(32768, 16, 8192, kv_tokens=400_000)
    cm = QWEN.cost(TRUE)
    for p in probes:
        p.samples_s = [F.predict(cm, QWEN, p)] * 24
        p.settle()
    client, engine = fit_all(QWEN, probes), fit_all(QWEN, probes, engine_clock=True)
    assert {"launch_floor_s", "floor_k"} <= set(client.not_identifiable)
    assert not {"launch_floor_s", "floor_k"} & set(engine.not_identifiable), engine.not_identifiable
    for name in ("launch_floor_s", "floor_k"):
        assert getattr(engine.coeffs, name) == pytest.approx(getattr(TRUE, name), rel=0.01)


def _noisy(rung_noise: float, seed: int = 1) -> list[Probe]:
    """The 32K plan and ladder timed by the true model: 0.2 ms x Exp(1) of host delay on each
    prefill sample, 0.5% x N(0, 1) on each 48-token decode, `rung_noise` x N(0, 1) on each rung."""
    rng = np.random.default_rng(seed)
    cm = QWEN.cost(TRUE)
    probes = make_plan(32768, 16, 8192, kv_tokens=400_000) + floor_probes(32768)[0]
    for p in probes:
        v = F.predict(cm, QWEN, p, (1e-3, 1e-7))
        if p.family in ("decode", "floor"):
            sd = rung_noise if p.family == "floor" else 0.005
            p.samples_s = [v * (1 + sd * rng.normal()) for _ in range(3)]
        else:
            p.samples_s = [v + 2e-4 * rng.exponential() for _ in range(samples(p, 3))]
        p.settle()
    return probes


def test_the_ladder_pins_the_floor_where_its_rungs_are_precise_and_says_so_where_not() -> None:
    """Rungs timed to 0.03% on the engine clock: the floor and its exponent come back within 10%
    and are not named; the same on the client clock (whose streams' ends add ~0.03% a rung that 3
    samples cannot show), or rungs timed to 1% (hostile: a jittery host): they are named."""
    good = fit_all(QWEN, _noisy(0.0003), engine_clock=True)
    assert not {"launch_floor_s", "floor_k"} & set(good.not_identifiable), good.not_identifiable
    for name in ("launch_floor_s", "floor_k", "stream_gbps"):
        assert getattr(good.coeffs, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    for bad in (fit_all(QWEN, _noisy(0.0003)), fit_all(QWEN, _noisy(0.01), engine_clock=True)):
        assert {"launch_floor_s", "floor_k"} <= set(bad.not_identifiable)


def _calibrate(tmp_path: Path, max_len: int, clock: str) -> tuple[subprocess.CompletedProcess, dict]:
    truth = tmp_path / "true.json"
    truth.write_text(json.dumps({"name": "true", "coefficients": TRUE.to_dict()}))
    port = free_ports(1)[0]
    procs = Procs(tmp_path / "logs")
    shape = ["--gpu", "h100", "--model", "qwen2.5-7b", "--max-model-len", str(max_len)]
    try:
        serve = ["serve", "--port", str(port), *shape, "--profile", str(truth)]
        wait_http(f"http://{HOST}:{port}/health", proc=procs.start("serve", serve))
        out = tmp_path / "profile.json"
        cmd = ["calibrate", "--target", f"http://{HOST}:{port}", "--out", str(out), "--clock", clock]
        run = subprocess.run(
            [*CLI, *cmd, "--budget", "20s", "--repeats", "1"], capture_output=True, text=True, timeout=90
        )
    finally:
        procs.stop_all()
    return run, json.loads(out.read_text())


def test_the_floor_probe_is_planned_measured_and_fitted_or_skipped_with_why(tmp_path: Path) -> None:
    """serve (Qwen2.5-7B, H100, a 2,048-token model length): the 16-token floor probe is measured on
    the engine clock (the engine's step exactly) and fitted; the 4K and 16K ones cannot fit the
    model length and the profile says why."""
    run, doc = _calibrate(tmp_path, 2048, "engine")
    assert run.returncode == 0, run.stderr
    assert doc["clock"] == "engine" and doc["error"] is None
    floor = [Probe(**p) for p in doc["probes"] if p["family"] == "floor"]
    assert [p.ctx for p in floor] == [16] and floor[0].samples_s
    true_step = F.predict(QWEN.cost(TRUE), QWEN, floor[0])
    assert floor[0].measured_s == pytest.approx(true_step, rel=0.005)  # the engine's own stamps
    assert "floor" in doc["fit"]["mape_pct"] and doc["fit"]["mape_pct"]["floor"] < 1.0
    why = doc["skipped_probes"]["floor n=1 ctx=4096"]
    assert "4,353 tokens" in why and "2,048" in why and "floor n=1 ctx=16384" in doc["skipped_probes"]
    assert "skipped floor n=1 ctx=4096: needs 4,353 tokens" in run.stdout


class _Unstamped(_Bare):
    """A real HTTP target that streams a token and usage, as vLLM does, but no engine times."""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17}
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
        )
        return resp


def test_engine_clock_refuses_a_target_without_stamps(tmp_path: Path) -> None:
    """--clock engine against a target whose responses carry no engine times: one clear line, the
    profile written with the error."""
    target = _Unstamped("plain")
    out = tmp_path / "p.json"
    try:
        cmd = [*CLI, "calibrate", "--target", f"http://{HOST}:{target.port}", "--out", str(out), "-q"]
        run = subprocess.run([*cmd, "--clock", "engine"], capture_output=True, text=True, timeout=60)
    finally:
        target.close()
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "no engine times" in run.stderr and "--clock client" in run.stderr
    doc = json.loads(out.read_text())
    assert doc["clock"] == "engine" and "no engine times" in doc["error"]
