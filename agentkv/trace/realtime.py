"""The real-time driver of a `ReplayPlan` on asyncio: send each item when due, report each end.

The benchmark passes its own `send` (an HTTP call); this loop only keeps the plan's clock honest:
it sleeps until the next due time or until a completion wakes it, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from agentkv.trace.plan import Dispatch, ReplayPlan


async def drive(
    plan: ReplayPlan,
    send: Callable[[Dispatch], Awaitable[bool | tuple[bool, float | None]]],
    *,
    clock: Callable[[], float] = time.monotonic,
    until: float | None = None,
) -> None:
    """Run `plan` to completion: `await send(dispatch)` for each item at its due time.

    `send` returns True on success; False or an exception marks the item failed (the session still
    advances). It may return `(ok, end)` instead: the item ended at `end` on `clock` (no later
    than now; e.g. the target's own end time), which the next turn's gap counts from. `until` (a
    `clock` time) stops releasing new items; in-flight ones finish. The first exception raised by
    `send` is re-raised once everything in flight has ended.
    """
    wake = asyncio.Event()
    tasks: set[asyncio.Task] = set()
    errors: list[BaseException] = []

    async def run(d: Dispatch) -> None:
        ok, end = False, None
        try:
            got = await send(d)
            ok, end = got if isinstance(got, tuple) else (bool(got), None)
        except Exception as e:  # re-raised below, once the plan has drained
            errors.append(e)
            plan.stop()
        finally:
            now = clock()
            plan.complete(d.item.id, now if end is None else min(end, now), ok)
            wake.set()

    plan.start(clock())
    stopped = False
    while not plan.done:
        now = clock()
        if until is not None and not stopped and now >= until:
            plan.stop()
            stopped = True
        for d in plan.pop_due(now):
            task = asyncio.create_task(run(d))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if plan.done:
            break
        due = plan.next_due()
        timeout = None if due is None else max(0.0, due - clock())
        if until is not None and not stopped:
            left = max(0.0, until - clock())
            timeout = left if timeout is None else min(timeout, left)
        wake.clear()  # single-threaded: no completion can slip in between this and the wait
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel (Ctrl-C) that
        # lands as the event fires, and the run would go on to the end of the plan
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await wake.wait()
    if errors:
        raise errors[0]
