"""kv_aware counts a worker's active prefill (Dynamo's active prefill tokens), in the simulator's
SimWorker over real engines and in the live router's load accounting."""

from __future__ import annotations

import itertools

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.errors import UserError
from agentkv.placement.policy import KvAware, RouteRequest
from agentkv.route.workers import Worker, WorkerSpec
from agentkv.sim.cluster import SimConfig, make_cluster, simulate
from agentkv.sim.worker import SimWorker
from agentkv.trace.synth import synthesize

BS = 16
_ids = itertools.count(1)


def _workers(n: int = 2) -> list[SimWorker]:
    cfg = EngineConfig(num_gpu_blocks_override=40_000, max_model_len=200_000)
    return [SimWorker(i, Engine(cfg)) for i in range(n)]


def _hashes(blocks: int) -> list[int]:
    return [next(_ids) for _ in range(blocks)]


def _queue(w: SimWorker, hashes: list[int], tokens: int | None = None) -> None:
    w.add_request(f"r{next(_ids)}", max_tokens=4, prompt_len=tokens or len(hashes) * BS, block_hashes=hashes)


def _drain(w: SimWorker) -> None:
    """Run the worker's engine until every request has finished."""
    eng = w.engine
    while eng.has_work():
        res = eng.step()
        eng.clock.advance_to(res.end)


def _req(hashes: list[int]) -> RouteRequest:
    return RouteRequest(hashes, len(hashes) * BS, session="tree", block_size=BS)


def test_a_long_prefill_queue_loses_a_new_tree_to_an_idle_worker():
    busy, idle = workers = _workers()
    for _ in range(4):
        _queue(busy, _hashes(500))  # 4 x 8,000 prompt tokens waiting, none cached, no KV held yet
    assert busy.active_blocks() == 0 and busy.active_prefill_blocks() == 2000
    new = _req(_hashes(60))
    policy = KvAware()
    assert [policy.choose(new, workers) for _ in range(3)] == [1, 1, 1]  # whatever the tie rotation
    blind = KvAware(queue_weight=0.0)  # the old cost: the queue holds no KV, so it is invisible
    assert blind.costs(new, workers)[0] == blind.costs(new, workers)[1]
    costs = KvAware(weight=2.0, queue_weight=0.5, queue_cap=float("inf")).costs(new, workers)
    assert costs[0] - costs[1] == 2.0 * 0.5 * 2000  # weight x queue_weight x active prefill blocks
    costs = KvAware(weight=2.0, queue_weight=0.5).costs(new, workers)
    assert costs[0] - costs[1] == 2.0 * 0.5 * 30  # capped at half the request's 60 blocks


class _NoQueue(SimWorker):
    """A worker that may not be asked for its queue (as a live worker's read costs a lock)."""

    def active_prefill_blocks(self) -> float:
        raise AssertionError("asked for the queue at queue weight 0")


def test_at_queue_weight_0_no_worker_is_asked_for_its_queue():
    cfg = EngineConfig(num_gpu_blocks_override=40_000, max_model_len=200_000)
    workers = [_NoQueue(i, Engine(cfg)) for i in range(2)]
    new = _req(_hashes(60))
    assert KvAware(queue_weight=0.0).costs(new, workers) == [16.0 * 60] * 2
    with pytest.raises(AssertionError, match="queue weight 0"):
        KvAware(queue_weight=1.0).costs(new, workers)


class _Unasked(SimWorker):
    """A worker that fails the test if a policy scores it."""

    def cached_prefix(self, block_hashes):
        raise AssertionError("a lone worker was scored")


def test_a_lone_worker_is_chosen_without_scoring_it():
    cfg = EngineConfig(num_gpu_blocks_override=40_000, max_model_len=200_000)
    new = _req(_hashes(60))
    policy = KvAware()
    policy._rot = 1  # (a rotation left by an earlier pick among two)
    assert policy.choose(new, [_Unasked(0, Engine(cfg))]) == 0
    assert policy._rot == 0  # as scoring the one worker leaves it: the next tie among two starts alike
    with pytest.raises(AssertionError, match="scored"):  # two workers, or a sampling or sticky policy
        KvAware().choose(new, [_Unasked(i, Engine(cfg)) for i in range(2)])
    for policy in (KvAware(temperature=0.5), KvAware(affinity=8.0)):
        with pytest.raises(AssertionError, match="scored"):
            policy.choose(new, [_Unasked(0, Engine(cfg))])


def _home_with(cached: int) -> tuple[list[SimWorker], list[int]]:
    """Two workers, the first caching the `cached`-block prefix a tree's last turn left there."""
    workers = _workers()
    _queue(workers[0], prefix := _hashes(cached))
    _drain(workers[0])
    return workers, prefix


def test_a_turn_with_most_of_its_prompt_cached_stays_behind_any_queue():
    workers, tree = _home_with(400)  # 6,400 tokens of its 420-block prompt cached on the first
    home, other = workers
    new = _req(tree + _hashes(20))
    policy = KvAware()
    _queue(home, _hashes(8))  # a short queue (128 tokens): the prefix wins, as it always did
    assert policy.choose(new, workers) == 0
    for _ in range(8):
        _queue(home, _hashes(250))  # 32,000 more tokens ahead of it, five times its cached prefix
    assert home.active_prefill_blocks() > 5 * 400 and other.active_prefill_blocks() == 0
    # a queue counts at most half the prompt (210 blocks), less than the 400 it would recompute
    assert [policy.choose(new, workers) for _ in range(3)] == [0, 0, 0]
    # Dynamo's uncapped sum moves it, recomputing the 400 blocks on the other worker
    assert KvAware(queue_cap=float("inf")).choose(new, workers) == 1
    assert KvAware(queue_weight=0.0).choose(new, workers) == 0  # blind to the queue, it stays


def test_a_turn_with_a_short_prefix_leaves_a_long_queue():
    workers, tree = _home_with(100)  # 1,600 tokens of its 420-block prompt cached on the first
    home, other = workers
    new = _req(tree + _hashes(320))
    policy = KvAware()
    _queue(home, _hashes(50))  # 50 blocks queued, less than the 100 cached: it stays
    assert policy.choose(new, workers) == 0
    for _ in range(4):
        _queue(home, _hashes(250))  # 16,000 tokens ahead: capped at 210 blocks, over the 100 cached
    assert [policy.choose(new, workers) for _ in range(3)] == [1, 1, 1]


def test_queues_deeper_than_half_the_prompt_look_alike_and_the_prefix_decides():
    workers, tree = _home_with(100)
    home, other = workers
    new = _req(tree + _hashes(320))
    for w, n in ((home, 8), (other, 2)):  # both far beyond 210 blocks, home four times deeper
        for _ in range(n):
            _queue(w, _hashes(500))
    assert KvAware().choose(new, workers) == 0
    assert KvAware(queue_cap=float("inf")).choose(new, workers) == 1


def test_active_prefill_shrinks_as_chunks_run_and_ends_at_the_first_token():
    (w,) = _workers(1)
    hashes = _hashes(1250)  # 20,000 tokens: three 8,192-token chunks
    _queue(w, hashes)
    seen = [w.active_prefill_blocks()]
    while w.engine.requests[next(iter(w.engine.requests))].first_token is None:
        res = w.engine.step()
        w.engine.clock.advance_to(res.end)
        seen.append(w.active_prefill_blocks())
    assert seen[0] == 1250 and seen[1] == (20_000 - 8192) / BS and seen[-1] == 0
    assert seen == sorted(seen, reverse=True)
    _drain(w)
    _queue(w, hashes + _hashes(10))  # the next turn: only its 10 new blocks are left to prefill
    assert w.active_prefill_blocks() == 10


def test_the_live_router_counts_prefill_from_send_to_first_byte():
    w = Worker(0, WorkerSpec("http://127.0.0.1:9"), BS, approximate=True)
    a = w.start(8000 + 256, 4800)  # 8,000-token prompt, 200 of its 500 blocks cached there
    b = w.start(1600 + 256, 1600)
    assert w.active_prefill_blocks() == 400 and w.active_blocks() == 0
    a.first_byte()  # prefilled: its whole context becomes KV load, its prefill is done
    assert w.active_prefill_blocks() == 100 and w.active_blocks() == (8000 + 256) // BS
    b.finish()  # failed before its first byte: nothing of it is left
    a.finish()
    assert w.active_prefill_blocks() == 0 and w.active_blocks() == 0 and w.in_flight == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_queue_weights_are_refused(bad, capsys):
    with pytest.raises(UserError, match="--kv-queue-weight"):
        SimConfig(kv_queue_weight=bad)
    assert main(["route", "--worker", "http://127.0.0.1:9", f"--kv-queue-weight={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-queue-weight" in err and "\n" not in err and "Traceback" not in err


def test_simulate_prices_the_queue_as_told_and_records_it():
    traces = synthesize(2, seed=1)
    eng = EngineConfig(num_gpu_blocks_override=6000, max_model_len=200_000)
    assert make_cluster(traces, SimConfig(engine=eng, workers=2)).policy.queue_weight == 1.0  # Dynamo's
    cfg = SimConfig(engine=eng, workers=2, lanes=2, kv_queue_weight=0.25, max_requests=6)
    assert simulate(traces, cfg).summary.config["kv_queue_weight"] == 0.25


def test_prefilled_requests_are_dropped_even_when_no_policy_asks():
    (w,) = _workers(1)
    for _ in range(50):
        _queue(w, _hashes(4))
        _drain(w)
    assert len(w.prefilling) + len(w.queued) == 1  # only the newest: finished ones are not held


def test_active_prefill_under_preemption_is_each_live_request_counted_as_it_stands():
    """Requests queued on a small pool are admitted, preempted and re-admitted; at every step the
    active prefill equals each live request's uncached tokens at routing less what it has run."""
    cfg = EngineConfig(num_gpu_blocks_override=300, max_model_len=20_000, max_num_batched_tokens=2048)
    w = SimWorker(0, Engine(cfg))
    routed = []
    shared = _hashes(40)  # a common prefix: lookups at the queue head find cached blocks
    for i in range(12):
        hashes = shared + _hashes(60 + 10 * i)
        w.add_request(f"r{next(_ids)}", max_tokens=200, prompt_len=len(hashes) * BS, block_hashes=hashes)
        routed.append((w.engine.scheduler.waiting[-1], w.queued[-1][1]))
    eng, steps = w.engine, 0
    while eng.has_work():
        if steps % 3 == 0:  # not every step: some are admitted and preempted between two asks
            live = [(r, unc) for r, unc in routed if r.first_token is None and r.status < 2]
            want = sum(min(unc, r.prompt_len - r.num_computed) for r, unc in live)
            assert w.active_prefill_blocks() == want / BS, steps
        res = eng.step()
        eng.clock.advance_to(res.end)
        steps += 1
    assert eng.scheduler.num_preemptions > 0 and w.active_prefill_blocks() == 0


def _counting(w: SimWorker) -> list[int]:
    """Count the worker's pool lookups (the real pool answers; the list grows by one per call)."""
    calls, pool = [], w.engine.pool
    real = pool.cached_prefix

    def counted(hashes):
        calls.append(1)
        return real(hashes)

    pool.cached_prefix = counted
    return calls


def test_the_routers_lookup_of_the_chosen_worker_is_not_repeated_at_queueing():
    home, other = workers = _workers()
    prefix = _hashes(300)
    _queue(home, prefix)
    _drain(home)
    calls = [_counting(w) for w in workers]
    hashes = prefix + _hashes(20)
    i = KvAware().choose(_req(hashes), workers)
    assert i == 0 and [len(c) for c in calls] == [1, 1]
    home.add_request("next", max_tokens=4, prompt_len=len(hashes) * BS, block_hashes=hashes)
    assert len(calls[0]) == 1 and home.active_prefill_blocks() == 20  # the router's answer, used once
    again = list(hashes)  # equal hashes in another list: not the lookup the router made, so looked up
    other.cached_prefix(hashes)
    other.add_request("again", max_tokens=4, prompt_len=len(again) * BS, block_hashes=again)
    assert len(calls[1]) == 3 and other.active_prefill_blocks() == 320


def test_a_lookup_made_before_the_pool_changed_is_not_reused():
    (w,) = _workers(1)
    hashes = _hashes(200)
    assert w.cached_prefix(hashes) == (0, 0)  # routed while nothing is cached
    # then another request, queued on the engine itself, computes most of the prompt
    w.engine.add_request("early", max_tokens=4, prompt_len=150 * BS, block_hashes=hashes[:150])
    _drain(w)
    w.add_request("late", max_tokens=4, prompt_len=len(hashes) * BS, block_hashes=hashes)
    assert w.active_prefill_blocks() == 50  # counted against the cache as it is now, not at routing


def _tiered(offload_gib: float) -> SimWorker:
    cfg = EngineConfig(num_gpu_blocks_override=700, max_model_len=20_000, kv_offloading_size=offload_gib)
    return SimWorker(0, Engine(cfg))


@pytest.mark.parametrize("offload", [64.0, 0.0])
def test_a_cpu_tier_hit_is_a_load_not_prefill_work(offload):
    w = _tiered(offload)
    prefix = _hashes(500)
    _queue(w, prefix)
    _drain(w)
    _queue(w, _hashes(500))  # another tree takes the empty blocks and ~300 of the prefix's
    _drain(w)
    gpu, lower = w.engine.cached_prefix(prefix)
    assert 150 < gpu < 250 and gpu + lower == (500 if offload else gpu)
    _queue(w, prefix + _hashes(20))  # the next turn: 20 new blocks, the rest cached (GPU or CPU)
    # with the tier, its ~300 CPU blocks are copied up, not computed; without it they are gone
    assert w.active_prefill_blocks() == (20 if offload else 20 + 500 - gpu)
