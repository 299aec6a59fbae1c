"""Host time under traffic: calibrate's loaded_ttft probes (a short prompt's first token while K other
streams decode), the per-other-request delay fitted from them, and predict's replay applying it."""

from __future__ import annotations

import pytest

from agentkv.calib import fit as F
from agentkv.calib.plan import LOADED_N, make_plan
from agentkv.calib.replay import replay
from agentkv.engine.config import EngineConfig
from agentkv.metrics.records import RequestRecord
from agentkv.trace.model import Request, Session, Trace
from tests.test_calibrate import TRUE


def test_the_plan_has_loaded_probes_that_fit_the_cache() -> None:
    loaded = [p for p in make_plan(8192, 32, 8192, kv_tokens=100_000) if p.family == "loaded_ttft"]
    assert sorted(p.n for p in loaded) == sorted(LOADED_N) and all(p.new < p.ctx for p in loaded)
    assert "beside n=" in loaded[0].label()
    tiny_kv = make_plan(8192, 32, 8192, kv_tokens=2_000)  # 3 streams of 512 tokens would not fit
    assert [p.n for p in tiny_kv if p.family == "loaded_ttft"] == [1]


@pytest.mark.parametrize("per_other", [4e-3, 0.0])
def test_the_fit_recovers_host_time_per_other_request(per_other: float) -> None:
    """Exact measurements with a known per-other-request delay: the main fit ignores the loaded probes
    and the slope recovers the delay; without one it is 0, not a negative time."""
    t = F.Target("h100", "llama3-70b", tp=4, time_scale=2.0)
    probes = make_plan(131072, 16, 8192, kv_tokens=489_824)
    cm = t.cost(TRUE)
    for p in probes:
        p.measured_s = F.predict(cm, t, p, (1e-3, 3e-7, per_other))
    f = F.fit(t, probes)
    got = F.fit_loaded(t, probes, f.coeffs, f.overhead)
    assert got == pytest.approx(per_other, rel=0.05, abs=2e-4)
    errs = F.errors(t, probes, f.coeffs, (*f.overhead, got))
    assert errs["loaded_ttft"] < 5.0 and errs["all"] < 0.5


def test_faster_than_predicted_loaded_probes_fit_zero() -> None:
    t = F.Target("h100", "llama3-8b")
    probes = [p for p in make_plan(8192, 16) if p.family == "loaded_ttft"]
    for p in probes:
        p.measured_s = F.predict(t.cost(), t, p) * 0.5
    assert F.fit_loaded(t, probes, t.cost().coeffs, (0.0, 0.0)) == 0.0
    assert F.fit_loaded(t, [], t.cost().coeffs, (0.0, 0.0)) == 0.0


def _items(sent: list[float], clock: str = "") -> list:
    stamp = {"engine_arrival": 0.0, "first_token": 0.01, "ttft": 0.01} if clock else {}
    reqs = [
        Request(t=0.0, input_tokens=512, output_tokens=4, hash_ids=[i * 10 + k for k in range(32)])
        for i in range(len(sent))
    ]
    out = []
    for i, s in enumerate(sent):
        tr = Trace(
            id=f"t{i}", block_size=16, session=Session(id=f"s{i}", requests=[reqs[i]]), format="agentx"
        )
        r = RequestRecord(
            id=i,
            trace=tr.id,
            session=f"s{i}",
            tree=f"s{i}",
            sent=s,
            scheduled=s,
            output_tokens=4,
            input_tokens=512,
            clock=clock,
            **stamp,
        )
        out.append((r, tr, reqs[i]))
    return out


def test_replay_delays_each_request_by_the_requests_in_flight() -> None:
    """Three requests sent at once on the client's clock, 1 ms of host time each: one front end hands
    them on at 1, 2 and 3 ms, and each reaches the predicted engine 50 ms per request already in flight
    later; with no such term the replay is what it was; a request timed on agentkv serve's engine
    clock keeps its stamp."""
    cfg = EngineConfig(gpu="h100", model="llama3-8b", block_size=16)
    plain = replay(cfg, _items([0.0, 0.0, 0.0]), (0.001, 0.0), False)
    zero = replay(cfg, _items([0.0, 0.0, 0.0]), (0.001, 0.0, 0.0), False)
    busy = replay(cfg, _items([0.0, 0.0, 0.0]), (0.001, 0.0, 0.05), False)
    assert {k: v.arrival for k, v in plain.items()} == {k: v.arrival for k, v in zero.items()}
    assert [plain[i].arrival for i in range(3)] == pytest.approx([0.001, 0.002, 0.003])
    assert [busy[i].arrival for i in range(3)] == pytest.approx([0.001, 0.052, 0.103])
    assert all(busy[i].first_token > plain[i].first_token for i in (1, 2))
    spaced = replay(cfg, _items([0.0, 5.0]), (0.0, 0.0, 0.05), False)  # the first has finished by then
    assert spaced[1].arrival == pytest.approx(5.0)
    stamped = replay(cfg, _items([0.0, 0.0, 0.0], clock="engine"), (0.001, 0.0, 0.05), False)
    assert [stamped[i].arrival for i in range(3)] == pytest.approx([0.0] * 3)
