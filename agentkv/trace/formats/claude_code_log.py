"""One Claude Code session log parsed into its conversations, each a list of merged API calls.

The main chain and each inline sidechain is a `Stream`; `claude_code` turns streams into sessions.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

from agentkv.trace.formats.limits import MAX_COUNT, MAX_MILLIS, MAX_TOKENS, MAX_TOTAL_TOKENS, Tokens
from agentkv.trace.model import TraceError

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

# A Task tool result's numbers (read when of the right type, else ignored): their bounds.
_RESULT_BOUNDS = {
    "totalTokens": MAX_TOTAL_TOKENS,
    "totalToolUseCount": MAX_COUNT,
    "totalDurationMs": MAX_MILLIS,
}


class _Usage(msgspec.Struct):
    input_tokens: Tokens = 0
    output_tokens: Tokens = 0
    cache_creation_input_tokens: Tokens | None = None
    cache_read_input_tokens: Tokens | None = None


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
class Call:
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


class Stream:
    """One conversation (the main chain or one sub-agent): its calls in order of first appearance."""

    def __init__(self) -> None:
        self.calls: dict[str, Call] = {}
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

    def assistant(self, key: str, msg: _Message, ts: float) -> Call:
        call = self.calls.get(key)
        if call is None:
            call = Call(
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
        return call


def _error(path: Path, line: int, e: msgspec.ValidationError) -> TraceError:
    msg, _, where = str(e).partition(" - at `$")
    fld = where.rstrip("`").lstrip(".") or None
    return TraceError(str(path), f"line {line}", fld, msg[:1].lower() + msg[1:])


def _bad_json(path: Path, line: int, raw: bytes, e: msgspec.DecodeError) -> TraceError:
    """An undecodable line's error; a number out of range in a field this reader uses is named."""
    try:
        msgspec.json.decode(raw, type=_Record)
    except msgspec.ValidationError as typed:
        return _error(path, line, typed)
    except (msgspec.DecodeError, RecursionError):
        pass
    return TraceError(str(path), f"line {line}", None, f"invalid JSON: {e}")


def _agent_result(path: Path, line: int, tur: object) -> dict | None:
    """A Task tool result naming a sub-agent, its numbers checked against their bounds."""
    if not isinstance(tur, dict) or not isinstance(tur.get("agentId"), str):
        return None
    for key, top in _RESULT_BOUNDS.items():
        v = tur.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and not 0 <= v <= top:
            raise TraceError(
                str(path), f"line {line}", f"toolUseResult.{key}", f"expected a number in [0, {top:.0f}]"
            )
    return tur


def _time(path: Path, line: int, s: str | None) -> float | None:
    if s is None:
        return None
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise TraceError(
            str(path), f"line {line}", "timestamp", f"expected an ISO 8601 time, got {s!r:.40}"
        ) from None


class Parsed:
    """A file's conversations: the main stream, inline sidechains, and counts for the warning line."""

    def __init__(self) -> None:
        self.main = Stream()
        self.side: dict[str, Stream] = {}
        self.side_of: dict[str, str] = {}  # record uuid -> inline sidechain key
        self.unknown: Counter[str] = Counter()
        self.synthetic = 0
        self.no_usage = 0
        self.agent_results: dict[str, dict] = {}  # Task tool results in the parent, by agentId

    def stream(self, rec: _Record, inline: bool) -> Stream:
        if not (inline and rec.isSidechain):
            return self.main
        key = rec.agentId or self.side_of.get(rec.parentUuid or "") or rec.uuid or "sidechain"
        if rec.uuid:
            self.side_of[rec.uuid] = key
        return self.side.setdefault(key, Stream())

    def skipped(self) -> list[str]:
        """What was skipped, one phrase per kind, for the reader's one warning line per file."""
        parts = []
        if self.unknown:
            many = len(self.unknown) > 1
            kinds = ", ".join(f"{k!r} x{c}" if many else repr(k) for k, c in self.unknown.most_common())
            parts.append(
                f"skipped {_n(self.unknown.total(), 'record')} of unknown type{'s' if many else ''} {kinds}"
            )
        if self.synthetic:
            parts.append(f"skipped {_n(self.synthetic, 'synthetic assistant record')} (no API call)")
        if self.no_usage:
            parts.append(f"skipped {_n(self.no_usage, 'assistant record')} without usage")
        return parts


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


_decode = msgspec.json.Decoder()


def _kind(path: Path, n: int, d: object) -> str:
    """The `type` of line `n`'s record: a TraceError unless the line is an object with a string type."""
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
    return kind


def parse(path: Path, data: bytes, inline: bool) -> Parsed:
    """Every line of `data` (the file at `path`) into streams; `inline`: sidechain records get their own."""
    out = Parsed()
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            d = _decode.decode(raw)
        except msgspec.DecodeError as e:
            raise _bad_json(path, n, raw, e) from None
        except RecursionError:
            raise TraceError(str(path), f"line {n}", None, "invalid JSON: nested too deeply") from None
        kind = _kind(path, n, d)
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
            tur = _agent_result(path, n, d.get("toolUseResult"))
            if tur is not None:
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
            call = s.assistant(msg.id or rec.requestId or rec.uuid or f"line {n}", msg, ts)
            if call.input_tokens > MAX_TOKENS:
                raise TraceError(
                    str(path), f"line {n}", "usage", f"input + cache tokens exceed {MAX_TOKENS:,}"
                )
    return out
