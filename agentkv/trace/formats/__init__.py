"""Trace readers and the writer. `load_paths` reads files or directories in any known format.

Each format module exposes `read(path: Path, data: bytes) -> list[Trace]` and
`sniff(path: Path, head: bytes) -> bool`; gzip is undone here, once, for all of them.
"""

from __future__ import annotations

import gzip
import importlib
import zlib
from pathlib import Path

from agentkv.trace.model import Trace, TraceError

FORMATS = ("agentx", "mooncake", "claude_code")
_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


def _module(fmt: str):
    return importlib.import_module(f"agentkv.trace.formats.{fmt}")


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when compressed (by magic number, not by name)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(str(path), None, None, "no such file or directory") from None
    except IsADirectoryError:
        raise TraceError(str(path), None, None, "is a directory") from None
    except OSError as e:
        raise TraceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(str(path), None, None, f"corrupt gzip data: {e}") from None
    return raw


def detect(path: Path, data: bytes) -> str:
    """Pick the format from the file's content (first bytes), falling back to its name."""
    head = data[:4096]
    for fmt in FORMATS:
        if _module(fmt).sniff(path, head):
            return fmt
    raise TraceError(
        str(path), None, None, f"unknown trace format (expected one of: {', '.join(FORMATS)}); pass --format"
    )


def _expand(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(_SUFFIXES))
        files = _module("claude_code").drop_companions(files)  # sub-agents are read with their session
        if not files:
            raise TraceError(
                str(path), None, None, f"directory holds no trace files ({', '.join(_SUFFIXES)})"
            )
        return files
    return [path]


def load(path: str | Path, fmt: str = "auto") -> list[Trace]:
    """Read one file (any format, gzip or not) into traces."""
    path = Path(path)
    data = read_bytes(path)
    if fmt == "auto":
        fmt = detect(path, data)
    elif fmt not in FORMATS:
        raise TraceError(
            str(path), None, None, f"unknown format '{fmt}' (expected one of: {', '.join(FORMATS)})"
        )
    return _module(fmt).read(path, data)


def load_paths(paths: list[str | Path], fmt: str = "auto") -> list[Trace]:
    """Read files and directories (every trace file inside, sorted) into one list of traces."""
    traces: list[Trace] = []
    for p in paths:
        for f in _expand(Path(p)):
            traces.extend(load(f, fmt))
    return traces


def bundled_sample() -> list[Path]:
    """The small real Claude Code traces shipped in `agentkv/data/traces` (see its NOTICE.md), sorted."""
    from importlib.resources import files

    folder = files("agentkv") / "data" / "traces"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(_SUFFIXES))
