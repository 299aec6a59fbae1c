"""Whether a run's figures can be trusted: the validity rules, the top errors, cache contamination.

A run is valid when its failures stay within a rate (default 1%) and no request overflowed the
target's context; hit rates above the ceiling mean the cache held this run's prompts already.
"""

from __future__ import annotations

import re
from collections import Counter

import msgspec

from agentkv.metrics.records import RequestRecord

DEFAULT_MAX_FAILURE_RATE = 0.01  # above this share of failed requests the run is invalid (AgentX: 1%)
CONTAMINATION_TOLERANCE = 0.02  # hits this far above the ceiling (a fraction) flag contamination
TOP_ERRORS = 5
EXIT_INVALID = 3  # the exit status of a run that finished but is invalid (bench and simulate)
_MESSAGE_KEYS = ("message", "detail", "msg")
_PARTIAL = re.compile(r'"(?:message|detail|msg)"\s*:\s*"((?:[^"\\]|\\.)*)')  # in a body cut short
_NUMBER = re.compile(r"\d+")


class ErrorGroup(msgspec.Struct, omit_defaults=True):
    """Failed requests with one reason, HTTP status and message (numbers in it aside), and a hint."""

    count: int
    error: str
    status: int = 0
    message: str = ""
    hint: str = ""  # what to try (filled by the application that knows its flags)


def _find_message(doc: object) -> str:
    """The message in a decoded error body: error.message, message, detail, msg (FastAPI lists too)."""
    if isinstance(doc, str):
        return doc
    if isinstance(doc, list):
        return "; ".join(m for m in (_find_message(x) for x in doc[:3]) if m)
    if not isinstance(doc, dict):
        return ""
    if "error" in doc and (m := _find_message(doc["error"])):
        return m
    for key in _MESSAGE_KEYS:
        if key in doc and (m := _find_message(doc[key])):
            return m
    return ""


def error_message(detail: str) -> str:
    """The readable message of an error body (JSON or text), on one line."""
    text = detail.strip()
    try:
        msg = _find_message(msgspec.json.decode(text))
    except msgspec.DecodeError:
        m = _PARTIAL.search(text)
        msg = m.group(1).replace('\\"', '"') if m else ""
    return " ".join((msg or text).split())


def top_errors(records: list[RequestRecord], n: int = TOP_ERRORS) -> list[ErrorGroup]:
    """The `n` most frequent (reason, status, message) of the failed requests, most frequent first."""
    counts: Counter[tuple[str, int, str]] = Counter()
    first: dict[tuple[str, int, str], str] = {}
    for r in records:
        if r.ok:
            continue
        msg = error_message(r.error_detail)
        key = (r.error or "unknown", r.http_status, _NUMBER.sub("N", msg))
        counts[key] += 1
        first.setdefault(key, msg)
    return [ErrorGroup(count=c, error=k[0], status=k[1], message=first[k]) for k, c in counts.most_common(n)]


def invalid_reasons(
    requests: int, failed: int, overflow: int, max_failure_rate: float = DEFAULT_MAX_FAILURE_RATE
) -> list[str]:
    """Why the run's figures cannot be trusted; empty when it is valid."""
    if not requests:
        return ["no request finished"]
    out = []
    if failed == requests:
        out.append(f"no request succeeded (all {requests} failed)")
    elif failed / requests > max_failure_rate:
        out.append(
            f"{failed} of {requests} requests failed ({failed / requests:.1%} > the "
            f"{max_failure_rate:.1%} allowed by --max-failure-rate)"
        )
    if overflow:
        out.append(
            f"context overflow on {overflow} of {requests} requests: prompts longer than the target's "
            "context window"
        )
    return out


def excess(rate: float | None, ceiling: float | None) -> float | None:
    """How far `rate` exceeds the ceiling, when by more than the tolerance; else None."""
    if rate is None or ceiling is None or rate - ceiling <= CONTAMINATION_TOLERANCE:
        return None
    return rate - ceiling


def contamination_note(reported: float | None, metrics: float | None, ceiling: float) -> str:
    """The note of a run whose hits exceed its ceiling (either excess given, as fractions)."""
    over = []
    if reported is not None:
        over.append(f"reported hits {ceiling + reported:.1%}")
    if metrics is not None:
        over.append(f"server-metric hits {ceiling + metrics:.1%}")
    gap = max(x for x in (reported, metrics) if x is not None)
    return (
        f"cache contaminated by an earlier run or other clients: {' and '.join(over)} exceed the "
        f"ceiling {ceiling:.1%} (by up to {gap * 100:.1f} points), more than an unbounded cache could "
        "serve from this run's own prompts; the hit rates do not measure this run (cache-busting, the "
        "default, avoids earlier runs; a server no one else uses avoids other clients)"
    )


def invalid_line(summary) -> str:
    """The one stderr line bench and simulate print for an invalid run (outputs are written)."""
    return f"agentkv: invalid run: {summary.invalid_reason} (outputs written; exit {EXIT_INVALID})"
