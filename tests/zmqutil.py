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
from agentkv.kv.events import EventBatch, encode_batch


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


def _bind(sock: zmq.Socket, port: int) -> int:
    if port:
        sock.bind(f"tcp://127.0.0.1:{port}")
        return port
    return sock.bind_to_random_port("tcp://127.0.0.1")


class RawPublisher:
    """A hand-driven vLLM-style publisher: live PUB frames we choose, and a replay ROUTER in a thread."""

    def __init__(self, port: int = 0, rport: int = 0) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = _bind(self.pub, port)
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rport = _bind(self.rep, rport)
        self.buffer: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def endpoints(self) -> tuple[str, str]:
        return f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.rport}"

    def batch(self, seq: int, *events) -> bytes:
        payload = encode_batch(EventBatch(0.0, list(events), None))
        self.buffer[seq] = payload
        return payload

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([b"kv-events", seq_bytes(seq), payload])

    def _serve(self) -> None:
        serve_replay(self.rep, lambda: self.buffer, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.ctx.destroy(linger=0)
