"""Turn msgspec's decode/validation errors into `TraceError`s that name the record and field.

msgspec reports a JSON path such as `$.requests[3].hash_ids[0]`; readers split it into the record
(`requests[3]`) and the field (`hash_ids`), so every format words its errors the same way.
"""

from __future__ import annotations

import re

import msgspec

from agentkv.trace.model import TraceError

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_SEGMENT = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)?((?:\[\d+\])*)")


def _segments(path: str) -> list[str]:
    """`.requests[3].hash_ids[0]` -> ['requests[3]', 'hash_ids[0]']."""
    out = []
    for name, idx in _SEGMENT.findall(path):
        if name or idx:
            out.append(name + idx)
    return out


def _lower(msg: str) -> str:
    return msg[:1].lower() + msg[1:] if msg else msg


def from_msgspec(
    path: str, e: msgspec.DecodeError, record: str | int | None = None, top: str | None = None
) -> TraceError:
    """A `TraceError` for a msgspec error: JSON syntax (field unknown) or schema (field named).

    `record` names the record when the caller knows it (a JSONL line); otherwise the deepest
    `requests[i]` in the error path is the record and `top` names the top level.
    """
    text = str(e)
    if not isinstance(e, msgspec.ValidationError):
        return TraceError(path, record, None, f"invalid JSON: {text}")
    m = _AT.match(text)
    msg, segs = m.group("msg"), _segments(m.group("path") or "")
    missing = _MISSING.match(msg)
    if missing:
        segs.append(missing.group("field"))
        msg = "missing"
    if record is None:
        cut = max((i + 1 for i, s in enumerate(segs) if s.startswith("requests[")), default=0)
        record = ".".join(segs[:cut]) or top
        segs = segs[cut:]
    field = segs[0].split("[")[0] if segs else None
    detail = ".".join(segs) if segs and segs[0] != field else ""
    msg = _lower(msg).replace(" | null`", "`")  # null reads as absent; name the real type
    if detail:
        msg += f" (at {detail})"
    return TraceError(path, record, field, msg)
