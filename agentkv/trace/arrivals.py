"""Open-loop arrivals of session trees for the replay plan: when each new tree arrives (Poisson or
evenly spaced at a set rate, seeded) and which lane slot runs it (lanes become a concurrency cap)."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from agentkv.errors import UserError

ARRIVALS = ("poisson", "constant")


class Arrivals:
    """The arrival timer of a plan with a session rate, and the lane slots trees run on.

    `cap` (None: no cap) bounds trees running at once; an arrival that finds every slot busy waits
    in `backlog` and starts when a tree drains (its wait counts in `delayed` and `delay_total`).
    """

    __slots__ = (
        "rate", "kind", "cap", "rng", "free", "lanes", "backlog", "arrived", "delayed", "delay_total",
        "waiting_since", "hkey", "hseq",
    )  # fmt: skip

    def __init__(self, rate: float, kind: str, cap: int | None, seed: int):
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise UserError(f"replay plan: session_rate must be a finite number > 0, got {rate!r}")
        if kind not in ARRIVALS:
            raise UserError(f"replay plan: arrivals must be one of {', '.join(ARRIVALS)}, got {kind!r}")
        self.rate, self.kind, self.cap = float(rate), kind, cap
        self.rng = random.Random(f"agentkv-plan-arrivals-{seed}")
        self.free: list[int] = []  # lane slots released by drained trees, lowest first
        self.lanes = 0  # slots handed out so far
        self.backlog = self.arrived = self.delayed = 0
        self.delay_total = 0.0
        self.waiting_since: deque[float] = deque()  # arrival keys of the backlog, oldest first
        self.hkey, self.hseq = 0.0, -1

    def gap(self) -> float:
        """Seconds from one arrival to the next: exponential (Poisson process) or 1/rate."""
        return self.rng.expovariate(self.rate) if self.kind == "poisson" else 1.0 / self.rate

    def slot(self) -> int | None:
        """A free lane slot for a new tree, or None when the cap is reached."""
        if self.free:
            return heapq.heappop(self.free)
        if self.cap is not None and self.lanes >= self.cap:
            return None
        self.lanes += 1
        return self.lanes - 1

    def release(self, lane: int) -> None:
        heapq.heappush(self.free, lane)


def arrivals_note(a: Arrivals, x: float = 1.0) -> str:
    """The summary's note on an open-loop run: trees arrived, at what rate (per target second;
    `x`: the target ran x times real time), under what cap, and how long capped ones waited."""
    wall = "" if x == 1.0 else f" of target time, {a.rate:g} a wall second"
    cap = f"at most {a.cap} at once" if a.cap else "no cap on trees at once"
    note = f"load: {a.arrived} session trees arrived ({a.kind}, {a.rate / x:g}/s{wall}, {cap})"
    if a.delayed:
        note += (
            f"; {a.delayed} waited for a free lane, {a.delay_total / a.delayed * x:.3f} s on average "
            "(the wait is not in their latencies: it is load the cap refused)"
        )
    return note
