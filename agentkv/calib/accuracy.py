"""Prediction against measurement: per-request rows, then MAPE, signed bias and error quantiles
overall, per session and per input-length bucket, the hit-rate and throughput differences."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from agentkv.calib.replay import Predicted
from agentkv.metrics.records import RequestRecord

FIGURES = ("ttft", "tpot", "e2e")
READ_APART_S = 0.001  # chunks closer than this were read as one (no engine step is this short here)
# tokens a read, on average, from which a stream counts as merged: its TPOT measures delivery, not
# steps (a live vLLM run read every stream's first two tokens together: one merged read is common)
MERGED_PER_READ = 2.0
BUCKET_EDGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def row(
    r: RequestRecord, p: Predicted, overhead_s: float, first_token_s: float = 0.0, after_s: float = 0.0
) -> dict:
    """One predictions.jsonl line: the measured figures beside the predicted ones (seconds).

    Latencies count as bench counted them: from the due time on the client's clock, or from the
    engine's arrival when the target stamped its own times (`clock` engine). On the client's clock
    the first token is read `after_s` (host time per prompt token, read after the engine's first
    token) later, and a stream that decodes on reads it `first_token_s` later still (the profile's
    first-token delay): TTFT gains both; TPOT loses `after_s` (the end moves only when the stream
    would end before its first token is read), while the delay moves the whole stream, its end too
    (the live vLLM bench's streams do not catch it up: docs/cost-model.md)."""
    start = p.arrival if r.clock == "engine" else r.scheduled
    first, end = p.first_token, p.end
    if r.clock != "engine":
        late = first_token_s if p.output_tokens > 1 else 0.0
        end = max(p.end, p.first_token + after_s) + late
        first = min(p.first_token + after_s + late, end)
    tpot = (end - first) / (p.output_tokens - 1) if p.output_tokens > 1 else None
    return {
        "id": r.id,
        "trace": r.trace,
        "session": r.session,
        "index": r.index,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "sent": r.sent,
        "ttft": r.ttft,
        "ttft_pred": first - start,
        "tpot": r.tpot,
        "tpot_pred": tpot,
        "e2e": r.e2e,
        "e2e_pred": end - start,
        "end": r.end,
        "end_pred": end,
        "cached_tokens": r.cached_tokens,
        "cached_tokens_pred": p.cached_tokens,
        "overhead_s": overhead_s,
        "chunks": chunks(r),
        "reads": (n := chunks(r, READ_APART_S)),
        "merged": n is not None and r.output_tokens >= MERGED_PER_READ * max(n, 1),
    }


def chunks(r: RequestRecord, apart_s: float = 0.0) -> int | None:
    """How many reads delivered the request's output: its stream's chunks that carried output, a
    chunk less than `apart_s` after the one before counted with it (a client read burst); None for a
    record kept before bench stored every gap. Reads of `MERGED_PER_READ` tokens or more on average: merged (issue 17)."""
    if r.output_tokens < 1:
        return 0
    if not r.itls and r.itl_max is not None:
        return None  # gaps measured but not kept: an older record
    return 1 + sum(g >= apart_s for g in r.itls)


def delivery(x: dict) -> str:
    """Whether a request's stream carried one token a chunk or merged several into a chunk."""
    return "merged chunks" if x.get("merged") else "one token a chunk"


def errors(rows: list[dict], fig: str) -> dict | None:
    """MAPE, signed bias (mean signed % error) and |error| quantiles of `fig` over `rows`."""
    pairs = [(x[fig], x[f"{fig}_pred"]) for x in rows if x[fig] and x[f"{fig}_pred"] is not None]
    if not pairs:
        return None
    m = np.array([a for a, _ in pairs])
    e = (np.array([b for _, b in pairs]) / m - 1.0) * 100.0
    a = np.abs(e)
    return {
        "n": len(pairs),
        "mape_pct": round(float(a.mean()), 2),
        "bias_pct": round(float(e.mean()), 2),
        "median_pct": round(float(np.median(e)), 2),
        "abs_p50_pct": round(float(np.percentile(a, 50)), 2),
        "abs_p90_pct": round(float(np.percentile(a, 90)), 2),
        "abs_max_pct": round(float(a.max()), 2),
    }


def bucket(n: int) -> str:
    """The input-length bucket of an `n`-token prompt: '<1K', '1K-2K', ..., '>=128K'."""
    lo = 0
    for hi in BUCKET_EDGES:
        if n < hi:
            return f"<{hi // 1024}K" if lo == 0 else f"{lo // 1024}K-{hi // 1024}K"
        lo = hi
    return f">={lo // 1024}K"


def _group(rows: list[dict], key) -> dict[str, dict]:
    """Per `key(row)` (or per label of a list `key` aligned with `rows`; in first-seen order), the
    request count and each figure's errors."""
    by: dict[str, list[dict]] = {}
    for x, k in zip(rows, [key(x) for x in rows] if callable(key) else key, strict=True):
        by.setdefault(k, []).append(x)
    return {k: {"requests": len(v)} | {f: errors(v, f) for f in FIGURES} for k, v in by.items()}


def position(x: dict) -> str:
    """A request's place in its session: its first turn (cold prompt) or a later one."""
    return "first turn" if not x.get("index") else "later turn"


def beside_prefill(rows: list[dict]) -> list[str]:
    """Per row, whether another request's prefill (its start to its measured first token) ran while
    this one decoded (its first token to its end), on the measured times: which steps TPOT saw.
    One sweep over the rows by start (a bench has thousands), not a scan of every pair."""
    spans = [
        (x["end"] - x["e2e"], x["end"] - x["e2e"] + x["ttft"], x["end"])
        if x.get("ttft") is not None and x.get("e2e") is not None
        else None
        for x in rows
    ]
    order = sorted((i for i, s in enumerate(spans) if s is not None), key=lambda i: spans[i][0])
    starts = [spans[i][0] for i in order]
    tops: list[tuple[float, int, float]] = []  # per prefix of `order`: latest first token, its row, the next
    top, owner, second = float("-inf"), -1, float("-inf")
    for i in order:
        first = spans[i][1]
        if first > top:
            top, owner, second = first, i, top
        elif first > second:
            second = first
        tops.append((top, owner, second))
    out = []
    for i, a in enumerate(spans):
        k = bisect_left(starts, a[2]) if a is not None else 0  # rows started before this one ended
        hit = False
        if k:
            top, owner, second = tops[k - 1]
            hit = (second if owner == i else top) > a[1]  # another's prefill still ran past its first token
        out.append("decode beside prefill" if hit else "decode alone")
    return out


def hit_rates(rows: list[dict]) -> dict:
    """Prompt-token hit rates, measured (usage cached_tokens) and predicted, and their difference."""
    tokens = sum(x["input_tokens"] for x in rows)
    reported = [x["cached_tokens"] for x in rows if x["cached_tokens"] is not None]
    meas = sum(reported) / tokens if reported and tokens else None
    pred = sum(x["cached_tokens_pred"] for x in rows) / tokens if tokens else None
    diff = None if meas is None or pred is None else round((pred - meas) * 100, 3)
    return {"measured": meas, "predicted": pred, "diff_points": diff}


def throughput(rows: list[dict]) -> dict:
    """Output tokens per second from the first send to the last end, measured and predicted."""
    t0 = min(x["sent"] for x in rows)
    toks = sum(x["output_tokens"] for x in rows)
    meas = toks / max(max(x["end"] for x in rows) - t0, 1e-9)
    pred = toks / max(max(x["end_pred"] for x in rows) - t0, 1e-9)
    return {
        "output_tokens_per_s": meas,
        "output_tokens_per_s_pred": pred,
        "diff_pct": round((pred / meas - 1) * 100, 2),
    }


def accuracy(rows: list[dict]) -> dict:
    """prediction.json's figures: overall, per session, per input-length bucket, per turn position and
    per decode beside / without another prefill, hits and throughput."""
    return {
        "requests": len(rows),
        "overall": {f: errors(rows, f) for f in FIGURES},
        "hit_rate": hit_rates(rows),
        "throughput": throughput(rows),
        "by_input_len": _group(
            sorted(rows, key=lambda x: x["input_tokens"]), lambda x: bucket(x["input_tokens"])
        ),
        "by_session": _group(rows, lambda x: x["session"]),
        "by_position": _group(rows, position),
        "by_overlap": _group(rows, beside_prefill(rows)),
        "by_delivery": _group(rows, delivery),  # MAPE without the merged streams, never dropped
        "merged_requests": sum(bool(x.get("merged")) for x in rows),
    }


def _as_predicted(rows: list[dict], fig: str, others: list[dict[int, dict]]) -> list[dict]:
    """`rows` with `fig`'s prediction replaced by the mean of the same request's `fig` in `others`
    (None where no other run measured it)."""
    out = []
    for x in rows:
        vals = [b[x["id"]][fig] for b in others if x["id"] in b and b[x["id"]][fig] is not None]
        out.append(x | {f"{fig}_pred": float(np.mean(vals)) if vals else None})
    return out


def repeatability(runs: list[list[dict]]) -> dict:
    """How well live runs of one plan predict one another (the host's own noise floor, issue 17): per
    figure, the MAPE of every ordered pair of runs (one's measurement as the other's prediction)
    and, per run, the MAPE of the per-request mean of the other runs' measurements (the best a
    deterministic prediction could do on this host) beside the model's. Requests match by id."""
    if len(runs) < 2:
        raise ValueError(f"repeatability needs two runs of the same plan or more, got {len(runs)}")
    by_id = [{x["id"]: x for x in rows} for rows in runs]
    out: dict[str, dict] = {}
    for fig in FIGURES:
        pairs = [
            errors(_as_predicted(rows, fig, [b]), fig)
            for i, rows in enumerate(runs)
            for j, b in enumerate(by_id)
            if i != j
        ]
        mapes = [p["mape_pct"] for p in pairs if p is not None]
        floor = [
            errors(_as_predicted(rows, fig, by_id[:i] + by_id[i + 1 :]), fig) for i, rows in enumerate(runs)
        ]
        model = [errors(rows, fig) for rows in runs]
        out[fig] = {
            "pair_mape_pct": {"median": float(np.median(mapes)), "min": min(mapes), "max": max(mapes)}
            if mapes
            else None,
            "floor_mape_pct": [f and f["mape_pct"] for f in floor],
            "model_mape_pct": [m and m["mape_pct"] for m in model],
        }
    return out
