"""Session-aware eviction for agentic traffic: evict the session expected back last.

An agent session alternates model calls with tool calls (seconds) and waits on its user
(minutes) after `end_turn`; each next call re-reads the whole context. So instead of ranking
blocks by when they were freed (LRU), rank *sessions* by when they are expected to return, and
evict from the one expected back last, its tail first (LRU order inside a session keeps prefixes
whole). The expected return of a paused session is learnt per stop reason (geometric mean of
its past gaps, else of every session's, else a default); a session overdue by more than that
is treated as idle for as long again as it has been. Ended sessions go first; a running
session's free blocks (ones its current call did not reuse) are treated as a user-wait away.
Without hints every block is in one group and the policy is LRU.

Hints (through the pool): `session_paused(s, now, reason)`, `session_resumed(s, now)`,
`session_ended(s, now)`; blocks belong to the session that freed them last.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from agentkv.kv.policies import Evictor

DEFAULT_GAPS = {"tool_use": 10.0, "end_turn": 120.0}


@dataclass(slots=True)
class SessionState:
    """What the policy knows of one session: its state since `since` and its learnt gaps."""

    state: str = "active"  # active | paused | ended
    since: float = 0.0
    reason: str = ""
    log_gaps: dict[str, float] = field(default_factory=dict)  # EWMA of log(gap) per stop reason


class SessionAware(Evictor):
    """Evict from the session predicted to return last; LRU (tail first) within a session."""

    name = "session"

    def __init__(self, default_gaps: dict[str, float] | None = None, default_gap: float = 60.0,
                 alpha: float = 0.3, use_end_hints: bool = True) -> None:
        self.default_gaps = dict(DEFAULT_GAPS if default_gaps is None else default_gaps)
        self.default_gap = default_gap
        self.alpha = alpha
        self.use_end_hints = use_end_hints

    def clear(self) -> None:
        self._owner: list[object] = [None] * self.pool.num_blocks
        self._groups: dict[object, OrderedDict[int, None]] = {}
        self.sessions: dict[object, SessionState] = getattr(self, "sessions", {})
        self._global: dict[str, float] = getattr(self, "_global", {})
        self.now = getattr(self, "now", 0.0)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def blocks(self) -> list[int]:
        return [b for g in self._groups.values() for b in g]

    # -- hints -----------------------------------------------------------------------------------
    def _state(self, session: object) -> SessionState:
        s = self.sessions.get(session)
        if s is None:
            s = self.sessions[session] = SessionState(since=self.now)
        return s

    def session_paused(self, session: object, now: float, reason: str) -> None:
        self.now = max(self.now, now)
        s = self._state(session)
        s.state, s.since, s.reason = "paused", now, reason

    def session_resumed(self, session: object, now: float) -> None:
        self.now = max(self.now, now)
        s = self._state(session)
        if s.state == "paused":
            lg = math.log(max(now - s.since, 1e-3))
            a = self.alpha
            old = s.log_gaps.get(s.reason)
            s.log_gaps[s.reason] = lg if old is None else (1 - a) * old + a * lg
            g = self._global.get(s.reason)
            self._global[s.reason] = lg if g is None else (1 - a / 4) * g + a / 4 * lg
        s.state, s.since = "active", now

    def session_ended(self, session: object, now: float | None) -> None:
        if now is not None:
            self.now = max(self.now, now)
        if self.use_end_hints:
            s = self._state(session)
            s.state, s.since = "ended", self.now if now is None else now
            if session not in self._groups:
                del self.sessions[session]

    def expected_gap(self, session: object, reason: str) -> float:
        """Seconds a session paused for `reason` is expected to stay away (learnt, else default)."""
        s = self.sessions.get(session)
        if s is not None and reason in s.log_gaps:
            return math.exp(s.log_gaps[reason])
        if reason in self._global:
            return math.exp(self._global[reason])
        return self.default_gaps.get(reason, self.default_gap)

    def time_to_return(self, session: object) -> float:
        """Predicted seconds until `session` next reuses its blocks (inf once ended)."""
        s = self.sessions.get(session)
        if s is None:
            return self.default_gap
        if s.state == "ended":
            return math.inf
        if s.state == "active":
            return self.expected_gap(session, "end_turn")
        waited = self.now - s.since
        gap = self.expected_gap(session, s.reason)
        return gap - waited if waited <= gap else waited

    # -- the evictor -----------------------------------------------------------------------------
    def add_many(self, blocks: list[int], session: object = None) -> None:
        g = self._groups.get(session)
        if g is None:
            g = self._groups[session] = OrderedDict()
        owner = self._owner
        for b in blocks:
            g[b] = None
            owner[b] = session
        self._n += len(blocks)

    def remove_many(self, blocks: list[int]) -> None:
        owner, groups = self._owner, self._groups
        owners = set(map(owner.__getitem__, blocks))
        if len(owners) == 1:
            s = owners.pop()
            g = groups[s]
            for b in blocks:
                del g[b]
            if not g:
                self._drop_group(s)
        else:
            for b in blocks:
                s = owner[b]
                g = groups[s]
                del g[b]
                if not g:
                    self._drop_group(s)
        self._n -= len(blocks)

    def _drop_group(self, session: object) -> None:
        del self._groups[session]
        s = self.sessions.get(session)
        if s is not None and s.state == "ended":
            del self.sessions[session]

    def pop_victims(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            session = max(self._groups, key=self._rank)
            g = self._groups[session]
            while g and len(out) < n:
                out.append(g.popitem(last=False)[0])
            if not g:
                self._drop_group(session)
        self._n -= n
        return out

    def _rank(self, session: object) -> tuple[float, float]:
        s = self.sessions.get(session)
        return self.time_to_return(session), (self.now - s.since) if s is not None else 0.0

    def check(self) -> None:
        assert sum(map(len, self._groups.values())) == self._n
        for s, g in self._groups.items():
            assert g and all(self._owner[b] == s for b in g)
