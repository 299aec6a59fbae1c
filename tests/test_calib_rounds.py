"""calibrate samples its probes in rounds (one sample of each per round, a first-token delay pair
between rounds) so that every probe meets the same mix of a busy host's fast and slow moments; a
prefix evicted between rounds is warmed again; the delay is the median of its pairs' differences."""

from __future__ import annotations

import asyncio
import statistics
import time
from argparse import Namespace
from dataclasses import replace

import pytest

from agentkv.bench.client import BenchClient
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.calib import fit as F
from agentkv.calib.identify import unpinned
from agentkv.calib.plan import Probe, make_plan, within_budget
from agentkv.calib.probes import PILOT_NEW, PILOT_OUT, FirstTokenLag, Prober, pilot, run_plan
from agentkv.calib.run import est_wall_s, plan_for, slowdown
from agentkv.engine.cost import load_coefficients


def _run(plan: list[Probe], deadline_s: float, lag: FirstTokenLag | None, behave=None) -> list[dict]:
    """run_plan against a loopback test server; the request bodies it saw, in order."""

    async def go() -> list[dict]:
        async with StreamTestServer(behave=behave) as srv, BenchClient(srv.url, timeout=30) as c:
            seen: list[tuple[str, int, int]] = []
            err = await run_plan(
                Prober(c, "test-model", 16, 1.0),
                plan,
                2,
                lambda *a: seen.append(a),
                time.monotonic() + deadline_s,
                lag,
            )
            assert err is None
            assert [s[1] for s in seen] == list(range(1, len(seen) + 1))  # samples done, counted
            return srv.seen

    return asyncio.run(go())


def test_probes_are_sampled_in_rounds_with_a_delay_pair_after_each() -> None:
    short, long = Probe("prefill_cold", new=300), Probe("prefill_cold", new=2000)  # 4 and 2 samples
    lag = FirstTokenLag(pairs=3)
    seen = _run([short, long], 60, lag)
    pair = [PILOT_NEW, PILOT_NEW]
    assert [len(b["prompt"]) for b in seen] == [300, 2000, *pair, 300, 2000, *pair, 300, *pair, 300]
    outs = [b["max_tokens"] for b in seen if len(b["prompt"]) == PILOT_NEW]
    assert outs == [1, PILOT_OUT, PILOT_OUT, 1, 1, PILOT_OUT]  # each pair's order alternates
    assert len(short.samples_s) == 4 and short.measured_s == statistics.median(short.samples_s)
    assert len(long.samples_s) == 2 and lag.done


def test_the_deadline_ends_a_round_and_keeps_every_probe_it_sampled() -> None:
    plan = [Probe("prefill_cold", new=300), Probe("prefill_cold", new=2000)]
    seen = _run(plan, 0.1, None, lambda body, n: Behaviour(ttft=0.2))
    assert [len(b["prompt"]) for b in seen] == [300]  # the first sample outlived the deadline
    assert plan[0].measured_s == plan[0].samples_s[0] and plan[1].measured_s is None


def test_a_prefix_evicted_between_rounds_is_warmed_again() -> None:
    """The server forgets its cache before the third request (the second sample): that sample finds
    no cached prefix, so the prober warms a fresh one and sends the sample again; none is lost."""
    srv: list[StreamTestServer] = []

    def behave(body: dict, n: int) -> Behaviour:
        if n == 2:
            srv[0].cache.clear()
        return Behaviour()

    async def go() -> tuple[list[dict], Probe]:
        async with StreamTestServer(behave=behave) as s, BenchClient(s.url, timeout=30) as c:
            srv.append(s)
            p = Probe("prefill_cached", new=2000, past=512)  # 2 samples
            await Prober(c, "test-model", 16, 1.0).run(p, 2)
            return s.seen, p

    seen, p = asyncio.run(go())
    lens = [len(b["prompt"]) for b in seen]
    assert lens == [512, 2512, 2512, 512, 2512], lens  # warm, sample, miss, warm again, sample
    assert seen[0]["prompt"] != seen[3]["prompt"]  # a fresh prefix, not the evicted one
    assert len(p.samples_s) == 2


def test_the_delay_is_the_median_of_the_pairs_differences() -> None:
    lag = FirstTokenLag(pairs=5)
    lag.ttft = {1: [0.017, 0.017, 0.020, 0.018, 0.016], PILOT_OUT: [0.102, 0.089, 0.022, 0.014, 0.021]}
    assert lag.result()[0] == pytest.approx(0.005)  # two hiccups of five: the mean would say ~25 ms
    lag.ttft = {1: [0.03, 0.03], PILOT_OUT: [0.01, 0.02]}
    assert lag.result()[0] == 0.0  # never negative
    assert FirstTokenLag().result()[0] == 0.0  # no pair finished: no delay


def test_a_short_budget_keeps_one_stream_decodes_at_two_contexts() -> None:
    """A slow target and a tight budget: the one-stream decodes at the two shortest contexts are kept
    before cheaper probes (with one context the fit put per-step host time into the KV read rate),
    and the fit names that rate not identifiable where the decodes have one context anyway."""
    t = F.Target("h100", "llama3-70b", tp=4)
    cm = t.cost()
    speed = (
        F.predict(cm, t, Probe("prefill_cold", new=512)),
        F.predict(cm, t, Probe("decode", n=1, ctx=512)),
    )
    slow = (speed[0] * 10, speed[1] * 10)
    plan = make_plan(131072, 16, 8192, kv_tokens=489_824)
    cheapest = within_budget(plan, [est_wall_s(t, p, 2, slowdown(t, slow)) for p in plan], 120.0)
    kept = plan_for(t, make_plan(131072, 16, 8192, kv_tokens=489_824), slow, Namespace(repeats=2), 120.0)
    ctxs = lambda ps: sorted(p.ctx for p in ps if p.family == "decode" and p.n == 1)  # noqa: E731
    assert len(ctxs(cheapest)) < 2 and ctxs(kept) == [1024, 4096]
    # a slow single-stream KV read (a CPU build's attention): a large share of every probed decode
    # step, so only the lack of a second context leaves it unpinned
    cm = t.cost(replace(load_coefficients(), stream_gbps=0.5))

    def timed(keep) -> list[Probe]:
        probes = [p for p in make_plan(32768, 16, 8192, kv_tokens=400_000) if keep(p)]
        for p in probes:
            p.samples_s = [F.predict(cm, t, p, (1e-3, 0.0))]
            p.settle()
        return probes

    one = timed(lambda p: p.family != "decode" or p.ctx == 1024)
    assert "have 1 context:" in unpinned(t, one, F.fit(t, one)).get("stream_gbps", "")
    both = timed(lambda p: p.family != "decode" or p.ctx <= 4096)
    assert "stream_gbps" not in unpinned(t, both, F.fit(t, both))


def test_the_pilot_step_survives_a_first_token_flushed_late() -> None:
    """A server that holds a stream's first token 100 ms and then sends all 16 at once: the pilot's
    decode step is the last token less the one-token TTFT over the steps (~6 ms), not 0 (which
    stretched the planned streams to thousands of tokens and spent a whole budget on three samples)."""

    async def go() -> tuple[float, float]:
        late = lambda body, n: Behaviour(ttft=0.1 if body["max_tokens"] > 1 else 0.0)  # noqa: E731
        async with StreamTestServer(behave=late) as srv, BenchClient(srv.url, timeout=30) as c:
            return await pilot(Prober(c, "test-model", 16, 1.0))

    ttft, step = asyncio.run(go())
    assert ttft < 0.05 and 0.1 / 15 <= step < 0.3, (ttft, step)


def test_a_decode_sample_whose_streams_never_overlap_is_skipped_not_fatal() -> None:
    """Two streams, the second's first token after the first one ended (a busy host): the sample
    measures nothing and is skipped; the probe stays unmeasured, calibrate goes on."""

    def behave(body: dict, n: int) -> Behaviour:
        return Behaviour(ttft=0.3 if n % 2 else 0.0)

    dec = Probe("decode", n=2, ctx=64, out=4)
    seen = _run([dec], 60, None, behave)
    assert len(seen) == 4 and dec.samples_s == [] and dec.measured_s is None  # 2 samples x 2 streams
