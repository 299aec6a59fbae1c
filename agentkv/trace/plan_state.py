"""The replay plan's per-session state: precomputed timing, live session trees and timestamp cursors.

`ReplayPlan` (agentkv.trace.plan) owns the heap and the rules; these classes hold what it tracks.
"""

from __future__ import annotations

from agentkv.errors import UserError
from agentkv.trace.model import Session, Trace

CYCLE_MODES = ("fresh", "shared")


def cycle_mode(cycle: bool | str | None) -> str | None:
    """A plan's `cycle`: None (no cycling), "fresh" (True: later passes share no cache with earlier
    ones) or "shared" (every pass keys its hash ids as the first did)."""
    if cycle is None or cycle is False:
        return None
    mode = "fresh" if cycle is True else cycle
    if mode not in CYCLE_MODES:
        raise UserError(f"replay plan: cycle must be one of {', '.join(CYCLE_MODES)}, got {cycle!r}")
    return mode


def cycle_space(trace: Trace, replay: int, mode: str | None) -> str:
    """The hash space of pass `replay` of a trace in a cycling plan, or "" for the default one.

    Local ids already differ per live tree; global (file-wide) ids get one space per pass when
    "fresh". "shared" keys every pass like the first.
    """
    if not mode or not replay:
        return ""
    if mode == "shared":
        return trace.hash_space(f"{trace.id}#0")
    return "" if trace.hash_id_scope == "local" else f"{trace.hash_space('')}@{replay}"


class Timing:
    """Per-session timing precomputed once: scaled gaps, spawn anchors and join gates."""

    __slots__ = ("gaps", "anchored", "loose", "anchor", "gates")

    def __init__(self, s: Session, scale: float):
        rs = s.requests
        thinks = any(r.think_time > 0 for r in rs[1:])  # else the trace carries no think times
        self.gaps = [scale * rs[0].t] if rs else []
        for prev, r in zip(rs, rs[1:], strict=False):
            g = r.think_time if thinks else r.t - prev.t - (prev.api_time or 0.0)
            self.gaps.append(scale * max(0.0, g))
        self.anchored: dict[int, list[tuple[int, float]]] = {}
        self.loose: list[tuple[int, float]] = []
        self.anchor: list[int] = []
        self.gates: dict[int, list[int]] = {}
        for c, sub in enumerate(s.subagents):
            j = max((i for i, r in enumerate(rs) if r.t <= sub.t), default=-1)
            self.anchor.append(j)
            if j < 0:
                self.loose.append((c, scale * max(0.0, sub.t)))
            else:
                a = rs[j]
                self.anchored.setdefault(j, []).append(
                    (c, scale * max(0.0, sub.t - a.t - (a.api_time or 0.0)))
                )
            end = sub.t + _length(sub)
            gate = next((i for i in range(j + 1, len(rs)) if rs[i].t >= end), None)
            if gate is not None and _sends(sub):  # a sub-agent that sends nothing holds nothing up
                self.gates.setdefault(gate, []).append(c)


def _sends(s: Session) -> bool:
    """Whether a session or any of its sub-agents has a request to send."""
    return bool(s.requests) or any(_sends(c) for c in s.subagents)


def _length(s: Session) -> float:
    """Recorded length of a sub-agent: its duration, else its last request's end or child's end."""
    if s.duration is not None:
        return s.duration
    ends = [r.t + (r.api_time or 0.0) for r in s.requests] + [c.t + _length(c) for c in s.subagents]
    return max(ends, default=0.0)


class Tree:
    """One replay of a trace on a lane: its sessions, requests in flight, and whether it has drained."""

    __slots__ = ("lane", "trace", "replay", "key", "runs", "inflight", "finished")

    def __init__(self, lane: int, trace: Trace, replay: int):
        self.lane, self.trace, self.replay = lane, trace, replay
        self.key = f"{trace.id}#{replay}"
        self.runs: list[Run] = []
        self.inflight = 0
        self.finished = False


class Run:
    """One live session: at most one request armed or in flight, plus its sub-agents' state."""

    __slots__ = (
        "tree",
        "session",
        "info",
        "parent",
        "cidx",
        "depth",
        "key",
        "next",
        "n",
        "busy",
        "live",
        "cdone",
        "waiting",
        "gkey",
        "hkey",
        "hseq",
        "started",
        "resumed",
    )

    def __init__(
        self,
        tree: Tree,
        session: Session,
        info: Timing,
        parent: Run | None,
        cidx: int,
        depth: int,
        skip: int = 0,
    ):
        self.tree, self.session, self.info, self.parent, self.cidx, self.depth = (
            tree,
            session,
            info,
            parent,
            cidx,
            depth,
        )
        self.key = f"{session.id}#{tree.replay}"
        self.next, self.n, self.busy = skip, len(session.requests), False
        # a warm-start skip drops the sub-agents anchored to skipped requests (or to the start)
        skipped = {c for c, j in enumerate(info.anchor) if j < skip} if skip else set()
        self.live = len(session.subagents) - len(skipped)
        self.cdone = skipped
        self.waiting: set[int] | None = None
        self.gkey = 0.0
        self.hkey, self.hseq = 0.0, -1
        self.started, self.resumed = False, skip > 0
        tree.runs.append(self)


class Cursor:
    """A timestamp-mode trace: its requests in arrival order, each due at its own time."""

    __slots__ = ("trace", "rows", "i", "base", "hkey", "hseq", "replay")

    def __init__(self, trace: Trace):
        rows = []
        for start, depth, s in trace.session.walk():
            rows.extend((start + r.t, len(rows), s, r, i, depth) for i, r in enumerate(s.requests))
        rows.sort(key=lambda x: (x[0], x[1]))
        self.trace, self.rows, self.i, self.base, self.replay = trace, rows, 0, 0.0, 0
        self.hkey, self.hseq = 0.0, -1

    def item(self, make, item_id: int, mode: str | None):
        """The next row as `make(...)` (a PlanItem, lane -1) of this pass; the cursor moves past it."""
        _, _, s, r, i, depth = self.rows[self.i]
        self.i += 1
        tid, n = self.trace.id, self.replay
        space = cycle_space(self.trace, n, mode)
        return make(item_id, -1, self.trace, n, s, r, i, depth, f"{s.id}#{n}", f"{tid}#{n}", False, space)

    def next_cycle(self, scale: float) -> bool:
        """Start the next pass: the first arrival one mean inter-arrival gap after the last one."""
        first, last = self.rows[0][0], self.rows[-1][0]
        gap = (last - first) / (len(self.rows) - 1) if last > first else 1.0
        self.base += scale * (last - first + gap)
        self.i, self.replay = 0, self.replay + 1
        return True
