"""Test helpers for hand-driven KV-event publishers on real ZMQ sockets (shared by the event tests)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import zmq

from agentkv.events.publisher import END_SEQ, seq_bytes
from agentkv.events.subscriber import AsyncZmqEventSubscriber


def serve_replay(rep: zmq.Socket, buffer: Callable[[], dict[int, bytes]], stop: threading.Event) -> None:
    """Answer replay requests on a ROUTER socket from `buffer()` (seq -> payload, read anew for each
    request: tests swap it), as vLLM's replay socket does."""
    while not stop.is_set():
        if not rep.poll(50):
            continue
        ident, _, start = rep.recv_multipart()
        buf = buffer()
        for seq in sorted(buf):
            if seq >= int.from_bytes(start, "big"):
                rep.send_multipart([ident, b"", b"kv-events", seq_bytes(seq), buf[seq]])
        rep.send_multipart([ident, b"", b"", END_SEQ, b""])


async def until(cond, timeout: float = 5.0, tick=None) -> bool:
    """Poll `cond` every 50 ms (calling `tick` between polls) until it holds or `timeout` passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if tick is not None:
            tick()
        await asyncio.sleep(0.05)
    return cond()


@contextlib.asynccontextmanager
async def subscribed():
    """A subscriber bound on a free loopback port (servers connect to it) and the list that collects
    every batch it receives until the block ends."""
    sub = AsyncZmqEventSubscriber("tcp://127.0.0.1:*")
    got: list = []

    async def collect():
        while True:
            r = await sub.recv(0.05)
            if r is not None:
                got.append(r)

    task = asyncio.create_task(collect())
    try:
        yield sub, got
    finally:
        task.cancel()
        sub.close()
