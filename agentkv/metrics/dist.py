"""Latency distributions: count, mean, standard deviation and the requested percentiles, keyed as
vLLM's `bench serve` spells them (p50, p99.9), so one summary serves the terminal, report and exports."""

from __future__ import annotations

import msgspec
import numpy as np

from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


def pct_key(p: float) -> str:
    """The key of percentile `p` as vLLM spells it: 50 -> "p50", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p) == int(p) else f"p{p:g}"


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    """`50,90,99.9` -> (50.0, 90.0, 99.9), sorted and unique; UserError outside (0, 100]."""
    if text is None or not str(text).strip():
        return DEFAULT_PERCENTILES
    out = set()
    for part in str(text).split(","):
        try:
            v = float(part.strip().lower().removeprefix("p"))
        except ValueError:
            raise UserError(
                f"--percentiles: expected numbers such as 50,90,99.9, got {part.strip()!r}"
            ) from None
        if not 0 < v <= 100:
            raise UserError(f"--percentiles: {part.strip()} is outside (0, 100]")
        out.add(v)
    return tuple(sorted(out))


class Dist(msgspec.Struct, omit_defaults=True):
    """A distribution in seconds (or tokens): count, mean, standard deviation and percentiles.
    p50/p90/p99 are always there (the terminal's compact set); `percentiles` holds every requested
    one, keyed as vLLM spells them ("p50", "p99.9")."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    std: float | None = None
    min: float | None = None
    percentiles: dict[str, float] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, values, percentiles=DEFAULT_PERCENTILES) -> Dist:
        a = np.asarray([v for v in values if v is not None], dtype=float)
        if a.size == 0:
            return cls()
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        ps = np.percentile(a, list(percentiles)) if percentiles else []
        return cls(
            int(a.size),
            float(a.mean()),
            float(p50),
            float(p90),
            float(p99),
            float(a.max()),
            float(a.std()),
            float(a.min()),
            {pct_key(p): float(v) for p, v in zip(percentiles, ps, strict=True)},
        )


def latency_dists(ok: list[RequestRecord], itl_values, percentiles=DEFAULT_PERCENTILES) -> dict[str, Dist]:
    """TTFT, TPOT, ITL and E2E of the succeeded requests (ITL: every gap when given, else each
    request's longest)."""
    itl = itl_values if itl_values is not None else (r.itl_max for r in ok)
    return {
        "ttft": Dist.of((r.ttft for r in ok), percentiles),
        "tpot": Dist.of((r.tpot for r in ok), percentiles),
        "itl": Dist.of(itl, percentiles),
        "e2e": Dist.of((r.e2e for r in ok), percentiles),
    }
