"""The shared real traces, loaded once per test run and reused by test_stats and test_synth."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from agentkv.trace.formats import load_paths
from agentkv.trace.model import Trace
from agentkv.trace.stats import StatsReport, compute


@cache
def claude_traces(shared: Path) -> list[Trace]:
    return load_paths([shared / "traces" / "claude-code"])


@cache
def claude_report(shared: Path) -> StatsReport:
    return compute(claude_traces(shared))
