"""CPU-heavy request parsing off the event loop: a small pool of worker processes, entered through
slots that bound how many large bodies one key (a tenant) and all keys together may have in
memory and in parse at once.

A slot is taken before the body is read, so a client waiting for one holds no body; the rest
wait their turn in order. Processes, not threads: tokenizing and JSON decoding hold the GIL, so a
thread would still stall the loop (and every other client's stream) for as long as it ran. The
processes run at nice 10, so under load the event loop gets the CPU first.
`start()` spawns the processes ahead of the first large body (a spawn takes ~0.5 s); a pool whose
process died is replaced on the next call (that request: 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from agentkv.gate.body import inflate_body
from agentkv.gate.errors import RequestError

OFFLOAD_BYTES = 32 << 10  # bodies from this size on are parsed in a worker process


def die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when its parent dies (PR_SET_PDEATHSIG); exit now if the parent
    `parent` already died while this process was starting (then the signal would never come)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)


def _child_init(init: Callable[..., None] | None, args: tuple, parent: int) -> None:
    """In each worker process: die with the parent, leave Ctrl-C to it, then the caller's set-up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    with contextlib.suppress(Exception):  # freed bodies go back to the system
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, as gate.conn.return_freed_memory
    with contextlib.suppress(OSError):
        os.nice(10)  # background work: the server's event loop gets the CPU first
    if init is not None:
        init(*args)


def _inflate_then(fn: Callable, raw: bytes, enc: str | None, limit: int, *args):
    """In a worker process: inflate the body as sent, then `fn(body, *args)`."""
    return fn(inflate_body(raw, enc, limit), *args)


def _noop() -> None:
    """Submitted once per process by `start`, so the pool spawns them all."""
    import time

    time.sleep(0.05)  # long enough that each submission finds no idle process and spawns one


class Offload:
    """Run parse functions in `processes` worker processes (0: in a thread), through per-key slots."""

    def __init__(
        self,
        processes: int,
        per_key: int,
        total: int,
        init: Callable[..., None] | None = None,
        init_args: tuple = (),
    ) -> None:
        self.processes, self.per_key, self.total = processes, per_key, total
        self._init, self._init_args = init, init_args
        self._pool: ProcessPoolExecutor | None = None
        self._keys: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}
        self._all: asyncio.Semaphore | None = None
        self.waiting = 0  # requests waiting for a slot now
        self.ran = 0  # parses run off the loop so far

    @contextlib.asynccontextmanager
    async def slot(self, key: str = "") -> AsyncIterator[None]:
        """Hold one of `key`'s `per_key` slots and one of the `total` (in that order) for the block."""
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = (asyncio.Semaphore(self.per_key), [0])
        if self._all is None:
            self._all = asyncio.Semaphore(self.total)
        sem, users = entry
        users[0] += 1
        self.waiting += 1
        entered = False
        try:
            async with sem, self._all:
                self.waiting -= 1
                entered = True
                yield
        finally:
            if not entered:
                self.waiting -= 1
            users[0] -= 1
            if not users[0]:
                del self._keys[key]

    def _ensure(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.processes,
                mp_context=mp.get_context("spawn"),
                initializer=_child_init,
                initargs=(self._init, self._init_args, os.getpid()),
            )
        return self._pool

    def start(self) -> None:
        """Spawn every worker process now (in the background), not on the first large body; with no
        processes (a thread), run the set-up here."""
        if self.processes <= 0 and self._init is not None:
            self._init(*self._init_args)
        if self.processes > 0:
            pool = self._ensure()
            for _ in range(self.processes):
                pool.submit(_noop)

    async def run_raw(self, fn: Callable, raw: bytes, enc: str | None, limit: int, *args):
        """`fn(body, *args)` in a worker process, `body` being `raw` (as sent, Content-Encoding `enc`)
        inflated there under `limit` bytes: decompression, too, runs off the event loop's CPU."""
        if enc is None:
            return await self.run(fn, raw, *args)
        return await self.run(_inflate_then, fn, raw, enc, limit, *args)

    async def run(self, fn: Callable, *args):
        """`fn(*args)` in a worker process; its RequestError comes back as raised."""
        self.ran += 1
        if self.processes <= 0:
            return await asyncio.to_thread(fn, *args)
        pool = self._ensure()
        try:
            return await asyncio.wrap_future(pool.submit(fn, *args))
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise RequestError("a parser process died; please retry", None, 503) from None

    def close(self) -> None:
        """Stop the processes and wait for them (a parse under way finishes; queued ones are cancelled).
        Waiting matters in a process that multiprocessing started (`route --processes`): its exit
        closes queues before the pool's own thread would send the processes their stop signal."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
