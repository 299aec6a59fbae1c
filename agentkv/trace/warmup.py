"""`--warmup` and `--think-scale`, as `agentkv bench` and `agentkv simulate` both take them: the flags,
their parsing and one-line errors, which released requests are warm-up, and the summary's notes.

Import-light (argparse builds every parser at start-up): the error type and durations load when parsed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol


class WarmupSettings(Protocol):
    """What a run's config holds of the warm-up (bench's LoadConfig, simulate's SimConfig)."""

    warmup_requests: int  # the first N released requests are warm-up
    warmup_s: float  # requests due in the first S (target or simulated) seconds are warm-up
    think_scale: float  # multiplies think/tool gaps only; latencies are not scaled


def add_warmup_args(p) -> None:
    """--warmup and --think-scale (bench and simulate alike)."""
    p.add_argument(
        "--warmup",
        default=None,
        metavar="N|DURATION",
        help="the first N requests, or those due in the first DURATION (e.g. 30s), are sent but "
        "left out of every statistic (marked warmup in requests.jsonl)",
    )
    p.add_argument(
        "--think-scale",
        default=1.0,
        metavar="F",
        help="replay think and tool gaps between turns at F times their length (0: none, 0.5: half); "
        "unlike bench --time-scale, measured latencies are not scaled (default 1)",
    )


def parse_warmup(text: str | None) -> tuple[int, float]:
    """`--warmup 20` (requests) or `--warmup 30s` (a duration) -> (requests, seconds); 0 for none."""
    from agentkv.errors import UserError
    from agentkv.units import parse_duration

    t = str(text or "").strip().lower()
    if t in ("", "0", "none", "off"):
        return 0, 0.0
    if t.isdigit():
        return int(t), 0.0
    try:
        if not t[-1].isalpha():  # 2.5: neither a count nor a duration with its unit
            raise UserError(t)
        s = parse_duration(t, "--warmup")
    except UserError:
        raise UserError(
            f"--warmup: expected a request count (20) or a duration (30s), got {text!r}"
        ) from None
    if not s > 0:
        raise UserError(f"--warmup must be > 0, got {text!r}")
    return 0, s


def parse_think_scale(value) -> float:
    """--think-scale as a number (its range is checked with the config); a one-line error for text."""
    from agentkv.errors import UserError

    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"--think-scale: expected a number >= 0 (0.5: half the gaps), got {value!r}"
        ) from None


def check_load(cfg: WarmupSettings) -> None:
    """One-line errors for a think scale or warm-up no run can use."""
    from agentkv.errors import UserError

    if not 0 <= cfg.think_scale < math.inf:
        raise UserError(f"--think-scale must be >= 0, got {cfg.think_scale:g}")
    if cfg.warmup_requests < 0 or not 0 <= cfg.warmup_s < math.inf:
        raise UserError("--warmup must be > 0")


def is_warmup(cfg: WarmupSettings, request_id: int, due: float) -> bool:
    """Whether a released request is warm-up: among the first N released or due in the first S."""
    return request_id < cfg.warmup_requests or due < cfg.warmup_s


def warmup_label(cfg: WarmupSettings) -> str | None:
    """What summary.json's config says of the warm-up: "100 requests", "30s" or None."""
    if cfg.warmup_requests:
        return f"{cfg.warmup_requests} requests"
    return f"{cfg.warmup_s:g}s" if cfg.warmup_s else None


def measured(records: Sequence) -> list:
    """The records statistics are computed from: warm-up ones left out."""
    return [r for r in records if not r.warmup]


def warmup_notes(cfg: WarmupSettings, warm: int, verb: str = "sent") -> list[str]:
    """The summary's notes on the warm-up left out and the think scale."""
    notes = []
    if cfg.warmup_requests or cfg.warmup_s:
        notes.append(
            f"warm-up: {warm} requests {verb} and left out of every statistic (warmup: true in requests.jsonl)"
        )
    if cfg.think_scale != 1.0:
        notes.append(
            f"think scale {cfg.think_scale:g}: think and tool gaps between turns were replayed at "
            f"{cfg.think_scale:g}x their recorded length; latencies are the target's, unscaled"
        )
    return notes
