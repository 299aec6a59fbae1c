"""The front end under concurrency: host time per prompt token that concurrent requests queue for.

A one-process API server (vLLM's) handles each request's prompt on one thread, before the engine
sees it and again when its first token goes out; requests sent together wait for each other's
share. calibrate times 1, 2 and 4 streams of a long cached prefix plus a few fresh tokens sent
together (`FrontEndCurve`, the engine's part small), fits the seconds per prompt token of that
queue and the share of it spent before the engine sees a request (`fit_front_end`: the first
token waits for all of it, the stream's end only for that share), and predict queues that share
before the engine (`replay.arrivals`) and reads each streamed first token through a queue of the
rest (`front_end_reads`): one formula for fit and use (docs/cost-model.md, the live vLLM section)."""

from __future__ import annotations

import asyncio
import math
import statistics

from agentkv.calib.probes import Prober

CURVE_STREAMS = (1, 2, 4)  # streams sent together, per round
CURVE_ROUNDS = 3
CURVE_NEW = 16  # fresh tokens after the cached prefix: one short prefill step for the engine
CURVE_MAX_PAST = 4096
# tokens asked: enough decode steps after the first token for a stream to catch up a first token
# read late (with 4, ~12 ms of steps against ~15 ms of host time a 4K-token request, vLLM's ends
# were as late as their first tokens and the fit put all of it before the engine)
CURVE_OUT = 16


def curve_past(max_model_len: int, block_size: int) -> int:
    """The cached prefix of the curve's prompts: long (host time grows with the prompt), at most
    half the model length, a whole number of blocks."""
    return max(block_size, min(CURVE_MAX_PAST, max_model_len // 2) // block_size * block_size)


def front_end_reads(firsts: list[tuple[object, float, int]], per_token_s: float) -> dict[object, float]:
    """When the client reads each first token: (key, engine's first token, prompt tokens) in, key ->
    read time out. One front end takes the first tokens of one engine step as one batch, in the
    order the engine made them, `per_token_s` x their prompt tokens, the batch starting when it is
    free (FIFO) and every token of it read at its end (the live vLLM bench: three first tokens of
    one step read together, 70 ms after the one before them)."""
    out: dict[object, float] = {}
    free = float("-inf")
    steps: dict[float, list[tuple[object, int]]] = {}
    for key, first, tokens in firsts:
        steps.setdefault(first, []).append((key, tokens))
    for first in sorted(steps):
        free = max(first, free) + per_token_s * sum(t for _, t in steps[first])
        out |= dict.fromkeys((k for k, _ in steps[first]), free)
    return out


class FrontEndCurve:
    """Client TTFTs of `n` (CURVE_STREAMS) streams of a `past`-token cached prefix plus CURVE_NEW
    fresh tokens each (CURVE_OUT tokens asked), sent together, one round of every `n` at a time (calibrate spreads the rounds
    over its run, as `FirstTokenLag`'s pairs). Each round warms a fresh prefix once."""

    def __init__(self, past: int, rounds: int = CURVE_ROUNDS):
        self.past, self.rounds = past, rounds
        self.ttft: dict[int, list[float]] = {n: [] for n in CURVE_STREAMS}
        self.e2e: dict[int, list[float]] = {n: [] for n in CURVE_STREAMS}

    @property
    def done(self) -> bool:
        return len(self.ttft[CURVE_STREAMS[-1]]) >= self.rounds

    async def pair(self, prober: Prober) -> None:
        """One round: a prefix warmed, then each `n`'s streams sent together (mean wall TTFT and
        end kept)."""
        pre = prober._ids(self.past)
        await prober._send(pre, 1)
        for n in CURVE_STREAMS:
            res = await asyncio.gather(
                *(prober._send(pre + prober._ids(CURVE_NEW), CURVE_OUT) for _ in range(n))
            )
            self.ttft[n].append(statistics.fmean(prober._first_token_s(r) for r in res))
            self.e2e[n].append(statistics.fmean(r.token_times[-1] - r.sent for r in res))

    def result(self) -> dict:
        """The samples as the profile keeps them (`fit.front_end_ttft_s`)."""
        return {
            "past": self.past,
            "new": CURVE_NEW,
            "out": CURVE_OUT,
            "ttft_s": {str(n): v for n, v in self.ttft.items()},
            "e2e_s": {str(n): v for n, v in self.e2e.items()},
        }


def _diffs(curve: dict, key: str) -> dict[int, list[float]]:
    """Per `n` > 1, every round's `n` streams' mean `key` ('ttft_s' or 'e2e_s') less the one stream's
    of the same round."""
    tt = {int(n): v for n, v in (curve.get(key) or {}).items()}
    one = tt.get(1) or []
    return {n: [v[i] - one[i] for i in range(min(len(v), len(one)))] for n, v in tt.items() if n > 1}


def _queued(n: int, tokens: int) -> float:
    """Seconds the front end's queue adds at 1 s a token to `n` streams of `tokens`, beyond one stream's."""
    return statistics.fmean(front_end_reads([(i, 0.0, tokens) for i in range(n)], 1.0).values()) - tokens


def _excess(curve: dict, key: str, engine_s, request_s: float, time_scale: float) -> dict[int, float]:
    """Per `n` > 1, the median over rounds of `_diffs`, less what else `n` streams add: the engine's
    (`engine_s(n)`, engine seconds) and predict's arrival queue (`request_s` per request ahead)."""
    out = {}
    for n, d in _diffs(curve, key).items():
        if d:
            out[n] = statistics.median(d) - (engine_s(n) - engine_s(1)) / time_scale - request_s * (n - 1) / 2
    return out


def _points(curve: dict, engine_s, request_s: float, time_scale: float) -> list[tuple[float, float]]:
    """Every round's (`_queued`; its `_diffs` TTFT less the engine's and the arrival queue's share)."""
    tokens, out = curve["past"] + curve["new"], []
    for n, d in _diffs(curve, "ttft_s").items():
        x, more = _queued(n, tokens), (engine_s(n)[0] - engine_s(1)[0]) / time_scale + request_s * (n - 1) / 2
        out += [(x, y - more) for y in d]
    return out


def robust_front_end(curve: dict, engine_s, request_s: float, time_scale: float, fallback_s: float) -> dict:
    """The front end's rate and share as the profile keeps them, with the curve's own slope and its
    standard error over every round: the curve's fit (`fit_front_end`) when its slope is at least
    twice its standard error over 3 points or more, else `fallback_s` (the per-prompt-token host time
    the single-request probes measured), all after the engine's first token (issue 17: on a busy
    host the curve's rounds scatter more than the queue adds, and a clipped 0 dropped that time)."""
    pts = _points(curve, engine_s, request_s, time_scale)
    slope, se = _slope(pts), None
    if slope is not None and len(pts) > 1:
        den = sum(x * x for x, _ in pts)
        se = math.sqrt(sum((y - slope * x) ** 2 for x, y in pts) / (len(pts) - 1) / den)
    fit = fit_front_end(curve, engine_s, request_s, time_scale)
    resolved = fit is not None and se is not None and len(pts) >= 3 and slope > 2 * se
    token_s, share = fit if resolved else (max(0.0, fallback_s), 0.0)
    return {
        "token_s": token_s,
        "before_engine": share,
        "source": "curve" if resolved else "prompt_token_s (curve not resolved)",
        "curve_token_s": slope,
        "curve_stderr_s": se,
        "curve_points": len(pts),
    }


def line_fit(pts: list[tuple[float, float]]) -> tuple[float | None, float | None, float | None]:
    """Least-squares line with an intercept through (x, y) points: (slope, its standard error,
    intercept); None where two distinct x (the slope) or three points (its error) are missing."""
    if len({x for x, _ in pts}) < 2:
        return None, None, None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    icpt = my - slope * mx
    if len(pts) < 3:
        return slope, None, icpt
    return slope, math.sqrt(sum((y - icpt - slope * x) ** 2 for x, y in pts) / (len(pts) - 2) / sxx), icpt


def _slope(pts: list[tuple[float, float]]) -> float | None:
    """Least-squares slope through zero of (x, y) points; None without any x."""
    den = sum(x * x for x, _ in pts)
    return sum(x * y for x, y in pts) / den if den else None


def fit_front_end(curve: dict, engine_s, request_s: float, time_scale: float) -> tuple[float, float] | None:
    """(Wall seconds per prompt token of the front end's queue, >= 0; the share of it before the
    engine, 0-1) from `FrontEndCurve.result()`, None without a round of two streams or more. The
    first is the slope of `n` streams' extra TTFT (`_excess`) against what `front_end_reads` adds
    per second of it; the share is the slope of their extra end (the first token's late reading is
    caught up by the stream's end, host time before the engine is not) against that TTFT's.
    `engine_s(n)`: engine seconds of `n` such streams together, (to the first token, to the end)."""
    tokens = curve["past"] + curve["new"]
    ttft = _excess(curve, "ttft_s", lambda n: engine_s(n)[0], request_s, time_scale)
    e2e = _excess(curve, "e2e_s", lambda n: engine_s(n)[1], request_s, time_scale)

    per_token = _slope([(_queued(n, tokens), y) for n, y in ttft.items()])
    if per_token is None:
        return None
    per_token = max(0.0, per_token)
    share = _slope([(per_token * _queued(n, tokens), e2e[n]) for n in ttft if n in e2e])
    return per_token, min(1.0, max(0.0, share or 0.0))
