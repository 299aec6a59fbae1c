"""Trace readers and the writer. `load_paths` reads files or directories in any known format.

Each format module exposes `read(path: Path, data: bytes) -> list[Trace]` and
`sniff(path: Path, head: bytes) -> bool`; gzip is undone here, once, for all of them.
"""

from __future__ import annotations

import gzip
import importlib
import io
import os
import stat
import zlib
from pathlib import Path

from agentkv.trace.formats.limits import MAX_BYTES_ENV, max_bytes
from agentkv.trace.model import Trace, TraceError

FORMATS = ("agentx", "mooncake", "claude_code")
_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_CHUNK = 1 << 20  # gunzip this many bytes at a time, so a bomb stops at the cap
_KINDS = (
    (stat.S_ISDIR, "is a directory"),
    (stat.S_ISFIFO, "is a FIFO (named pipe)"),
    (stat.S_ISSOCK, "is a socket"),
    (stat.S_ISCHR, "is a character device"),
    (stat.S_ISBLK, "is a block device"),
)


def _module(fmt: str):
    return importlib.import_module(f"agentkv.trace.formats.{fmt}")


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _open_regular(path: Path) -> tuple[int, int]:
    """An fd open on `path` and its size, or a TraceError; a FIFO or device is never opened."""
    try:
        mode = os.stat(path).st_mode
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY) if stat.S_ISREG(mode) else -1
    except FileNotFoundError:
        raise TraceError(str(path), None, None, "no such file or directory") from None
    except OSError as e:
        raise TraceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    except ValueError as e:  # an embedded NUL byte
        raise TraceError(str(path), None, None, f"bad path: {e}") from None
    if fd >= 0:
        st = os.fstat(fd)
        mode, size = st.st_mode, st.st_size
        if stat.S_ISREG(mode):
            return fd, size
        os.close(fd)  # swapped for something else between stat and open
    raise TraceError(str(path), None, None, f"{_kind(mode)}; only regular files are read")


def _too_big(path: Path, what: str, cap: int) -> TraceError:
    return TraceError(
        str(path), None, None, f"{what} more than {cap:,} bytes (the cap; raise it with ${MAX_BYTES_ENV})"
    )


def _gunzip(path: Path, raw: bytes, cap: int) -> bytes:
    """`raw` decompressed (every gzip member) in chunks, stopping as soon as it passes `cap`."""
    out, size = [], 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            while chunk := f.read(_CHUNK):
                size += len(chunk)
                if size > cap:
                    raise _too_big(path, "decompresses to", cap)
                out.append(chunk)
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(str(path), None, None, f"corrupt gzip data: {e}") from None
    return b"".join(out)


def read_bytes(path: Path) -> bytes:
    """A regular file's bytes, gunzipped when compressed (by magic number, not by name), both
    within the size cap (`limits.max_bytes()`)."""
    cap = max_bytes()
    fd, size = _open_regular(path)
    with open(fd, "rb", closefd=True) as f:
        if size > cap:
            raise _too_big(path, "holds", cap)
        try:
            raw = f.read(size + 1)
            if len(raw) > size:  # it grew since fstat (or is a /proc file that says 0)
                raw += f.read(cap + 1 - len(raw))
        except OSError as e:
            raise TraceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    if len(raw) > cap:
        raise _too_big(path, "holds", cap)
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw, cap)
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


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # e.g. no permission to look: reading it will say so
        return False


def _expand(path: Path) -> list[Path]:
    if _is_dir(path):
        try:  # a FIFO, device or socket named like a trace is kept, so that reading it is an error
            files = sorted(p for p in path.rglob("*") if p.name.endswith(_SUFFIXES) and not p.is_dir())
        except OSError as e:  # a folder removed or unreadable while it was walked
            raise TraceError(str(path), None, None, f"cannot list: {e.strerror or e}") from None
        files = _module("claude_code").drop_companions(files)  # sub-agents are read with their session
        if not files:
            raise TraceError(
                str(path), None, None, f"directory holds no trace files ({', '.join(_SUFFIXES)})"
            )
        return files
    return [path]


def load(path: str | Path, fmt: str = "auto", block_size: int | None = None) -> list[Trace]:
    """Read one file (any format, gzip or not) into traces; `block_size`: tokens per Mooncake hash id
    (formats that state their block size ignore it)."""
    path = Path(path)
    data = read_bytes(path)
    if fmt == "auto":
        fmt = detect(path, data)
    elif fmt not in FORMATS:
        raise TraceError(
            str(path), None, None, f"unknown format '{fmt}' (expected one of: {', '.join(FORMATS)})"
        )
    if fmt == "mooncake" and block_size is not None:
        return _module(fmt).read(path, data, block_size)
    return _module(fmt).read(path, data)


def load_paths(paths: list[str | Path], fmt: str = "auto", block_size: int | None = None) -> list[Trace]:
    """Read files and directories (every trace file inside, sorted) into one list of traces."""
    traces: list[Trace] = []
    for p in paths:
        for f in _expand(Path(p)):
            traces.extend(load(f, fmt, block_size))
    return traces


def bundled_sample() -> list[Path]:
    """The small real Claude Code traces shipped in `agentkv/data/traces` (see its NOTICE.md), sorted."""
    from importlib.resources import files

    folder = files("agentkv") / "data" / "traces"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(_SUFFIXES))
