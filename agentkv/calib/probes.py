"""Run the probe plan against a target over the OpenAI API (streamed completions of token-id prompts)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable

from agentkv.bench.client import BenchClient, StreamResult
from agentkv.calib.plan import Probe, samples, tiny_pair
from agentkv.errors import UserError
from agentkv.trace.blocks import request_tokens


class ProbeError(UserError):
    """A probe failed: the target stopped answering, does not stream, or does not report usage."""


class Prober:
    """Sends each probe's requests and turns wall times into engine seconds (x `time_scale`)."""

    def __init__(self, client: BenchClient, model: str, block_size: int, time_scale: float):
        self.client, self.model, self.bs, self.scale = client, model, block_size, time_scale
        self.nonce = uuid.uuid4().hex[:12]  # unique first blocks per run: nothing is cached from before
        self.seq = 0
        self._prefix: tuple[int, list[int]] = (0, [])  # (id of the cached probe, its warmed prefix)

    def _ids(self, n: int, space: str | None = None) -> list[int]:
        if space is None:
            self.seq += 1
            space = f"calib-{self.nonce}-{self.seq}"
        m = -(-n // self.bs)
        return request_tokens(space, list(range(m)), n, self.bs).tolist()

    async def _send(self, prompt: list[int], out: int) -> StreamResult:
        res = await self.client.stream(self.client.body(self.model, prompt, out))
        if not res.ok:
            hint = {
                "not_streamed": "the target does not stream (stream: true)",
                "incomplete": "a stream ended without [DONE]",
            }.get(res.error, f"a request failed ({res.error})")
            raise ProbeError(f"target {self.client.base}: {hint}: {res.detail}")
        if res.prompt_tokens is None:
            raise ProbeError(
                f"target {self.client.base}: no usage in the stream (stream_options.include_usage); "
                "calibrate needs prompt and completion token counts"
            )
        return res

    async def ttft(self, p: Probe) -> float:
        """Engine seconds to the first token of `p.new` tokens after `p.past` cached ones. The prefix
        is warmed once per probe and each sample adds fresh tokens to it (a sample costs one short
        prefill, not the prefix's too)."""
        prompt = self._ids(p.new)
        if p.past:
            if self._prefix[0] != id(p) or len(self._prefix[1]) != p.past:
                self._prefix = (id(p), self._ids(p.past))
                await self._send(self._prefix[1], 1)  # warm the prefix
            prompt = self._prefix[1] + prompt
        res = await self._send(prompt, 1)
        if p.past and res.cached_tokens is not None and res.cached_tokens < p.past - self.bs:
            raise ProbeError(
                f"target {self.client.base}: a {p.past}-token prefix was not served from cache "
                f"({res.cached_tokens} cached tokens); is prefix caching enabled?"
            )
        return self._first_token_s(res) * self.scale

    def _first_token_s(self, res: StreamResult) -> float:
        """Wall seconds from sending `res`'s request to its first token; ProbeError without one."""
        if not res.token_times:
            raise ProbeError(f"target {self.client.base}: a stream carried no output tokens")
        return res.token_times[0] - res.sent

    async def itl(self, p: Probe) -> float:
        """Engine seconds per token while `p.n` streams of `p.ctx` context all decode together."""
        results = await asyncio.gather(*(self._send(self._ids(p.ctx), p.out) for _ in range(p.n)))
        start = max(r.token_times[0] for r in results if r.token_times)
        end = min(r.token_times[-1] for r in results if r.token_times)
        gaps = []
        for r in results:
            inside = [t for t in r.token_times if start <= t <= end]
            if len(inside) >= 2:
                gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
        if not gaps:
            raise ProbeError(f"target {self.client.base}: {p.n} streams never decoded together")
        return statistics.median(gaps) * self.scale

    async def _beside(self, p: Probe) -> tuple[StreamResult, list[StreamResult]]:
        """A cold `p.new`-token prompt sent `p.lead_s` wall seconds after `p.n` streams of `p.ctx`
        tokens start: (its result, the streams' results)."""
        streams = [asyncio.create_task(self._send(self._ids(p.ctx), p.out)) for _ in range(p.n)]
        try:
            await asyncio.sleep(p.lead_s)
            pre = await self._send(self._ids(p.new), 1)
            results = await asyncio.gather(*streams)
        finally:
            for task in streams:
                task.cancel()
        self._first_token_s(pre)  # ProbeError when it carried none
        return pre, results

    async def stall(self, p: Probe) -> float | None:
        """Engine seconds of the longest decode gap while a cold `p.new`-token prefill runs beside
        `p.n` decoding streams (None: no stream was decoding across it)."""
        pre, results = await self._beside(p)
        lo, hi = pre.sent, pre.token_times[0]
        gaps = [
            b - a
            for r in results
            for a, b in zip(r.token_times, r.token_times[1:], strict=False)
            if b > lo and a < hi  # the gap overlaps the prefill
        ]
        return max(gaps) * self.scale if gaps else None

    async def loaded_ttft(self, p: Probe) -> float:
        """Engine seconds to the first token of a cold `p.new`-token prompt sent while `p.n` streams
        decode: client-side TTFT under traffic, host time included."""
        pre, _ = await self._beside(p)
        return (pre.token_times[0] - pre.sent) * self.scale

    async def run(self, p: Probe, repeats: int, partner: Probe | None = None) -> None:
        """`samples(p, repeats)` samples of `p`, then its measurement (`Probe.settle`); with a
        `partner` (a prefill), one sample of it after each of `p`'s, so that the two meet the same
        host (the pair whose difference is the cached-past setup: calib.pair)."""
        measure = {"decode": self.itl, "interference": self.stall, "loaded_ttft": self.loaded_ttft}
        measure = measure.get(p.family, self.ttft)
        for _ in range(samples(p, repeats)):
            for q, m in ((p, measure), (partner, self.ttft)):
                if q is not None and (v := await m(q)) is not None:
                    q.samples_s.append(v)
        p.settle()
        if partner is not None:
            partner.settle()


PILOT_NEW, PILOT_OUT = 512, 16  # the pilot request: a 512-token prefill, then 16 tokens of decode


async def pilot(prober: Prober) -> tuple[float, float]:
    """Two discarded warm-up requests, then one pilot: (engine seconds to its first token, engine
    seconds per decode step), which scale the plan's estimates to how fast the target really is."""
    for _ in range(2):
        await prober.ttft(Probe("prefill_cold", new=prober.bs))
    res = await prober._send(prober._ids(PILOT_NEW), PILOT_OUT)
    tt = res.token_times
    if len(tt) < 2:
        raise ProbeError(f"target {prober.client.base}: a {PILOT_OUT}-token stream carried {len(tt)} tokens")
    step = (tt[-1] - tt[0]) / (len(tt) - 1)
    return (tt[0] - res.sent) * prober.scale, step * prober.scale


LAG_PAIRS = 5  # cold prompts timed to the first token alone and followed by more tokens, each


async def first_token_lag(prober: Prober, pairs: int = LAG_PAIRS) -> tuple[float, dict[str, list[float]]]:
    """(Wall seconds (>= 0) a stream's first token reaches the client later when more tokens follow it
    than when it is the only one, the TTFTs): the mean TTFT of cold PILOT_NEW-token prompts streaming
    PILOT_OUT tokens less that of one-token ones (alternating; each without its least and greatest
    sample: the delay comes and goes with the host). A server busy with the stream's next decode
    steps flushes its first token late (vLLM's CPU build: 5-30 ms); the one-token TTFT probes cannot
    see it, bench's streams meet it, and predict adds it to TTFT alone (docs/cost-model.md)."""
    ttft: dict[int, list[float]] = {1: [], PILOT_OUT: []}
    for i in range(pairs):
        for out in (1, PILOT_OUT) if i % 2 == 0 else (PILOT_OUT, 1):
            res = await prober._send(prober._ids(PILOT_NEW), out)
            ttft[out].append(prober._first_token_s(res))
    mid = {k: sorted(v)[1:-1] if len(v) > 2 else v for k, v in ttft.items()}
    lag = max(0.0, statistics.fmean(mid[PILOT_OUT]) - statistics.fmean(mid[1]))
    return lag, {"one_token": ttft[1], "continuing": ttft[PILOT_OUT]}


async def run_plan(
    prober: Prober, plan: list[Probe], repeats: int, on_done: Callable[[Probe], None], deadline: float
) -> str | None:
    """Run the probes in order until `deadline` (time.monotonic()); the first failure's message (the
    probes before it keep their data). Probes the budget leaves no time for stay unmeasured. The
    tiny pair (`plan.tiny_pair`) runs interleaved, when the first of the two comes."""
    pair = tiny_pair(plan)
    for p in plan:
        if time.monotonic() > deadline:
            break
        partner = None
        if pair and any(p is q for q in pair):
            if p.samples_s:  # its partner's turn measured it already
                on_done(p)
                continue
            partner = pair[1] if p is pair[0] else pair[0]
        try:
            await prober.run(p, repeats, partner)
        except UserError as e:
            return f"{p.label()}: {e}"
        on_done(p)
    return None
