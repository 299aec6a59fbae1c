"""Driving the replay plan: a step-by-step driver with inexact floats, and the real-time driver."""

from __future__ import annotations

import heapq

import pytest
from planutil import by_key, example, recorded, req, trace

from agentkv.trace.plan import ReplayPlan, simulate_schedule


def test_many_idle_shifts_with_inexact_floats_never_stall():
    """Due times compare the same way in next_due and pop_due, so rounding cannot stall a driver."""
    reqs = [req(i * 10.0, api=0.1, think=th) for i, th in enumerate([0.0, 0.3, 1.7, 1.7, 0.3])]
    plan = ReplayPlan([trace("f", reqs)], lanes=1, cycle=True, max_requests=2000, idle_gap_cap=0.7)
    plan.start(0.0)
    released, ends = 0, []
    for _ in range(20_000):  # each turn completes or releases something; a stall would spin here
        due = plan.next_due()
        if ends and (due is None or ends[0][0] <= due):
            end, item_id = heapq.heappop(ends)
            plan.complete(item_id, end)
        elif due is None:
            break
        else:
            batch = plan.pop_due(due)
            assert batch, f"nothing released at next_due() = {due!r}"
            released += len(batch)
            for d in batch:
                heapq.heappush(ends, (due + 0.1 + d.item.id % 7 * 0.013, d.item.id))
    assert released == 2000 and plan.done


# ---- the real-time driver ---------------------------------------------------------------------
def test_realtime_driver_sends_every_item_once_in_session_order():
    import asyncio

    from agentkv.trace.realtime import drive

    sent = []

    async def send(d):
        sent.append(d)
        await asyncio.sleep(recorded(d.item) * 0.002)
        return d.item.index != 1

    plan = ReplayPlan([example(), trace("Q", [req(0), req(5, think=3)])], lanes=2, time_scale=0.002)
    asyncio.run(drive(plan, send))
    assert plan.done and len(sent) == 8 and plan.failed == 3
    keys = [(d.item.session.id, d.item.index) for d in sent]
    assert sorted(keys) == sorted(
        by_key(
            simulate_schedule(
                ReplayPlan([example(), trace("Q", [req(0), req(5, think=3)])], lanes=2), recorded
            )
        )
    )
    for sid in {k[0] for k in keys}:
        assert [i for s, i in keys if s == sid] == sorted(i for s, i in keys if s == sid)
    a0 = next(d for d in sent if d.item.session.id == "P/A" and d.item.index == 0)
    r1 = next(d for d in sent if d.item.session.id == "P" and d.item.index == 1)
    assert a0.due > r1.due  # the spawn waits for its anchor's completion


def test_realtime_driver_until_and_send_errors():
    import asyncio

    from agentkv.trace.realtime import drive

    async def fine(d):
        await asyncio.sleep(0.001)
        return True

    plan = ReplayPlan([trace("c", [req(0, api=0.001), req(1, think=0.001)])], lanes=2, cycle=True)

    async def main():
        clock = asyncio.get_running_loop().time
        await drive(plan, fine, clock=clock, until=clock() + 0.05)  # cycling: only `until` ends it

    asyncio.run(main())
    assert plan.done and plan.released > 2 and plan.failed == 0

    async def boom(d):
        raise RuntimeError("send broke")

    plan = ReplayPlan([example()], lanes=1)
    with pytest.raises(RuntimeError, match="send broke"):
        asyncio.run(drive(plan, boom))
    assert plan.done and plan.failed == 1


def test_realtime_driver_is_cancelled_even_when_a_completion_wakes_it_at_once():
    """Ctrl-C cancels the driving task. If that cancel lands just as a completion wakes the driver,
    the driver must still stop (Python 3.11's wait_for swallowed it: the bench ran on to the end)."""
    import asyncio

    from agentkv.trace.realtime import drive

    sent = []

    async def main():
        task = asyncio.current_task()

        async def send(d):
            sent.append(d)
            if len(sent) == 1:  # queued before this send's completion wakes the driver
                asyncio.get_running_loop().call_soon(task.cancel)
            return True

        plan = ReplayPlan([trace("c", [req(0, api=0.001), req(1, think=0.001)])], lanes=1, cycle=True)
        clock = asyncio.get_running_loop().time
        await drive(plan, send, clock=clock, until=clock() + 60)  # `until`: the driver waits with a timeout

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asyncio.wait_for(main(), 5))
    assert len(sent) <= 2
