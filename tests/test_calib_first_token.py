"""The first-token delay of a continuing stream: calibrate measures how much later a server delivers
a stream's first token when more tokens follow it, and predict adds that to TTFT and E2E (the
stream does not catch it up: TPOT keeps its steps), on the client's clock only (docs/cost-model.md, the live vLLM runs)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentkv.bench.client import BenchClient
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.calib.accuracy import row
from agentkv.calib.bench_predict import predict_bench_run
from agentkv.calib.probes import LAG_PAIRS, ProbeError, Prober, first_token_lag
from agentkv.calib.replay import replay
from agentkv.cli import build_parser
from agentkv.engine.config import EngineConfig
from agentkv.engine.cost import load_coefficients
from tests.test_calib_front_end import calibrate_against
from tests.test_calib_loaded import _items


def _lag(behave) -> float:
    """first_token_lag against a loopback test server answering each request as `behave` says."""

    async def go() -> float:
        async with StreamTestServer(behave=behave) as srv, BenchClient(srv.url, timeout=30) as c:
            lag, ttft = await first_token_lag(Prober(c, "test-model", 16, 1.0))
            assert len(ttft["one_token"]) == len(ttft["continuing"]) == LAG_PAIRS  # kept in the profile
            return lag

    return asyncio.run(go())


def test_calibrate_measures_the_first_token_delay_of_a_continuing_stream() -> None:
    late = _lag(lambda body, n: Behaviour(ttft=0.06 if body["max_tokens"] > 1 else 0.0))
    assert 0.04 < late < 0.3, late  # 60 ms, give or take a busy host's wake-ups
    assert _lag(lambda body, n: Behaviour(ttft=0.01)) < 0.03  # the same for both: no delay
    early = _lag(lambda body, n: Behaviour(ttft=0.0 if body["max_tokens"] > 1 else 0.06))
    assert early == 0.0  # never negative: a continuing stream is not sped up
    with pytest.raises(ProbeError, match="a request failed"):
        _lag(lambda body, n: Behaviour(reset_after=0))


def test_calibrate_writes_the_delay_into_the_profile(tmp_path: Path, capsys) -> None:
    """`agentkv calibrate` against a loopback server whose streams of more than one token start 40 ms
    late: the profile's overhead holds the delay, its samples beside it, and the terminal says it."""

    def late(body, n):
        return Behaviour(ttft=0.04 if body["max_tokens"] > 1 else 0.0)

    rc, doc = calibrate_against(tmp_path, late, max_model_len=8192, budget="3s")
    fit = doc["fit"]
    assert rc == 0 and 0.025 < fit["overhead"]["first_token_s"] < 0.3, fit["overhead"]
    assert len(fit["first_token_ttft_s"]["continuing"]) == LAG_PAIRS
    assert "first token of a continuing stream: " in capsys.readouterr().out


def test_the_delay_moves_the_whole_predicted_stream_on_the_client_clock() -> None:
    cfg = EngineConfig(gpu="h100", model="llama3-8b", block_size=16)
    for clock in ("", "engine"):
        items = _items([0.0, 0.0], clock=clock)
        pred = replay(cfg, items, (0.001, 0.0), False)
        r, p = items[1][0], pred[items[1][0].id]
        plain, late = row(r, p, 0.0), row(r, p, 0.0, 0.02)
        if clock:  # agentkv serve's engine clock: its stamps are the engine's, nothing to add
            assert late == plain
            continue
        assert late["ttft_pred"] == pytest.approx(plain["ttft_pred"] + 0.02)
        assert late["e2e_pred"] == pytest.approx(plain["e2e_pred"] + 0.02)
        assert late["end_pred"] == pytest.approx(plain["end_pred"] + 0.02)
        assert late["tpot_pred"] == pytest.approx(plain["tpot_pred"])  # the steps after it unchanged
        p.output_tokens = 1  # a one-token answer: its only token is read when its stream ends
        assert row(r, p, 0.0, 0.02)["ttft_pred"] == plain["ttft_pred"]


def test_host_time_per_prompt_token_is_read_after_the_first_token_on_the_client_clock() -> None:
    """Host time per prompt token delays when the client reads the first token, not when the engine
    starts (live vLLM: one-token answers trail vLLM's TTFT by it, 16-token streams end on time)."""
    cfg = EngineConfig(gpu="h100", model="llama3-8b", block_size=16)
    items = _items([0.0, 0.0])
    pred = replay(cfg, items, (0.001, 0.0), False)
    r, p = items[1][0], pred[items[1][0].id]
    host = 0.5 * (p.end - p.first_token)  # shorter than the decode after the first token
    plain, late = row(r, p, 0.0), row(r, p, 0.0, 0.0, host)
    assert late["ttft_pred"] == pytest.approx(plain["ttft_pred"] + host)
    assert late["e2e_pred"] == plain["e2e_pred"]  # hidden under the decode that follows
    slow = row(r, p, 0.0, 0.0, 100.0)  # read after the engine is done: the stream ends then
    assert slow["end_pred"] == pytest.approx(p.first_token + 100.0) and slow["tpot_pred"] == 0.0
    p.output_tokens = 1  # a one-token answer is read late by all of it, end included
    one = row(r, p, 0.0, 0.02, 0.03)
    assert one["ttft_pred"] == pytest.approx(one["e2e_pred"]) == pytest.approx(plain["ttft_pred"] + 0.03)
    r.clock = "engine"  # agentkv serve's stamps: nothing is added
    assert row(r, p, 0.0, 0.02, 0.03)["ttft_pred"] == row(r, p, 0.0)["ttft_pred"]


def _predicted_twice(tmp_path: Path, overhead: dict) -> tuple[dict, list[dict], list[dict]]:
    """A client-clock bench run against the embedded server (time scale 10), predicted with a
    profile without host overheads, then with `overhead`: the second doc, both predictions."""
    out, prof = tmp_path / "run", tmp_path / "p.json"
    doc = {
        "name": "embedded",
        "coefficients": load_coefficients().to_dict(),
        "modelled_as": {"gpu": "h200", "model": "llama3-8b"},
    }
    prof.write_text(json.dumps(doc))
    argv = ["bench", "--max-requests", "4", "--duration", "none", "--time-scale", "10", "-q"]
    args = build_parser().parse_args([*argv, "--clock", "client", "--out", str(out), "--predict", str(prof)])
    assert args.func(args) == 0

    def rows() -> list[dict]:
        return [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]

    before = rows()
    prof.write_text(json.dumps(doc | {"fit": {"overhead": overhead}}))
    return predict_bench_run(args), before, rows()


def test_predict_replays_no_prompt_token_time_before_the_engine(tmp_path: Path) -> None:
    """A profile's per-prompt-token host time moves predicted TTFT, not the replayed arrivals."""
    doc, before, after = _predicted_twice(tmp_path, {"prompt_token_s": 1e-6})
    assert doc["overhead_s"]["prompt_token"] == pytest.approx(1e-5)
    for a, b in zip(after, before, strict=True):
        assert a["overhead_s"] == b["overhead_s"]  # same arrivals at the engine
        assert a["ttft_pred"] == pytest.approx(b["ttft_pred"] + 1e-5 * a["input_tokens"])


def test_predict_reads_the_delay_from_the_profile(tmp_path: Path) -> None:
    """A client-clock bench run against the embedded server, predicted with a profile without the
    delay and with 5 ms of it (time scale 10: 50 ms of engine time): every streamed request's
    TTFT and E2E gain it."""
    doc, before, after = _predicted_twice(tmp_path, {"first_token_s": 0.005})
    assert doc["overhead_s"]["first_token"] == pytest.approx(0.05)
    assert len(after) == len(before) == 4 and all(x["output_tokens"] > 1 for x in after)
    for a, b in zip(after, before, strict=True):
        assert a["ttft_pred"] == pytest.approx(b["ttft_pred"] + 0.05)
        assert a["e2e_pred"] == pytest.approx(b["e2e_pred"] + 0.05)
