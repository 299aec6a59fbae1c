"""The front end under concurrency: calibrate times 1, 2 and 4 streams of a long prompt sent together
and fits the host seconds per prompt token they queue for; predict reads each streamed first token
through that queue (docs/cost-model.md, the live vLLM section)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from agentkv.bench.client import BenchClient
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.calib.frontend import CURVE_NEW, CURVE_STREAMS, FrontEndCurve, fit_front_end, front_end_reads
from agentkv.calib.predict import _after_first_token
from agentkv.calib.probes import ProbeError, Prober
from agentkv.calib.replay import replay
from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from tests.test_calib_loaded import _items

PAST = 1024
TOKENS = PAST + CURVE_NEW


def _curve(rounds: int = 2, timeout: float = 30.0, **server) -> dict:
    """FrontEndCurve's rounds against a loopback test server (`server`: its keyword arguments)."""

    async def go() -> dict:
        async with StreamTestServer(**server) as srv, BenchClient(srv.url, timeout=timeout) as c:
            curve = FrontEndCurve(PAST, rounds)
            while not curve.done:
                await curve.pair(Prober(c, "test-model", 16, 1.0))
            bodies = [b for b in srv.seen if b["max_tokens"] > 1]
            assert {len(b["prompt"]) for b in bodies} == {TOKENS}  # the warmed prefix + fresh tokens
            assert len({tuple(b["prompt"][:PAST]) for b in bodies}) == rounds  # one prefix a round
            return curve.result()

    return asyncio.run(go())


def test_the_queue_reads_first_tokens_of_one_step_together_after_all_of_them() -> None:
    reads = front_end_reads([("a", 1.0, 1000), ("b", 1.0, 2000), ("c", 5.0, 1000)], 1e-6)
    assert reads == pytest.approx({"a": 1.003, "b": 1.003, "c": 5.001})  # c: the queue was empty again
    later = front_end_reads([("a", 1.0, 1000), ("b", 1.0005, 2000)], 1e-6)
    assert later == pytest.approx({"a": 1.001, "b": 1.003})  # the next step's waits for the batch before
    assert front_end_reads([("x", 0.0, 500)], 0.0) == {"x": 0.0}


def test_a_target_that_serves_one_request_at_a_time_is_a_front_end_queue() -> None:
    """A server that caps concurrency at one and spends 80 ms on each request: n streams sent together
    read their first tokens 80 ms apart and end 80 ms apart, so the fit puts 80 ms per request (over
    its prompt tokens) in the queue, all of it before the engine; the same server taking them all at
    once queues nothing (a busy host's few ms aside)."""
    slow = lambda body, n: Behaviour(ttft=0.08)  # noqa: E731
    serial = _curve(serial=True, behave=slow)
    assert set(serial["ttft_s"]) == {str(n) for n in CURVE_STREAMS} and serial["past"] == PAST
    assert all(len(v) == 2 for v in serial["ttft_s"].values())
    none = lambda n: (0.0, 0.0)  # noqa: E731 - no engine time
    got, share = fit_front_end(serial, none, 0.0, 1.0)
    # one step's first tokens are read together after all of them (`front_end_reads`): n streams
    # 80 ms apart (mean (n - 1) / 2 x 80 ms late) are a batch at half the server's rate
    assert 0.3 * 0.08 / TOKENS < got < 1.0 * 0.08 / TOKENS, got * TOKENS
    assert share > 0.7, share  # the ends queue as the first tokens do: all before the engine
    free, _ = fit_front_end(_curve(behave=slow), none, 0.0, 1.0)
    assert free < 0.25 * 0.08 / TOKENS, free * TOKENS
    # what the engine's longer steps and the arrival queue explain is not the front end's
    assert fit_front_end(serial, lambda n: (0.08 * n, 0.08 * n), 0.0, 1.0)[0] < 0.2 * got
    assert fit_front_end(serial, none, 0.16, 1.0)[0] < 0.2 * got
    on_time = serial | {"e2e_s": {k: [1.0] * len(v) for k, v in serial["e2e_s"].items()}}
    assert fit_front_end(on_time, none, 0.0, 1.0)[1] == 0.0  # ends on time: all after the engine
    alone = {"past": PAST, "new": CURVE_NEW, "ttft_s": {"1": [0.1]}, "e2e_s": {"1": [0.2]}}
    assert fit_front_end(alone, none, 0, 1) is None  # no round of two or more streams


def test_a_stream_that_never_sends_a_first_token_is_a_probe_error() -> None:
    hang = lambda body, n: Behaviour(hang=body["max_tokens"] > 1)  # noqa: E731 - the warm-up answers
    with pytest.raises(ProbeError, match="timeout"):
        _curve(rounds=1, timeout=1.0, behave=hang)
    empty = lambda body, n: Behaviour(reset_after=0 if body["max_tokens"] > 1 else None)  # noqa: E731
    with pytest.raises(ProbeError, match="a stream ended without|a request failed"):
        _curve(rounds=1, behave=empty)


def calibrate_against(
    tmp_path: Path, behave, max_model_len: int = 4096, budget: str = "2s"
) -> tuple[int, dict]:
    """`agentkv calibrate --budget BUDGET` against a loopback server answering as `behave` says: (the
    exit code, the profile)."""
    srv = StreamTestServer(model="llama3-8b", max_model_len=max_model_len, behave=behave)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)
    out = tmp_path / "p.json"
    try:
        rc = main(["calibrate", "--target", url, "--out", str(out), "--budget", budget, "--gpu", "h100"])
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    return rc, json.loads(out.read_text())


def test_calibrate_writes_the_curve_and_its_fit_into_the_profile(tmp_path: Path, capsys) -> None:
    rc, doc = calibrate_against(tmp_path, lambda body, n: Behaviour())
    fit = doc["fit"]
    ov = fit["overhead"]
    assert rc == 0 and ov["front_end_token_s"] >= 0.0 and 0.0 <= ov["front_end_before_engine"] <= 1.0, ov
    curve = fit["front_end_ttft_s"]
    assert curve["past"] == 2048 and all(len(curve["ttft_s"][str(n)]) >= 2 for n in CURVE_STREAMS)
    assert "front end under concurrency: " in capsys.readouterr().out
    # no /metrics here: the split stops after its first scrape and the curve's fit stands
    assert "split" not in fit["front_end"]["source"] and "split_token_s" not in fit["front_end"]


def test_a_curve_stream_without_a_first_token_ends_calibrate_with_the_probes_kept(
    tmp_path: Path, capsys
) -> None:
    """The curve's streams (the longest prompts, 16 tokens asked) end without a token: one error
    naming the front end, the probes finished before it in the profile."""
    cut = lambda body, n: Behaviour(reset_after=0 if len(body["prompt"]) == 2048 + CURVE_NEW else None)  # noqa: E731
    rc, doc = calibrate_against(tmp_path, cut)
    last = capsys.readouterr().err.strip().splitlines()[-1]  # before it: the plan's size, notes
    assert rc == 2 and last.startswith("agentkv: error: front end: ") and "finished probes written" in last
    assert doc["error"].startswith("front end: ") and len(doc["probes"]) >= 3


def test_predict_reads_first_tokens_made_together_through_the_queue() -> None:
    """Two requests sent together, their first tokens from one step: through the queue both are
    read after both shares; a profile without the field reads each alone (as
    before); agentkv serve's engine clock adds nothing."""
    cfg = EngineConfig(gpu="h100", model="llama3-8b", block_size=16)
    items = _items([0.0, 0.0])
    pred = replay(cfg, items, (0.0, 0.0), False)
    assert pred[0].first_token == pred[1].first_token  # one prefill step for both
    alone = _after_first_token(items, pred, 1e-5, None)
    assert alone == pytest.approx({0: 512e-5, 1: 512e-5})
    queued = _after_first_token(items, pred, 1e-5, 2e-5)
    assert sorted(queued.values()) == pytest.approx([2 * 512 * 2e-5, 2 * 512 * 2e-5])
    stamped = _items([0.0, 0.0], clock="engine")
    assert _after_first_token(stamped, replay(cfg, stamped, (0.0, 0.0), False), 1e-5, 2e-5) == {
        0: 0.0,
        1: 0.0,
    }


def test_the_first_token_delays_streams_fit_the_servers_context() -> None:
    """A slow pilot (a busy host: 2 s to the first token, 1 ms steps) wants the delay's beside-streams
    to decode for thousands of tokens; they stay within the server's max_model_len with their context
    (uncapped, a 4,096-token server was asked for 4,641 tokens and calibrate failed in CI)."""
    from agentkv.calib.probes import PILOT_NEW
    from agentkv.calib.run import lag_beside, lag_wall_s

    slow = (2.0, 0.001)
    assert lag_beside(slow, 1.0).out + PILOT_NEW > 4096  # what the plan wants
    capped = lag_beside(slow, 1.0, 4096)
    assert capped.ctx + capped.out == 4096
    assert lag_wall_s(slow, 1.0, 4096) < lag_wall_s(slow, 1.0)
    fast = (0.02, 0.01)
    assert lag_beside(fast, 1.0, 4096).out == lag_beside(fast, 1.0).out  # room enough: unchanged
