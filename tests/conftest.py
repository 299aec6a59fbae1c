"""Shared test fixtures: where ../shared lives, and the real traces in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared"))
CLAUDE_TRACES = SHARED / "traces" / "claude-code"
MOONCAKE_TRACES = SHARED / "traces" / "mooncake"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared, or skip: tests that need the real traces say so instead of failing on a bare clone."""
    if not CLAUDE_TRACES.is_dir():
        pytest.skip(f"../shared not found at {SHARED} (set AGENTKV_SHARED)")
    return SHARED
