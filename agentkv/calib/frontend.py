"""The front end under concurrency: host time per prompt token that concurrent requests queue for.

A one-process API server (vLLM's) handles each request's prompt on one thread, before the engine
sees it and again when its first token goes out; requests sent together wait for each other's
share. calibrate times 1, 2 and 4 streams of a long cached prefix plus a few fresh tokens sent
together (`FrontEndCurve`, the engine's part small), fits the seconds per prompt token of that
queue (`fit_front_end`), and predict reads each streamed first token through the same queue
(`front_end_reads`): one formula for fit and use (docs/cost-model.md, the live vLLM section)."""

from __future__ import annotations

import asyncio
import statistics

from agentkv.calib.probes import PILOT_OUT, Prober

CURVE_STREAMS = (1, 2, 4)  # streams sent together, per round
CURVE_ROUNDS = 3
CURVE_NEW = 16  # fresh tokens after the cached prefix: one short prefill step for the engine
CURVE_MAX_PAST = 4096


def curve_past(max_model_len: int, block_size: int) -> int:
    """The cached prefix of the curve's prompts: long (host time grows with the prompt), at most
    half the model length, a whole number of blocks."""
    return max(block_size, min(CURVE_MAX_PAST, max_model_len // 2) // block_size * block_size)


def front_end_reads(firsts: list[tuple[object, float, int]], per_token_s: float) -> dict[object, float]:
    """When the client reads each first token: (key, engine's first token, prompt tokens) in, key ->
    read time out. One front end takes first tokens in the order the engine made them, each
    `per_token_s` x its prompt tokens, the next one starting when it is free (FIFO)."""
    out: dict[object, float] = {}
    free = float("-inf")
    for key, first, tokens in sorted(firsts, key=lambda x: x[1]):
        free = out[key] = max(first, free) + per_token_s * tokens
    return out


class FrontEndCurve:
    """Client TTFTs of `n` (CURVE_STREAMS) streams of a `past`-token cached prefix plus CURVE_NEW
    fresh tokens each, sent together, one round of every `n` at a time (calibrate spreads the rounds
    over its run, as `FirstTokenLag`'s pairs). Each round warms a fresh prefix once."""

    def __init__(self, past: int, rounds: int = CURVE_ROUNDS):
        self.past, self.rounds = past, rounds
        self.ttft: dict[int, list[float]] = {n: [] for n in CURVE_STREAMS}

    @property
    def done(self) -> bool:
        return len(self.ttft[CURVE_STREAMS[-1]]) >= self.rounds

    async def pair(self, prober: Prober) -> None:
        """One round: a prefix warmed, then each `n`'s streams sent together (mean wall TTFT kept)."""
        pre = prober._ids(self.past)
        await prober._send(pre, 1)
        for n in CURVE_STREAMS:
            res = await asyncio.gather(
                *(prober._send(pre + prober._ids(CURVE_NEW), PILOT_OUT) for _ in range(n))
            )
            self.ttft[n].append(statistics.fmean(prober._first_token_s(r) for r in res))

    def result(self) -> dict:
        """The samples as the profile keeps them (`fit.front_end_ttft_s`)."""
        return {"past": self.past, "new": CURVE_NEW, "ttft_s": {str(n): v for n, v in self.ttft.items()}}


def fit_front_end(curve: dict, step_s, request_s: float, time_scale: float) -> float | None:
    """Wall seconds per prompt token of the front end's queue (>= 0), None without two rounds'
    worth: the least-squares slope, through zero, of each `n`'s mean TTFT less the one-stream one
    (per round, the median over rounds) against what `front_end_reads` adds per second of it, after
    taking off what else `n` streams add: the engine's longer step (`step_s(n)`, engine seconds of
    the step prefilling `n` of them) and predict's arrival queue (`request_s` per request ahead)."""
    tt = {int(n): v for n, v in curve.get("ttft_s", {}).items()}
    one, tokens = tt.get(1) or [], curve["past"] + curve["new"]
    xs, ys = [], []
    for n, v in tt.items():
        k = min(len(v), len(one))
        if n == 1 or k == 0:
            continue
        d = statistics.median(v[i] - one[i] for i in range(k))
        d -= (step_s(n) - step_s(1)) / time_scale + request_s * (n - 1) / 2
        reads = front_end_reads([(i, 0.0, tokens) for i in range(n)], 1.0)
        xs.append(statistics.fmean(reads.values()) - tokens)  # a lone stream's share is prompt_token_s
        ys.append(d)
    den = sum(x * x for x in xs)
    return max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / den) if den else None
