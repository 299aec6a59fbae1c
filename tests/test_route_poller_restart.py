"""The KV-event thread outlives a bug in its own loop: the failure is logged and counted, the loop
starts over and events keep coming (a dead thread once left a router with 0 events applied)."""

from __future__ import annotations

import logging
import threading
import time

from zmqutil import RawPublisher

from agentkv.events.poller import Delivery, EventPoller
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored


def test_a_failing_thread_loop_is_logged_and_started_over(caplog):
    pub = RawPublisher()
    sub = ZmqEventSubscriber(pub.endpoints[0])
    seqs: list[int] = []
    lock = threading.Lock()

    def deliver(deliveries: list[Delivery]) -> None:
        with lock:
            seqs.extend(r.seq for d in deliveries for r in d.batches)

    poller = EventPoller(deliver, name="test-events", coalesce_s=0)
    watch, calls = poller._watch, []

    def failing_watch() -> None:  # the second handshake check hits a bug; later ones are fine
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug in the thread")
        watch()

    poller._watch = failing_watch
    poller.add(sub, "w0", "worker 0")
    payloads = [pub.batch(i, BlockStored(block_hashes=[100 + i])) for i in range(2)]
    try:
        with caplog.at_level(logging.ERROR, logger="agentkv.events"):
            end = time.monotonic() + 10
            while (poller.restarts == 0 or 1 not in seqs) and time.monotonic() < end:
                pub.send(0 if poller.restarts == 0 else 1, payloads[0 if poller.restarts == 0 else 1])
                time.sleep(0.05)
            poller._wake()  # wake it so it polls once more
        assert poller.restarts == 1 and 1 in seqs, (poller.restarts, seqs)
        assert poller._thread is not None and poller._thread.is_alive()
        assert any("KV-event thread failed" in r.getMessage() for r in caplog.records)
    finally:
        poller.close()
        pub.close()
