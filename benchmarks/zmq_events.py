"""KV-event transport speed over loopback TCP: publish() cost to the engine and end-to-end rate.

Run: .venv/bin/python benchmarks/zmq_events.py   (prints the median publish() call time, batches/s
delivered to a subscriber, and the time to replay the buffer)
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentkv.events.publisher import ZmqEventPublisher
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored

N = 20_000


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    batches = [
        [BlockStored(block_hashes=list(range(i, i + 16)), parent_block_hash=i, block_size=16)]
        for i in range(N)
    ]
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=N) as pub,
        ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        assert pub.wait_for_subscribers(timeout=5)
        calls = []
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            pub.publish(b, ts=0.0)
            calls.append(time.perf_counter() - t)
        got = 0
        while got < N:
            r = sub.recv(5.0)
            if r is None:
                break
            got += 1
        elapsed = time.perf_counter() - t0
        t = time.perf_counter()
        replayed = sub.replay(0, timeout=10.0)
        replay_s = time.perf_counter() - t
    calls.sort()
    print(
        f"publish(): median {statistics.median(calls) * 1e6:.1f} us, p99 {calls[int(0.99 * N)] * 1e6:.1f} us "
        f"per call (1 BlockStored of 16 hashes)"
    )
    print(
        f"delivered {got:,}/{N:,} batches in {elapsed:.2f} s: {got / elapsed:,.0f} batches/s "
        f"(gaps {sub.stats.gaps}, recovered {sub.stats.recovered}, lost {sub.stats.lost}, "
        f"dropped by publisher {pub.stats.dropped})"
    )
    print(f"replay of {len(replayed):,} buffered batches: {replay_s:.2f} s")


if __name__ == "__main__":
    main()
