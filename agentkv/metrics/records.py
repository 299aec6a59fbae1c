"""The per-request record: one schema written by `agentkv bench` (measured) and `agentkv simulate`.

Times are seconds from the run's start. `scheduled` is when the replay plan said the request was
due; latencies count from it, so a slow client or a saturated server cannot hide queueing
(no coordinated omission).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from agentkv.trace.plan import PlanItem


class RequestRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int
    trace: str
    session: str  # live session key (session id + replay number)
    tree: str = ""  # live session tree (root session + its sub-agents): trace id + replay number
    lane: int = -1
    depth: int = 0  # 0: main session; 1+: sub-agent
    index: int = 0  # request position in its session
    worker: str = ""  # which engine served it (URL or simulated worker index)
    scheduled: float = 0.0  # due time per the replay plan
    sent: float = 0.0  # when the client actually sent it
    first_token: float | None = None
    end: float = 0.0
    ttft: float | None = None  # first_token - scheduled
    e2e: float = 0.0  # end - scheduled
    tpot: float | None = None  # (end - first_token) / (output_tokens - 1)
    itl_max: float | None = None  # longest gap between two tokens
    itls: list[float] = msgspec.field(default_factory=list)  # bench: every gap between two tokens, to the us
    input_tokens: int = 0  # prompt tokens as the server counted them (usage.prompt_tokens), else the trace's
    trace_input_tokens: int = 0  # the trace's input tokens, which the ceiling counts against (0: old record)
    output_tokens: int = 0  # tokens actually received
    expected_output_tokens: int = 0  # max_tokens asked (the trace's recorded output)
    cached_tokens: int | None = None  # server-reported usage.prompt_tokens_details.cached_tokens, <= input
    cached_reported: int | None = None  # the server's figure when outside 0..input_tokens (clipped)
    cached_by_tier: dict[str, int] = msgspec.field(default_factory=dict)  # simulate: GPU/CPU/DISK
    ceiling_tokens: int = 0  # hit tokens an unbounded prefix cache would give (trace ceiling)
    queue_s: float | None = None  # simulate: arrival -> first scheduled
    preemptions: int = 0
    clock: str = ""  # "engine": ttft, tpot, itl_max and e2e are the target's own (agentkv serve's) times
    engine_arrival: float | None = None  # agentkv serve: when its engine saw the request (engine clock)
    engine_id: str = ""  # agentkv serve: which engine's clock engine_arrival is on (one per worker)
    ok: bool = True
    error: str = ""  # reason when not ok: http_500, timeout, reset, context_overflow, not_streamed, ...
    http_status: int = 0  # the server's HTTP status when not ok (0: no HTTP answer)
    error_detail: str = ""  # when not ok: the first 512 bytes of the error body, or what went wrong
    recorded_api_time: float | None = None
    recorded_ttft: float | None = None
    warmup: bool = False  # sent during bench --warmup: left out of every statistic


def record_for(item: PlanItem, scheduled: float, **measured) -> RequestRecord:
    """The record of a replayed plan item: where it sits in the replay and what its trace recorded,
    then what bench measured or simulate computed (`measured` may override `input_tokens`).

    Cached tokens outside 0..prompt tokens are clipped into it; the reported figure stays in `cached_reported`."""
    r = item.request
    fields = {
        "id": item.id,
        "trace": item.trace.id,
        "session": item.session_key,
        "tree": item.tree_key,
        "lane": item.lane,
        "depth": item.depth,
        "index": item.index,
        "scheduled": scheduled,
        "input_tokens": r.input_tokens,
        "trace_input_tokens": r.input_tokens,
        "recorded_api_time": r.api_time,
        "recorded_ttft": r.ttft,
    }
    fields.update(measured)
    cached = fields.get("cached_tokens")
    if cached is not None and not 0 <= cached <= fields["input_tokens"]:
        fields["cached_reported"] = cached
        fields["cached_tokens"] = min(max(cached, 0), fields["input_tokens"])
    return RequestRecord(**fields)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(RequestRecord)


def encode_record(r: RequestRecord) -> bytes:
    return _enc.encode(r)


def decode_record(line: bytes | str) -> RequestRecord:
    return _dec.decode(line)


def read_records(path) -> list[RequestRecord]:
    """Records from a requests.jsonl; a torn last line (crash mid-write) is skipped."""
    out = []
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(_dec.decode(line))
        except msgspec.DecodeError:
            if i == len(lines) - 1:
                break
            raise
    return out
