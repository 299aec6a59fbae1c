"""Re-run a recorded bench run on the simulated engine: each request arrives when bench sent it.

The requests come from the run's requests.jsonl (trace, session, turn, send time, output length);
their hash ids from the same trace files, keyed as bench and simulate key them, so the engine sees
the sharing the live target saw. Open loop: a request arrives at its measured send time (plus the
profile's per-request and per-prompt-token overheads, queued in send order through one front end),
whatever the engine predicts for the turn before it."""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, read_records
from agentkv.trace.blocks import chain_keys
from agentkv.trace.model import Request, Trace

# An arrival this close after a step's end (engine seconds) joins the step that starts there: serve
# stamps a request that came while its loop was late exactly at that end, and moving the stamp onto
# the client's clock must not round it a hair after the predicted end (it then waited a whole step).
TIE_S = 1e-6


@dataclass(slots=True)
class Run:
    """A bench run folder: its summary's config and its succeeded request records."""

    path: Path
    config: dict
    records: list[RequestRecord]
    failed: int


@dataclass(slots=True)
class Predicted:
    """What the engine predicts for one record: engine-clock times and cached prompt tokens."""

    arrival: float
    first_token: float
    end: float
    output_tokens: int
    cached_tokens: int


def load_run(run_dir: str | Path) -> Run:
    """summary.json (a bench one) and requests.jsonl of `run_dir`; UserError names a missing or bad file."""
    d = Path(run_dir)
    summ, reqs = d / "summary.json", d / "requests.jsonl"
    for f in (summ, reqs):
        if not f.is_file():
            raise UserError(f"{f}: not found (give the --out folder of an `agentkv bench` run)")
    try:
        doc = json.loads(summ.read_text())
        records = read_records(reqs)
    except (OSError, ValueError) as e:
        raise UserError(f"{d}: cannot read the run ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "bench":
        raise UserError(f"{summ}: not the summary of an `agentkv bench` run (kind {doc.get('kind')!r})")
    ok = [r for r in records if r.ok]
    if not ok:
        raise UserError(f"{reqs}: no succeeded request to predict")
    return Run(d, doc.get("config") or {}, ok, len(records) - len(ok))


def trace_requests(run: Run, traces: list[Trace]) -> list[tuple[RequestRecord, Trace, Request]]:
    """Each record with its trace and trace request (found by trace id, session id and turn);
    UserError when the traces given are not the run's."""
    by_id = {t.id: t for t in traces}
    want = set(run.config.get("traces") or [r.trace for r in run.records])
    missing = sorted(want - set(by_id))
    if missing:
        raise UserError(
            f"{run.path}: the run replayed traces that were not given: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    sessions = {t.id: {s.id: s for s in t.sessions()} for t in traces if t.id in want}
    out = []
    for r in run.records:
        s = sessions[r.trace].get(r.session.rsplit("#", 1)[0])
        if s is None or not 0 <= r.index < len(s.requests):
            raise UserError(
                f"{run.path}/requests.jsonl: record {r.id}: trace {r.trace} has no session turn "
                f"{r.session}[{r.index}] (a different version of the trace?)"
            )
        out.append((r, by_id[r.trace], s.requests[r.index]))
    return out


@dataclass(slots=True)
class Clocks:
    """Each engine's clock against the client's (engine id -> client less engine seconds; "" for
    stamps that name no engine) and how the arrivals were placed, in a line for prediction.json."""

    offsets: dict[str, float]
    note: str


def _stamped(r: RequestRecord) -> bool:
    return (
        r.clock == "engine"
        and r.engine_arrival is not None
        and r.first_token is not None
        and r.ttft is not None
    )


def clock_offsets(records: list[RequestRecord], one_server: bool = True) -> Clocks:
    """Per engine, the client's clock less its clock: the least gap between a first token's engine
    stamp and its reading by the client (the fastest delivery). Each agentkv serve engine runs its
    own clock, so a run through `agentkv route` to several workers gets one offset per engine. Stamps
    that name no engine (older serve) share one offset only when the target was one agentkv serve
    (`one_server`: it answered /server_info, a router does not) and no other stamp names one; else
    those arrivals are their first token less their engine TTFT, which needs no engine clock."""
    gaps: dict[str, float] = {}
    for r in records:
        if _stamped(r):
            g = r.first_token - r.ttft - r.engine_arrival
            gaps[r.engine_id] = min(g, gaps.get(r.engine_id, g))
    if not gaps:
        engine = any(
            r.clock == "engine" and r.first_token is not None and r.ttft is not None for r in records
        )
        how = "first token less engine TTFT" if engine else "send time plus the profile's overheads"
        return Clocks({}, f"arrivals: {how} (client clock)")
    named = len(gaps) - ("" in gaps)
    if "" in gaps and (named or not one_server):
        del gaps[""]
        why = "other stamps name theirs" if named else "the target was not one agentkv serve (a router?)"
        left = "first token less engine TTFT (client clock) for stamps naming no engine"
        return Clocks(gaps, f"arrivals: {named} engine clock(s) told apart; {left}: {why}")
    if named > 1:
        return Clocks(gaps, f"arrivals: {named} engines' stamps, each on its own clock and offset")
    return Clocks(gaps, "arrivals: one engine's stamps, moved onto the client's clock")


def stamped_arrival(r: RequestRecord, offsets: dict[str, float] | None = None) -> float | None:
    """When the request reached the engine by the engine's own clock, on the client's: agentkv
    serve's stamp moved by its engine's offset (`clock_offsets`), or its first token less its engine
    TTFT (which adds the token's delivery time); None for a request timed on the client's clock."""
    offset = (offsets or {}).get(r.engine_id) if r.engine_arrival is not None else None
    if r.clock == "engine" and offset is not None:
        return max(r.sent, r.engine_arrival + offset)
    if r.clock == "engine" and r.first_token is not None and r.ttft is not None:
        return max(r.sent, r.first_token - r.ttft)
    return None


def arrivals(
    records: list[RequestRecord], delay_s: tuple[float, ...], offsets: dict[str, float] | None = None
) -> dict[int, float]:
    """Record id -> when it reached the engine, on the client's clock: its engine stamp
    (`stamped_arrival`), else through one front end: in send order, each request's host delay (the
    profile's per-request and per-prompt-token overheads) starts once the request sent before it has
    been handed on. vLLM's API server is one process that takes requests one at a time, so a short
    prompt sent 1 ms after a long one does not overtake it, and prompts sent together queue
    (docs/cost-model.md, the live vLLM runs)."""
    out: dict[int, float] = {}
    free = float("-inf")  # when the front end is done with the request sent before
    for r in sorted(records, key=lambda r: (r.sent, r.id)):
        at = stamped_arrival(r, offsets)
        if at is None:
            at = free = max(r.sent, free) + delay_s[0] + delay_s[1] * r.input_tokens
        out[r.id] = at
    return out


def _add(eng: Engine, item: tuple[RequestRecord, Trace, Request], at: float, tenant_salts: bool) -> None:
    """Add a record's request to `eng`, arriving at `at`, keyed as bench and simulate key it."""
    r, tr, req = item
    space = tr.hash_space(r.tree)
    if tenant_salts and tr.hash_id_scope != "local":
        space = f"{space}|{r.tree}"
    keys = chain_keys(space, req.hash_ids, tr.block_size, eng.config.block_size, req.input_tokens)
    n_out = max(1, r.output_tokens)
    if req.input_tokens + n_out > eng.max_model_len:
        raise UserError(
            f"record {r.id}: {req.input_tokens} + {n_out} tokens exceed the predicted engine's "
            f"max_model_len {eng.max_model_len}; pass --max-model-len"
        )
    eng.add_request(
        str(r.id),
        max_tokens=n_out,
        prompt_len=req.input_tokens,
        block_hashes=keys.tolist(),
        session_id=r.tree,
        arrival=at,
        hash_array=keys,
    )


def replay(
    ecfg: EngineConfig,
    items: list[tuple[RequestRecord, Trace, Request]],
    delay_s: tuple[float, ...],
    tenant_salts: bool,
    clocks: Clocks | None = None,
) -> dict[int, Predicted]:
    """Run the records' requests on one engine in arrival order; record id -> prediction.

    `delay_s`: engine seconds before a sent request reaches the engine, per request, per prompt token
    and (optional third) per other request then in flight in the prediction (`fit.host_delay`);
    `clocks`: the engines' offsets (default: `clock_offsets` of the records); a request timed on
    agentkv serve's engine clock arrives at its stamp instead."""
    eng = Engine(ecfg)
    offsets = (clocks or clock_offsets([r for r, _, _ in items])).offsets
    at = arrivals([r for r, _, _ in items], delay_s, offsets)
    order = sorted(items, key=lambda x: (at[x[0].id], x[0].sent, x[0].id))
    base = [at[r.id] for r, _, _ in order]
    per_other = delay_s[2] if len(delay_s) > 2 else 0.0
    out: dict[int, Predicted] = {}
    live: dict[str, RequestRecord] = {}
    pending: list[tuple[float, int]] = []  # sent, not yet at the engine: (arrival, index in order)
    i, now, n = 0, 0.0, len(order)

    def due() -> float:  # the next arrival: the next sent request's or the earliest pending one's
        return min([*base[i : i + 1], *(a for a, _ in pending[:1])])

    while i < n or pending or eng.has_work():
        if not eng.has_work():
            now = max(now, due())
        while i < n and base[i] <= now + TIE_S:
            busy = per_other * (len(live) + len(pending)) if order[i][0].clock != "engine" else 0.0
            heapq.heappush(pending, (base[i] + busy, i))
            i += 1
        while pending and pending[0][0] <= now + TIE_S:
            at, j = heapq.heappop(pending)
            _add(eng, order[j], at, tenant_salts)
            live[str(order[j][0].id)] = order[j][0]
        eng.clock.advance_to(now)
        res = eng.step()
        if res is None:
            if i >= n and not pending:
                raise UserError(f"the predicted engine cannot schedule {eng.num_waiting} waiting requests")
            now = due()
            continue
        now = res.end
        for o in res.outputs:
            if o.finished:
                q = o.request
                r = live.pop(q.request_id)
                cached = q.num_cached_tokens + sum(q.lower_tier_tokens.values())
                out[r.id] = Predicted(q.arrival, q.first_token, q.finished_at, q.num_output, cached)
    return out
