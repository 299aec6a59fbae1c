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
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated

import msgspec

from agentkv.trace.model import Request, Session, Trace, TraceError

log = logging.getLogger(__name__)

BLOCK_SIZE = 64
# Record types that carry no API call; skipped without a warning.
_SKIPPED = frozenset(
    {
        "summary",
        "file-history-snapshot",
        "queue-operation",
        "progress",
        "pr-link",
        "permission-mode",
        "attachment",
        "ai-title",
        "custom-title",
    }
)
_USED = frozenset({"user", "assistant", "system"})
_SUFFIXES = (".jsonl", ".jsonl.gz")

_NonNeg = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]  # token counts: no log holds more than 2**40


class _Usage(msgspec.Struct):
    input_tokens: _NonNeg = 0
    output_tokens: _NonNeg = 0
    cache_creation_input_tokens: _NonNeg | None = None
    cache_read_input_tokens: _NonNeg | None = None


class _Block(msgspec.Struct):
    type: str = ""


class _Message(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    content: str | list[_Block] | None = None
    stop_reason: str | None = None
    usage: _Usage | None = None


class _Record(msgspec.Struct):
    """The fields of a user/assistant/system line this reader uses; others are ignored."""

    type: str
    timestamp: str | None = None
    uuid: str | None = None
    parentUuid: str | None = None
    isSidechain: bool = False
    agentId: str | None = None
    subtype: str | None = None
    requestId: str | None = None
    message: _Message | None = None


@dataclass
class _Call:
    """One API call, merged from the assistant lines that share its message id."""

    first: float  # timestamp of its first assistant line
    end: float  # timestamp of its last assistant line
    trigger: float | None  # latest user/tool_result record that preceded it
    prev_end: float | None  # end of the call before it in the same conversation
    reset: bool  # a compact_boundary came between the previous call and this one
    in_types: list[str]
    usage: _Usage = field(default_factory=_Usage)
    model: str = ""
    stop: str = ""
    out_types: list[str] = field(default_factory=list)

    def merge(self, msg: _Message, ts: float) -> None:
        self.end = max(self.end, ts)
        u = msg.usage or _Usage()
        for f in _Usage.__struct_fields__:  # repeated on every line: count once, keep the largest
            setattr(self.usage, f, max(getattr(self.usage, f) or 0, getattr(u, f) or 0))
        self.model = msg.model or self.model
        self.stop = msg.stop_reason or self.stop
        if isinstance(msg.content, list):
            for b in msg.content:
                if b.type and b.type not in self.out_types:
                    self.out_types.append(b.type)

    @property
    def start(self) -> float:
        return min(self.trigger, self.first) if self.trigger is not None else self.first

    @property
    def input_tokens(self) -> int:
        u = self.usage
        return u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)


class _Stream:
    """One conversation (the main chain or one sub-agent): its calls in order of first appearance."""

    def __init__(self) -> None:
        self.calls: dict[str, _Call] = {}
        self.first_ts: float | None = None
        self.last_ts: float | None = None
        self._pending: set[str] = set()
        self._pending_ts: float | None = None
        self._reset = False
        self._last_end: float | None = None

    def seen(self, ts: float | None) -> None:
        if ts is not None:
            self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
            self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)

    def user(self, rec: _Record, ts: float | None) -> None:
        content = rec.message.content if rec.message else None
        if isinstance(content, str):
            self._pending.add("text")
        elif content:
            self._pending.update(b.type for b in content if b.type)
        if ts is not None:
            self._pending_ts = ts if self._pending_ts is None else max(self._pending_ts, ts)

    def compact(self) -> None:
        self._reset = True

    def assistant(self, key: str, msg: _Message, ts: float) -> None:
        call = self.calls.get(key)
        if call is None:
            call = _Call(
                first=ts,
                end=ts,
                trigger=self._pending_ts,
                prev_end=self._last_end,
                reset=self._reset,
                in_types=sorted(self._pending),
            )
            self.calls[key] = call
            self._pending.clear()
            self._pending_ts, self._reset = None, False
        call.merge(msg, ts)
        self._last_end = call.end


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


def _error(path: Path, line: int, e: msgspec.ValidationError) -> TraceError:
    msg, _, where = str(e).partition(" - at `$")
    fld = where.rstrip("`").lstrip(".") or None
    return TraceError(str(path), f"line {line}", fld, msg[:1].lower() + msg[1:])


def _time(path: Path, line: int, s: str | None) -> float | None:
    if s is None:
        return None
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise TraceError(
            str(path), f"line {line}", "timestamp", f"expected an ISO 8601 time, got {s!r:.40}"
        ) from None


class _Parsed:
    """A file's conversations: the main stream, inline sidechains, and counts for the warning line."""

    def __init__(self) -> None:
        self.main = _Stream()
        self.side: dict[str, _Stream] = {}
        self.side_of: dict[str, str] = {}  # record uuid -> inline sidechain key
        self.unknown: Counter[str] = Counter()
        self.synthetic = 0
        self.no_usage = 0
        self.agent_results: dict[str, dict] = {}  # Task tool results in the parent, by agentId

    def stream(self, rec: _Record, inline: bool) -> _Stream:
        if not (inline and rec.isSidechain):
            return self.main
        key = rec.agentId or self.side_of.get(rec.parentUuid or "") or rec.uuid or "sidechain"
        if rec.uuid:
            self.side_of[rec.uuid] = key
        return self.side.setdefault(key, _Stream())


_decode = msgspec.json.Decoder()


def _parse(path: Path, data: bytes, inline: bool) -> _Parsed:
    out = _Parsed()
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            d = _decode.decode(raw)
        except msgspec.DecodeError as e:
            raise TraceError(str(path), f"line {n}", None, f"invalid JSON: {e}") from None
        except RecursionError:
            raise TraceError(str(path), f"line {n}", None, "invalid JSON: nested too deeply") from None
        if not isinstance(d, dict):
            raise TraceError(str(path), f"line {n}", None, f"expected a JSON object, got {type(d).__name__}")
        kind = d.get("type")
        if not isinstance(kind, str):
            raise TraceError(
                str(path),
                f"line {n}",
                "type",
                "missing" if kind is None else f"expected a string, got {kind!r:.40}",
            )
        if kind not in _USED:
            if kind not in _SKIPPED:
                out.unknown[kind] += 1
            continue
        try:
            rec = msgspec.convert(d, _Record)
        except msgspec.ValidationError as e:
            raise _error(path, n, e) from None
        if rec.uuid:  # a resumed session can repeat records verbatim
            if rec.uuid in seen:
                continue
            seen.add(rec.uuid)
        ts = _time(path, n, rec.timestamp)
        s = out.stream(rec, inline)
        s.seen(ts)
        if kind == "user":
            s.user(rec, ts)
            tur = d.get("toolUseResult")
            if isinstance(tur, dict) and isinstance(tur.get("agentId"), str):
                out.agent_results[tur["agentId"]] = tur
        elif kind == "system":
            if rec.subtype == "compact_boundary":
                s.compact()
        else:
            msg = rec.message
            if msg is None:
                raise TraceError(str(path), f"line {n}", "message", "missing on an assistant record")
            if msg.model == "<synthetic>":  # a client-side message (API error, interruption): no call
                out.synthetic += 1
                continue
            if msg.usage is None:
                out.no_usage += 1
                continue
            if ts is None:
                raise TraceError(str(path), f"line {n}", "timestamp", "missing on an assistant record")
            s.assistant(msg.id or rec.requestId or rec.uuid or f"line {n}", msg, ts)
    _warn(path, out)
    return out


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _warn(path: Path, p: _Parsed) -> None:
    """One warning line per file for everything skipped, so nothing is dropped silently."""
    parts = []
    if p.unknown:
        many = len(p.unknown) > 1
        kinds = ", ".join(f"{k!r} x{c}" if many else repr(k) for k, c in p.unknown.most_common())
        parts.append(
            f"skipped {_n(p.unknown.total(), 'record')} of unknown type{'s' if many else ''} {kinds}"
        )
    if p.synthetic:
        parts.append(f"skipped {_n(p.synthetic, 'synthetic assistant record')} (no API call)")
    if p.no_usage:
        parts.append(f"skipped {_n(p.no_usage, 'assistant record')} without usage")
    if parts:
        log.warning("%s: %s", path, "; ".join(parts))


def _session(stream: _Stream, sid: str, ids: _Ids, base: list[int]) -> Session:
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
    stream: _Stream,
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
        if isinstance(result.get("totalTokens"), int):
            s.total_tokens = result["totalTokens"]
        if isinstance(result.get("totalToolUseCount"), int):
            s.tool_use_count = result["totalToolUseCount"]
        if isinstance(result.get("totalDurationMs"), (int, float)):
            s.duration = result["totalDurationMs"] / 1000.0
    return s


def _stem(path: Path) -> str:
    return path.name.split(".")[0]


def _agent_files(path: Path) -> list[Path]:
    d = path.parent / _stem(path) / "subagents"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name.startswith("agent-") and p.name.endswith(_SUFFIXES))


def _agent_type(agent_file: Path) -> str:
    """`agent-<id>.meta.json` beside the transcript names the sub-agent type, when present."""
    meta = agent_file.parent / f"{_stem(agent_file)}.meta.json"
    try:
        d = msgspec.json.decode(meta.read_bytes())
    except (OSError, msgspec.DecodeError):
        return ""
    t = d.get("agentType") if isinstance(d, dict) else None
    return t if isinstance(t, str) else ""


def read(path: Path, data: bytes) -> list[Trace]:
    """One trace for the session file, its sub-agent transcripts attached as child sessions."""
    from agentkv.trace.formats import read_bytes

    tid = _stem(path)
    inline = not tid.startswith("agent-")
    main = _parse(path, data, inline)
    subs: list[tuple[_Stream, str, str, str]] = []  # stream, session id, agent id, agent type
    for key, st in main.side.items():
        subs.append((st, f"{tid}/{key}", key, ""))
    if inline:
        for f in _agent_files(path):
            agent_id = _stem(f).removeprefix("agent-")
            subs.append((_parse(f, read_bytes(f), False).main, f"{tid}/{agent_id}", agent_id, _agent_type(f)))
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
