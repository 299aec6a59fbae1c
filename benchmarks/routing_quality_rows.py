"""Routing quality's figures: one router's row, built from its bench summary, and how the rows print
(a line per run, the markdown table, JSON) in benchmarks/routing_quality.py."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True)
class Row:
    """One router's figures: hits against the oracle, latency, throughput and its own cost."""

    router: str
    prompts: str
    requests: int
    failed: int
    hit_rate: float
    oracle: float
    ttft_p50: float
    ttft_p99: float
    out_tok_s: float
    router_cpu_ms: float  # router CPU per replayed request
    added_p50_ms: float | None = None  # probe: time to first byte, via router - direct
    added_p99_ms: float | None = None
    predicted_hit: float | None = None  # our router: prompt tokens its index placed on the chosen worker
    catchup: float = 0.0  # engine time the workers skipped because the host fell behind --time-scale
    steady_hit: float = 0.0  # hit rate and oracle over the requests after the first --warmup (cold start)
    steady_oracle: float = 0.0

    @classmethod
    def from_summary(
        cls,
        router: str,
        prompts: str,
        s: dict,
        *,
        cpu_s: float,
        added: tuple[float | None, float | None],
        predicted: float | None,
        catchup: float,
        steady: tuple[float, float],
    ) -> Row:
        """The row of a bench summary.json and the figures measured around its replay."""
        tp = s.get("throughput") or {}
        return cls(
            router,
            prompts,
            s["requests"],
            s["failed"],
            s["cache"].get("reported") or 0.0,
            s["cache"].get("ceiling") or 0.0,
            s["ttft"].get("p50") or 0.0,
            s["ttft"].get("p99") or 0.0,
            tp.get("output_tokens_per_s", 0.0),
            cpu_s / max(1, s["requests"]) * 1e3,
            *added,
            predicted,
            catchup,
            *steady,
        )

    @property
    def of_oracle(self) -> float:
        return self.hit_rate / self.oracle if self.oracle else 0.0

    @property
    def steady_of_oracle(self) -> float:
        return self.steady_hit / self.steady_oracle if self.steady_oracle else 0.0


def steady(records: Path, warmup: int) -> tuple[float, float]:
    """(hit rate, oracle) over the requests after the first `warmup` by due time, when all lanes are warm."""
    recs = sorted((json.loads(line) for line in records.open()), key=lambda r: r["scheduled"])[warmup:]
    total = sum(r["input_tokens"] for r in recs if r.get("ok", True))
    if not total:
        return 0.0, 0.0
    hit = sum(r.get("cached_tokens") or 0 for r in recs if r.get("ok", True))
    return hit / total, sum(r.get("ceiling_tokens", 0) for r in recs if r.get("ok", True)) / total


def run_line(r: Row, wall: float, warmup: int) -> str:
    """The line printed as each router's run ends."""
    return (
        f"  {r.router}: {r.requests} requests in {wall:.0f} s wall, hit {r.hit_rate:.4f} of oracle "
        f"{r.oracle:.4f} ({r.of_oracle:.1%}); after the first {warmup}: {r.steady_hit:.4f} of "
        f"{r.steady_oracle:.4f} ({r.steady_of_oracle:.1%}); workers skipped {r.catchup:.0%} of engine time "
        f"(host behind)"
        + (f"; index predicted {r.predicted_hit:.1%} hits" if r.predicted_hit is not None else "")
    )


def table(rows: list[Row]) -> str:
    """The markdown table of all routers' rows."""
    head = (
        "router",
        "prompts",
        "requests",
        "failed",
        "hit rate",
        "oracle",
        "% of oracle",
        "after warm-up",
        "engine time skipped",
        "TTFT p50 s",
        "TTFT p99 s",
        "out tok/s",
        "router CPU ms/req",
        "added TTFB p50 / p99 ms",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        added = "-" if r.added_p50_ms is None else f"{r.added_p50_ms:+.1f} / {r.added_p99_ms:+.1f}"
        lines.append(
            f"| {r.router} | {r.prompts} | {r.requests} | {r.failed} | {r.hit_rate:.1%} | {r.oracle:.1%} | "
            f"{r.of_oracle:.1%} | {r.steady_hit:.1%} / {r.steady_oracle:.1%} = {r.steady_of_oracle:.1%} | "
            f"{r.catchup:.0%} | {r.ttft_p50:.2f} | {r.ttft_p99:.1f} | {r.out_tok_s:,.0f} | "
            f"{r.router_cpu_ms:.1f} | {added} |"
        )
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> str:
    """The rows as a JSON list, with the two ratios to the oracle."""
    return json.dumps(
        [{**asdict(r), "of_oracle": r.of_oracle, "steady_of_oracle": r.steady_of_oracle} for r in rows],
        indent=2,
    )
