"""Which traces a run replays: sessions over a context window dropped or trimmed, then the first N
or a seeded sample (`--max-context`, `--over-context`, `--traces-limit`, `--sample`).

Each step returns the traces it keeps and a one-line note for the summary and the terminal.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from agentkv.errors import UserError
from agentkv.trace.model import Request, Session, Trace

OVER_CONTEXT = ("drop", "trim", "keep")
MAX_TRACE_BLOCK_SIZE = 1 << 20  # tokens per hash id; a larger one is a typo, not a trace


def parse_trace_block_size(text: str | int | None) -> int | None:
    """`--trace-block-size`: a positive int up to MAX_TRACE_BLOCK_SIZE, or None (the format's own)."""
    if text is None:
        return None
    try:
        v = int(str(text).strip())
    except ValueError:
        raise UserError(f"--trace-block-size: expected a number of tokens, got {text!r}") from None
    if not 1 <= v <= MAX_TRACE_BLOCK_SIZE:
        raise UserError(f"--trace-block-size: must be between 1 and {MAX_TRACE_BLOCK_SIZE:,} tokens, got {v}")
    return v


def request_len(r: Request) -> int:
    """Tokens the request needs in the window: its prompt plus the max_tokens bench asks for (vLLM
    refuses a request whose prompt + max_tokens exceeds max_model_len)."""
    return r.input_tokens + max(1, r.output_tokens)


def _count(s: Session) -> int:
    return len(s.requests) + sum(_count(c) for c in s.subagents)


def _fits(s: Session, limit: int) -> bool:
    return all(request_len(r) <= limit for r in s.requests) and all(_fits(c, limit) for c in s.subagents)


def _trim(s: Session, limit: int) -> Session:
    """`s` cut before its first request over `limit`, without the sub-agents spawned from there on
    (their own over-limit tails trimmed the same way)."""
    cut = next((i for i, r in enumerate(s.requests) if request_len(r) > limit), None)
    reqs = s.requests if cut is None else s.requests[:cut]
    end = None if cut is None else s.requests[cut].t
    subs = [_trim(c, limit) for c in s.subagents if end is None or c.t < end]
    return msgspec.structs.replace(s, requests=reqs, subagents=[c for c in subs if _count(c)])


def _drop_requests(s: Session, limit: int) -> Session:
    """A timestamp-mode session (independent requests) without the ones over `limit`."""
    reqs = [r for r in s.requests if request_len(r) <= limit]
    return msgspec.structs.replace(
        s, requests=reqs, subagents=[_drop_requests(c, limit) for c in s.subagents]
    )


def fit_context(
    traces: Sequence[Trace], limit: int, policy: str = "drop", source: str = "--max-context"
) -> tuple[list[Trace], str | None]:
    """Drop (or trim, or only count with "keep") the session trees with a request over `limit` tokens.

    Timestamp-mode traces (Mooncake) hold independent requests: only the requests over it go.
    """
    if policy not in OVER_CONTEXT:
        raise UserError(f"--over-context: expected one of {', '.join(OVER_CONTEXT)}, got {policy!r}")
    kept: list[Trace] = []
    over = trimmed = lost = 0
    total = sum(t.num_requests for t in traces)
    for t in traces:
        if _fits(t.session, limit):
            kept.append(t)
            continue
        over += 1
        if policy == "keep":
            kept.append(t)
            continue
        if t.replay == "timestamp":
            s = _drop_requests(t.session, limit)
        else:
            s = _trim(t.session, limit) if policy == "trim" else Session(id=t.session.id)
        lost += t.num_requests - _count(s)
        if _count(s):
            kept.append(msgspec.structs.replace(t, session=s))
            trimmed += 1
    if not over:
        return kept, None
    what = f"{source} {limit:,} tokens (prompt + max_tokens)"
    if policy == "keep":
        return (
            kept,
            f"{what}: {over} of {len(traces)} session trees have requests over it (kept; they may fail)",
        )
    dropped = over - trimmed
    note = f"{what}, --over-context {policy}: {lost:,} of {total:,} requests removed"
    note += f"; {dropped} of {len(traces)} session trees dropped" if dropped else ""
    note += f"; {trimmed} trimmed" if trimmed else ""
    if not kept:
        raise UserError(f"{note}: nothing left to replay (raise --max-context, or --over-context trim)")
    return kept, note


def pick(
    traces: Sequence[Trace], *, sample: int | None = None, limit: int | None = None, seed: int = 0
) -> tuple[list[Trace], str | None]:
    """The first `limit` traces, or a seeded random `sample` of them (kept in load order)."""
    n = len(traces)
    if sample is not None and limit is not None:
        raise UserError("--sample and --traces-limit: pick one (a random sample, or the first N)")
    for flag, v in (("--sample", sample), ("--traces-limit", limit)):
        if v is not None and v < 1:
            raise UserError(f"{flag}: must be at least 1, got {v}")
    if limit is not None:
        return list(traces[:limit]), (f"--traces-limit {limit}: the first {min(limit, n)} of {n} traces")
    if sample is None:
        return list(traces), None
    if sample > n:
        raise UserError(f"--sample {sample}: the set holds only {n} traces (sample at most {n})")
    idx = sorted(random.Random(f"agentkv-sample-{seed}").sample(range(n), sample))
    out = [traces[i] for i in idx]
    ids = ", ".join(t.id for t in out[:8]) + (", ..." if sample > 8 else "")
    return out, f"--sample {sample}: a random sample (seed {seed}) of {n} traces: {ids}"
