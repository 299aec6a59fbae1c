"""The front end's time per prompt token from the split of client TTFT (issue 17): client less server.

`SplitLag` times one prompt of each of several lengths (a cached prefix and SPLIT_NEW fresh tokens,
SPLIT_OUT tokens streamed, as bench's turns) a round, reading the
server's /metrics TTFT histogram just before and after it (`streamlag.scrape`), so each sample splits
into the server's own TTFT and the client's lag beyond it: API-server time the engine's model lacks.
`fit_split` fits that lag against what one front end adds per second of a token's host time
(`frontend.front_end_reads` of the one request: the formula predict reads first tokens with), with an
intercept (the per-request part, which the request overhead carries), and keeps the slope when it is
at least twice its standard error over 3 lengths or more (docs/cost-model.md, the calibrate section)."""

from __future__ import annotations

from agentkv.calib.frontend import front_end_reads, line_fit
from agentkv.calib.probes import Prober
from agentkv.calib.streamlag import TTFT_METRIC, lag_points, scrape, server_delta

SPLIT_LENGTHS = (64, 1024, 2048, 4096)  # prompt tokens, one prompt of each a round
SPLIT_ROUNDS = 4
SPLIT_NEW = 64  # fresh tokens after a cached prefix of the rest (bench's turns mostly hit the cache)
SPLIT_OUT = 16  # tokens asked: a stream, as bench's
# vLLM's engine-core part of its TTFT (queued to scheduled, scheduled to first token): kept beside it
ENGINE_METRICS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")


def split_lengths(max_len: int) -> tuple[int, ...]:
    """SPLIT_LENGTHS that fit half the model length (the shortest always)."""
    return tuple(n for n in SPLIT_LENGTHS if n <= max_len // 2) or SPLIT_LENGTHS[:1]


def after_engine_s(per_token_s: float, tokens: int) -> float:
    """Seconds one request's first token is read after the engine made it, alone at the front end:
    ONE formula for the split's fit and predict's reads (`front_end_reads`)."""
    return front_end_reads([(0, 0.0, tokens)], per_token_s)[0]


class SplitLag:
    """Per prompt length: client TTFTs (wall seconds) and the server's own TTFT of the same prompt
    (wall seconds; None where /metrics did not isolate it), one sample per length a round."""

    def __init__(self, max_len: int, rounds: int = SPLIT_ROUNDS):
        self.lengths, self.rounds = split_lengths(max_len), rounds
        self.client: dict[int, list[float]] = {n: [] for n in self.lengths}
        self.server: dict[int, list[float | None]] = {n: [] for n in self.lengths}
        self.engine: dict[int, list[float | None]] = {n: [] for n in self.lengths}
        self.metrics = True  # False once a round found no /metrics: the probe stops

    @property
    def done(self) -> bool:
        return not self.metrics or len(self.client[self.lengths[-1]]) >= self.rounds

    @property
    def ttft(self) -> dict[int, list[float]]:
        """Keyed as the other extras' (`probes.extra_pairs` reads `ttft[1]`'s length)."""
        return {1: self.client[self.lengths[-1]]}

    async def pair(self, prober: Prober) -> None:
        """One round: each length's prompt once (a prefix of all but SPLIT_NEW tokens warmed first),
        between two scrapes of /metrics."""
        for n in self.lengths:
            pre = prober._ids(n - SPLIT_NEW) if n > SPLIT_NEW else []
            if pre:
                await prober._send(pre, 1)
            names = (TTFT_METRIC, *ENGINE_METRICS)
            before = await scrape(prober, names)
            if before is None:
                self.metrics = False
                return
            res = await prober._timed(lambda n=n, pre=pre: pre + prober._ids(min(n, SPLIT_NEW)), SPLIT_OUT)
            after = await scrape(prober, names)
            server = server_delta(before, after)
            eng = [server_delta(before, after, m) for m in ENGINE_METRICS]
            self.client[n].append(prober._first_token_s(res))
            self.server[n].append(None if server is None else server / prober.scale)
            self.engine[n].append(None if None in eng else sum(eng) / prober.scale)

    def result(self) -> dict:
        """The samples as the profile keeps them (`fit.front_end_split`)."""
        return {
            "lengths": list(self.lengths),
            "new": SPLIT_NEW,
            "out": SPLIT_OUT,
            "client_ttft_s": {str(n): v for n, v in self.client.items()},
            "server_ttft_s": {str(n): v for n, v in self.server.items()},
            "engine_ttft_s": {str(n): v for n, v in self.engine.items()},
        }


def split_points(doc: dict) -> list[tuple[int, float]]:
    """(prompt tokens, client TTFT less the server's) for every sample /metrics isolated."""
    return [(int(n), lag) for n, lag in lag_points(doc)]


def fit_split(doc: dict, fallback_s: float) -> dict | None:
    """The front end's rate from the split, as `frontend.robust_front_end`'s doc (all of it after the
    engine): the slope of `split_points` against `after_engine_s(1, tokens)` with an intercept, kept
    when at least twice its standard error over 3 lengths or more, else `fallback_s` (the single
    probes' per-prompt-token time); None without a sample (no /metrics: the curve's fit stands)."""
    pts = [(after_engine_s(1.0, n), y) for n, y in split_points(doc)]
    if not pts:
        return None
    slope, se, icpt = line_fit(pts)
    resolved = se is not None and len({x for x, _ in pts}) >= 3 and slope > 2 * se
    return {
        "token_s": slope if resolved else max(0.0, fallback_s),
        "before_engine": 0.0,
        "source": "split" if resolved else "prompt_token_s (split not resolved)",
        "split_token_s": slope,
        "split_stderr_s": se,
        "split_lag_at_0_s": icpt,
        "split_points": len(pts),
    }
