"""The first-token lag under decoding streams (issue 17): a short prompt's client TTFT beside N streams.

`StreamLag` times one short cold prompt (one output token) sent while `n` background streams decode,
for each `n` of its levels, one level set per round (calibrate spreads rounds as `FirstTokenLag`'s
pairs), and reads the server's /metrics (vLLM's `vllm:time_to_first_token_seconds` sum and count)
just before and after the prompt, so that the client's lag beyond the server's own TTFT is split
out. `fit_stream_lag` fits that lag against `n` (least-squares slope over all levels) with its
standard error; unresolved (or no /metrics), the slope is 0: the constant first-token delay alone."""

from __future__ import annotations

import asyncio

from agentkv.bench.scrape import Scraper
from agentkv.calib.frontend import line_fit
from agentkv.calib.probes import Prober
from agentkv.metrics.scrape import parse_prometheus

LAG_LEVELS = (0, 2, 4, 8)  # background streams decoding beside the timed prompt
LAG_ROUNDS = 3
LAG_NEW = 32  # the timed prompt's cold tokens: one short prefill step
BG_NEW, BG_OUT = 32, 96  # each background stream: a short prompt, then many decode steps
BG_LEAD_S = 0.25  # wall seconds the streams decode before the timed prompt goes out
TTFT_METRIC = "vllm:time_to_first_token_seconds"


def levels(lanes: int | None) -> tuple[int, ...]:
    """LAG_LEVELS up to `lanes` (the bench's concurrency; None: all), the largest kept if it falls
    between two."""
    if not lanes:
        return LAG_LEVELS
    out = tuple(n for n in LAG_LEVELS if n <= lanes)
    return out if lanes in out else (*out, lanes)


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The `_sum` and `_count` of each histogram in `names`, summed over label sets (the project's
    Prometheus parser, `metrics.scrape.parse_prometheus`: malformed and hostile lines skipped)."""
    wanted = [f"{m}{part}" for m in names for part in ("_sum", "_count")]
    return {k: sum(v) for k, v in parse_prometheus(text, wanted).items()}


async def scrape(prober: Prober, names: tuple[str, ...] = (TTFT_METRIC,)) -> dict[str, float] | None:
    """The target's TTFT histogram's sum and count (and those of `names`), or None when it serves no
    such /metrics."""
    session = prober.client.session
    if session is None:
        return None
    text = await Scraper(session, prober.client.base, timeout=5.0).page()
    got = parse_metrics(text or "", names)
    return got if f"{TTFT_METRIC}_count" in got else None


class StreamLag:
    """Per level `n`: client TTFTs (wall seconds) of the timed prompt and the server's own TTFT of it
        (None where /metrics did not isolate it), one sample per level a round; the timed prompt is `new`
    cold tokens after a cached `past`-token prefix, with `out` output tokens."""

    def __init__(
        self,
        lanes: int | None = None,
        rounds: int = LAG_ROUNDS,
        out: int = 1,
        new: int = LAG_NEW,
        past: int = 0,
    ):
        self.levels, self.rounds, self.out, self.new, self.past = levels(lanes), rounds, out, new, past
        self._pre: list[int] = []
        self.client: dict[int, list[float]] = {n: [] for n in self.levels}
        self.server: dict[int, list[float | None]] = {n: [] for n in self.levels}

    @property
    def done(self) -> bool:
        return len(self.client[self.levels[-1]]) >= self.rounds

    @property
    def ttft(self) -> dict[int, list[float]]:
        """Keyed as the other extras' (`probes.extra_pairs` reads `ttft[1]`'s length)."""
        return {1: self.client[self.levels[-1]]}

    async def _one(self, prober: Prober, n: int) -> None:
        streams = [asyncio.create_task(prober._send(prober._ids(BG_NEW), BG_OUT)) for _ in range(n)]
        try:
            if n:
                await asyncio.sleep(BG_LEAD_S)
            before = await scrape(prober)
            res = await prober._timed(lambda: self._pre + prober._ids(self.new), self.out)
            after = await scrape(prober)
            await asyncio.gather(*streams)
        finally:
            for task in streams:
                task.cancel()
        self.client[n].append(prober._first_token_s(res))
        self.server[n].append(server_delta(before, after))

    async def pair(self, prober: Prober) -> None:
        """One round: a `past`-token prefix warmed (none at 0), then each level's timed prompt once
        (the prefix plus `new` cold tokens)."""
        self._pre = prober._ids(self.past) if self.past else []
        if self._pre:
            await prober._send(self._pre, 1)
        for n in self.levels:
            await self._one(prober, n)

    def result(self) -> dict:
        """The samples as the profile keeps them (`fit.stream_lag`)."""
        return {
            "levels": list(self.levels),
            "past": self.past,
            "new": self.new,
            "out": self.out,
            "background": {"new": BG_NEW, "out": BG_OUT, "lead_s": BG_LEAD_S},
            "client_ttft_s": {str(n): v for n, v in self.client.items()},
            "server_ttft_s": {str(n): v for n, v in self.server.items()},
        }


def server_delta(before: dict | None, after: dict | None, metric: str = TTFT_METRIC) -> float | None:
    """The server's TTFT (or `metric`, a histogram) of the one request between two scrapes; None
    unless exactly one was counted."""
    if before is None or after is None:
        return None
    k, s = f"{metric}_count", f"{metric}_sum"
    if after.get(k, 0.0) - before.get(k, 0.0) != 1.0:
        return None
    return after.get(s, 0.0) - before.get(s, 0.0)


def lag_points(doc: dict) -> list[tuple[float, float]]:
    """(the sample's key: streams, or prompt tokens in the split; its client TTFT less the server's)
    for every sample the server's /metrics isolated: host time the engine's model lacks."""
    out = []
    for n, cs in (doc.get("client_ttft_s") or {}).items():
        ss = (doc.get("server_ttft_s") or {}).get(n) or []
        out += [(float(n), c - s) for c, s in zip(cs, ss, strict=False) if s is not None]
    return out


def fit_stream_lag(doc: dict) -> dict:
    """Seconds of first-token lag per decoding stream: the least-squares slope of `lag_points` (with
    an intercept: the lag without streams) and its standard error; kept when at least twice that
    over 3 levels or more, else 0 (the constant first-token delay alone), its source saying which."""
    pts = lag_points(doc)
    slope, se, icpt = line_fit(pts)
    resolved = se is not None and len({x for x, _ in pts}) >= 3 and slope > 2 * se
    return {
        "per_stream_s": slope if resolved else 0.0,
        "source": "stream_lag curve" if resolved else "none (curve not resolved)",
        "curve_per_stream_s": slope,
        "curve_stderr_s": se,
        "curve_lag_at_0_s": icpt,
        "curve_points": len(pts),
    }
