"""Load control of `agentkv bench`: closed-loop lanes or open-loop session arrivals, warm-up, think
scaling. The settings, the replay plan they shape, which requests are warm-up, and the notes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from agentkv.errors import UserError
from agentkv.trace.arrivals import arrivals_note
from agentkv.trace.model import Trace
from agentkv.trace.plan import ReplayPlan
from agentkv.trace.warmup import check_load, warmup_label, warmup_notes

DEFAULT_LANES = 16


@dataclass(slots=True, kw_only=True)
class LoadConfig:
    """How much load a run offers (BenchConfig's load fields)."""

    lanes: int | None = DEFAULT_LANES  # closed loop: trees at once; with session_rate a cap (None: none)
    session_rate: float | None = None  # new session trees per (target) second, open loop
    arrivals: str = "poisson"  # poisson | constant spacing of those arrivals (seeded by seed)
    warmup_requests: int = 0  # the first N released requests are warm-up
    warmup_s: float = 0.0  # requests due in the first S wall seconds are warm-up
    think_scale: float = 1.0  # multiplies think/tool gaps only; latencies stay the target's


class LoadSettings(msgspec.Struct, kw_only=True):
    """What summary.json's `config` records of the load (BenchSettings extends it)."""

    lanes: int | None
    session_rate: float | None = None
    arrivals: str | None = None
    warmup: str | None = None  # "100 requests" or "30s"
    think_scale: float = 1.0


def settings_of(cfg: LoadConfig) -> dict:
    """The LoadSettings fields of a config, as keyword arguments."""
    return {
        "lanes": cfg.lanes,
        "session_rate": cfg.session_rate,
        "arrivals": cfg.arrivals if cfg.session_rate else None,
        "warmup": warmup_label(cfg),
        "think_scale": cfg.think_scale,
    }


def parse_rate(text: str, flag: str) -> float:
    """A share in [0, 1] from `5%` or `0.05`."""
    t = str(text).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UserError(f"{flag}: expected a share such as 1% or 0.01, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise UserError(f"{flag} must be between 0 and 100%, got {text!r}")
    return v


def check(cfg: LoadConfig) -> None:
    """One-line errors for load settings no run can use."""
    if cfg.session_rate is None and cfg.lanes is None:
        raise UserError("--lanes is needed without --session-rate")
    if cfg.lanes is not None and cfg.lanes < 1:
        raise UserError(f"--lanes must be >= 1, got {cfg.lanes}")
    if cfg.session_rate is not None and not 0 < cfg.session_rate < float("inf"):
        raise UserError(f"--session-rate must be > 0 sessions/s, got {cfg.session_rate:g}")
    check_load(cfg)


def build_plan(cfg, traces: Sequence[Trace], x: float) -> ReplayPlan:
    """The replay plan of a bench config against a target `x` times faster than real time: gaps
    shrink x times (time scale) and scale by think_scale; the idle cap and the session rate are in
    target seconds, as every reported figure is (so x sessions a wall second per session a second)."""
    check(cfg)
    return ReplayPlan(
        traces,
        lanes=cfg.lanes,
        seed=cfg.seed,
        warm_start=cfg.warm_start,
        idle_gap_cap=None if cfg.idle_gap_cap is None else cfg.idle_gap_cap / x,
        max_requests=cfg.max_requests,
        time_scale=cfg.think_scale / x,
        session_rate=None if cfg.session_rate is None else cfg.session_rate * x,
        arrivals=cfg.arrivals,
        cycle=cfg.cycle,
    )


def load_notes(cfg: LoadConfig, plan: ReplayPlan, warm: int, x: float = 1.0) -> list[str]:
    """What the summary says about the load: arrivals, lane-cap waits, warm-up left out, think scale."""
    notes = []
    a = plan.arrivals
    if a is not None:
        notes.append(arrivals_note(a, x))
    if a is not None and not plan.traces:
        notes.append(
            "--session-rate had no effect: timestamp-mode traces (Mooncake) arrive on their own "
            "timeline (--think-scale scales it)"
        )
    return notes + warmup_notes(cfg, warm)
