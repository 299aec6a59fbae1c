"""AgentX / kv-cache-tester JSON traces: one session tree per file, sub-agents nested inline.

Top level: `id, models, block_size, hash_id_scope, tool_tokens, system_tokens, requests[], totals`.
A request is `{t, type: "n"|"s", model, in, out, hash_ids, input_types, output_types, stop,
api_time, ttft, think_time}`; a sub-agent is `{t, type: "subagent", agent_id, subagent_type,
duration_ms, total_tokens, tool_use_count, status, requests[], models, tool_tokens, system_tokens}`
whose requests count `t` from its spawn. A sub-agent's own `t` is when it *ended* (in every shared
trace, `t - duration_ms` falls just after the parent request that launched it), so the model's spawn
offset is `t - duration_ms / 1000`, and the writer adds the duration back. `read` parses it;
`write_agentx` saves any `Trace` as it.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import Literal

import msgspec

from agentkv.trace.formats._errors import from_msgspec
from agentkv.trace.formats.limits import (
    BlockSize,
    Count,
    HashId,
    Int64,
    Millis,
    Seconds,
    Tokens,
    TotalTokens,
)
from agentkv.trace.model import Request, Session, Trace, TraceError


class _Item(msgspec.Struct, gc=False):
    """A request or a sub-agent entry as stored; schema checks (types, signs, bounds) happen in C."""

    t: Seconds | None = None
    type: str = "n"
    model: str = ""
    in_: Tokens | None = msgspec.field(default=None, name="in")
    out: Tokens | None = None
    hash_ids: msgspec.Raw = msgspec.Raw(b"[]")  # decoded per turn by `_Ids`, sharing prefixes
    input_types: list[str] = []
    output_types: list[str] = []
    stop: str | None = None
    api_time: Seconds | None = None
    ttft: Seconds | None = None
    think_time: Seconds | None = None
    agent_id: str | None = None
    subagent_type: str | None = None
    duration_ms: Millis | None = None
    total_tokens: TotalTokens | None = None
    tool_use_count: Count | None = None
    status: str | None = None
    tool_tokens: Tokens = 0
    system_tokens: Tokens = 0
    requests: list[_Item] | None = None


class _Doc(msgspec.Struct, gc=False):
    requests: list[_Item]
    id: str | Int64 | None = None
    block_size: BlockSize = 64
    hash_id_scope: Literal["local", "global"] = "local"
    replay: Literal["session", "timestamp"] = "session"
    tool_tokens: Tokens = 0
    system_tokens: Tokens = 0


class _StrictItem(_Item):
    """`_Item` with `hash_ids` checked in place: decoded only to word the first error exactly."""

    hash_ids: list[HashId] = []
    requests: list[_StrictItem] | None = None


class _StrictDoc(_Doc):
    requests: list[_StrictItem]


_decode = msgspec.json.Decoder(_Doc).decode
_decode_strict = msgspec.json.Decoder(_StrictDoc).decode
_decode_ids = msgspec.json.Decoder(list[HashId]).decode


class _Ids:
    """Decodes a session's turns' `hash_ids`, reusing the previous turn's int objects for a shared
    prefix, so a long session holds its prefix ids once rather than once per turn."""

    __slots__ = ("raw", "ids")

    def __init__(self) -> None:
        self.raw, self.ids = b"[]", []

    def __call__(self, raw: bytes) -> list[int]:
        prev, ids = self.raw, self.ids
        if raw == prev:
            out = ids[:]
        elif ids and raw.startswith(prev[:-1]) and raw[len(prev) - 1 : len(prev)] == b",":
            out = ids + _decode_ids(b"[" + raw[len(prev) :])  # the common case: the turn appends
        else:
            out = _decode_ids(raw)
            lo, hi = 0, min(len(out), len(ids))
            while lo < hi:  # longest shared prefix, by C-level slice compares
                mid = (lo + hi + 1) // 2
                if out[:mid] == ids[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                out[:lo] = ids[:lo]
        self.raw, self.ids = raw, out
        return out


MAX_DEPTH = 100  # sub-agent nesting levels read


def sniff(path: Path, head: bytes) -> bool:
    s = head.lstrip()
    return s[:1] == b"{" and b'"requests"' in s and (b'"block_size"' in s or b'"hash_ids"' in s)


def _count(path: str, rec: str, key: str, v: int | None) -> int:
    if v is None:
        raise TraceError(path, rec, key, "missing")
    return v


def _request(path: str, bs: int, it: _Item, rec: str, ids: _Ids) -> Request:
    hash_ids = ids(bytes(it.hash_ids))  # a bad id raises here; `read` re-decodes strictly to word it
    if it.t is None:
        raise TraceError(path, rec, "t", "missing")
    n_in = _count(path, rec, "in", it.in_)
    limit = -(-n_in // bs)
    if len(hash_ids) > limit:
        raise TraceError(
            path,
            rec,
            "hash_ids",
            f"{len(hash_ids)} blocks but 'in' = {n_in} tokens implies at most {limit} blocks of {bs}",
        )
    return Request(
        t=it.t,
        input_tokens=n_in,
        output_tokens=_count(path, rec, "out", it.out),
        hash_ids=hash_ids,
        think_time=it.think_time or 0.0,
        model=it.model,
        kind=it.type,
        stop=it.stop or "",
        api_time=it.api_time,
        ttft=it.ttft,
        input_types=it.input_types,
        output_types=it.output_types,
    )


def _session(path: str, bs: int, src: _Item | _Doc, sid: str, prefix: str, t: float) -> Session:
    s = Session(id=sid, t=t, tool_tokens=src.tool_tokens, system_tokens=src.system_tokens)
    if isinstance(src, _Item):
        s.agent_type, s.status = src.subagent_type or "", src.status or ""
        s.total_tokens, s.tool_use_count = src.total_tokens, src.tool_use_count
        s.duration = src.duration_ms / 1000.0 if src.duration_ms is not None else None
    ids = _Ids()
    for i, it in enumerate(src.requests or ()):
        rec = f"{prefix}requests[{i}]"
        if it.type in ("n", "s"):
            s.requests.append(_request(path, bs, it, rec, ids))
        elif it.type == "subagent":
            if prefix.count(".") >= MAX_DEPTH:  # real traces nest 1-3 deep; this keeps recursion bounded
                raise TraceError(path, rec, "requests", f"sub-agents nested more than {MAX_DEPTH} deep")
            if it.t is None:
                raise TraceError(path, rec, "t", "missing")
            if it.requests is None:
                raise TraceError(path, rec, "requests", "missing (a sub-agent needs a list of requests)")
            agent = it.agent_id or f"agent_{len(s.subagents) + 1:03d}"
            # spawn = end - duration, rounded as the file's times are (microseconds at most)
            spawn = max(0.0, round(it.t - it.duration_ms / 1000.0, 6)) if it.duration_ms is not None else it.t
            s.subagents.append(_session(path, bs, it, f"{sid}/{agent}", rec + ".", spawn))
        else:
            raise TraceError(
                path, rec, "type", f"unknown request type {it.type!r} (expected 'n', 's' or 'subagent')"
            )
    s.subagents.sort(key=lambda a: (a.t, _end_t(a)))  # the model keeps sub-agents in spawn order
    return s


def read(path: Path, data: bytes) -> list[Trace]:
    try:
        doc = _decode(data)
    except msgspec.DecodeError as e:
        raise from_msgspec(str(path), e, top="top level") from None
    except RecursionError:
        raise TraceError(str(path), None, None, "invalid JSON: nested too deeply") from None
    tid = str(doc.id) if doc.id not in (None, "") else path.name.split(".")[0]
    try:
        root = _session(str(path), doc.block_size, doc, tid, "", 0.0)
    except (TraceError, msgspec.DecodeError) as e:
        _strict(path, data)  # a bad hash id anywhere is reported first, as a one-pass decode would
        if isinstance(e, TraceError):
            raise
        raise from_msgspec(str(path), e, top="top level") from None
    return [
        Trace(
            id=tid,
            block_size=doc.block_size,
            session=root,
            hash_id_scope=doc.hash_id_scope,
            source=str(path),
            format="agentx",
            replay=doc.replay,
        )
    ]


def _strict(path: Path, data: bytes) -> None:
    """Decode `data` checking every hash id in place; raise its first error (in file order)."""
    try:
        _decode_strict(data)
    except msgspec.DecodeError as e:
        raise from_msgspec(str(path), e, top="top level") from None


# ---------------------------------------------------------------------------------------------- writer


def _models(requests: list[Request]) -> list[str]:
    return list(dict.fromkeys(r.model for r in requests if r.model))


def _ms(seconds: float) -> int | float:
    """Seconds as the milliseconds the format stores: the shortest nearby value that reads back
    (as ms / 1000) to the same float, when one exists."""
    x = seconds * 1000.0
    near = [x, math.nextafter(x, math.inf), math.nextafter(x, -math.inf)]
    for c in (
        round(x),
        round(x, 3),
        *near,
        math.nextafter(near[1], math.inf),
        math.nextafter(near[2], -math.inf),
    ):
        if c / 1000.0 == seconds:
            return c
    return x


def _request_doc(r: Request) -> dict:
    d = {
        "t": r.t,
        "type": r.kind,
        "model": r.model,
        "in": r.input_tokens,
        "out": r.output_tokens,
        "hash_ids": r.hash_ids,
        "input_types": r.input_types,
        "output_types": r.output_types,
        "stop": r.stop,
    }
    if r.api_time is not None:
        d["api_time"] = r.api_time
    if r.ttft is not None:
        d["ttft"] = r.ttft
    d["think_time"] = r.think_time
    return d


def _items(s: Session) -> list[dict]:
    """Requests and sub-agents merged by time, each list keeping its own order; requests win ties."""
    out: list[dict] = []
    subs, j = sorted(s.subagents, key=_end_t), 0  # placed by their recorded end, as the originals
    for r in s.requests:
        while j < len(subs) and _end_t(subs[j]) < r.t:
            out.append(_subagent_doc(subs[j], s.id))
            j += 1
        out.append(_request_doc(r))
    out.extend(_subagent_doc(sub, s.id) for sub in subs[j:])
    return out


def _end_t(s: Session) -> float:
    """A sub-agent's AgentX `t`: its end (spawn + duration), rounded to the file's microseconds."""
    return round(s.t + s.duration, 6) if s.duration is not None else s.t


def _subagent_doc(s: Session, parent_id: str) -> dict:
    agent = s.id[len(parent_id) + 1 :] if s.id.startswith(parent_id + "/") else s.id
    d: dict = {"t": _end_t(s), "type": "subagent", "agent_id": agent, "subagent_type": s.agent_type}
    if s.duration is not None:
        d["duration_ms"] = _ms(s.duration)
    if s.total_tokens is not None:
        d["total_tokens"] = s.total_tokens
    if s.tool_use_count is not None:
        d["tool_use_count"] = s.tool_use_count
    d.update(
        status=s.status,
        requests=_items(s),
        models=_models(s.requests),
        tool_tokens=s.tool_tokens,
        system_tokens=s.system_tokens,
    )
    return d


def _tokens(sessions) -> dict:
    reqs = [r for s in sessions for r in s.requests]
    return {"input": sum(r.input_tokens for r in reqs), "output": sum(r.output_tokens for r in reqs)}


def to_agentx(trace: Trace) -> dict:
    """The AgentX document for a trace (the root session's own fields sit at the top level)."""
    root = trace.session
    subs = [s for s in trace.sessions() if s is not root]
    for s in (root, *subs):
        for i, r in enumerate(s.requests):
            if r.kind not in ("n", "s"):
                raise TraceError(
                    trace.source or trace.id,
                    f"session {s.id} request {i}",
                    "kind",
                    f"{r.kind!r} cannot be saved as AgentX (expected 'n' or 's')",
                )
    parent, sub = _tokens([root]), _tokens(subs)
    doc: dict = {
        "id": trace.id,
        "models": _models(root.requests),
        "block_size": trace.block_size,
        "hash_id_scope": trace.hash_id_scope,
    }
    if trace.replay != "session":
        doc["replay"] = trace.replay  # an extension: Mooncake traces replay by arrival time
    doc.update(tool_tokens=root.tool_tokens, system_tokens=root.system_tokens, requests=_items(root))
    doc["totals"] = {
        "parent_tokens": parent,
        "subagent_tokens": sub,
        "combined_tokens": {k: parent[k] + sub[k] for k in parent},
        "subagent_count": len(subs),
    }
    return doc


def write_agentx(trace: Trace, path: str | Path) -> Path:
    """Save `trace` as AgentX JSON at `path` (gzip when the name ends with .gz); returns the path."""
    path = Path(path)
    data = msgspec.json.encode(to_agentx(trace))
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    try:
        path.write_bytes(data)
    except OSError as e:
        raise TraceError(str(path), None, None, f"cannot write: {e.strerror or e}") from None
    return path
