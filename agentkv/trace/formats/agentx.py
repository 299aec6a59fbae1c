"""AgentX / kv-cache-tester JSON traces: one session tree per file, sub-agents nested inline.

Top level: `id, block_size, hash_id_scope, tool_tokens, system_tokens, requests[]`. A request is
`{t, type: "n"|"s", model, in, out, hash_ids, input_types, output_types, stop, api_time,
think_time, ttft}`; a sub-agent is `{t, type: "subagent", agent_id, subagent_type, duration_ms,
status, tool_tokens, system_tokens, requests[]}` whose requests count `t` from its spawn.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from agentkv.trace.model import Request, Session, Trace, TraceError

_json = msgspec.json.Decoder()


def sniff(path: Path, head: bytes) -> bool:
    s = head.lstrip()
    return s[:1] == b"{" and b'"requests"' in s and (b'"block_size"' in s or b'"hash_ids"' in s)


class _Ctx:
    __slots__ = ("path", "block_size")

    def __init__(self, path: str, block_size: int):
        self.path, self.block_size = path, block_size

    def err(self, rec: str, field: str | None, msg: str) -> TraceError:
        return TraceError(self.path, rec, field, msg)


def _num(ctx: _Ctx, d: dict, key: str, rec: str, *, required: bool, integer: bool = False,
         default=None):
    v = d.get(key, None)
    if v is None:
        if required:
            raise ctx.err(rec, key, "missing")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ctx.err(rec, key, f"expected a number, got {type(v).__name__} {v!r:.40}")
    if integer and not (isinstance(v, int) or float(v).is_integer()):
        raise ctx.err(rec, key, f"expected an integer, got {v!r}")
    if not math.isfinite(v) or v < 0:
        raise ctx.err(rec, key, f"must be a finite number >= 0, got {v!r}")
    return int(v) if integer else float(v)


def _strs(ctx: _Ctx, d: dict, key: str, rec: str) -> list[str]:
    v = d.get(key) or []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ctx.err(rec, key, "expected a list of strings")
    return v


def _request(ctx: _Ctx, d: dict, rec: str) -> Request:
    n_in = _num(ctx, d, "in", rec, required=True, integer=True)
    n_out = _num(ctx, d, "out", rec, required=True, integer=True)
    hash_ids = d.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise ctx.err(rec, "hash_ids", "expected a list of non-negative integers")
    limit = -(-n_in // ctx.block_size)
    if len(hash_ids) > limit:
        raise ctx.err(rec, "hash_ids", f"{len(hash_ids)} blocks but 'in' = {n_in} tokens implies at most "
                                       f"{limit} blocks of {ctx.block_size}")
    model = d.get("model", "")
    stop = d.get("stop", "") or ""
    if not isinstance(model, str):
        raise ctx.err(rec, "model", "expected a string")
    if not isinstance(stop, str):
        raise ctx.err(rec, "stop", "expected a string")
    return Request(
        t=_num(ctx, d, "t", rec, required=True),
        input_tokens=n_in,
        output_tokens=n_out,
        hash_ids=hash_ids,
        think_time=_num(ctx, d, "think_time", rec, required=False, default=0.0),
        model=model,
        kind=d.get("type", "n"),
        stop=stop,
        api_time=_num(ctx, d, "api_time", rec, required=False),
        ttft=_num(ctx, d, "ttft", rec, required=False),
        input_types=_strs(ctx, d, "input_types", rec),
        output_types=_strs(ctx, d, "output_types", rec),
    )


def _session(ctx: _Ctx, d: dict, sid: str, rec_prefix: str, t: float) -> Session:
    reqs = d.get("requests")
    if not isinstance(reqs, list):
        raise ctx.err(rec_prefix or "top level", "requests", "expected a list of requests")
    dur = d.get("duration_ms")
    s = Session(
        id=sid, t=t,
        agent_type=str(d.get("subagent_type", "") or ""),
        status=str(d.get("status", "") or ""),
        system_tokens=_num(ctx, d, "system_tokens", rec_prefix, required=False, integer=True, default=0),
        tool_tokens=_num(ctx, d, "tool_tokens", rec_prefix, required=False, integer=True, default=0),
        duration=dur / 1000.0 if isinstance(dur, (int, float)) and not isinstance(dur, bool) else None,
    )
    for i, r in enumerate(reqs):
        rec = f"{rec_prefix}requests[{i}]"
        if not isinstance(r, dict):
            raise ctx.err(rec, None, f"expected an object, got {type(r).__name__}")
        kind = r.get("type", "n")
        if kind == "subagent":
            sub_t = _num(ctx, r, "t", rec, required=True)
            agent = r.get("agent_id") or f"agent_{len(s.subagents) + 1:03d}"
            s.subagents.append(_session(ctx, r, f"{sid}/{agent}", rec + ".", sub_t))
        elif kind in ("n", "s"):
            s.requests.append(_request(ctx, r, rec))
        else:
            raise ctx.err(rec, "type", f"unknown request type {kind!r} (expected 'n', 's' or 'subagent')")
    return s


def read(path: Path, data: bytes) -> list[Trace]:
    try:
        doc = _json.decode(data)
    except msgspec.DecodeError as e:
        raise TraceError(str(path), None, None, f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise TraceError(str(path), None, None, "expected a JSON object with 'requests'")
    bs = doc.get("block_size", 64)
    if type(bs) is not int or bs <= 0:
        raise TraceError(str(path), "top level", "block_size", f"expected a positive integer, got {bs!r}")
    ctx = _Ctx(str(path), bs)
    tid = doc.get("id") or path.name.split(".")[0]
    scope = doc.get("hash_id_scope", "local")
    return [Trace(id=str(tid), block_size=bs, session=_session(ctx, doc, str(tid), "", 0.0),
                  hash_id_scope=str(scope), source=str(path), format="agentx")]
