"""The replay plan: one event-driven state machine that decides when each trace request is sent.

Both drivers use it unchanged, the simulator on a virtual clock and the benchmark on real time:
ask `next_due()`, send what `pop_due(now)` releases, report each end with `complete(id, now)`.
The rules (lanes, gaps, sub-agents, joins, idle caps, warm start, timestamps) are in docs/replay.md.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable

import msgspec

from agentkv.errors import UserError
from agentkv.trace.arrivals import Arrivals
from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.plan_state import Cursor, Run, Timing, Tree, cycle_mode, cycle_space


class PlanItem(msgspec.Struct, gc=False):
    """One request released for sending, with where it sits in the replay."""

    id: int  # unique in this plan, increasing in release order
    lane: int  # -1 for timestamp-mode traces
    trace: Trace
    replay: int  # how many times this trace id was started before in this plan (0 first)
    session: Session
    request: Request
    index: int  # position of `request` in `session.requests`
    depth: int  # 0 for the root session, 1 for its sub-agents, ...
    session_key: str  # "<session.id>#<replay>": one live session; for sticky routing and salts
    tree_key: str  # "<trace.id>#<replay>": the whole live session tree
    resumed: bool = False  # first request sent after a warm-start skip (its prefix was never sent)
    space: str = ""  # a cycling plan's hash space for this pass (plan_state.cycle_space); "": the default

    @property
    def hash_space(self) -> str:
        """Where its hash ids are keyed: this live session tree, or the file for global ids."""
        return self.space or self.trace.hash_space(self.tree_key)


class Dispatch(msgspec.Struct, gc=False):
    """A released item and the (possibly idle-shifted) time it was due."""

    due: float
    item: PlanItem


def _check(name: str, v: float | None, lo: float, *, allow_none: bool = True, strict: bool = False):
    if v is None and allow_none:
        return
    bad = v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
    if bad or v < lo or (strict and v == lo):
        raise UserError(
            f"replay plan: {name} must be a finite number {'>' if strict else '>='} {lo}, got {v!r}"
        )


def _count(name: str, v: int | None, allow_none: bool) -> None:
    if (v is not None or not allow_none) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise UserError(f"replay plan: {name} must be an integer >= 1, got {v!r}")


class ReplayPlan:
    """N session lanes over a shared trace queue (or trees arriving at `session_rate` per second, with
    `lanes` as a cap, None for none), plus timestamp-mode traces; see docs/replay.md.

    Times are whatever clock the driver uses (seconds). The plan never reads a clock itself.
    """

    def __init__(
        self,
        traces: Iterable[Trace],
        *,
        lanes: int | None = 16,
        seed: int = 0,
        shuffle: bool = False,
        cycle: bool | str | None = False,
        max_requests: int | None = None,
        warm_start: bool = False,
        idle_gap_cap: float | None = 10.0,
        lane_idle_gap_cap: float | None = None,
        time_scale: float = 1.0,
        session_rate: float | None = None,
        arrivals: str = "poisson",
    ):
        _count("lanes", lanes, allow_none=session_rate is not None)
        _count("max_requests", max_requests, allow_none=True)
        _check("idle_gap_cap", idle_gap_cap, 0.0)
        _check("lane_idle_gap_cap", lane_idle_gap_cap, 0.0)
        _check("time_scale", time_scale, 0.0, allow_none=False)
        self.traces: list[Trace] = []
        stamped: list[Trace] = []
        for t in traces:
            if t.replay not in ("session", "timestamp"):
                raise UserError(
                    f"{t.source or t.id}: trace {t.id}: replay must be 'session' or "
                    f"'timestamp', got {t.replay!r}"
                )
            if t.num_requests:
                (stamped if t.replay == "timestamp" else self.traces).append(t)
        if not self.traces and not stamped:
            raise UserError("replay plan: the traces hold no requests to replay")
        self.lanes, self.max_requests, self.warm_start = lanes, max_requests, warm_start
        self.cycle = cycle_mode(cycle)
        self.idle_gap_cap, self.lane_idle_gap_cap, self.time_scale = (
            idle_gap_cap,
            lane_idle_gap_cap,
            time_scale,
        )
        self._order_rng = random.Random(f"agentkv-plan-order-{seed}")
        self._warm_rng = random.Random(f"agentkv-plan-warm-{seed}")
        self._shuffle = shuffle
        self._queue: deque[int] = deque()
        self._refill()
        self._cursors = [Cursor(t) for t in stamped]
        self._info: dict[int, Timing] = {}
        self._replays: dict[str, int] = {}
        self._lane_used: set[int] = set()
        self.arrivals = None if session_rate is None else Arrivals(session_rate, arrivals, lanes, seed)
        self._heap: list[tuple[float, int, Run | Cursor]] = []
        self._seq = 0
        self._offset = 0.0  # heap keys are due + offset; a plan-wide idle shift raises it
        self._inflight: dict[int, Run | Cursor] = {}
        self._started = self._stopped = False
        self.released = self.completed = self.failed = self.trees_started = self.active_trees = 0

    # ---- driver API -------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Fill every lane with its first tree and arm timestamp traces; nothing is released yet."""
        if self._started:
            raise RuntimeError("replay plan already started")
        self._started = True
        if self._cursors:
            t0 = min(c.rows[0][0] for c in self._cursors)
            for c in self._cursors:  # `base` is a heap key: later idle shifts move the whole timeline
                c.base = now + self._offset - self.time_scale * t0
                self._push(c, c.base + self.time_scale * c.rows[0][0])
        if self.arrivals is not None and self.traces:  # the first tree arrives at once
            self._push(self.arrivals, now + self._offset)
        for lane in range(0 if self.arrivals is not None else self.lanes):
            self._pull(lane, now + self._offset)
        self._plan_shift(now)

    def next_due(self) -> float | None:
        """When the earliest pending item (or spawn) is due; None when nothing is pending."""
        heap = self._heap
        while heap and heap[0][2].hseq != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][0] - self._offset if heap else None

    def pop_due(self, now: float) -> list[Dispatch]:
        """Release every item due at or before `now`, in due order; they count as in flight."""
        out: list[Dispatch] = []
        heap, offset, inflight = self._heap, self._offset, self._inflight
        while heap and heap[0][0] - offset <= now and not self._stopped:  # as next_due computes it
            key, seq, obj = heapq.heappop(heap)
            if obj.hseq != seq:
                continue
            obj.hseq = -1
            if type(obj) is Cursor:
                item = obj.item(PlanItem, self.released, self.cycle)
                if obj.i < len(obj.rows) or (self.cycle and obj.next_cycle(self.time_scale)):
                    self._push(obj, obj.base + self.time_scale * obj.rows[obj.i][0])
            elif type(obj) is Arrivals:
                self._arrive(obj, key)
                continue
            elif not obj.started:
                self._begin(obj, key)
                continue
            else:
                i, tree = obj.next, obj.tree
                obj.next, obj.busy = i + 1, True
                item = PlanItem(
                    self.released,
                    tree.lane,
                    tree.trace,
                    tree.replay,
                    obj.session,
                    obj.session.requests[i],
                    i,
                    obj.depth,
                    obj.key,
                    tree.key,
                    obj.resumed,
                    cycle_space(tree.trace, tree.replay, self.cycle),
                )
                obj.resumed = False
                tree.inflight += 1
            inflight[item.id] = obj
            self.released += 1
            out.append(Dispatch(key - offset, item))
            if self.max_requests is not None and self.released >= self.max_requests:
                self.stop()
        if not inflight:
            self._plan_shift(now)
        return out

    def complete(self, item_id: int, now: float, ok: bool = True) -> None:
        """Item `item_id` ended at `now` (a failure, ok=False, still advances its session)."""
        obj = self._inflight.pop(item_id, None)
        if obj is None:
            raise ValueError(f"replay plan: item {item_id} is not in flight")
        self.completed += 1
        if not ok:
            self.failed += 1
        if type(obj) is Run:
            tree, info, nxt = obj.tree, obj.info, obj.next
            tree.inflight -= 1
            obj.busy = False
            if self._stopped:
                return
            key = now + self._offset
            if info.anchored:
                for c, delay in info.anchored.get(nxt - 1, ()):
                    self._spawn(obj, c, key + delay)
            if nxt < obj.n:
                if info.gates:
                    self._arm(obj, nxt, key + info.gaps[nxt])
                else:  # the common case, inlined: arm the next request
                    k, seq = key + info.gaps[nxt], self._seq
                    obj.hkey, obj.hseq, self._seq = k, seq, seq + 1
                    heapq.heappush(self._heap, (k, seq, obj))
            elif obj.live == 0:
                self._finish(obj, key)
            if self.lane_idle_gap_cap is not None and tree.inflight == 0 and not tree.finished:
                self._lane_shift(tree, key)
        if not self._inflight and not self._stopped:
            self._plan_shift(now)

    def stop(self) -> None:
        """Release nothing more (duration or request limit reached); in-flight items may still end."""
        self._stopped = True
        self._heap.clear()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def done(self) -> bool:
        """True once started with nothing in flight and nothing left to release: no more work."""
        return self._started and not self._inflight and self.next_due() is None

    # ---- internals --------------------------------------------------------------------------
    def _refill(self) -> None:
        order = list(range(len(self.traces)))
        if self._shuffle:
            self._order_rng.shuffle(order)
        self._queue.extend(order)

    def _push(self, obj: Run | Cursor, key: float) -> None:
        obj.hkey, obj.hseq = key, self._seq
        heapq.heappush(self._heap, (key, self._seq, obj))
        self._seq += 1

    def _get_info(self, s: Session) -> Timing:
        info = self._info.get(id(s))
        if info is None:
            info = self._info[id(s)] = Timing(s, self.time_scale)
        return info

    def _pull(self, lane: int, key: float) -> None:
        """Lane `lane` starts its next tree at heap key `key`, if the queue (or cycling) has one."""
        if self._stopped:
            return
        if not self._queue and self.cycle:
            self._refill()
        if not self._queue:
            return
        trace = self.traces[self._queue.popleft()]
        replay = self._replays.get(trace.id, 0)
        self._replays[trace.id] = replay + 1
        skip = 0
        if self.warm_start and lane not in self._lane_used:
            skip = self._warm_rng.randrange(len(trace.session.requests) or 1)
        self._lane_used.add(lane)
        self.trees_started += 1
        self.active_trees += 1
        tree = Tree(lane, trace, replay)
        root = Run(tree, trace.session, self._get_info(trace.session), None, -1, 0, skip)
        self._begin(root, key)

    def _begin(self, r: Run, key: float) -> None:
        """Session `r` starts at `key`: arm its first request and its pre-first-request sub-agents."""
        r.started = True
        for c, off in r.info.loose:
            if c not in r.cdone:
                self._spawn(r, c, key + off)
        if r.next < r.n:
            self._arm(r, r.next, key if r.resumed else key + r.info.gaps[r.next])
        elif r.live == 0:
            self._finish(r, key)

    def _spawn(self, parent: Run, c: int, key: float) -> None:
        sub = parent.session.subagents[c]
        self._push(Run(parent.tree, sub, self._get_info(sub), parent, c, parent.depth + 1), key)

    def _arm(self, r: Run, i: int, key: float) -> None:
        """Request `i` of `r` is ready at `key`, unless it must first join its gating sub-agents."""
        need = r.info.gates.get(i)
        if need:
            waiting = {c for c in need if c not in r.cdone}
            if waiting:
                r.waiting, r.gkey = waiting, key
                return
        self._push(r, key)

    def _finish(self, r: Run, key: float) -> None:
        """Session `r` has drained; tell its parent (join, drain) or free its lane."""
        while True:
            p = r.parent
            if p is None:
                tree = r.tree
                tree.finished = True
                self.active_trees -= 1
                if self.arrivals is None:
                    self._pull(tree.lane, key)
                else:
                    self._free_lane(tree.lane, key)
                return
            p.live -= 1
            p.cdone.add(r.cidx)
            if p.waiting is not None and r.cidx in p.waiting:
                p.waiting.discard(r.cidx)
                if not p.waiting:
                    p.waiting = None
                    self._push(p, max(p.gkey, key))
            if p.live or p.busy or p.next < p.n or not p.started:
                return
            r = p

    def _lane_shift(self, tree: Tree, key: float) -> None:
        """A tree with nothing in flight waits at most `lane_idle_gap_cap` for its next timer."""
        live = [r for r in tree.runs if r.hseq >= 0]
        if not live:
            return
        excess = min(r.hkey for r in live) - key - self.lane_idle_gap_cap
        if excess > 0:
            for r in live:
                self._push(r, r.hkey - excess)
            for r in tree.runs:
                if r.waiting is not None:
                    r.gkey -= excess

    def _plan_shift(self, now: float) -> None:
        """Nothing in flight anywhere: the next timer fires at most `idle_gap_cap` after `now`;
        session arrivals keep their own times (the rate is the load asked for)."""
        if self.idle_gap_cap is None:
            return
        due, a = self.next_due(), self.arrivals
        if a is not None and a.hseq >= 0:
            keys = (k for k, q, o in self._heap if o.hseq == q and o is not a)
            due = min(keys, default=None)
            due = None if due is None else due - self._offset
        if due is not None and due > now + self.idle_gap_cap:
            self._offset += due - now - self.idle_gap_cap
            if a is not None and a.hseq >= 0:
                self._push(a, a.hkey + due - now - self.idle_gap_cap)

    def _arrive(self, a: Arrivals, key: float) -> None:
        """A new session tree arrives: it takes a free lane slot or waits for one; arm the next."""
        a.arrived += 1
        lane = a.slot()
        if lane is None:
            a.backlog += 1
            a.waiting_since.append(key)
        else:
            self._pull(lane, key)
        if self.cycle or len(self._queue) > a.backlog:
            self._push(a, key + a.gap())

    def _free_lane(self, lane: int, key: float) -> None:
        """A tree drained in rate mode: the oldest waiting arrival takes its lane, else it is free."""
        a = self.arrivals
        if a.backlog:
            a.backlog -= 1
            a.delayed += 1
            a.delay_total += key - a.waiting_since.popleft()
            self._pull(lane, key)
        else:
            a.release(lane)


# the reference virtual-clock driver lives beside the plan; re-exported here for its callers
from agentkv.trace.schedule import Span, simulate_schedule  # noqa: E402

__all__ = ["Dispatch", "PlanItem", "ReplayPlan", "Span", "simulate_schedule"]
