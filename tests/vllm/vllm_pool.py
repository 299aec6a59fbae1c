"""The suite's live servers: at most two at once, started ahead of need and stopped once done with.

`plan()` receives, in run order, the servers each test uses. A server is stopped when its last
test has released it, and the next planned server starts in a background thread as soon as
there is room, so a start-up overlaps the tests still running on the other server.
"""

from __future__ import annotations

import atexit
import threading
from collections import Counter, OrderedDict
from pathlib import Path

from vllm_env import VllmEnv
from vllm_server import ServerSpec, VllmServer


class ServerPool:
    """Live servers by name; `get(name, spec)` returns one (starting it if needed), `release` after use."""

    def __init__(self, env: VllmEnv, log_dir: Path, specs: dict[str, ServerSpec], limit: int = 2):
        self.env, self.log_dir, self.specs, self.limit = env, log_dir, specs, limit
        self.live: OrderedDict[str, VllmServer] = OrderedDict()
        self.pending: dict[str, tuple[threading.Thread, list]] = {}
        self.started: list[tuple[str, float]] = []  # (name, start-up seconds), in start order
        self.order: list[str] = []  # first use order
        self.remaining: Counter[str] = Counter()
        atexit.register(self.close)  # no server outlives the test run, even an interrupted one

    def plan(self, uses: list[list[str]]) -> None:
        """The servers of each test, in run order."""
        for names in uses:
            for n in names:
                if n not in self.order:
                    self.order.append(n)
                self.remaining[n] += 1

    def get(self, name: str) -> VllmServer:
        if name not in self.live and name not in self.pending:
            while len(self.live) + len(self.pending) >= self.limit:
                if not self.live:  # both slots are starting servers planned for later: take one in
                    self._join(next(iter(self.pending)))
                self._stop(next(iter(self.live)))  # least recently used
            self._spawn(name)
        self._prefetch()  # the next planned server starts alongside this one
        if name in self.pending:
            self._join(name)
        self.live.move_to_end(name)
        return self.live[name]

    def release(self, name: str) -> None:
        """A test is done with `name`: stop it after its last planned use, and start what comes next."""
        if self.remaining[name] > 0:
            self.remaining[name] -= 1
            if self.remaining[name] == 0 and name in self.live:
                self._stop(name)
        self._prefetch()

    def close(self) -> None:
        for thread, _ in self.pending.values():
            thread.join()
        for _, box in self.pending.values():
            if isinstance(box[0], VllmServer):
                box[0].stop()
        self.pending.clear()
        while self.live:
            self._stop(next(iter(self.live)))

    def _join(self, name: str) -> None:
        thread, box = self.pending.pop(name)
        thread.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        self._add(name, box[0])

    def _start(self, name: str) -> VllmServer:
        return VllmServer(self.env, self.specs[name], self.log_dir, name).start()

    def _add(self, name: str, srv: VllmServer) -> None:
        self.live[name] = srv
        self.started.append((name, srv.startup_s))

    def _stop(self, name: str) -> None:
        self.live.pop(name).stop()

    def _spawn(self, name: str) -> None:
        """Start `name` in a background thread; `_join` takes it in (or raises its start-up error)."""
        box: list = [None]

        def run():
            try:
                box[0] = self._start(name)
            except BaseException as e:  # re-raised in the test that gets it
                box[0] = e

        thread = threading.Thread(target=run, name=f"start-{name}", daemon=True)
        thread.start()
        self.pending[name] = (thread, box)

    def _prefetch(self) -> None:
        for name in self.order:
            if len(self.live) + len(self.pending) >= self.limit:
                return
            if self.remaining[name] > 0 and name not in self.live and name not in self.pending:
                self._spawn(name)
