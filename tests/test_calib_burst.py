"""Streams read in a burst (calib.probes): the decode window opens after a stream's leading burst,
and the first-token delay's pairs are timed beside decoding streams."""

from __future__ import annotations

import asyncio

import pytest

from agentkv.bench.client import BenchClient, StreamResult
from agentkv.bench.testserver import StreamTestServer
from agentkv.calib.plan import Probe
from agentkv.calib.probes import PILOT_NEW, PILOT_OUT, FirstTokenLag, Prober, burst_end


def test_the_leading_burst_ends_where_the_steps_start() -> None:
    step = 0.01
    burst = [0.1, 0.1001, 0.1002, 0.1003]  # a first token flushed late, three queued behind it
    assert burst_end([*burst, *(0.1003 + step * i for i in range(1, 13))]) == 3
    assert burst_end([step * i for i in range(16)]) == 0  # steady: no burst
    assert burst_end([0.0, 0.0]) == 0 and burst_end([]) == 0


class _Canned(Prober):
    """A prober whose streams arrive as given (client clock), no server."""

    def __init__(self, times: list[list[float]]):
        super().__init__(None, "m", 16, 1.0)  # type: ignore[arg-type]
        self.times = iter(times)

    async def _send(self, prompt: list[int], out: int) -> StreamResult:
        return StreamResult(sent=0.0, token_times=next(self.times), prompt_tokens=len(prompt))


def test_itl_skips_each_streams_leading_burst() -> None:
    """Two streams decoding together at 10 ms a step, each with its first four tokens read at once:
    the window from the later first token saw 0.2 ms gaps; it opens after the bursts now."""
    step = 0.01
    a = [0.1, 0.1001, 0.1002, 0.1003, *(0.1003 + step * i for i in range(1, 30))]
    b = [0.12, 0.1201, 0.1202, *(0.1202 + step * i for i in range(1, 30))]
    got = asyncio.run(_Canned([a, b]).itl(Probe("decode", n=2, ctx=64, out=33)))
    assert got == pytest.approx(step, rel=0.01)


def test_the_delay_pairs_are_timed_beside_decoding_streams() -> None:
    """With `beside`, each request of a pair goes out after its decoding streams; the pair keeps its
    one-token and PILOT_OUT-token requests, alternating order."""
    beside = Probe("loaded_ttft", new=PILOT_NEW, n=2, ctx=64, out=8, lead_s=0.01)

    async def go() -> tuple[list[dict], FirstTokenLag]:
        lag = FirstTokenLag(pairs=2, beside=beside)
        async with StreamTestServer() as srv, BenchClient(srv.url, timeout=30) as c:
            prober = Prober(c, "test-model", 16, 1.0)
            while not lag.done:
                await lag.pair(prober)
            return srv.seen, lag

    seen, lag = asyncio.run(go())
    shape = [(len(b["prompt"]), b["max_tokens"]) for b in seen]
    streams = [(64, 8), (64, 8)]
    firsts = [(PILOT_NEW, o) for o in (1, PILOT_OUT, PILOT_OUT, 1)]
    assert shape == [x for f in firsts for x in (*streams, f)], shape
    assert len(lag.ttft[1]) == len(lag.ttft[PILOT_OUT]) == 2
