"""One simulated engine as the router sees it (placement's `WorkerView`), and what it runs now."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from agentkv.engine.engine import DecodeBurst, Engine, StepResult
from agentkv.engine.request import EngineRequest, Status


class SimWorker:
    """One engine as the router sees it (the `WorkerView` protocol), plus what it is running now."""

    __slots__ = (
        "index",
        "engine",
        "pending",
        "burst",
        "version",
        "starting",
        "prefilling",
        "queued",
        "_queued_tokens",
        "track_prefill",
        "_last_lookup",
    )

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self.engine = engine
        self.pending: StepResult | None = None  # the single step in flight
        self.burst: DecodeBurst | None = None  # or the decode burst in flight
        self.version = 0  # bumped when a burst is cut short, so its end event is ignored
        self.starting = False  # busy until a scheduled start event (after a cut burst)
        # requests routed here without a first token yet, with their uncached prompt tokens at routing:
        # those the scheduler has not looked at yet (a FIFO: it looks at the queue head first), and the rest
        self.queued: deque[tuple[EngineRequest, int]] = deque()
        self._queued_tokens = 0  # their uncached tokens summed: each counts in full until looked at
        self.prefilling: list[tuple[EngineRequest, int]] = []
        self.track_prefill = True  # False where no policy asks `active_prefill_blocks` (no lookup then)
        # (hashes, pool counters, (GPU, lower-tier) blocks) of the last cached_prefix, for add_request
        self._last_lookup: tuple | None = None

    def idle(self) -> bool:
        return self.pending is None and self.burst is None and not self.starting

    def add_request(self, request_id: str, **kw) -> EngineRequest:
        """Queue a request on the engine and count the prompt it will compute as active prefill here:
        not its GPU hit, nor its arrived KV, nor its lower-tier hit (loaded over PCIe, not recomputed)."""
        req = self.engine.add_request(request_id, **kw)
        if not self.track_prefill:
            return req
        gpu, lower = self._prefix(req.block_hashes)
        have = max((gpu + lower) * self.engine.config.block_size, req.external_tokens)
        self.active_prefill_blocks()  # drops the prefilled (no policy may ask: keep the list short)
        uncached = max(0, req.prompt_len - have)
        self.queued.append((req, uncached))
        self._queued_tokens += uncached
        return req

    def active_requests(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def active_blocks(self) -> int:
        return self.engine.active_blocks

    def active_prefill_blocks(self) -> float:
        """Dynamo's active prefill tokens, in blocks: what requests routed here still have to
        prefill until their first token (as predicted at routing, less what has run since).

        A request never admitted nor looked up has computed nothing: it counts its routing figure in
        full, from a running sum. The scheduler looks only at its queue's head and admits in order,
        so only the front of `queued` can have moved on; those go to `prefilling`, summed one by one."""
        queued, tokens = self.queued, 0
        while queued:
            req, uncached = queued[0]
            if (
                req.status == Status.WAITING
                and req.computed is None
                and not req.num_computed
                and not req.num_preemptions
            ):
                break  # never admitted nor looked up: nor is any routed after it
            queued.popleft()
            self._queued_tokens -= uncached
            self.prefilling.append((req, uncached))
        live = []
        for req, uncached in self.prefilling:
            if req.first_token is None and req.status < Status.FINISHED:
                live.append((req, uncached))
                tokens += min(uncached, req.prompt_len - req.num_computed)
        self.prefilling = live
        return (tokens + self._queued_tokens) / self.engine.config.block_size

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """The engine's answer, kept for `add_request`: the router's lookup of the worker it then
        picks is not repeated (kv_aware looks up every worker just before queueing on one)."""
        found = self.engine.cached_prefix(block_hashes)
        self._last_lookup = (block_hashes, self._pool_version(), found)
        return found

    def _prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """(GPU, lower-tier) blocks cached of this prompt: the router's lookup when it was of these
        very hashes and the pool has stored, evicted and allocated nothing since; else a fresh one."""
        last, self._last_lookup = self._last_lookup, None
        if last is not None and last[0] is block_hashes and last[1] == self._pool_version():
            return last[2]
        return self.engine.cached_prefix(block_hashes)

    def _pool_version(self) -> tuple[int, int, int]:
        """Counters that move whenever the GPU prefix cache can change (a block cached, evicted or handed out)."""
        st = self.engine.pool.stats
        return st.stored, st.evicted, st.allocated
