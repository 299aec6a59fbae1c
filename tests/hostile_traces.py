"""Hostile trace inputs for tests/test_trace_hostile.py: bad numbers in every numeric field of every
format (written as raw JSON text, so 400-digit ints, 1e999 and NaN reach the reader), and paths
that are not plain trace files (FIFOs, devices, sockets, gzip bombs, oversized files, links).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentkv.trace.formats import limits as L

HUGE, HUGER = "9" * 400, "9" * 5000  # the second is past Python's 4,300-digit int/str limit
NOT_JSON = {"NaN", "Infinity", "-Infinity"}  # JSON has no such literals: "invalid JSON", no field


def _ints(top: int) -> list[str]:
    return [HUGE, HUGER, str(2**64), str(top + 1), "-1", "-" + HUGE, "1.5", "3.0", "true", "1e999", *NOT_JSON]


def _floats(top: float) -> list[str]:
    return [HUGE, HUGER, "1e999", "-1e999", repr(top * 2), "-1", "-0.5", *NOT_JSON]


def _results(top: float) -> list[str]:  # Claude Code's Task results: wrong types are ignored, not bad
    return [HUGE, HUGER, f"{int(top) + 1}", "-1", "1e999", "NaN"]


@dataclass
class Case:
    """One hostile input: a path, what the error must name, and the environment to read it under."""

    label: str
    path: Path
    record: str | None = None  # expected in the error (None: not checked)
    key: str | None = None  # expected in TraceError.field (a valid JSON number's field)
    words: str = ""  # expected in the error message
    env: dict[str, str] = field(default_factory=dict)
    names: str | None = None  # what the error names instead of the path (a file inside, a setting)
    fmt: str = "auto"  # number cases name theirs: a 5,000-digit first field hides the format's keys

    def args(self) -> list[str]:
        return [str(self.path), "--format", self.fmt]


# ---------------------------------------------------------------------------------------- numbers
_REQ = {"t": 1.0, "type": "n", "model": "m", "in": 200, "out": 10, "hash_ids": [1, 2, 3]}
_REQ.update(api_time=1.5, ttft=0.2, think_time=0.5)
_SUB = {"t": 9.0, "type": "subagent", "agent_id": "a1", "duration_ms": 4000, "total_tokens": 500}
_SUB.update(tool_use_count=1, tool_tokens=5, system_tokens=7, requests=[dict(_REQ)])
AGENTX = {"id": "hx", "block_size": 64, "tool_tokens": 10, "system_tokens": 20, "requests": [_REQ, _SUB]}

# (field, where in the document, the record the error names, its bad values)
_AGENTX_FIELDS: list[tuple[str, Callable[[dict], dict], str, list[str]]] = [
    *((f, lambda d: d["requests"][0], "requests[0]", _ints(L.MAX_TOKENS)) for f in ("in", "out")),
    ("hash_ids", lambda d: d["requests"][0], "requests[0]", _ints(L.MAX_HASH_ID)),
    *(
        (f, lambda d: d["requests"][0], "requests[0]", _floats(L.MAX_SECONDS))
        for f in ("t", "api_time", "ttft", "think_time")
    ),
    ("t", lambda d: d["requests"][1], "requests[1]", _floats(L.MAX_SECONDS)),
    ("duration_ms", lambda d: d["requests"][1], "requests[1]", _floats(L.MAX_MILLIS)),
    ("total_tokens", lambda d: d["requests"][1], "requests[1]", _ints(L.MAX_TOTAL_TOKENS)),
    ("tool_use_count", lambda d: d["requests"][1], "requests[1]", _ints(L.MAX_COUNT)),
    *(
        (f, lambda d: d["requests"][1], "requests[1]", _ints(L.MAX_TOKENS))
        for f in ("tool_tokens", "system_tokens")
    ),
    ("in", lambda d: d["requests"][1]["requests"][0], "requests[1].requests[0]", _ints(L.MAX_TOKENS)),
    ("block_size", lambda d: d, "top level", [*_ints(L.MAX_BLOCK_SIZE), "0"]),
    *((f, lambda d: d, "top level", _ints(L.MAX_TOKENS)) for f in ("tool_tokens", "system_tokens")),
    ("id", lambda d: d, "top level", [HUGE, HUGER, str(2**63), "-" + HUGE, "1.5", "1e999", "NaN"]),
]

MOONCAKE = [{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}] * 3
_MOONCAKE_FIELDS = [
    ("timestamp", _floats(L.MAX_MILLIS)),
    ("input_length", _ints(L.MAX_TOKENS)),
    ("output_length", _ints(L.MAX_TOKENS)),
    ("hash_ids", _ints(L.MAX_HASH_ID)),
]

_TS = "2026-01-10T10:00:0{}Z"
_USAGE = {"input_tokens": 3, "output_tokens": 12, "cache_creation_input_tokens": 500}
_USAGE["cache_read_input_tokens"] = 100
_RESULT = {"agentId": "a7", "status": "completed", "totalTokens": 900, "totalToolUseCount": 2}
_RESULT["totalDurationMs"] = 4000
CLAUDE = [
    {
        "type": "user",
        "sessionId": "s",
        "uuid": "u1",
        "timestamp": _TS.format(0),
        "message": {"content": "hi"},
    },
    {
        "type": "assistant",
        "sessionId": "s",
        "uuid": "a1",
        "timestamp": _TS.format(2),
        "message": {"id": "m1", "model": "claude", "content": [{"type": "text"}], "usage": _USAGE},
    },
    {"type": "user", "sessionId": "s", "uuid": "u2", "timestamp": _TS.format(3), "toolUseResult": _RESULT},
]
_CLAUDE_FIELDS = [
    *((f, 1, lambda d: d["message"]["usage"], _ints(L.MAX_TOKENS)) for f in _USAGE),
    *((f, 2, lambda d: d["toolUseResult"], _results(L.MAX_TOTAL_TOKENS)) for f in ("totalTokens",)),
    ("totalToolUseCount", 2, lambda d: d["toolUseResult"], _results(L.MAX_COUNT)),
    ("totalDurationMs", 2, lambda d: d["toolUseResult"], [*_results(L.MAX_MILLIS), "-0.5"]),
]
_MARK = "@@BAD@@"
_UNTYPED = {HUGER, "1e999"}  # Task results are read untyped: such numbers are "invalid JSON" there


def _raw(text: str, value: str) -> str:
    return text.replace(json.dumps(_MARK), value)


def _name(value: str) -> str:
    return value[:12].replace(".", "p").replace("-", "m") + (f"_{len(value)}" if len(value) > 12 else "")


def number_cases(d: Path) -> list[Case]:
    """A file per (format, field, bad value); the case says which record and field the error names."""
    cases = []
    for i, (fld, where, record, values) in enumerate(_AGENTX_FIELDS):
        for v in values:
            doc = copy.deepcopy(AGENTX)
            node = where(doc)
            if fld == "hash_ids":
                node[fld] = [1, _MARK]
            else:
                node[fld] = _MARK
            p = d / f"agentx-{i}-{fld}-{_name(v)}.json"
            p.write_text(_raw(json.dumps(doc), v))
            cases.append(_number_case(p, record, fld, v))
    for fld, values in _MOONCAKE_FIELDS:
        for v in values:
            line = dict(MOONCAKE[1], **{fld: [0, _MARK] if fld == "hash_ids" else _MARK})
            p = d / f"mooncake-{fld}-{_name(v)}.jsonl"
            p.write_text(_raw("\n".join(json.dumps(x) for x in (MOONCAKE[0], line, MOONCAKE[2])), v))
            cases.append(_number_case(p, 2, fld, v))
    for fld, row, where, values in _CLAUDE_FIELDS:
        for v in values:
            lines = copy.deepcopy(CLAUDE)
            where(lines[row])[fld] = _MARK
            p = d / f"claude-{fld}-{_name(v)}.jsonl"
            p.write_text(_raw("\n".join(json.dumps(x) for x in lines), v))
            cases.append(_number_case(p, f"line {row + 1}", None if row == 2 and v in _UNTYPED else fld, v))
    lines = copy.deepcopy(CLAUDE)  # each count in bounds, their sum (the input) past them
    lines[1]["message"]["usage"].update(dict.fromkeys(_USAGE, L.MAX_TOKENS))
    p = d / "claude-usage-sum.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    cases.append(Case("claude-usage-sum", p, "line 2", "usage", fmt="claude_code"))
    return cases


def _number_case(p: Path, record, fld: str | None, v: str) -> Case:
    bad_json = v in NOT_JSON  # a JSON document (AgentX) that does not parse has no record to name
    if bad_json and p.suffix == ".json":
        record = None
    fmt = {".json": "agentx", ".jsonl": "claude_code" if p.stem.startswith("claude") else "mooncake"}[
        p.suffix
    ]
    words = "invalid JSON" if bad_json else ""
    return Case(p.stem, p, record and str(record), None if bad_json else fld, words, fmt=fmt)


# ------------------------------------------------------------------------------------------ paths
def _gzip_bomb(p: Path, members: int, member_mib: int = 64) -> Path:
    """Zeros in `members` concatenated gzip members: ~1 KB on disk per MiB it decompresses to."""
    p.write_bytes(gzip.compress(b"\0" * (member_mib << 20), compresslevel=9, mtime=0) * members)
    return p


def _link(p: Path, target: str | Path) -> Path:
    p.symlink_to(target)
    return p


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _path_tree(d: Path, sock_dir: Path, good: str) -> tuple[Path, Path]:
    """The folders, special files and links path_cases names; returns (a session transcript, a sparse
    file past the size cap)."""
    (d / "baddir").mkdir()
    number_cases(d / "baddir")  # a folder of bad files: the first, sorted, is named
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_dir / "s.json"))  # the socket file stays after close
    (d / "empty").mkdir()
    (d / "fifodir").mkdir()
    _fifo(d / "fifodir" / "p.jsonl")
    (d / "loop").mkdir()
    _link(d / "loop" / "self", d / "loop")
    (d / "loop" / "x.json").write_text('{"block_size": 64, "requests": [{"t": -1}]}')
    session = d / "cc" / "s1.jsonl"
    (d / "cc" / "s1" / "subagents").mkdir(parents=True)
    session.write_text("\n".join(json.dumps(x) for x in CLAUDE))
    _fifo(d / "cc" / "s1" / "subagents" / "agent-a7.jsonl")
    big = d / "sparse.json"
    with open(big, "wb") as f:
        f.truncate(L.MAX_BYTES + 1)  # sparse: nothing is written, nothing need be read
    (d / "small.json").write_text(good)
    (d / "nl\nname.json").write_text('{"block_size": 64, "requests": [{"t": 1e999}]}')
    return session, big


def path_cases(d: Path, sock_dir: Path) -> list[Case]:
    """Paths that are not plain trace files, or too big, each with the words its error must hold."""
    good = json.dumps(AGENTX)
    session, big = _path_tree(d, sock_dir, good)
    gz = gzip.compress(good.encode())
    cases = [
        Case("fifo", _fifo(d / "f.json"), words="FIFO"),
        Case("fifo in a folder", d / "fifodir", words="FIFO"),
        Case("fifo sub-agent transcript", session, words="FIFO", names=str(d / "cc" / "s1" / "subagents")),
        Case("link to a fifo", _link(d / "lf.json", d / "f.json"), words="FIFO"),
        Case("socket", sock_dir / "s.json", words="socket"),
        Case("/dev/zero", Path("/dev/zero"), words="character device"),
        Case("/dev/null", Path("/dev/null"), words="character device"),
        Case("/dev/urandom", Path("/dev/urandom"), words="character device"),
        Case("link to /dev/zero", _link(d / "z.jsonl", "/dev/zero"), words="character device"),
        Case("dangling link", _link(d / "dl.json", d / "nowhere"), words="no such file"),
        Case("missing", d / "missing.json", words="no such file"),
        Case("empty folder", d / "empty", words="no trace files"),
        Case("folder of bad files", d / "baddir", words="agentx-0-in-"),
        Case("link loop in a folder", d / "loop", record="requests[0]", key="t"),
        Case("newline in the name", d / "nl\nname.json", record="requests[0]", key="t"),
        Case("gzip bomb 320 MiB", _gzip_bomb(d / "bomb.json.gz", 5), words="decompresses to more than"),
        Case("sparse file past the cap", big, words="holds more than"),
        Case(
            "file past a 256B cap", d / "small.json", words="holds more than", env={L.MAX_BYTES_ENV: "256B"}
        ),
        Case(
            "gzip past a cap",
            _write(d / "g.json.gz", gz),
            words="decompresses to more than",
            env={L.MAX_BYTES_ENV: str(len(gz) + 1)},
        ),
        Case("bad cap setting", d / "small.json", names=L.MAX_BYTES_ENV, env={L.MAX_BYTES_ENV: "lots"}),
        Case("truncated gzip", _write(d / "t.json.gz", gz[:-5]), words="corrupt gzip"),
        Case("gzip with trailing junk", _write(d / "j.json.gz", gz + b"junk"), words="corrupt gzip"),
        Case("empty file", _write(d / "e.json", b""), words="unknown trace format"),
        Case("random bytes", _write(d / "r.json", os.urandom(1 << 16)), words="unknown trace format"),
        Case("a /proc file", Path("/proc/self/status"), words="unknown trace format"),
    ]
    if os.geteuid() != 0:  # root reads anything
        locked = _write(d / "locked.json", good)
        locked.chmod(0)
        cases.append(Case("unreadable file", locked, words="cannot read"))
    return cases


def _write(p: Path, data: bytes | str) -> Path:
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p
