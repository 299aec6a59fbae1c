"""`agentkv trace convert`: read traces in any format and save them as AgentX JSON.

AgentX is the exchange format (kv-cache-tester and AIPerf read it), so a Mooncake or Claude Code
trace converted here can be replayed by those tools as well as by ours.
"""

from __future__ import annotations

import re
from pathlib import Path

from agentkv.trace.formats import load_paths
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Trace, TraceError

_FILE_SUFFIXES = (".json", ".json.gz")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def output_paths(traces: list[Trace], out: str | Path, gzip: bool = False) -> list[Path]:
    """Where each trace goes: `out` itself when it names a .json/.json.gz file (one trace only),
    else `out/<trace id>.json[.gz]`, made unique when two traces share an id."""
    out = Path(out)
    if out.name.endswith(_FILE_SUFFIXES) and not out.is_dir():
        if len(traces) != 1:
            raise TraceError(
                str(out), None, None, f"{len(traces)} traces need a directory for -o, not a file name"
            )
        return [out]
    if out.exists() and not out.is_dir():
        raise TraceError(
            str(out),
            None,
            None,
            "exists and is not a directory (name a .json or .json.gz file "
            "for one trace, or a directory for many)",
        )
    suffix = ".json.gz" if gzip else ".json"
    paths, used = [], set()
    for t in traces:
        stem = _UNSAFE.sub("_", t.id).strip("._") or "trace"
        name, n = stem, 1
        while name in used:
            n += 1
            name = f"{stem}-{n}"
        used.add(name)
        paths.append(out / f"{name}{suffix}")
    return paths


def convert(
    inputs: list[str | Path], out: str | Path, fmt: str = "auto", gzip: bool = False
) -> list[tuple[Trace, Path]]:
    """Read `inputs` (files or directories) and write each trace as AgentX; returns (trace, path) pairs."""
    traces = load_paths(inputs, fmt)
    paths = output_paths(traces, out, gzip)
    sources = {Path(t.source).resolve() for t in traces if t.source}
    for p in paths:
        if p.resolve() in sources:
            raise TraceError(str(p), None, None, "is one of the inputs; choose another output")
    try:
        paths[0].parent.mkdir(parents=True, exist_ok=True)  # every path shares this folder
    except OSError as e:
        raise TraceError(
            str(paths[0].parent), None, None, f"cannot create directory: {e.strerror or e}"
        ) from None
    for t, p in zip(traces, paths, strict=True):
        write_agentx(t, p)
    return list(zip(traces, paths, strict=True))
