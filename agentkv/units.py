"""Parse the sizes and durations a user types ("512GB", "1.5TiB", "2m", "50ms") for the CLI and engine.

Decimal units are powers of 1000 (GB = 1e9 bytes), binary units powers of 1024 (GiB = 2**30);
case is ignored. A bare number is bytes, or seconds. Bad input raises `UserError` naming `what`.
"""

from __future__ import annotations

import math
import re

from agentkv.errors import UserError

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
    "p": 10**15,
    "pb": 10**15,
    "pib": 2**50,
}

_DURATION_UNITS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "ns": 1e-9,
    "us": 1e-6,
    "ms": 1e-3,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([a-zA-Z]*)\s*$")


def _split(text: object, what: str, units: dict, examples: str) -> tuple[float, str]:
    """The number and lower-cased unit of `text`, or a UserError saying what was expected."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise UserError(f"{what}: expected a string like {examples}, got {text!r}")
    m = _NUMBER_UNIT.match(str(text))
    unit = m.group(3).lower() if m else ""
    if m is None or unit not in units:
        raise UserError(f"{what}: cannot parse {text!r}; expected a number and a unit, e.g. {examples}")
    value = float(m.group(1).replace("_", "") + (f"e{m.group(2)}" if m.group(2) else ""))
    if not math.isfinite(value):
        raise UserError(f"{what}: {text!r} is not a finite number")
    return value, unit


def parse_capacity(text: str | int, what: str = "capacity") -> int:
    """Bytes in `text` ("512GB" = 512e9, "1.5TiB" = 1.5 * 2**40, "4096" = 4096), rounded down."""
    value, unit = _split(text, what, _SIZE_UNITS, "'512GB', '200GiB', '1.5TiB'")
    return int(value * _SIZE_UNITS[unit])


def parse_duration(text: str | int | float, what: str = "duration") -> float:
    """Seconds in `text` ("60s", "2m" = 120, "50ms" = 0.05, "1h", "250us"; a bare number is seconds)."""
    value, unit = _split(text, what, _DURATION_UNITS, "'60s', '2m', '50ms'")
    return value * _DURATION_UNITS[unit]


def format_bytes(n: float) -> str:
    """A short binary-unit rendering for reports: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
