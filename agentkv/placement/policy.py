"""Routing policies, shared by the offline simulator and the live router.

A policy sees each worker through `WorkerView` (its load and what it caches for this request)
and picks one. kv_aware follows Dynamo's KV router: cost = weight x (blocks still to prefill +
the worker's active prefill blocks, capped) + its active blocks, lowest wins (ties rotate, so idle
workers share the load).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentkv.errors import UserError
from agentkv.placement import KV_QUEUE_CAP, KV_QUEUE_WEIGHT, KV_WEIGHT, POLICIES


@dataclass(slots=True)
class RouteRequest:
    """What a policy knows of a request: its prompt's block hashes and its session."""

    block_hashes: Sequence[int]
    prompt_tokens: int
    session: str = ""
    block_size: int = 16


class WorkerView(Protocol):
    def active_requests(self) -> int: ...  # running + waiting
    def active_blocks(self) -> int: ...  # KV blocks held by running requests
    def active_prefill_blocks(self) -> float: ...  # uncached prompt blocks routed here, no first token yet
    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]: ...  # (GPU, lower-tier) blocks


class Policy:
    name = "base"
    queue_weight = 0.0  # > 0: it asks workers' `active_prefill_blocks` (kv_aware's queue term)

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> int:
        raise NotImplementedError

    def forget(self, worker: int) -> None:
        """A worker left: drop any state that points at it."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, seed: int = 0):
        self._next = 0

    def choose(self, req, workers):
        i = self._next % len(workers)
        self._next = i + 1
        return i


class LeastLoaded(Policy):
    """Fewest active requests; ties go round-robin so idle workers share the load."""

    name = "least_loaded"

    def __init__(self, seed: int = 0):
        self._rot = 0

    def choose(self, req, workers):
        self._rot = (self._rot + 1) % len(workers)
        return _first_min(self._rot, [w.active_requests() for w in workers])


class SessionAffinity(Policy):
    """A session's requests stay on one worker, unless it is overloaded (then it moves, least loaded)."""

    name = "session"

    def __init__(self, seed: int = 0, overload: float = 2.0, slack: int = 4):
        self._home: dict[str, int] = {}
        self._ll = LeastLoaded()
        self.overload, self.slack = overload, slack

    def choose(self, req, workers):
        home = self._home.get(req.session) if req.session else None
        loads = [w.active_requests() for w in workers]
        if home is not None and home < len(workers):
            mean = sum(loads) / len(loads)
            if loads[home] <= self.overload * mean + self.slack:
                return home
        i = self._ll.choose(req, workers)
        if req.session:
            self._home[req.session] = i
        return i

    def forget(self, worker):
        self._home = {s: w for s, w in self._home.items() if w != worker}


class KvAware(Policy):
    """cost_i = weight x (blocks to prefill on i + queue_weight x min(i's active prefill blocks,
    queue_cap x this request's blocks)) + active blocks on i; lower-tier hits earn `tier_credit`.

    Active prefill is Dynamo's active prefill tokens: the uncached prompt blocks of requests routed
    to i that have no first token yet (its prefill queue). Dynamo weighs them as this request's own
    (queue_weight 1); without them a prefill-bound worker's queue is invisible and trees pile on it.
    Dynamo sums them uncapped (queue_cap inf); then, once every worker is overloaded, a queue gap
    larger than a tree's cached prefix moves the tree and recomputes the prefix elsewhere, which
    only adds work. Capped at half the prompt (default), queues deeper than that look alike: they
    still steer new trees and short prefixes, never a turn with over half its prompt cached.

    `weight` defaults to 16: a prefill block costs an order of magnitude more than a block of
    decode load once contexts are long, and a miss also copies the prefix into a second cache.
    At 1 (Dynamo's default) 32 lanes of Claude Code sessions on 4 H200s kept 70% of the oracle's
    hits in the simulator, at 16 they keep 89% (docs/route.md, "Routing quality").

    `temperature` > 0 samples from softmax(-cost / (temperature x mean cost)) instead of argmin.
    `affinity` > 0 keeps a session on its last worker while that costs at most `affinity` blocks
    more than the best and the worker is not overloaded (active > overload x mean + slack).
    """

    name = "kv_aware"

    def __init__(
        self,
        seed: int = 0,
        weight: float = KV_WEIGHT,
        queue_weight: float = KV_QUEUE_WEIGHT,
        tier_credit: float = 0.5,
        queue_cap: float = KV_QUEUE_CAP,
        temperature: float = 0.0,
        affinity: float = 0.0,
        overload: float = 2.0,
        slack: int = 4,
        max_sessions: int = 1 << 17,
    ):
        self.weight, self.tier_credit, self.temperature = weight, tier_credit, temperature
        self.queue_weight, self.queue_cap = queue_weight, queue_cap
        self.affinity, self.overload, self.slack, self.max_sessions = affinity, overload, slack, max_sessions
        self._rng = random.Random(seed)
        self._rot = 0
        self._home: dict[str, int] = {}

    def costs(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        total = -(-req.prompt_tokens // req.block_size)
        out = []
        for w in workers:
            gpu, lower = w.cached_prefix(req.block_hashes)
            prefill = total - gpu - self.tier_credit * lower + self._queue(total, w)
            out.append(self.weight * prefill + w.active_blocks())
        return out

    def _queue(self, total: int, w: WorkerView) -> float:
        """The worker's queue term: queue_weight x its active prefill, at most queue_cap x this
        request's blocks (0 at queue weight 0, without asking the worker)."""
        if not self.queue_weight:
            return 0.0
        return self.queue_weight * min(w.active_prefill_blocks(), self.queue_cap * total)

    def choose(self, req, workers):
        if len(workers) == 1 and self.temperature <= 0 and self.affinity <= 0:
            self._rot = 0  # (where `_pick` leaves it for one worker)
            return 0  # one candidate: scoring it (a prefix lookup) would change nothing
        costs = self.costs(req, workers)
        i = self._pick(costs)
        if self.affinity > 0 and req.session:
            home = self._home.pop(req.session, None)
            if (
                home is not None
                and home < len(workers)
                and home != i
                and costs[home] <= costs[i] + self.affinity
            ):
                loads = [w.active_requests() for w in workers]
                if loads[home] <= self.overload * sum(loads) / len(loads) + self.slack:
                    i = home
            self._home[req.session] = i  # re-inserted last: the oldest session is dropped first
            if len(self._home) > self.max_sessions:
                del self._home[next(iter(self._home))]
        return i

    def forget(self, worker):
        self._home = {s: w for s, w in self._home.items() if w != worker}

    def _pick(self, costs: list[float]) -> int:
        n = len(costs)
        if self.temperature > 0:
            scale = self.temperature * (sum(costs) / n or 1.0)
            lo = min(costs)
            weights = [math.exp(-(c - lo) / scale) for c in costs]
            return self._rng.choices(range(n), weights)[0]
        self._rot = (self._rot + 1) % n
        return _first_min(self._rot, costs)


def _first_min(start: int, values: Sequence[float]) -> int:
    """The first index holding the minimum, scanning from `start` round the list (ties rotate)."""
    n = len(values)
    best = min(values)
    for k in range(n):
        i = (start + k) % n
        if values[i] == best:
            return i
    return 0


def make_policy(name: str, seed: int = 0, **kwargs) -> Policy:
    classes = {c.name: c for c in (RoundRobin, LeastLoaded, SessionAffinity, KvAware)}
    if name not in classes:
        raise UserError(f"--router/--policy: unknown policy '{name}' (choose from {', '.join(POLICIES)})")
    return classes[name](seed=seed, **kwargs)
