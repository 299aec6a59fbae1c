"""CPU per KV-event batch of the router's event consumer: its one poller thread over every worker
(`agentkv route`'s `WorkerPool`, real ZMQ publishers on loopback) against one blocking subscriber
thread per worker (the design before it), on the same stream.

N `ZmqEventPublisher`s publish --rate batches/s in all (each a BlockStored of 4 blocks with
--tokens token ids, 64 as `agentkv serve` sends per 64-token prompt, ids spread over a 128K
vocabulary, and every fourth a BlockRemoved), round robin, for --seconds; the consumer threads'
CPU time is read from /proc. The poller runs with each --decode: `skip` leaves the token ids
undecoded (the router's subscribers), `full` decodes them (as before). --profile prints where the
poller thread's time goes (cProfile); --syscalls counts syscalls and context switches per batch by
thread (`perf stat`: counts, so they do not depend on the host's load).

Run: .venv/bin/python benchmarks/event_thread.py [--workers 4] [--rate 500] [--seconds 5] [--tokens 64]
     [--decode full skip] [--syscalls] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import threading
import time

from proccpu import SyscallCount, cpu_seconds  # benchmarks/proccpu.py

from agentkv.events.poller import COALESCE_S
from agentkv.events.publisher import ZmqEventPublisher
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.route.index import TenantIndex
from agentkv.route.workers import WorkerPool, WorkerSpec


def thread_cpu(tid: int) -> float:
    return cpu_seconds(os.getpid(), f"/proc/self/task/{tid}/stat")


def publish(pubs: list[ZmqEventPublisher], rate: float, seconds: float, tokens: int) -> int:
    """Open-loop: batch i at i / rate, to publisher i % N; returns the number sent."""
    n = int(rate * seconds)
    ids = [1000 + k * 7919 % 127_000 for k in range(tokens)]  # beyond Python's cached small ints
    t0 = time.perf_counter()
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        hashes = [i * 8 + k for k in range(4)]
        events = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids, block_size=16)]
        if i % 4 == 3:
            events.append(BlockRemoved(block_hashes=[(i - 3) * 8 + k for k in range(4)]))
        pubs[i % len(pubs)].publish(events)
    return n


def per_worker_threads(pubs: list[ZmqEventPublisher], index: TenantIndex, stop: threading.Event) -> list[int]:
    """The design before: one blocking subscriber thread per worker, the index lock per batch."""
    lock, tids, ready = threading.Lock(), [], threading.Barrier(len(pubs) + 1)

    def consume(slot: int, sub: ZmqEventSubscriber) -> None:
        tids.append(threading.get_native_id())
        ready.wait()
        while not stop.is_set():
            for r in sub.recv_batches(0.1, max_batches=256):
                with lock:
                    for ev in r.batch.events:
                        index.apply(slot, ev)
        sub.close()

    for slot, p in enumerate(pubs):
        sub = ZmqEventSubscriber(p.endpoint, start_seq=0)
        threading.Thread(target=consume, args=(slot, sub), daemon=True).start()
    ready.wait()
    return tids


def start_poller(
    pubs: list[ZmqEventPublisher], index: TenantIndex, args: argparse.Namespace, prof: cProfile.Profile | None
) -> tuple[WorkerPool, list[int]]:
    """The router's `WorkerPool` over `pubs` (its poller thread's id in the list once it runs);
    `args.decode == "full"` subscribes as before, decoding every token id."""
    pool = WorkerPool(
        [WorkerSpec(f"http://127.0.0.1:{9 + i}", p.endpoint) for i, p in enumerate(pubs)], index, 16
    )
    pool.poller.coalesce_s = args.coalesce
    tids: list[int] = []
    inner = pool.poller._run

    def traced() -> None:
        tids.append(threading.get_native_id())
        if prof is None:
            return inner()
        prof.runcall(inner)

    pool.poller._run = traced
    for w in pool.workers:
        if args.decode == "skip":
            pool._subscribe(w)
        else:
            w.subscriber = ZmqEventSubscriber(w.spec.events, start_seq=0)
            pool.poller.add(w.subscriber, w, f"worker {w.slot}")
    return pool, tids


def run(design: str, args: argparse.Namespace) -> None:
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*") for _ in range(args.workers)]
    index, stop = TenantIndex(), threading.Event()
    prof = cProfile.Profile(time.thread_time) if args.profile and design.startswith("poller") else None
    if design.startswith("poller"):
        pool, tids = start_poller(pubs, index, args, prof)
    else:
        tids = per_worker_threads(pubs, index, stop)
    for p in pubs:
        p.wait_for_subscribers(1, 5)
    time.sleep(0.2)
    cpu0 = sum(thread_cpu(t) for t in tids)
    names = {os.getpid(): "publisher", **{t: "consumer" for t in tids}}
    counts = SyscallCount(os.getpid(), names) if args.syscalls else None
    n = publish(pubs, args.rate, args.seconds, args.tokens)
    time.sleep(0.3)  # the last batches arrive
    cpu = sum(thread_cpu(t) for t in tids) - cpu0
    stop.set()
    if design.startswith("poller"):
        pool.poller.close()
        wakes = f", {n / max(1, pool.poller.wakes):.2f} batches per wake"
    else:
        wakes = ""
        time.sleep(0.2)
    for p in pubs:
        p.close()
    print(
        f"{design:>18}: {len(tids)} thread(s), {cpu / n * 1e6:6.1f} us CPU per batch "
        f"({n} batches of {args.tokens} token ids at {args.rate:.0f}/s over {args.workers} workers{wakes})"
    )
    if counts is not None:
        counts.report(n, "batch")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=500.0, help="batches per second, all workers together")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--tokens", type=int, default=64, help="token ids per BlockStored (64: a 64-token prompt)"
    )
    ap.add_argument(
        "--decode",
        nargs="+",
        choices=["full", "skip"],
        default=["full", "skip"],
        help="the poller's BlockStored decode: token ids decoded (before) or left undecoded (the router's)",
    )
    ap.add_argument(
        "--coalesce",
        type=float,
        nargs="+",
        default=[0.0, COALESCE_S],
        help="the poller's wait after a wake, seconds",
    )
    ap.add_argument(
        "--syscalls",
        action="store_true",
        help="syscalls and context switches per batch, by thread (perf stat)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the poller thread (its last round)")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    for r in range(args.rounds):
        run("thread per worker", args)
        for c in args.coalesce:
            for dec in args.decode:
                last = (
                    args.profile and r == args.rounds - 1 and (c, dec) == (args.coalesce[-1], args.decode[-1])
                )
                run(
                    f"poller, {c * 1e3:g} ms, {dec}",
                    argparse.Namespace(**{**vars(args), "profile": last, "coalesce": c, "decode": dec}),
                )


if __name__ == "__main__":
    main()
