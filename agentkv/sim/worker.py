"""One simulated engine as the router sees it (placement's `WorkerView`), and what it runs now."""

from __future__ import annotations

from collections.abc import Sequence

from agentkv.engine.engine import DecodeBurst, Engine, StepResult


class SimWorker:
    """One engine as the router sees it (the `WorkerView` protocol), plus what it is running now."""

    __slots__ = ("index", "engine", "pending", "burst", "version", "starting")

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self.engine = engine
        self.pending: StepResult | None = None  # the single step in flight
        self.burst: DecodeBurst | None = None  # or the decode burst in flight
        self.version = 0  # bumped when a burst is cut short, so its end event is ignored
        self.starting = False  # busy until a scheduled start event (after a cut burst)

    def idle(self) -> bool:
        return self.pending is None and self.burst is None and not self.starting

    def active_requests(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def active_blocks(self) -> int:
        return self.engine.active_blocks

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        return self.engine.cached_prefix(block_hashes)
