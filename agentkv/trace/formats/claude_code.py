"""Claude Code session logs (`~/.claude/projects/<project>/<session>.jsonl`) read as replayable traces.

One trace per session file; sub-agent transcripts in `<session>/subagents/agent-*.jsonl` (or, in
older logs, `isSidechain` records inline) become child sessions spawned at their first record.
Each API call is one request: assistant lines sharing `message.id` are merged (usage counted once,
the largest `output_tokens` kept). Input = input + cache-creation + cache-read tokens.

Hash ids (64-token blocks, local to the trace): a call reuses the first ceil(cache_read / 64)
blocks of the previous call in its session (never more than that call had) and takes fresh ids
for the rest; after a `compact_boundary` every block is fresh. A sub-agent's first call may reuse
the leading blocks of the parent's first call (its shared system/tool prefix), again only as far
as its own cache_read reaches. Unknown record types are counted and logged as one warning line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from agentkv.trace.formats.claude_code_log import Parsed, Stream, parse
from agentkv.trace.model import Request, Session, Trace, TraceError

log = logging.getLogger(__name__)

BLOCK_SIZE = 64
_SUFFIXES = (".jsonl", ".jsonl.gz")


class _Ids:
    """The trace's hash-id counter and the cache_read-driven reuse rule."""

    def __init__(self) -> None:
        self.next = 1

    def chain(self, prev: list[int], n_in: int, cache_read: int) -> list[int]:
        n = -(-n_in // BLOCK_SIZE)  # integer ceil: exact for any size
        reuse = min(-(-cache_read // BLOCK_SIZE), len(prev), n)
        fresh = list(range(self.next, self.next + n - reuse))
        self.next += n - reuse
        return prev[:reuse] + fresh


def _conversations(path: Path, data: bytes, inline: bool) -> Parsed:
    """The file's conversations; one warning line for everything skipped, so nothing is dropped silently."""
    out = parse(path, data, inline)
    parts = out.skipped()
    if parts:
        log.warning("%s: %s", path, "; ".join(parts))
    return out


def _session(stream: Stream, sid: str, ids: _Ids, base: list[int]) -> Session:
    """Requests of one conversation; `t` counts from its first record. `base`: ids a first call may reuse."""
    start = stream.first_ts or 0.0
    s = Session(id=sid)
    prev = base
    for c in stream.calls.values():
        if c.reset:
            prev = []
        n_in = c.input_tokens
        hash_ids = ids.chain(prev, n_in, c.usage.cache_read_input_tokens or 0)
        prev = hash_ids
        s.requests.append(
            Request(
                t=round(c.start - start, 3),
                input_tokens=n_in,
                output_tokens=c.usage.output_tokens,
                hash_ids=hash_ids,
                think_time=round(max(0.0, c.start - c.prev_end), 3) if c.prev_end is not None else 0.0,
                model=c.model,
                stop=c.stop,
                api_time=round(max(0.0, c.end - c.start), 3) if c.trigger is not None else None,
                input_types=c.in_types,
                output_types=sorted(c.out_types),
            )
        )
    return s


def _subagent(
    stream: Stream,
    sid: str,
    parent_start: float,
    ids: _Ids,
    base: list[int],
    agent_type: str,
    result: dict | None,
) -> Session:
    s = _session(stream, sid, ids, base)
    s.t = round(max(0.0, (stream.first_ts or parent_start) - parent_start), 3)
    s.agent_type = agent_type
    if stream.first_ts is not None and stream.last_ts is not None:
        s.duration = round(stream.last_ts - stream.first_ts, 3)
    s.tool_use_count = sum(r.output_types.count("tool_use") for r in s.requests)
    if result:
        if not s.agent_type and isinstance(result.get("agentType"), str):
            s.agent_type = result["agentType"]
        s.status = result.get("status") if isinstance(result.get("status"), str) else ""
        if _is_int(result.get("totalTokens")):
            s.total_tokens = result["totalTokens"]
        if _is_int(result.get("totalToolUseCount")):
            s.tool_use_count = result["totalToolUseCount"]
        if _is_int(result.get("totalDurationMs")) or isinstance(result.get("totalDurationMs"), float):
            s.duration = result["totalDurationMs"] / 1000.0
    return s


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _stem(path: Path) -> str:
    return path.name.split(".")[0]


def _agent_files(path: Path) -> list[Path]:
    d = path.parent / _stem(path) / "subagents"
    try:
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if p.name.startswith("agent-") and p.name.endswith(_SUFFIXES))
    except OSError as e:  # unreadable, or removed while listed
        raise TraceError(str(d), None, None, f"cannot list: {e.strerror or e}") from None


def _agent_type(agent_file: Path) -> str:
    """`agent-<id>.meta.json` beside the transcript names the sub-agent type, when present."""
    from agentkv.trace.formats import read_bytes

    meta = agent_file.parent / f"{_stem(agent_file)}.meta.json"
    try:  # optional: a missing, odd (a FIFO, too big) or broken file names no type
        d = msgspec.json.decode(read_bytes(meta))
    except (TraceError, msgspec.DecodeError, RecursionError):
        return ""
    t = d.get("agentType") if isinstance(d, dict) else None
    return t if isinstance(t, str) else ""


def read(path: Path, data: bytes) -> list[Trace]:
    """One trace for the session file, its sub-agent transcripts attached as child sessions."""
    from agentkv.trace.formats import read_bytes

    tid = _stem(path)
    inline = not tid.startswith("agent-")
    main = _conversations(path, data, inline)
    subs: list[tuple[Stream, str, str, str]] = []  # stream, session id, agent id, agent type
    for key, st in main.side.items():
        subs.append((st, f"{tid}/{key}", key, ""))
    if inline:
        for f in _agent_files(path):
            agent_id = _stem(f).removeprefix("agent-")
            st = _conversations(f, read_bytes(f), False).main
            subs.append((st, f"{tid}/{agent_id}", agent_id, _agent_type(f)))
    subs = [x for x in subs if x[0].calls]
    if not main.main.calls and not subs:
        log.warning("%s: no API calls (no assistant records with usage); skipped", path)
        return []
    starts = [t for t in [main.main.first_ts] + [x[0].first_ts for x in subs] if t is not None]
    parent_start = main.main.first_ts if main.main.first_ts is not None else min(starts)
    ids = _Ids()
    root = _session(main.main, tid, ids, [])
    base = root.requests[0].hash_ids if root.requests else []
    subs.sort(key=lambda x: x[0].first_ts or parent_start)
    for st, sid, agent_id, agent_type in subs:
        root.subagents.append(
            _subagent(st, sid, parent_start, ids, base, agent_type, main.agent_results.get(agent_id))
        )
    return [
        Trace(
            id=tid,
            block_size=BLOCK_SIZE,
            session=root,
            hash_id_scope="local",
            source=str(path),
            format="claude_code",
        )
    ]


def sniff(path: Path, head: bytes) -> bool:
    s = head.lstrip()
    if s[:1] != b"{":
        return False
    if any(k in s for k in (b'"sessionId"', b'"parentUuid"', b'"leafUuid"', b'"file-history-snapshot"')):
        return True
    return b'"uuid"' in s and b'"timestamp"' in s and b'"message"' in s


def drop_companions(files: list[Path]) -> list[Path]:
    """Drop files Claude Code keeps beside sessions that are no traces of their own.

    Sub-agent transcripts are read with their session when that session's file is in `files`;
    their `.meta.json` and `sessions-index.json` (Claude Code's own index) are never traces.
    """
    listed = set(files)

    def companion(f: Path) -> bool:
        if f.name == "sessions-index.json":
            return True
        if f.parent.name != "subagents" or not f.name.startswith("agent-"):
            return False
        if f.name.endswith(".meta.json"):
            return True
        session_dir = f.parent.parent
        return any(session_dir.with_name(session_dir.name + sfx) in listed for sfx in _SUFFIXES)

    return [f for f in files if not companion(f)]
