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

BURST_FRAC = 0.2  # a gap under this share of a stream's mean gap: the tokens came in one read


def burst_end(tt: list[float]) -> int:
    """Index of the last token of `tt`'s leading burst: tokens read together (a first token flushed
    late, the next ones queued behind it) that no decode step separates; 0 without one."""
    if len(tt) < 3:
        return 0
    tight = BURST_FRAC * (tt[-1] - tt[0]) / (len(tt) - 1)
    k = 0
    while k + 1 < len(tt) and tt[k + 1] - tt[k] <= tight:
        k += 1
    return k


class ProbeError(UserError):
    """A probe failed: the target stopped answering, does not stream, or does not report usage."""


class Prober:
    """Sends each probe's requests and turns wall times into engine seconds (x `time_scale`); with
    `engine_clock`, reads agentkv serve's own stamps instead (`clock_of`)."""

    def __init__(
        self, client: BenchClient, model: str, block_size: int, time_scale: float, engine_clock: bool = False
    ):
        self.client, self.model, self.bs, self.scale = client, model, block_size, time_scale
        self.engine_clock = engine_clock
        self.nonce = uuid.uuid4().hex[:12]  # unique first blocks per run: nothing is cached from before
        self.seq = 0
        self._prefix: dict[int, list[int]] = {}  # id of a cached probe -> its warmed prefix

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
        prefill, not the prefix's too); a sample that finds it evicted (other probes' traffic between
        the rounds) warms it again and is sent once more."""
        if not p.past:
            return self._first_token_s(await self._timed(lambda: self._ids(p.new), 1)) * self.scale
        for warmed in (False, True):
            pre = self._prefix.get(id(p))
            if pre is None or len(pre) != p.past or warmed:
                pre = self._prefix[id(p)] = self._ids(p.past)
                await self._send(pre, 1)  # warm the prefix
            res = await self._timed(lambda pre=pre: pre + self._ids(p.new), 1)
            if res.cached_tokens is None or res.cached_tokens >= p.past - self.bs:
                return self._first_token_s(res) * self.scale
        raise ProbeError(
            f"target {self.client.base}: a {p.past}-token prefix was not served from cache "
            f"({res.cached_tokens} cached tokens); is prefix caching enabled?"
        )

    async def _timed(self, prompt: Callable[[], list[int]], out: int) -> StreamResult:
        """`_send` of `prompt()`, sent once more with a fresh `prompt()` when the stream carried no
        output token though it ended well (vLLM's CPU build did so under load, twice in about 15
        calibrations, cause not found): one such sample does not end a calibration, two do."""
        res = await self._send(prompt(), out)
        return res if res.token_times else await self._send(prompt(), out)

    def clock_of(self, res: StreamResult) -> tuple[float, list[float]]:
        """(When `res` was sent, its tokens' times) in wall seconds: the client's, or with
        `engine_clock` the target's own stamps (agentkv serve's `agentkv` object: arrival and each
        token on its engine's clock, over the time scale), which hold no host delay."""
        if not self.engine_clock:
            return res.sent, res.token_times
        e = res.engine
        if e is None:
            raise ProbeError(
                f"target {self.client.base}: --clock engine, but a response carried no engine times "
                "(agentkv serve's `agentkv` object); use --clock client"
            )
        return e.arrival / self.scale, [(e.arrival + x) / self.scale for x in e.token_times]

    def _first_token_s(self, res: StreamResult) -> float:
        """Wall seconds from sending `res`'s request to its first token; ProbeError without one."""
        sent, tt = self.clock_of(res) if res.token_times else (res.sent, [])
        if not tt:
            raise ProbeError(f"target {self.client.base}: a stream carried no output tokens")
        return tt[0] - sent

    async def itl(self, p: Probe) -> float | None:
        """Engine seconds per token while `p.n` streams of `p.ctx` context all decode together; None
        (the sample is skipped) when they never did: a busy host let the first ones end before the
        last one's first token. The window opens after each stream's leading burst (`burst_end`):
        tokens read together there are no steps."""
        results = await asyncio.gather(*(self._send(self._ids(p.ctx), p.out) for _ in range(p.n)))
        times = [tt for r in results if r.token_times and (tt := self.clock_of(r)[1])]
        start, end = max(tt[burst_end(tt)] for tt in times), min(tt[-1] for tt in times)
        gaps = []
        for tt in times:
            inside = [t for t in tt if start <= t <= end]
            if len(inside) >= 2 and self.engine_clock:  # each gap a step: the median skips a catch-up
                gaps.append(statistics.median(b - a for a, b in zip(inside, inside[1:], strict=False)))
            elif len(inside) >= 2:
                gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
        return statistics.median(gaps) * self.scale if gaps else None  # None: never all decoding

    async def _beside(self, p: Probe, out: int = 1) -> tuple[StreamResult, list[StreamResult]]:
        """A cold `p.new`-token prompt of `out` output tokens sent `p.lead_s` wall seconds after `p.n`
        streams of `p.ctx` tokens start: (its result, the streams' results)."""
        streams = [asyncio.create_task(self._send(self._ids(p.ctx), p.out)) for _ in range(p.n)]
        try:
            await asyncio.sleep(p.lead_s)
            pre = await self._timed(lambda: self._ids(p.new), out)
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
        lo, pre_tt = self.clock_of(pre)
        hi = pre_tt[0]
        gaps = [
            b - a
            for r in results
            if r.token_times
            for tt in (self.clock_of(r)[1],)
            for a, b in zip(tt, tt[1:], strict=False)
            if b > lo and a < hi  # the gap overlaps the prefill
        ]
        return max(gaps) * self.scale if gaps else None

    async def loaded_ttft(self, p: Probe) -> float:
        """Engine seconds to the first token of a cold `p.new`-token prompt sent while `p.n` streams
        decode: client-side TTFT under traffic, host time included."""
        pre, _ = await self._beside(p)
        return self._first_token_s(pre) * self.scale

    async def sample(self, p: Probe, partner: Probe | None = None) -> None:
        """One sample of `p` (its family's measure) into `p.samples_s`; with a `partner` (a prefill),
        one sample of it right after, so that the two meet the same host (the pair whose difference
        is the cached-past setup: calib.pair)."""
        measure = {
            "decode": self.itl,
            "floor": self.itl,
            "interference": self.stall,
            "loaded_ttft": self.loaded_ttft,
        }
        for q, m in ((p, measure.get(p.family, self.ttft)), (partner, self.ttft)):
            if q is not None and (v := await m(q)) is not None:
                q.samples_s.append(v)

    async def run(self, p: Probe, repeats: int, partner: Probe | None = None) -> None:
        """`samples(p, repeats)` samples of `p` back to back (each with its `partner`'s), then its
        measurement (`Probe.settle`)."""
        for _ in range(samples(p, repeats)):
            await self.sample(p, partner)
        for q in (p, partner):
            if q is not None:
                q.settle()


PILOT_NEW, PILOT_OUT = 512, 16  # the pilot request: a 512-token prefill, then 16 tokens of decode


async def pilot(prober: Prober) -> tuple[float, float]:
    """Two discarded warm-up requests, then a one-token and a PILOT_OUT-token stream of PILOT_NEW cold
    tokens each: (engine seconds to the first token, engine seconds per decode step), which scale the
    plan's estimates to how fast the target really is. The step is the longer of the stream's own
    (from its leading burst's end, `burst_end`, to its last token) and its last token less the
    one-token TTFT: a busy server that delivers
    the first token late, the rest in a burst, made the first near 0 (planned decode streams then
    ran 744 and 7,680 tokens and spent the whole budget on three samples)."""
    for _ in range(2):
        await prober.ttft(Probe("prefill_cold", new=prober.bs))
    one = prober._first_token_s(await prober._timed(lambda: prober._ids(PILOT_NEW), 1))
    res = await prober._timed(lambda: prober._ids(PILOT_NEW), PILOT_OUT)
    tt = res.token_times
    if len(tt) < 2:
        raise ProbeError(f"target {prober.client.base}: a {PILOT_OUT}-token stream carried {len(tt)} tokens")
    k = min(burst_end(tt), len(tt) - 2)
    step = max((tt[-1] - tt[k]) / (len(tt) - 1 - k), (tt[-1] - res.sent - one) / (len(tt) - 1))
    return min(one, tt[0] - res.sent) * prober.scale, step * prober.scale


LAG_PAIRS = 6  # cold prompts timed to the first token alone and followed by more tokens, each


class FirstTokenLag:
    """The first-token delay of a continuing stream, one pair of cold PILOT_NEW-token prompts at a
    time (one streaming a single token, one PILOT_OUT; their order alternates), so that calibrate can
    spread the pairs over its whole run (`run_plan`) instead of one moment of a busy host.

    The delay is the median over the pairs of each pair's difference in TTFT, never negative: the two
    of a pair meet the same host, and the median ignores pairs a hiccup hit (one of five pairs at
    +85 ms took the mean of the middle three to 25 ms where the median gave 5). A server busy with
    the stream's next decode steps flushes its first token late (vLLM's CPU build: 0-90 ms); the
    one-token TTFT probes cannot see it, bench's streams meet it, and predict adds it to TTFT and E2E
    (docs/cost-model.md)."""

    def __init__(self, pairs: int = LAG_PAIRS, beside: Probe | None = None):
        self.pairs, self.beside = pairs, beside
        self.ttft: dict[int, list[float]] = {1: [], PILOT_OUT: []}

    @property
    def done(self) -> bool:
        return len(self.ttft[PILOT_OUT]) >= self.pairs

    async def pair(self, prober: Prober) -> None:
        """Time one more pair (wall seconds to the first token); with `beside` (a Probe of
        PILOT_NEW new tokens), each of the two sent beside its decoding streams (`Prober._beside`)."""
        first = 1 if len(self.ttft[1]) % 2 == 0 else PILOT_OUT
        for out in (first, PILOT_OUT + 1 - first):
            if self.beside is not None:
                res = (await prober._beside(self.beside, out))[0]
            else:
                res = await prober._timed(lambda: prober._ids(PILOT_NEW), out)
            self.ttft[out].append(prober._first_token_s(res))

    def result(self) -> tuple[float, dict[str, list[float]]]:
        """(The delay in wall seconds, the TTFTs of each kind, in pair order)."""
        diffs = [c - o for o, c in zip(self.ttft[1], self.ttft[PILOT_OUT], strict=False)]
        lag = max(0.0, statistics.median(diffs)) if diffs else 0.0
        return lag, {"one_token": self.ttft[1], "continuing": self.ttft[PILOT_OUT]}


async def first_token_lag(prober: Prober, pairs: int = LAG_PAIRS) -> tuple[float, dict[str, list[float]]]:
    """`FirstTokenLag`'s delay and TTFTs from `pairs` pairs sent back to back."""
    lag = FirstTokenLag(pairs)
    while not lag.done:
        await lag.pair(prober)
    return lag.result()


def resolve_clock(choice: str | None, server_info: object) -> str:
    """`--clock auto` (or unset) resolved once: engine when /server_info names agentkv serve (whose
    responses carry its engine's stamps), else client; client or engine as given."""
    if choice in ("client", "engine"):
        return choice
    return "engine" if isinstance(server_info, dict) and server_info.get("engine") == "agentkv" else "client"


def named_extras(lag: FirstTokenLag | None, extras: tuple = ()) -> list[tuple[object, str]]:
    """(Each extra timed in pairs beside the probes, its name in a failure's message)."""
    named = ((lag, "first-token delay"), *((x, "front end") for x in extras))
    return [(x, what) for x, what in named if x is not None]


async def extra_pairs(
    prober: Prober, extras: list[tuple[object, str]], until: float | None = None
) -> str | None:
    """Pairs of the `extras` not yet done: one of each (a round of `run_plan`) when `until` is None,
    else each one's until done or `until` (time.monotonic()) passes, two at least. The failure's message."""
    for x, what in extras:
        try:
            if until is None and not x.done:
                await x.pair(prober)
            while until is not None and not x.done and (len(x.ttft[1]) < 2 or time.monotonic() < until):
                await x.pair(prober)
        except UserError as e:
            return f"{what}: {e}"
    return None


async def run_plan(
    prober: Prober,
    plan: list[Probe],
    repeats: int,
    on_sample: Callable[[str, int, int], None],
    deadline: float,
    lag: FirstTokenLag | None = None,
    extras: tuple = (),
) -> str | None:
    """Sample the probes in rounds until `deadline` (time.monotonic()): each round one sample of every
    probe that wants more (`samples`), then one pair of `lag` and one round of each of `extras`
    (`frontend.FrontEndCurve`) while they want more (their time extends the deadline: calibrate
    reserves it apart). Each probe's samples so spread over the whole run and
    all probes meet the same mix of a busy host's fast and slow moments (back to back, one probe's
    samples saw one moment: one-stream decode probes ranged 2.6-14.6 ms from probe to probe). The
    tiny pair (`plan.tiny_pair`) is sampled interleaved. Every probe is settled with the samples it
    has; `on_sample(label, samples done, samples planned)` after each. The first failure's message."""
    pair = tiny_pair(plan)
    partner = {id(pair[0]): pair[1]} if pair else {}
    solo = [p for p in plan if not (pair and p is pair[1])]
    want = {id(p): samples(p, repeats) for p in solo}
    total, done, label = sum(want.values()), 0, ""
    try:
        for k in range(max(want.values(), default=0)):
            for p in (p for p in solo if k < want[id(p)]):
                if time.monotonic() > deadline:
                    return None
                label = p.label()
                await prober.sample(p, partner.get(id(p)))
                done += 1
                on_sample(label, done, total)
            t0 = time.monotonic()
            if error := await extra_pairs(prober, named_extras(lag, extras)):
                return error
            deadline += time.monotonic() - t0
    except UserError as e:
        return f"{label}: {e}"
    finally:
        for p in plan:
            p.settle()
    return None
