"""Trace requests as block accesses: the keys each request reads, in arrival order.

Two orders. By timestamps (the default): every trace starts at t=0 and each request arrives at
its recorded time, so sessions interleave as they ran. By concurrency N: the replay plan
runs N sessions at a time on a virtual clock where each request takes its recorded
`api_time`, and the next session starts when one ends. Block keys are `chain_keys` of the
engine block size, as the simulator's: a 16-token block splits a 64-token trace block in 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from agentkv.errors import UserError
from agentkv.trace.blocks import chain_keys
from agentkv.trace.model import Request, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One request's block accesses: when it arrives and ends, its session and its block hashes."""

    time: float
    end: float
    session: str  # "trace:session", plus "/side" for side calls (kind "s"): a lane of its own
    hashes: list[int]
    input_tokens: int
    output_tokens: int
    stop: str
    last: bool  # the lane's last request


class Arrival(NamedTuple):
    """One request placed on the replay clock, with its hash-id space and session lane."""

    start: float
    end: float
    space: str  # key space of its hash ids: one run of a trace, or a whole file for global ids
    lane: str  # its session for session hints; side calls (kind "s") are a lane of their own
    trace: Trace
    request: Request


def _lane(run: str, session_id: str, r: Request) -> str:
    return f"{run}:{session_id}{'/side' if r.kind == 's' else ''}"


def arrivals(traces: Sequence[Trace], concurrency: int | None = None) -> list[Arrival]:
    """Every request with its (start, end), in arrival order; `end` is start + recorded `api_time`.

    `concurrency=None`: every trace from t=0 at its recorded times. Otherwise `concurrency` lanes
    of the replay plan take the traces in the given order, real gaps kept (no idle-gap cap);
    timestamp-mode traces (Mooncake) keep their own arrival times either way.
    """
    if concurrency is not None and concurrency < 1:
        raise UserError(f"--concurrency: must be at least 1, got {concurrency}")
    out: list[tuple[float, int, int, Arrival]] = []
    if concurrency is None:
        for ti, t in enumerate(traces):
            run = f"{t.id}#{ti}"
            space = t.hash_space(run)
            for k, x in enumerate(t.timeline()):
                r = x.request
                a = Arrival(x.time, x.time + (r.api_time or 0.0), space, _lane(run, x.session.id, r), t, r)
                out.append((x.time, ti, k, a))
    else:
        plan = ReplayPlan(traces, lanes=concurrency, idle_gap_cap=None)
        for sp in simulate_schedule(plan, lambda item: item.request.api_time or 0.0):
            it = sp.item
            a = Arrival(
                sp.start,
                sp.end,
                it.hash_space,
                _lane(it.tree_key, it.session.id, it.request),
                it.trace,
                it.request,
            )
            out.append((sp.start, it.id, 0, a))
    out.sort(key=lambda x: x[:3])
    return [x[3] for x in out]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two key arrays."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    eq = a[:m] == b[:m]
    return m if eq.all() else int(eq.argmin())


def block_accesses(arrivals: Sequence[Arrival], block_size: int) -> list[BlockRequest]:
    """One `BlockRequest` per arrival, its hashes the chained keys of `block_size`-token blocks.

    A request shares the key objects of its common prefix with the previous request of its
    lane or of its hash space, so the lists of a long session cost one pointer per block.
    """
    by_lane: dict[str, tuple[np.ndarray, list[int]]] = {}
    by_space: dict[str, tuple[np.ndarray, list[int]]] = {}
    out: list[BlockRequest] = []
    for a in arrivals:
        r = a.request
        keys = chain_keys(a.space, r.hash_ids, a.trace.block_size, block_size, r.input_tokens)
        best, shared = 0, None
        for prev in (by_lane.get(a.lane), by_space.get(a.space)):
            if prev is not None and (c := _common(prev[0], keys)) > best:
                best, shared = c, prev[1]
        hashes = shared[:best] + keys[best:].tolist() if shared is not None else keys.tolist()
        by_lane[a.lane] = by_space[a.space] = (keys, hashes)
        out.append(
            BlockRequest(a.start, a.end, a.lane, hashes, r.input_tokens, r.output_tokens, r.stop, False)
        )
    last = {r.session: i for i, r in enumerate(out)}
    for i in last.values():
        r = out[i]
        out[i] = BlockRequest(
            r.time, r.end, r.session, r.hashes, r.input_tokens, r.output_tokens, r.stop, True
        )
    return out
