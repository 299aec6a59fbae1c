"""The reference virtual-clock driver of a `ReplayPlan`: every item takes a given service time,
with no queueing (the tests, the cache analysis and benchmarks/plan.py use it)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from agentkv.trace.plan import PlanItem, ReplayPlan


class Span(msgspec.Struct, gc=False):
    """One item as `simulate_schedule` ran it: sent at `start`, done at `end`."""

    item: PlanItem
    start: float
    end: float
    ok: bool = True


def simulate_schedule(
    plan: ReplayPlan,
    service_time: Callable[[PlanItem], float],
    *,
    start: float = 0.0,
    until: float | None = None,
    ok: Callable[[PlanItem], bool] | None = None,
) -> list[Span]:
    """Run `plan` on a virtual clock where each item takes `service_time(item)` with no queueing.

    The reference driver: returns every released item with its (start, end), in release order.
    Ends are processed before releases at the same instant; `until` stops releasing after it.
    """
    if plan.cycle and plan.max_requests is None and until is None:
        raise ValueError("simulate_schedule: a cycling plan needs max_requests or until to end")
    plan.start(start)
    spans: list[Span] = []
    ends: list[tuple[float, int, Span]] = []
    while True:
        due = plan.next_due()
        if ends and (due is None or ends[0][0] <= due):
            end, _, sp = heapq.heappop(ends)
            plan.complete(sp.item.id, end, sp.ok)
            continue
        if due is None:
            return spans
        if until is not None and due > until:
            plan.stop()
            continue
        for d in plan.pop_due(due):
            dur = service_time(d.item)
            if not dur >= 0:
                raise ValueError(f"simulate_schedule: service_time gave {dur!r} for item {d.item.id}")
            sp = Span(d.item, d.due, d.due + dur, True if ok is None else bool(ok(d.item)))
            spans.append(sp)
            heapq.heappush(ends, (sp.end, d.item.id, sp))
